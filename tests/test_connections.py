"""The proxy's HTTP/1.1 client to the children (supervisor/proxy/connections.py), against a
scripted server on loopback: body framings, keep-alive pooling and what an attempt learns of
its connection, silence, a connection closed under a request, flow control."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from supervisor.proxy import connections
from supervisor.proxy.connections import (
    ConnectionUse, UpstreamClient, UpstreamClosed, UpstreamConnectError,
)

MIB = 1024 * 1024

class Server:
    """Answers each request on a connection with the script's bytes; records the requests."""

    def __init__(self, answer: Callable[[int, bytes], bytes | None]) -> None:
        self.answer = answer  # (request number on this connection, request) -> bytes or None
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.gate: asyncio.Event | None = None  # set: a request's body is read once it is set

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()  # the server is gone: so are its connections

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if self.gate is not None:
                    await self.gate.wait()
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                n += 1
                out = self.answer(n, head + body)
                if out is None:
                    break  # close with no answer
                writer.write(out)
                await writer.drain()
                if b"\r\nConnection: close\r\n" in out:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def ok(body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            f"\r\n{extra}\r\n").encode() + body


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(keepalive_s=4.0)
    yield c
    c.close()


async def get(client: UpstreamClient, port: int, body: bytes = b'{"a":1}',
              use: ConnectionUse | None = None, headers: list[tuple[str, str]] | None = None,
              read_timeout: float | None = 5.0) -> tuple[int, bytes, Any]:
    r = await client.request("127.0.0.1", port, "POST", "/v1/chat/completions",
                             headers or [("Content-Type", "application/json")], body,
                             use or ConnectionUse(), connect_timeout=2.0,
                             read_timeout=read_timeout)
    data = await r.read()
    return r.status, data, r.headers


async def test_a_whole_answer_comes_back_and_its_connection_is_reused(
        client: UpstreamClient) -> None:
    async with Server(lambda n, req: ok(b'{"n":%d}' % n)) as srv:
        first, second = ConnectionUse(), ConnectionUse()
        assert (await get(client, srv.port, use=first))[:2] == (200, b'{"n":1}')
        status, body, headers = await get(client, srv.port, use=second)
        assert (status, body) == (200, b'{"n":2}') and headers["Content-Type"] == \
            "application/json"
        assert srv.connections == 1
        assert not first.reused and second.reused and second.requests == 2
        assert second.idle_s is not None and 0 <= second.idle_s < 1
        # The request went out whole, with its framing and the headers given.
        sent = srv.requests[0]
        assert sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"\r\nContent-Length: 7\r\n" in sent and sent.endswith(b'\r\n\r\n{"a":1}')


async def test_a_large_body_goes_out_whole_never_all_of_it_in_the_transports_buffer(
        client: UpstreamClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image's base64 is sent apart from its head, in slices as the child takes them: held
    back by a child that reads nothing yet, the transport's buffer holds about a slice of it,
    not the rest of the body (a copy of it, before Python 3.12)."""
    buffered: list[int] = []  # the transport's buffer each time it asked the sender to wait
    pause = connections._Connection.pause_writing

    def recorded(self: connections._Connection) -> None:
        assert self.transport is not None
        buffered.append(self.transport.get_write_buffer_size())
        pause(self)

    monkeypatch.setattr(connections._Connection, "pause_writing", recorded)
    body = b'{"image": "' + b"A" * (32 * MIB) + b'"}'  # more than the kernel's buffers take
    async with Server(lambda n, req: ok(b"{}")) as srv:
        srv.gate = asyncio.Event()
        task = asyncio.get_running_loop().create_task(get(client, srv.port, body=body))
        deadline = asyncio.get_running_loop().time() + 30
        while not buffered:  # until the sender must wait: the child has taken nothing
            assert asyncio.get_running_loop().time() < deadline and not task.done()
            await asyncio.sleep(0.01)
        srv.gate.set()
        assert (await task)[:2] == (200, b"{}")
    assert srv.requests[0].endswith(b"\r\n\r\n" + body)
    assert b"\r\nContent-Length: %d\r\n" % len(body) in srv.requests[0]
    # About a slice (256 KiB) over the transport's high-water mark (64 KiB), at most.
    assert max(buffered) <= 512 * 1024, max(buffered)


async def test_chunked_and_until_close_bodies(client: UpstreamClient) -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: 1\r\n\r\n")
    async with Server(lambda n, req: chunked) as srv:
        assert (await get(client, srv.port))[:2] == (200, b"hello world")
        assert (await get(client, srv.port))[:2] == (200, b"hello world")
        assert srv.connections == 1  # read whole: pooled
    until_close = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"
    async with Server(lambda n, req: until_close if n == 1 else None) as srv:
        assert (await get(client, srv.port))[:2] == (200, b"all of it")


async def test_readany_gives_a_stream_as_it_arrives() -> None:
    client = UpstreamClient(keepalive_s=4.0)
    gate = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await gate.wait()
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        r = await client.request("127.0.0.1", port, "GET", "/s", [], b"", ConnectionUse(),
                                 connect_timeout=2.0, read_timeout=5.0)
        assert await r.readany() == b"data: 1\n\n"  # before the rest was even sent
        gate.set()
        assert await r.readany() == b"data: 2\n\n"
        assert await r.readany() == b""
    finally:
        server.close()
        client.close()


async def test_silence_is_a_timeout_and_the_connection_is_not_pooled(
        client: UpstreamClient) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(5)  # says nothing

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(TimeoutError):
            await get(client, port, body=b"", read_timeout=0.2)
        idle = client._idle[("127.0.0.1", port)]
        assert idle.conns == []
    finally:
        server.close()


async def test_a_reused_connection_closed_under_a_request_says_so(
        client: UpstreamClient) -> None:
    # The server answers once, then closes the connection on the next request with no answer.
    async with Server(lambda n, req: ok(b"{}") if n == 1 else None) as srv:
        await get(client, srv.port)
        use = ConnectionUse()
        with pytest.raises(UpstreamClosed) as e:
            await get(client, srv.port, use=use)
        assert use.reused and use.requests == 2 and not e.value.unwritten
        assert "reused connection (request 2 on it" in use.describe()
        # A new connection works (what the forwarder's resend uses).
        fresh = ConnectionUse()
        r = await client.request("127.0.0.1", srv.port, "POST", "/", [], b"{}", fresh,
                                 connect_timeout=2.0, read_timeout=5.0, fresh=True)
        assert r.status == 200 and not fresh.reused
        await r.read()


async def test_nothing_listening_is_a_connect_error(client: UpstreamClient) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(UpstreamConnectError):
        await get(client, port)


async def test_a_connection_asked_to_close_or_an_answer_left_unread_is_not_pooled(
        client: UpstreamClient) -> None:
    async with Server(lambda n, req: ok(b"x" * 10)) as srv:
        await get(client, srv.port, headers=[("Connection", "close")])
        await get(client, srv.port)
        assert srv.connections == 2
        r = await client.request("127.0.0.1", srv.port, "POST", "/", [], b"{}",
                                 ConnectionUse(), connect_timeout=2.0, read_timeout=5.0)
        r.close()  # the client went away before the body was read
        await get(client, srv.port)
        assert srv.connections == 3


async def test_a_large_body_is_read_whole_with_reading_paused_and_resumed(
        client: UpstreamClient) -> None:
    big = bytes(range(256)) * 8192  # 2 MiB, past the read-ahead limit
    async with Server(lambda n, req: ok(big)) as srv:
        r = await client.request("127.0.0.1", srv.port, "POST", "/", [], b"{}",
                                 ConnectionUse(), connect_timeout=2.0, read_timeout=5.0)
        await asyncio.sleep(0.2)  # let it fill the buffer and pause
        got = bytearray()
        while chunk := await r.readany():
            got += chunk
        assert bytes(got) == big and r.finished


async def test_the_pools_of_ports_no_longer_in_use_are_forgotten(client: UpstreamClient) -> None:
    # A child that restarts listens on a new port; its old port's pool must not stay forever.
    async with Server(lambda n, req: ok(b"{}")) as old:
        await get(client, old.port)
        assert ("127.0.0.1", old.port) in client._idle
    await asyncio.sleep(0.05)  # the old server is gone: its pooled connection closed
    async with Server(lambda n, req: ok(b"{}")) as new:
        await get(client, new.port)
        assert list(client._idle) == [("127.0.0.1", new.port)]
