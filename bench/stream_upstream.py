"""An upstream that streams, to isolate the proxy's relay of SSE events in the benchmark: an
aiohttp server posing as llama-server (health, props, `--list-devices`) whose chat route answers
every request with a stream of EVENTS chunk events, one every PACE seconds (each its own write,
as a real server's tokens are), then `[DONE]`. Spillway starts it as a child with llama-server's
arguments; only --port matters here.

    python bench/stream_upstream.py --port N [--events 1000] [--pace 0.001]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from aiohttp import web

# A chat chunk the size of llama-server's (fixtures/llama-server/cpu/chat-completions-stream.sse).
EVENT = ("data: " + json.dumps({
    "choices": [{"finish_reason": None, "index": 0, "delta": {"content": " word"}}],
    "created": 1764460800, "id": "chatcmpl-bench0000000000000000000000", "model": "bench",
    "system_fingerprint": "b11434-bench", "object": "chat.completion.chunk"},
    separators=(",", ":")) + "\n\n").encode()
DONE = b"data: [DONE]\n\n"


def app(events: int, pace: float) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(request: web.Request) -> web.Response:
        return web.json_response({"default_generation_settings": {"n_ctx": 8192},
                                  "total_slots": 1024})

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(events):
            await response.write(EVENT)
            await asyncio.sleep(pace)
        await response.write(DONE)
        await response.write_eof()
        return response

    a = web.Application()
    a.router.add_get("/health", health)
    a.router.add_get("/props", props)
    a.router.add_post("/v1/chat/completions", chat)
    return a


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--pace", type=float, default=0.001)
    parser.add_argument("--list-devices", action="store_true")
    args, _ = parser.parse_known_args()
    if args.list_devices:
        print("Available devices:\n  (none)")
        sys.exit(0)
    web.run_app(app(args.events, args.pace), host="127.0.0.1", port=args.port,
                access_log=None, print=None)


if __name__ == "__main__":
    main()
