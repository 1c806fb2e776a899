"""Every error Spillway makes itself: OpenAI-shaped JSON, marked with its source.

    {"error": {"message", "type", "code", "param": null, "src": "spillway", "request_id", ...}}

`type` is `unavailable_error` (503, with `queue_position` and `retry_after_s`), `upstream_error`
(502, with `kind`), `invalid_request_error` (4xx), `authentication_error` (401) or
`exceed_context_size_error` (400, with `n_prompt_tokens` and `n_ctx`). Where llama-server has an
answer for the same situation, this one has its status, type, code, fields and, where the
situation is the same, its words (tests/test_llama_fidelity.py holds them to the captures).
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

# The OpenAI SDKs ignore a Retry-After over 60 s and fall back to their own backoff.
MAX_RETRY_AFTER_S = 60
JSON_TYPE = "application/json"
# llama-server's words for "not ready yet" (every route of a server loading its model).
LOADING = "Loading model"
# A refusal for want of capacity says this word first. Continue retries a failed request only
# when its error is a 429 or its message (the body, there) says "overloaded"
# (core/util/withExponentialBackoff.ts); the OpenAI SDKs go by the status, Retry-After and
# x-should-retry, whatever the words. LOADING stays llama-server's own words.
OVERLOADED = "overloaded"


def error_body(status: int, type_: str, message: str, request_id: str | None,
               **extra: Any) -> dict[str, Any]:
    error: dict[str, Any] = {
        "message": message,
        "type": type_,
        "code": status,
        "param": extra.pop("param", None),
        "src": "spillway",
        "request_id": request_id,
    }
    error.update(extra)
    return {"error": error}


def json_error(status: int, type_: str, message: str, request_id: str | None,
               headers: dict[str, str] | None = None, **extra: Any) -> web.Response:
    body = json.dumps(error_body(status, type_, message, request_id, **extra))
    h = {"X-Request-Id": request_id} if request_id else {}
    h.update(headers or {})
    return web.Response(status=status, text=body, content_type=JSON_TYPE, headers=h)


def retry_after_header(seconds: float) -> int:
    """Whole seconds, at least 1, at most 60."""
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))


def unavailable(message: str, request_id: str | None, retry_after_s: float,
                queue_position: int = 0, should_retry: bool = True,
                **extra: Any) -> web.Response:
    """503: Spillway cannot serve this now; the client learns when to come back."""
    if message != LOADING and not message.startswith(OVERLOADED):
        message = f"{OVERLOADED}: {message}"
    retry_after = retry_after_header(retry_after_s)
    headers = {"Retry-After": str(retry_after),
               "x-should-retry": "true" if should_retry else "false"}
    return json_error(503, "unavailable_error", message, request_id, headers=headers,
                      queue_position=queue_position, retry_after_s=retry_after, **extra)


def upstream_error(message: str, request_id: str | None, kind: str,
                   retry_after_s: float | None = None, **extra: Any) -> web.Response:
    """502: the child failed and the request could not be replayed."""
    headers: dict[str, str] = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_header(retry_after_s))
        headers["x-should-retry"] = "true"
    else:
        headers["x-should-retry"] = "false"
    return json_error(502, "upstream_error", message, request_id, headers=headers, kind=kind,
                      **extra)


def invalid_request(status: int, message: str, request_id: str | None,
                    **extra: Any) -> web.Response:
    return json_error(status, "invalid_request_error", message, request_id, **extra)


def exceed_context(n_prompt_tokens: int, n_ctx: int, request_id: str | None) -> web.Response:
    """400: a prompt over the context of a slot of every child, refused before any child works
    on it, in llama-server's words and with its fields (clients read them to trim the
    conversation and try again); a stream gets it as plain JSON too, as llama-server does."""
    return json_error(400, "exceed_context_size_error",
                      f"request ({n_prompt_tokens} tokens) exceeds the available context size "
                      f"({n_ctx} tokens), try increasing it", request_id,
                      n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)


def authentication_error(request_id: str | None) -> web.Response:
    """401, shaped as llama-server shapes its own refusal."""
    body = {"error": {"code": 401, "message": "Invalid API Key",
                      "type": "authentication_error", "src": "spillway",
                      "request_id": request_id}}
    headers = {"WWW-Authenticate": 'Bearer realm="spillway"'}
    if request_id:
        headers["X-Request-Id"] = request_id
    return web.Response(status=401, text=json.dumps(body), content_type=JSON_TYPE,
                        headers=headers)


def sse_error_event(message: str, type_: str, code: int, request_id: str | None,
                    anthropic: bool = False, **extra: Any) -> bytes:
    """The one event that ends a stream that failed after bytes reached the client."""
    payload = json.dumps(error_body(code, type_, message, request_id, **extra))
    prefix = b"event: error\n" if anthropic else b""
    return prefix + b"data: " + payload.encode() + b"\n\n"
