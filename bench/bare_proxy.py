"""A bare aiohttp pass-through, as a reference in the benchmark: what the framework Spillway is
built on costs by itself (read the body, forward it, send the answer back; nothing else). With
a third argument `stream`, the answer is relayed chunk by chunk as it comes (the reference for
an SSE stream's relay, bench/relay.py).

    python bench/bare_proxy.py UPSTREAM_URL PORT [stream]
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web


async def main(upstream: str, port: int, stream: bool = False) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    auto_decompress=False)

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        async with session.request(request.method, upstream + request.path_qs, data=body,
                                   headers={"Content-Type": "application/json"}) as r:
            data = await r.read()
            return web.Response(body=data, status=r.status, content_type="application/json")

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with session.request(request.method, upstream + request.path_qs, data=body,
                                   headers={"Content-Type": "application/json"}) as r:
            response = web.StreamResponse(status=r.status, headers={
                "Content-Type": r.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            async for chunk in r.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay if stream else handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:4] == ["stream"]))
