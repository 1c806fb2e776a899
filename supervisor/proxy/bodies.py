"""A request's body: read whole within a size limit and a timeout, and read as JSON.

Every body a client sends Spillway goes through here: the proxy's (generation and pass-through
routes alike), the resumable streams' lookup, the drill's arm. So the limits hold everywhere: a
`Content-Length` with no body behind it waits `server.body_timeout_s`, not forever; a body over
the limit is refused before it is read (or as soon as it is over, without a length); JSON
nested deeper than MAX_JSON_DEPTH is a 400, not the RecursionError (a 500) that Python's parser
raises near a thousand levels, nor one raised later by code that walks or re-encodes the body
(a continuation's body, a replay).

`Content-Encoding`: aiohttp undoes gzip, deflate, br and zstd as it reads, so the body here is
the decompressed one, and it is what admission parses, what a replay sends again and what the
child gets, without the header (headers.py drops it): the pinned llama-server is built without
zlib and answers 415 to any compressed body. The size limit counts the decompressed bytes (a
gzip bomb is refused at the limit, and aiohttp, from 3.14.1 on, decompresses no further than
the reader asks: before, each network read was decompressed whole, hundreds of MiB for a bomb),
and a body that is not what its `Content-Encoding` says is a 400. Nothing here reads more than
the limit before counting: the fast path takes only a body that is already whole in aiohttp's
buffer, which a bomb never is (its decompression waits for the reader).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from . import errors

# The body of one of Spillway's own small routes (a lookup's ids, the drill's arm): the limit
# the app sets for them (client_max_size).
OWN_ROUTE_BYTES = 1024 * 1024
# Deeper than any request a person or an SDK writes (a JSON schema of 30 nested objects is about
# 60 levels); far below what Python's recursive encoder and decoder stand.
MAX_JSON_DEPTH = 128


class BodyTimeout(Exception):
    pass


class BodyTooLarge(Exception):
    def __init__(self, size: int | None, limit: int, decoded: str | None = None) -> None:
        self.size = size  # as announced by Content-Length; None: found while reading
        self.limit = limit
        self.decoded = decoded  # the Content-Encoding undone, when there was one


class BodyUnreadable(Exception):
    """A body aiohttp could not take apart: not what its Content-Encoding says, or broken
    chunks. `message` says which, without the body's bytes."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _coding(request: web.Request) -> str | None:
    value = request.headers.get("Content-Encoding", "").strip().lower()
    return value if value and value != "identity" else None


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, refusing (before reading it) one that announces more than `limit`, and
    giving up on a client that trickles it (no byte for `timeout_s`)."""
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(length, limit)
    content = request.content
    try:
        if length is not None and content.is_eof():
            # The whole body already arrived with the headers (the usual case): no waiting.
            # (Decompressed, it may still be over the limit.)
            data = content.read_nowait()
            if len(data) > limit:
                raise BodyTooLarge(None, limit, _coding(request))
            return data
        return await _read_chunks(request, limit, timeout_s)
    except web.RequestPayloadError as e:
        raise _unreadable(request, e) from None


async def _read_chunks(request: web.Request, limit: int, timeout_s: float) -> bytes:
    chunks = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                chunk = await request.content.readany()
        except TimeoutError as e:
            raise BodyTimeout() from e
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(None, limit, _coding(request))
        chunks.append(chunk)
    return b"".join(chunks)


def _unreadable(request: web.Request, error: web.RequestPayloadError) -> BodyUnreadable:
    if isinstance(error.__cause__, ContentEncodingError):
        coding = _coding(request) or "its Content-Encoding"
        return BodyUnreadable(f"the request body is not valid {coding} data, as its "
                              "Content-Encoding says", param="Content-Encoding")
    # Broken chunks, or a body cut short: aiohttp's first words (never the body's bytes).
    cause = error.__cause__ if error.__cause__ is not None else error
    words = str(getattr(cause, "message", "") or "").split("\n", 1)[0].rstrip(":. ")
    return BodyUnreadable(f"the request body is malformed ({words or 'unreadable'})")


def refusal(error: BodyTimeout | BodyTooLarge | BodyUnreadable, request_id: str | None,
            timeout_s: float) -> web.Response:
    """The answer to a body that could not be read."""
    if isinstance(error, BodyTimeout):
        response = errors.invalid_request(
            408, f"no byte of the request body for {timeout_s:g} s (server.body_timeout_s)",
            request_id)
    elif isinstance(error, BodyTooLarge):
        size = f"{error.size} bytes" if error.size is not None else "more than that"
        if error.decoded is not None and error.size is None:
            size = f"more than that once decompressed (Content-Encoding: {error.decoded})"
        return errors.invalid_request(
            413, f"request body is {size}; the limit is {error.limit} bytes "
                 "(server.max_body_mib)", request_id, param="body")
    else:
        response = errors.invalid_request(400, error.message, request_id, param=error.param)
    # What is left of the request on the connection cannot be trusted to end where a next
    # request begins.
    response.force_close()
    return response


class TooDeep(ValueError):
    def __init__(self) -> None:
        super().__init__(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep "
                         "(JSON arrays and objects)")


def parse_json(body: bytes) -> Any:
    """The body's JSON value; ValueError (UnicodeDecodeError, json's, TooDeep) when it is not
    one Spillway can use."""
    try:
        parsed = json.loads(body.decode("utf-8"))
    except RecursionError:
        raise TooDeep() from None
    if _deeper_than(body, parsed, MAX_JSON_DEPTH):
        raise TooDeep()
    return parsed


def parse_json_object(body: bytes) -> tuple[str | None, dict[str, Any] | None]:
    """(the problem, None) or (None, the object): what is wrong with a body that should be a
    JSON object, in words for the client."""
    if not body:
        return "the request body is empty; expected a JSON object", None
    try:
        parsed = parse_json(body)
    except UnicodeDecodeError:
        return "the request body is not valid UTF-8", None
    except TooDeep as e:
        return str(e), None
    except ValueError as e:
        return f"the request body is not valid JSON: {e}", None
    if not isinstance(parsed, dict):
        return f"the request body must be a JSON object, not {type(parsed).__name__}", None
    return None, parsed


def _deeper_than(body: bytes, parsed: object, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep. Counting the brackets first
    (fast, in C) spares the walk for nearly every body: the depth is at most their number."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    todo: list[tuple[object, int]] = [(parsed, 1)]
    while todo:  # by hand, not by recursion: the depth is what is in question
        node, depth = todo.pop()
        if depth > limit:
            return True
        inner = node.values() if isinstance(node, dict) else node if isinstance(node, list) \
            else ()
        todo.extend((child, depth + 1) for child in inner if isinstance(child, (dict, list)))
    return False
