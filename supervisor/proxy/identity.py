"""Request identity: X-Request-Id is kept when sane, else made; and what of a request a log line
may show."""

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


# Control characters (C0, DEL, C1) and the Unicode line separators: in a log line they would
# end it early (a forged line after a decoded %0d or %0a), or move a terminal's cursor and
# colours (ESC).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def loggable(text: str, limit: int = 1024) -> str:
    """`text` (a path, a client's words) as a log line may show it: control characters written
    as `\\xNN` (`\\uNNNN`), and at most `limit` characters of it."""
    if len(text) > limit:
        text = text[:limit] + "..."
    if _CONTROL.search(text) is None:
        return text  # nearly always: no copy
    return _CONTROL.sub(_escaped, text)


def _escaped(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
