"""Connections to the children: a small HTTP/1.1 client with a keep-alive pool, made for one
kind of server (llama-server on loopback) and for the proxy's hot path.

Why not aiohttp's client: measured in the benchmark (`python -m bench --only hotpath`), its
request machinery was most of what Spillway added to a request: the same handler with this
client served 1.5 times what the bare aiohttp pass-through serves. What the proxy needs is
small: send one request in one write, read the status line and headers, read the body by its
framing (Content-Length, chunked, or until close), notice silence, and pool the connection when
the answer was read whole and both sides keep it alive.

What it also knows, and aiohttp's pool could only be asked through a context variable: which
connection an attempt got, how many requests it had carried and how long it had been idle.
llama-server (cpp-httplib) closes a keep-alive connection after 5 s idle and after 100 requests;
a request that meets a connection closed under it dies on that socket, not on the child, and
can only be told apart when it is known that the connection was a reused one (a new connection
that closes with no answer says something about the child). The forwarder reads it from the
attempt's `ConnectionUse`.

Errors: `UpstreamConnectError` (nothing accepted the connection), `UpstreamClosed` (the
connection closed before the answer was whole; `unwritten` when the request never left), and
`TimeoutError` (connecting took too long, or no byte for the read timeout).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from ..records.caches import figures

READ_CHUNK_HIGH = 256 * 1024  # stop reading from the socket past this much unread body
# A request body up to this size goes out in one write with its head (one syscall: the text
# request's hot path). A larger one (an image's base64) is written apart from the head, in
# slices as the child takes them: neither joined to the head (a copy of the whole body) nor
# left whole in the transport's buffer (Python before 3.12 copies what the socket did not take
# at once into it).
WRITE_WHOLE_BYTES = 64 * 1024
WRITE_SLICE_BYTES = 256 * 1024
MAX_HEAD_BYTES = 64 * 1024  # a status line and headers larger than this are refused


class UpstreamConnectError(OSError):
    """No connection: nothing listening, or refused."""


class UpstreamClosed(ConnectionError):
    """The connection closed before the answer was whole."""

    def __init__(self, message: str, unwritten: bool = False) -> None:
        super().__init__(message)
        self.unwritten = unwritten  # the request never left: sending it again is safe


class UpstreamProtocolError(ConnectionError):
    """The child's answer is not HTTP/1.1 as expected."""


@dataclass
class _History:
    """What one pooled connection has done so far."""

    requests: int = 0
    last_done: float | None = None  # monotonic: when its latest request ended


@dataclass
class ConnectionUse:
    """The connection one attempt got, as the forwarder logs and judges it."""

    reused: bool = False
    requests: int = 0  # requests the connection has carried, this one included
    idle_s: float | None = None  # since its previous request ended (None: a new connection)
    _history: _History | None = field(default=None, repr=False)

    def done(self, now: float) -> None:
        """The attempt is over: the connection, if pooled again, is idle from now."""
        if self._history is not None:
            self._history.last_done = now

    def describe(self) -> str:
        if not self.reused:
            return "a new connection"
        idle = f", idle {self.idle_s:.2f} s before it" if self.idle_s is not None else ""
        return f"a reused connection (request {self.requests} on it{idle})"


class _Connection(asyncio.Protocol):
    """One TCP connection: bytes in a buffer, and one waiter for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False  # the server closed its side (or the connection is gone)
        self.waiter: asyncio.Future[None] | None = None
        self.history = _History()
        self.paused = False
        self.drained: asyncio.Future[None] | None = None  # set while the transport's buffer is full

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > READ_CHUNK_HIGH and self.transport is not None \
                and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        self.eof = True
        self._wake()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # for the response

    @property
    def usable(self) -> bool:
        return not self.eof and self.transport is not None and not self.transport.is_closing()

    def take(self, n: int) -> bytes:
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        if self.paused and len(self.buffer) < READ_CHUNK_HIGH // 2 \
                and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def more(self, timeout: float | None) -> bool:
        """Wait for more bytes; False at the end of the connection. TimeoutError on silence."""
        if self.eof:
            return False
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        handle = loop.call_later(timeout, _time_out, waiter) if timeout else None
        try:
            await waiter
        finally:
            if handle is not None:
                handle.cancel()
            if self.waiter is waiter:
                self.waiter = None
        return True

    async def write_large(self, body: bytes, timeout: float | None) -> None:
        """`body` in slices, each once the transport has sent most of the one before (its
        buffer under the low-water mark): the transport holds at most about a slice of it.
        UpstreamClosed when the connection goes, TimeoutError when the child takes nothing
        for `timeout`."""
        view = memoryview(body)
        for start in range(0, len(view), WRITE_SLICE_BYTES):
            if self.drained is not None:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self.drained)
            transport = self.transport
            if transport is None or transport.is_closing() or self.eof:
                raise UpstreamClosed("the connection closed while the request was sent")
            transport.write(view[start:start + WRITE_SLICE_BYTES])

    def close(self) -> None:
        self.eof = True
        if self.transport is not None:
            self.transport.close()


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class UpstreamResponse:
    """One answer: status and headers read; the body is read with `read` or `readany`."""

    def __init__(self, conn: _Connection, pool: _Idle | None, status: int, reason: str,
                 headers: CIMultiDict[str], method: str, read_timeout: float | None,
                 keep_alive: bool) -> None:
        self._conn = conn
        self._pool = pool
        self.status = status
        self.reason = reason
        self.headers = CIMultiDictProxy(headers)
        self._read_timeout = read_timeout
        self._keep_alive = keep_alive
        self._finished = False
        self._chunked = False
        self._left: int | None = None  # body bytes left (Content-Length), or chunk bytes left
        self._chunk_state = "size"  # size | data | crlf | trailers
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            self._left = 0
        elif "chunked" in headers.get("Transfer-Encoding", "").lower():
            self._chunked = True
        elif (length := headers.get("Content-Length")) is not None:
            if not length.strip().isdigit():
                raise UpstreamProtocolError(f"bad Content-Length {length!r}")
            self._left = int(length)
        else:
            self._keep_alive = False  # the body ends when the connection does
        if self._left == 0 and not self._chunked:
            self._finish()

    @property
    def finished(self) -> bool:
        return self._finished

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    async def readany(self) -> bytes:
        """The next bytes of the body (as much as has arrived); b"" at its end."""
        while not self._finished:
            data = self._chunk() if self._chunked else self._plain()
            if data:
                return data
            if self._finished:
                break
            if not await self._conn.more(self._read_timeout):
                if self._left is None and not self._chunked:
                    self._finish()  # read until close: this is the end
                    break
                raise UpstreamClosed("the connection closed in the middle of the answer")
        return b""

    def _plain(self) -> bytes:
        buf = self._conn.buffer
        if not buf:
            return b""
        if self._left is None:
            return self._conn.take(len(buf))
        data = self._conn.take(min(self._left, len(buf)))
        self._left -= len(data)
        if self._left == 0:
            self._finish()
        return data

    def _chunk(self) -> bytes:
        """Decode what the buffer holds of a chunked body."""
        out = bytearray()
        while not self._finished:
            if self._chunk_state == "data":
                data = self._chunk_data()
                if not data:
                    break
                out += data
                continue
            buf = self._conn.buffer
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise UpstreamProtocolError("a chunk size line too long")
                break
            self._chunk_line(self._conn.take(end + 2)[:-2])
        return bytes(out)

    def _chunk_data(self) -> bytes:
        assert self._left is not None
        if not self._conn.buffer:
            return b""
        data = self._conn.take(min(self._left, len(self._conn.buffer)))
        self._left -= len(data)
        if self._left == 0:
            self._chunk_state = "crlf"
        return data

    def _chunk_line(self, line: bytes) -> None:
        """A line of the chunked framing: a size, the CRLF after data, or a trailer."""
        if self._chunk_state == "crlf":
            if line:
                raise UpstreamProtocolError("no CRLF after a chunk")
            self._chunk_state = "size"
        elif self._chunk_state == "size":
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError as e:
                raise UpstreamProtocolError(f"bad chunk size {line[:40]!r}") from e
            self._chunk_state = "trailers" if size == 0 else "data"
            self._left = size
        elif not line:  # the empty line after the trailers: the end
            self._finish()

    def _finish(self) -> None:
        self._finished = True
        conn, pool = self._conn, self._pool
        self._pool = None
        if pool is not None and self._keep_alive and conn.usable and not conn.buffer:
            pool.put(conn)
        elif pool is not None:
            conn.close()

    def close(self) -> None:
        """Done with it: a connection whose answer was not read whole is closed (which also
        tells llama-server that the client went away and frees its slot)."""
        if not self._finished:
            self._finished = True
            self._pool = None
            self._conn.close()


class _Idle:
    """The idle keep-alive connections to one server, the most recently used first."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
        self.conns: list[_Connection] = []

    def put(self, conn: _Connection) -> None:
        now = conn.history.last_done = time.monotonic()
        # Oldest first: the ones idle past keep-alive go now, not only when asked for (a
        # burst's connections would otherwise stay open until the next burst).
        while self.conns and now - (self.conns[0].history.last_done or now) >= \
                self.keepalive_s:
            self.conns.pop(0).close()
        self.conns.append(conn)

    def get(self) -> _Connection | None:
        now = time.monotonic()
        while self.conns:
            conn = self.conns.pop()
            last = conn.history.last_done
            if conn.usable and (last is None or now - last < self.keepalive_s):
                return conn
            conn.close()
        return None

    def has_usable(self) -> bool:
        return any(conn.usable for conn in self.conns)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns.clear()


class UpstreamClient:
    """Keep-alive connections to the children, by address."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], _Idle] = {}

    def cache_figures(self) -> dict[str, Any]:
        """For the status's caches: the idle keep-alive connections held (at most as many as
        requests were in flight at once, each closed once idle for keepalive_s)."""
        return figures(sum(len(idle.conns) for idle in self._idle.values()),
                       max_age_s=self.keepalive_s)

    async def request(self, host: str, port: int, method: str, target: str,
                      headers: Iterable[tuple[str, str]], body: bytes, use: ConnectionUse, *,
                      connect_timeout: float, read_timeout: float | None,
                      fresh: bool = False) -> UpstreamResponse:
        """Send one request and read its status and headers. `fresh`: on a new connection."""
        idle = self._idle.get((host, port))
        if idle is None:
            # A child that restarted listens on a new port: forget the old ports' pools.
            for key in [k for k, v in self._idle.items() if not v.has_usable()]:
                self._idle.pop(key).close()
            idle = self._idle[(host, port)] = _Idle(self.keepalive_s)
        conn = None if fresh else idle.get()
        if conn is None:
            conn = await _connect(host, port, connect_timeout)
        else:
            use.reused = True
            last = conn.history.last_done
            use.idle_s = None if last is None else time.monotonic() - last
        conn.history.requests += 1
        use.requests = conn.history.requests
        use._history = conn.history
        keep_alive = True
        lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"]
        for name, value in headers:
            if name.lower() == "connection" and value.lower() == "close":
                keep_alive = False
            lines.append(f"{name}: {value}\r\n")
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        transport = conn.transport
        if transport is None or transport.is_closing():
            raise UpstreamClosed("the connection closed before the request was sent",
                                 unwritten=True)
        head = "".join(lines).encode("latin-1")
        try:
            if len(body) <= WRITE_WHOLE_BYTES:
                transport.write(head + body)
            else:
                transport.write(head)
                await conn.write_large(body, read_timeout)
            return await _read_head(conn, idle, method, read_timeout, keep_alive)
        except BaseException:
            conn.close()
            raise

    def close(self) -> None:
        for idle in self._idle.values():
            idle.close()
        self._idle.clear()


async def _connect(host: str, port: int, timeout: float) -> _Connection:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            _, conn = await loop.create_connection(_Connection, host, port)
    except TimeoutError:
        raise
    except OSError as e:
        raise UpstreamConnectError(e.errno, f"cannot connect to {host}:{port}: {e}") from e
    return conn


async def _read_head(conn: _Connection, idle: _Idle, method: str, read_timeout: float | None,
                     keep_alive: bool) -> UpstreamResponse:
    while (end := conn.buffer.find(b"\r\n\r\n")) < 0:
        if len(conn.buffer) > MAX_HEAD_BYTES:
            raise UpstreamProtocolError("the answer's headers are too large")
        if not await conn.more(read_timeout):
            raise UpstreamClosed("the connection closed before a response")
    head = conn.take(end + 4)[:-4].decode("latin-1").split("\r\n")
    version, _, rest = head[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise UpstreamProtocolError(f"not an HTTP/1 status line: {head[0][:80]!r}")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in head[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise UpstreamProtocolError(f"a header line without a colon: {line[:80]!r}")
        headers.add(name.strip(), value.strip())
    if version == "HTTP/1.0" or "close" in headers.get("Connection", "").lower():
        keep_alive = False
    return UpstreamResponse(conn, idle, int(code), reason, headers, method, read_timeout,
                            keep_alive)
