"""Request identity: X-Request-Id is kept when sane, else made."""

from __future__ import annotations

import re
import uuid

from aiohttp import web

_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id when it is a sane token, else a new one."""
    given = request.headers.get("X-Request-Id", "")
    return given if _SAFE_REQUEST_ID.match(given) else uuid.uuid4().hex
