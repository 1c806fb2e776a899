"""A bare aiohttp pass-through, as a reference in the benchmark: what the framework Spillway is
built on costs by itself (read the body, forward it, send the answer back; nothing else)."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web


async def main(upstream: str, port: int) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    auto_decompress=False)

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        async with session.request(request.method, upstream + request.path_qs, data=body,
                                   headers={"Content-Type": "application/json"}) as r:
            data = await r.read()
            return web.Response(body=data, status=r.status, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
