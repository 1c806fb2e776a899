"""llama-server's resumable stream routes, answered from Spillway's own replay buffers.

- `GET /v1/stream?conv_id=ID&from=N`: the stream's bytes from offset N, then its live bytes
  until it ends (an event stream, as an EventSource reattaches);
- `POST /v1/streams/lookup` with `{"conversation_ids": [...]}`: the status of the sessions of
  the ids named, and of nothing else;
- `DELETE /v1/stream?conv_id=ID`: the explicit Stop; idempotent, 204.

Statuses and error messages are llama-server's (server-stream.cpp), so its web UI reads them
as it reads its own. They are answered here whichever child served the stream, or after that
child died: the buffer is Spillway's (stream_sessions.py).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from aiohttp import web

from ..records.metrics import Metrics
from ..records.stream_sessions import Read, StreamSessions
from . import errors
from .bodies import OWN_ROUTE_BYTES, BodyTimeout, BodyTooLarge, BodyUnreadable, TooDeep, \
    parse_json, read_body, refusal
from .identity import request_id_of

# The type llama-server gives its 404 here.
_NOT_FOUND = "not_found_error"


class StreamRoutes:
    def __init__(self, streams: StreamSessions, metrics: Metrics,
                 wall_clock: Callable[[], float],
                 body_timeout_s: Callable[[], float]) -> None:
        self.streams = streams
        self.metrics = metrics
        self.wall_clock = wall_clock
        self.body_timeout_s = body_timeout_s  # server.body_timeout_s, as reloaded

    def table(self) -> dict[tuple[str, str],
                             Callable[[web.Request], Awaitable[web.StreamResponse]]]:
        return {("GET", "/v1/stream"): self.read, ("DELETE", "/v1/stream"): self.stop,
                ("POST", "/v1/streams/lookup"): self.lookup}

    async def read(self, request: web.Request) -> web.StreamResponse:
        rid = request_id_of(request)
        conversation = request.query.get("conv_id", "")
        if not conversation:
            return errors.invalid_request(400, "Missing conversation id in path", rid)
        session = self.streams.get(conversation, self.wall_clock())
        if session is None:
            self.metrics.stream_resumes.labels("not_found").inc()
            return errors.json_error(404, _NOT_FOUND, "Stream not found or expired", rid)
        text = request.query.get("from", "")
        offset = int(text) if text.isdigit() else (0 if not text else -1)
        if offset < 0:
            return errors.invalid_request(400, "Invalid 'from' offset", rid, param="from")
        if offset < session.dropped:
            self.metrics.stream_resumes.labels("offset_lost").inc()
            return errors.invalid_request(400, "Stream offset lost, please restart", rid,
                                          param="from")
        self.metrics.stream_resumes.labels("served").inc()
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": session.request_id, "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        while True:
            status, data = session.read_from(offset)
            if status is Read.OFFSET_LOST:
                break  # a reader slower than the cap: it ends, as llama-server's does
            if data:
                await resp.write(data)  # a reader that leaves ends here (ConnectionError)
                offset += len(data)
                continue
            if session.done:
                break
            await session.wait_beyond(offset)
        await resp.write_eof()
        return resp

    async def lookup(self, request: web.Request) -> web.StreamResponse:
        rid = request_id_of(request)
        timeout_s = self.body_timeout_s()
        try:
            body = parse_json(await read_body(request, OWN_ROUTE_BYTES, timeout_s))
        except (BodyTimeout, BodyTooLarge, BodyUnreadable) as e:
            return refusal(e, rid, timeout_s)
        except TooDeep as e:
            return errors.invalid_request(400, str(e), rid)
        except ValueError as e:  # (llama-server's words)
            return errors.invalid_request(400, f"invalid body: {e}", rid)
        wanted = body.get("conversation_ids") if isinstance(body, dict) else None
        ids = [i for i in wanted if isinstance(i, str) and i] if isinstance(wanted, list) \
            else []
        found = self.streams.lookup(ids, self.wall_clock())
        return web.Response(text=json.dumps([s.describe() for s in found]),
                            content_type="application/json")

    async def stop(self, request: web.Request) -> web.StreamResponse:
        conversation = request.query.get("conv_id", "")
        if not conversation:
            return errors.invalid_request(400, "Missing conversation id in path",
                                          request_id_of(request))
        self.streams.stop(conversation, self.wall_clock())
        return web.Response(status=204)
