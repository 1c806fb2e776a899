"""Whether a stream's client asked for pings, and how often.

A ping is llama-server's keep-alive: an SSE comment, `:` and a blank line, written after that
many seconds with no result (server-context.cpp, `handle_completions_impl`; its timer starts
again at every result, and the first result is the status and headers, at prompt processing's
start). llama-server pings when its interval is over 0: the request's `sse_ping_interval`
(JSON null counts as absent; on /v1/messages the body is converted to a chat body that drops
it, so the server's applies there), else the server's `--sse-ping-interval`
(`LLAMA_ARG_SSE_PING_INTERVAL`), else its built-in 30 s; whole seconds (a fraction is cut, so
0.5 is 0: none).

Spillway takes as asked only what someone set: the request's field, else the operator's flag
on the child that answers. llama-server's built-in 30 s is not an ask: a client that talks to
its llama-server on a GPU never waits 30 s for a token, so it never met that ping, and the
clients that parse every line (home-llm's `json.loads` per line, Jan's "Malformed chunk") break
on one; it is through Spillway, on the CPU child's long prefill, that they would first meet it.
So a client that did not ask gets no comment line at all, Spillway's or a child's.
"""

from __future__ import annotations

from typing import Any

# llama-server's ping, as it writes it.
PING = b":\n\n"
FIELD = "sse_ping_interval"


def asked_interval(payload: Any, messages_route: bool, server_flag: int | None) -> int | None:
    """The seconds of silence after which the client asked to hear a ping; None: it did not
    ask (or asked for none). `payload`: the request's JSON body; `messages_route`: the
    Anthropic Messages route, where llama-server does not read the field; `server_flag`: the
    child's `--sse-ping-interval` as the operator set it (None: not set)."""
    value: Any = None
    if not messages_route and isinstance(payload, dict):
        value = payload.get(FIELD)
    if value is None or isinstance(value, str):
        # (A string is refused by the child with a 400: no stream to ping.)
        value = server_flag
    if not isinstance(value, (int, float)):
        return None
    seconds = int(value)  # llama-server reads it as an int32: a fraction is cut
    return seconds if seconds > 0 else None


def flag_value(text: str | None) -> int | None:
    """`--sse-ping-interval N` (or its environment variable) as llama-server reads it (an
    integer); None when not given or not a number (llama-server refuses to start then)."""
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None
