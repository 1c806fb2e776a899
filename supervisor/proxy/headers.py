"""Which headers cross the proxy, in each direction; and Spillway's own request headers, read
by one rule."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from multidict import CIMultiDict, CIMultiDictProxy

from ..vocabulary import OwnHeaders

# RFC 9110 7.6.1 connection-specific fields, plus the ones the proxy sets itself.
HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
    "TE", "Trailer", "Transfer-Encoding", "Upgrade",
))

# Not forwarded to a child: the child's own key replaces the client's, the body is re-framed,
# and Spillway's own request headers stop here.
_NOT_UPSTREAM = HOP_BY_HOP | frozenset({
    "host", "content-length", "authorization", "x-api-key", "accept-encoding", "expect",
    "x-spillway-child", "x-spillway-replay", "x-spillway-deadline", "idempotency-key",
    "x-spillway-fallback",
    # The body a child gets is the one Spillway read, which aiohttp has decompressed (gzip,
    # deflate, br, zstd; bodies.py); a coding it does not know, llama-server ignores as well.
    "content-encoding",
    # Spillway holds resumable streams itself (stream_sessions.py): a child that saw the id
    # would keep generating after Spillway stopped reading, until a DELETE it never gets.
    "x-conversation-id",
})

# Not copied back to the client: re-framed by the server side, or set by Spillway.
_NOT_DOWNSTREAM = HOP_BY_HOP | frozenset({
    "content-length", "content-encoding", "date", "server",
    "x-request-id", "x-spillway-child", "x-spillway-attempts", "x-spillway-failover",
})


_NONE: frozenset[str] = frozenset()


def _connection_tokens(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> frozenset[str]:
    """Fields named in `Connection:` are hop-by-hop too."""
    if "Connection" not in headers:
        return _NONE
    tokens: set[str] = set()
    for value in headers.getall("Connection", []):
        tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return frozenset(tokens)


def upstream_headers(client: CIMultiDictProxy[str], request_id: str,
                     child_key: str | None) -> CIMultiDict[str]:
    extra = _connection_tokens(client)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in client.items():
        low = name.lower()
        if low in _NOT_UPSTREAM or low in extra or low == "x-request-id":
            continue
        out.add(name, value)
    out["X-Request-Id"] = request_id
    if child_key is not None:
        out["Authorization"] = f"Bearer {child_key}"
    # Compressed bodies would have to be decoded to find SSE events; loopback needs no gzip.
    out["Accept-Encoding"] = "identity"
    return out


def downstream_headers(upstream: CIMultiDictProxy[str],
                       own: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    extra = _connection_tokens(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.items():
        low = name.lower()
        if low in _NOT_DOWNSTREAM or low in extra:
            continue
        out.add(name, value)
    for name, value in own:
        out[name] = value
    return out


# --- Spillway's own request headers -----------------------------------------------------------
#
# One rule for all of them: absent (or empty) is "not given"; any other value must be one the
# header takes, case and surrounding spaces aside, else the request is a 400 naming the header,
# before its body is read. Silently ignored, a mistyped `X-Spillway-Replay: nevr` would be
# replayed, and a `X-Spillway-Deadline: 30s` would wait past the client. The same header twice
# with different values is ambiguous, and refused. Other names that start with X-Spillway- are
# not Spillway's to refuse: a load balancer in front sets its own (examples/haproxy.cfg routes
# by X-Spillway-Route), and they pass as any header.
#
# X-Stainless-Timeout is not Spillway's: the OpenAI SDKs send it on every request, so it is a
# deadline when it holds a usable one (a number of seconds over 0) and ignored otherwise, never
# a 400 (the Node SDK sends "0" for a timeout under a second).

CHILD = "X-Spillway-Child"  # a child's name: routes outside generation go to it
REPLAY = "X-Spillway-Replay"  # "never": not replayed on another child
DEADLINE = "X-Spillway-Deadline"  # the seconds the client will wait
FALLBACK = "X-Spillway-Fallback"  # "smaller" (a smaller model may answer) or "none"
SDK_TIMEOUT = "X-Stainless-Timeout"
OWN_REQUEST_HEADERS = (CHILD, REPLAY, DEADLINE, FALLBACK)
# X-Spillway-Fallback's values: "smaller" accepts a smaller model's answer, "none" refuses one
# even where small.requests = "all", "" (not given) is the config's choice.
FALLBACKS = ("smaller", "none")


@dataclass(frozen=True)
class HeaderProblem:
    header: str
    message: str


def own_headers(headers: CIMultiDictProxy[str] | CIMultiDict[str],
                children: Callable[[], Collection[str]]) -> OwnHeaders | HeaderProblem:
    """The request's own headers read, or the first one that says what Spillway does not
    know. `children()`: the names X-Spillway-Child may pin (asked only when it is given)."""
    if not any(name in headers for name in OWN_REQUEST_HEADERS):
        return _sdk_only(headers.get(SDK_TIMEOUT))  # nearly every request
    values: dict[str, str] = {}
    for name in OWN_REQUEST_HEADERS:
        given = {v.strip().lower() for v in headers.getall(name, ())} - {""}
        if len(given) > 1:
            return HeaderProblem(name, f"{name} is given more than once, with different values")
        if given:
            values[name] = given.pop()
    child = values.get(CHILD)
    if child is not None and child not in (names := children()):
        return HeaderProblem(CHILD, f"{CHILD} must name a child: "
                                    f"{' or '.join(_quoted(names))}")
    if values.get(REPLAY, "never") != "never":
        return HeaderProblem(REPLAY, f'{REPLAY} must be "never" (the request is not replayed '
                                     "on another child)")
    fallback = values.get(FALLBACK, "")
    if fallback and fallback not in FALLBACKS:
        return HeaderProblem(FALLBACK, f'{FALLBACK} must be "smaller" (a smaller model may '
                                       'answer when the GPU child cannot) or "none"')
    deadline = _seconds(values.get(DEADLINE))
    if DEADLINE in values and deadline is None:
        return HeaderProblem(DEADLINE, f"{DEADLINE} must be the seconds the client will wait, "
                                       "a number over 0")
    sdk = _seconds(headers.get(SDK_TIMEOUT))
    deadlines = [s for s in (deadline, sdk) if s is not None]
    return OwnHeaders(pin=child, replay=REPLAY not in values,
                      deadline_s=min(deadlines) if deadlines else None, fallback=fallback)


@functools.lru_cache(maxsize=64)
def _sdk_only(timeout: str | None) -> OwnHeaders:
    """A request with no header of Spillway's: what its X-Stainless-Timeout asks (an SDK sends
    the same few values again and again)."""
    return OwnHeaders(deadline_s=_seconds(timeout))


def _seconds(text: str | None) -> float | None:
    """A number of seconds over 0, or None."""
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def _quoted(names: Iterable[str]) -> list[str]:
    return [f'"{n}"' for n in names]
