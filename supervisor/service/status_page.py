"""The status page at /spillway/: one HTML file with its CSS and JS inline (service/web/).

The page carries no data: it reads Spillway's own routes from the browser, with the key when one
is set, so it is served without the key (GET and HEAD only; see PUBLIC_PAGES in policy/routes.py)
and every data route keeps asking for it. Its Content-Security-Policy allows exactly the inline
blocks the file holds, by their SHA-256 (computed once, when the file is read), and nothing from
anywhere else: no 'unsafe-inline', no other origin, no frames, no form submissions.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from aiohttp import web

from ..proxy.app import OwnRoute

PAGE_PATH = "/spillway/"

_BLOCK = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def content_security_policy(html: str) -> str:
    """The policy for this page: its own inline <style> and <script> blocks, by hash."""
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for kind, body in _BLOCK.findall(html):
        hashes[kind].append(_sha256(body))
    if not hashes["script"] or not hashes["style"]:
        raise ValueError("the status page has no inline <script> or <style> block")
    return "; ".join([
        "default-src 'none'",
        "connect-src 'self'",  # the page's own fetches of /spillway/*
        "img-src 'self' data:",
        "style-src " + " ".join(hashes["style"]),
        "script-src " + " ".join(hashes["script"]),
        "base-uri 'none'",
        "form-action 'none'",  # the key form is read by the script, never submitted
        "frame-ancestors 'none'",
    ])


@dataclass(frozen=True)
class StatusPage:
    body: bytes
    headers: dict[str, str]

    @classmethod
    def load(cls) -> StatusPage:
        html = resources.files("supervisor.service").joinpath("web/status.html").read_text("utf-8")
        return cls(body=html.encode(), headers={
            "Content-Type": "text/html; charset=utf-8",
            "Cache-Control": "no-store",
            "Content-Security-Policy": content_security_policy(html),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY",
        })

    async def page(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.body, headers=self.headers)

    async def redirect(self, request: web.Request) -> web.StreamResponse:
        # Relative, so that it holds behind a proxy that mounts Spillway under a prefix.
        return web.Response(status=301, headers={"Location": "spillway/",
                                                 "Cache-Control": "no-store"})

    def routes(self) -> dict[tuple[str, str], OwnRoute]:
        return {(method, path): handler
                for method in ("GET", "HEAD")
                for path, handler in ((PAGE_PATH, self.page),
                                      (PAGE_PATH.rstrip("/"), self.redirect))}
