"""Request identity: X-Request-Id is kept when sane, else made."""

from __future__ import annotations

import itertools
import os
import re

from aiohttp import web

_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


# A new id: a random prefix per process and a counter, 32 hex digits like a UUID's, unique
# without costing a random draw per request.
_PREFIX = os.urandom(8).hex()
_COUNTER = itertools.count(1)


def new_request_id() -> str:
    return f"{_PREFIX}{next(_COUNTER):016x}"


def request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id when it is a sane token, else a new one."""
    given = request.headers.get("X-Request-Id")
    if given and _SAFE_REQUEST_ID.match(given):
        return given
    return new_request_id()
