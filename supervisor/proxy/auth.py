"""The key check, as llama-server does it: `Authorization: Bearer K` or `X-Api-Key: K`."""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..policy.browser import BrowserRules
from ..policy.routes import PUBLIC_PAGES, PUBLIC_ROUTES
from . import errors
from .identity import request_id_of

# Set on every request: did it present the key (or is there none to present)?
AUTHENTICATED = web.RequestKey("authenticated", bool)

# The web UI's assets are public in llama-server (they carry no data); so they are here.
_UI_ASSET = re.compile(r"^/([\w.\-]+/)*[\w.\-]+\.(js|mjs|css|html|ico|svg|png|jpg|woff2?|map|"
                       r"webmanifest|txt)$")


@dataclass
class AuthSettings:
    api_key: str | None
    # What Spillway's own routes take from a browser (proxy/browser_guard.py)
    browser: BrowserRules = field(default_factory=BrowserRules)
    # Open for GET and HEAD beside PUBLIC_ROUTES: Vertex AI's health route, which answers as
    # /health does (its health checks carry no key; llama-server asks one there, so a keyed
    # container never became healthy). Not POST: the predict route may be the same path.
    public_reads: frozenset[str] = frozenset()


def _is_public(request: web.Request, settings: AuthSettings) -> bool:
    if request.method == "OPTIONS":  # CORS preflight: browsers send no credentials
        return True
    if request.path in PUBLIC_ROUTES:
        return True
    if request.method not in ("GET", "HEAD"):
        return False
    if request.path in settings.public_reads:
        return True
    if request.path.startswith("/spillway"):
        return request.path in PUBLIC_PAGES  # the page, never the data it reads
    return request.path == "/" or bool(_UI_ASSET.match(request.path))


def presented_key(request: web.Request) -> str | None:
    """The key the client presented, as llama-server reads it: `Authorization: Bearer K` or
    `X-Api-Key: K`. Two Authorization (or X-Api-Key) headers are ambiguous: no key."""
    auths = request.headers.getall("Authorization", [])
    api_keys = request.headers.getall("X-Api-Key", [])
    if len(auths) > 1 or len(api_keys) > 1:
        return None
    if auths:
        value = auths[0]
        return value[7:] if value.startswith("Bearer ") else value
    if api_keys:
        return api_keys[0]
    return None


Precheck = Callable[[web.Request], web.StreamResponse | None]


def auth_middleware(settings: AuthSettings, prechecks: Sequence[Precheck] = (),
                    then: Sequence[Precheck] = ()) -> Any:
    """The key check, in one middleware with the other checks, since every layer costs on
    every request: `prechecks` (a header budget) run before it, `then` (the browser checks)
    after it, for a request the key let through or that needs none."""

    @web.middleware
    async def check_key(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                        ) -> web.StreamResponse:
        for precheck in prechecks:
            if (refused := precheck(request)) is not None:
                return refused
        key = settings.api_key
        if key is None:
            request[AUTHENTICATED] = True
        elif _is_public(request, settings):
            # Open, but not trusted: forwarded without the child's key, so that a path that
            # looks public here and means something else to llama-server is refused there.
            request[AUTHENTICATED] = False
        else:
            given = presented_key(request)
            if given is None or not hmac.compare_digest(given.encode(), key.encode()):
                return errors.authentication_error(request_id_of(request))
            request[AUTHENTICATED] = True
        for check in then:
            if (refused := check(request)) is not None:
                return refused
        return await handler(request)

    return check_key
