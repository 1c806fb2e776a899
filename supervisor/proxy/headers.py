"""Which headers cross the proxy, in each direction."""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy

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

