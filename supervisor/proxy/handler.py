"""The request pipeline: read and check the request, pick a child, attempt, answer.

Branch numbers follow the admission order of the design (policy/admission.py decides).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from ..policy import admission
from ..policy.routes import RouteClass, classify_route
from . import errors
from .forward import AttemptFailure, Forwarder, RequestCtx, Upstream

log = logging.getLogger("spillway.proxy")

_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class BodyTooLarge(Exception):
    def __init__(self, size: int | None, limit: int) -> None:
        self.size = size
        self.limit = limit


def request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id when it is a sane token, else a new one."""
    given = request.headers.get("X-Request-Id", "")
    return given if _SAFE_REQUEST_ID.match(given) else uuid.uuid4().hex


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, refusing (before reading it) one that announces more than `limit`."""
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(length, limit)
    chunks = []
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class ProxySettings:
    max_body_bytes: int


ChildView = Callable[[], Mapping[str, Upstream]]
Finished = Callable[[RequestCtx, int, str | None], None]


class ProxyHandler:
    """Handles every request outside /spillway/."""

    def __init__(self, children: ChildView, states: Callable[[], Mapping[str, str]],
                 forwarder: Forwarder, settings: ProxySettings,
                 on_finished: Finished | None = None) -> None:
        self.children = children
        self.states = states
        self.forwarder = forwarder
        self.settings = settings
        self.on_finished = on_finished

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        rid = request_id_of(request)
        route = classify_route(request.path)
        started = time.monotonic()
        # 2. Bad input is answered before any child sees it.
        try:
            body = await read_body(request, self.settings.max_body_bytes)
        except BodyTooLarge as e:
            size = f"{e.size} bytes" if e.size is not None else "more than that"
            return self._done(None, errors.invalid_request(
                413, f"request body is {size}; the limit is {e.limit} bytes "
                     "(server.max_body_mib)", rid, param="body"), request, rid, started)
        payload: dict[str, object] | None = None
        if route is RouteClass.GENERATION and request.method == "POST":
            problem, payload = _parse_json_object(body)
            if problem is not None:
                return self._done(None, errors.invalid_request(400, problem, rid),
                                  request, rid, started)
        ctx = RequestCtx(
            request_id=rid, method=request.method, path=request.path,
            path_qs=request.raw_path, route=route, body=body, payload=payload,
            stream=bool(payload.get("stream")) if payload else False,
            client_headers=request.headers, received=started,
        )
        pin = request.headers.get("X-Spillway-Child", "").strip().lower() or None
        decision = admission.route_simple(self.states(), route, pin)
        if decision.child is None:
            return self._done(ctx, errors.unavailable(
                decision.reason, rid, retry_after_s=decision.retry_after_s,
                queue_position=0), request, rid, started)
        child = self.children()[decision.child]
        result = await self._attempt(request, ctx, child)
        if isinstance(result, AttemptFailure):
            response = self._failure_response(ctx, result)
            return self._done(ctx, response, request, rid, started)
        return self._done(ctx, result, request, rid, started)

    async def _attempt(self, request: web.Request, ctx: RequestCtx,
                       child: Upstream) -> web.StreamResponse | AttemptFailure:
        ctx.attempts += 1
        ctx.children.append(child.name)
        own = [("X-Request-Id", ctx.request_id), ("X-Spillway-Child", child.name),
               ("X-Spillway-Attempts", str(ctx.attempts))]
        if ctx.failover_kind:
            own.append(("X-Spillway-Failover", ctx.failover_kind))
        return await self.forwarder.attempt(request, ctx, child, own)

    def _failure_response(self, ctx: RequestCtx, failure: AttemptFailure) -> web.Response:
        v = failure.verdict
        if failure.timed_out:
            return errors.json_error(
                504, "upstream_error", f"the {failure.child} child sent nothing for "
                f"{self.forwarder.settings.read_timeout_s:.0f} s", ctx.request_id,
                kind=str(v.kind))
        if failure.status is not None and not failure.stream_started:
            # The child answered with an error of its own (e.g. an OOM it survived): say what
            # it was, in Spillway's shape, since the request could not be replayed.
            return errors.upstream_error(
                f"the {failure.child} child failed: {v.kind}: {v.evidence}", ctx.request_id,
                kind=str(v.kind), retry_after_s=2.0)
        return errors.upstream_error(
            f"the {failure.child} child failed before answering: {v.kind}: {v.evidence}",
            ctx.request_id, kind=str(v.kind), retry_after_s=2.0)

    def _done(self, ctx: RequestCtx | None, response: web.StreamResponse,
              request: web.Request, rid: str, started: float) -> web.StreamResponse:
        elapsed = time.monotonic() - started
        child = ctx.children[-1] if ctx and ctx.children else "-"
        attempts = ctx.attempts if ctx else 0
        log.info("rid=%s %s %s -> %s %d %.3fs attempts=%d", rid, request.method,
                 request.path, child, response.status, elapsed, attempts)
        if self.on_finished is not None and ctx is not None:
            self.on_finished(ctx, response.status, ctx.children[-1] if ctx.children else None)
        return response


def _parse_json_object(body: bytes) -> tuple[str | None, dict[str, object] | None]:
    if not body:
        return "the request body is empty; expected a JSON object", None
    try:
        parsed = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        return "the request body is not valid UTF-8", None
    except ValueError as e:
        return f"the request body is not valid JSON: {e}", None
    if not isinstance(parsed, dict):
        return f"the request body must be a JSON object, not {type(parsed).__name__}", None
    return None, parsed
