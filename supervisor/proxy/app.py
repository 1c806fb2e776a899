"""The aiohttp application: the key check, Spillway's own routes, and the catch-all proxy."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from . import errors
from .auth import AuthSettings, auth_middleware
from .browser_guard import browser_guard
from .handler import ProxyHandler
from .identity import request_id_of
from .vertex import VertexRoutes
from ..policy.vertex import Contract


# All of a request's headers together; each one alone is bounded by the parser (16 KiB).
MAX_HEADER_BYTES = 32 * 1024


def header_budget(request: web.Request) -> web.StreamResponse | None:
    """431 for a request whose headers together exceed MAX_HEADER_BYTES."""
    size = sum(len(k) + len(v) + 4 for k, v in request.raw_headers)
    if size > MAX_HEADER_BYTES:
        return errors.json_error(431, "invalid_request_error",
                                 f"the request's headers are {size} bytes; the limit is "
                                 f"{MAX_HEADER_BYTES}", request_id_of(request))
    return None


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(data, indent=1),
                        content_type="application/json")


OwnRoute = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(proxy: ProxyHandler, auth: AuthSettings,
              own_routes: dict[tuple[str, str], OwnRoute],
              answered_here: dict[tuple[str, str], OwnRoute] | None = None,
              on_refused: Callable[[str], None] | None = None,
              vertex: Contract | None = None) -> web.Application:
    """`own_routes` maps (method, path under /spillway/) to a handler; `answered_here`, llama-
    server routes that Spillway answers itself (the resumable streams' routes); `on_refused` is
    told the reason of each request the browser checks refuse; `vertex`, Vertex AI's contract,
    whose predict and health routes Spillway answers as llama-server does."""
    # The body limit is enforced by the proxy handler itself (it can change on reload); the
    # framework's own limit only applies to Spillway's small routes.
    guard = browser_guard(lambda: auth.browser, on_refused)
    app = web.Application(middlewares=[auth_middleware(auth, (header_budget,), (guard,))],
                          client_max_size=1024 * 1024,
                          handler_args={"max_field_size": 16384, "max_line_size": 16384})
    for (method, path), handler in own_routes.items():
        app.router.add_route(method, path, handler)

    methods: dict[str, set[str]] = {}
    for method, path in own_routes:
        methods.setdefault(path, set()).add(method)

    async def unknown_own(request: web.Request) -> web.StreamResponse:
        allowed = methods.get(request.path)
        if allowed:
            return errors.json_error(405, "invalid_request_error",
                                     f"{request.path} takes {', '.join(sorted(allowed))}",
                                     request_id_of(request),
                                     headers={"Allow": ", ".join(sorted(allowed))})
        # As llama-server types its own 404 (format_error_response: not_found_error).
        return errors.json_error(404, "not_found_error",
                                 f"no Spillway route {request.method} {request.path}",
                                 request_id_of(request))

    for (method, path), handler in (answered_here or {}).items():
        app.router.add_route(method, path, handler)
    if vertex is not None:
        routes = VertexRoutes(vertex, proxy, proxy.settings, proxy.pools.router)
        for (method, path), handler in routes.table().items():
            app.router.add_route(method, path, handler)
    # `[\s\S]*`, not `.*`: a path may hold a decoded %0a, which `.` does not match (such a
    # request got aiohttp's own plain-text 404 instead of the proxy's answer).
    app.router.add_route("*", r"/spillway/{tail:[\s\S]*}", unknown_own)
    app.router.add_route("*", "/spillway", unknown_own)
    app.router.add_route("*", r"/{tail:[\s\S]*}", proxy)
    return app
