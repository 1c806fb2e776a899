"""Vertex AI's predict and health routes, answered as llama-server answers them
(policy/vertex.py says what that is).

The health route is /health under another name: the request goes on as `GET /health`, so it
gets what /health gets (the ready child's answer, or "Loading model").

Each instance of a prediction is a request of its own, as llama-server runs each through its
route's handler: sent to Spillway's own socket, the one the prediction came in on, so that it
goes through everything a request goes through here (the key, admission, the waiting line,
replay on the other child, incidents, the access log) with the client's own headers. The
instances run at once, as llama-server runs them (one std::async each).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ..policy import vertex
from . import errors
from . import bodies
from .handler import ProxySettings
from .headers import HOP_BY_HOP
from .identity import request_id_of

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The client's headers an instance does not take: framing (each instance has its own body), the
# Host (the instance names Spillway's socket), what makes a request one of a kind (a stored
# answer, a resumable stream) and what only a browser's request carries.
_NOT_PASSED = HOP_BY_HOP | frozenset({
    "host", "content-length", "content-type", "expect", "accept-encoding", "x-request-id",
    "idempotency-key", "x-conversation-id", "origin", "referer", "cookie", "sec-fetch-site",
    "sec-fetch-mode", "sec-fetch-dest", "sec-fetch-user",
})


class VertexRoutes:
    """`proxy` answers every other route; `settings` are the proxy's own (read at each request:
    a reload changes them); `router`: llama-server's router mode, whose routes differ."""

    def __init__(self, contract: vertex.Contract, proxy: Handler, settings: ProxySettings,
                 router: bool) -> None:
        self.contract = contract
        self.proxy = proxy
        self.settings = settings
        self.router = router

    def table(self) -> dict[tuple[str, str], Handler]:
        routes: dict[tuple[str, str], Handler] = {("POST", self.contract.predict_route):
                                                  self.predict}
        health = vertex.health_alias(self.contract)
        if health is not None:
            routes[("GET", health)] = routes[("HEAD", health)] = self.health
        return routes

    async def health(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy(request.clone(rel_url=request.rel_url.with_path("/health")))

    async def predict(self, request: web.Request) -> web.StreamResponse:
        rid = request_id_of(request)
        try:  # as the proxy reads a body (bodies.py): its limit, its timeout, its coding
            body = await bodies.read_body(request, self.settings.max_body_bytes,
                                          self.settings.body_timeout_s)
        except (bodies.BodyTimeout, bodies.BodyTooLarge, bodies.BodyUnreadable) as e:
            return bodies.refusal(e, rid, self.settings.body_timeout_s)
        try:
            parsed = bodies.parse_json(body)
        except ValueError as e:  # the parser's words, or the depth limit's
            return errors.invalid_request(400, f"the request body is not valid JSON: {e}"
                                          if not isinstance(e, bodies.TooDeep) else str(e), rid)
        found = vertex.instances(parsed)
        if isinstance(found, vertex.Refused):
            return errors.invalid_request(400, found.message, rid)
        socket = _own_socket(request)
        if socket is None:  # the client is gone
            return errors.invalid_request(400, "the connection closed", rid)
        headers = _passed(request.headers)
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=None),
        ) as session:
            predictions = await asyncio.gather(*(
                self._instance(session, socket, request.query_string, headers,
                               f"{rid[:120]}.{i}", instance)
                for i, instance in enumerate(found)))
        return web.json_response({"predictions": predictions}, headers={"X-Request-Id": rid})

    async def _instance(self, session: aiohttp.ClientSession, socket: str, query: str,
                        headers: CIMultiDict[str], rid: str, instance: Any) -> Any:
        sent = vertex.dispatch(instance, self.router)
        if isinstance(sent, vertex.Refused):
            return errors.error_body(400, "invalid_request_error", sent.message, rid)
        url = URL(socket + sent.path + (f"?{query}" if query else ""), encoded=True)
        headers = headers.copy()
        headers["X-Request-Id"] = rid
        if sent.body is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with session.request(sent.method, url, data=sent.body,
                                       headers=headers) as resp:
                if resp.content_type == "text/event-stream":
                    return errors.error_body(400, "invalid_request_error", vertex.STREAMING,
                                             rid)
                return vertex.prediction(await resp.read())
        except aiohttp.ClientError as e:
            # llama-server's catch-all for an instance: a server_error with what went wrong.
            return errors.error_body(500, "server_error", f"the instance was not run: {e!r}",
                                     rid)


def _own_socket(request: web.Request) -> str | None:
    """`http://address:port` of the socket the request came in on (a listen address, or the
    machine's address that a 0.0.0.0 listener took it on)."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return None
    host = str(sockname[0]).split("%", 1)[0]
    return f"http://[{host}]:{sockname[1]}" if ":" in host else f"http://{host}:{sockname[1]}"


def _passed(client: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    named = {t.strip().lower() for v in client.getall("Connection", []) for t in v.split(",")}
    return CIMultiDict((k, v) for k, v in client.items()
                       if k.lower() not in _NOT_PASSED and k.lower() not in named)
