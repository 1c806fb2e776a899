#!/usr/bin/env python3
"""A fault injector around a real llama-server, standing in for a GPU that runs out of memory.

Named for what it is: a test double of the *GPU*, not of llama-server. Spillway starts it as the
GPU child's `llama_server`; it starts the real llama-server (REAL_LLAMA_SERVER) with the same
arguments on a private port and relays HTTP between the two, byte for byte, streams included.
Every line the real server writes passes through to stderr, so Spillway sees its real
`launch_slot_` lines (one per task: the execution count) and its real exit.

On a trigger it does what a CUDA build does when its memory pool cannot grow: the request has
reached the real server and its slot has launched (prompt processing), then the captured CUDA
lines are written and the process dies with SIGABRT, taking the real server with it.

  FAULT_MARKER=TEXT     trigger on a generation request whose body contains TEXT
  FAULT_NTH=N           trigger on the Nth generation request
  FAULT_PATHS=*         any route may trigger, not only the generation routes
  FAULT_ON_PATH=PATH    trigger on a request for PATH, whatever its route (a web UI's file)
  FAULT_CLIENTS_ONLY=1  only a client's request, forwarded by Spillway (with its X-Request-Id),
                        triggers: not Spillway's own probes (its /health liveness poll)
  FAULT_ONCE_FILE=PATH  fire at most once across restarts (the file records that it fired)
  FAULT_WHEN=launch     abort once the real server launched the task (default)
  FAULT_WHEN=events:K   abort after K SSE events of the stream reached Spillway (events with
                        data: llama-server's pings, `:` comments, are not counted)
  FAULT_WHEN=tokens:K   abort after the Kth event that carries generated text (a chat delta's
                        `content` or `reasoning_content`, a completion's `content` or `text`),
                        whatever progress events and pings came before
  FAULT_WHEN=finish:1   abort right after the event with the answer's finish (a chunk's
                        finish_reason, /completion's `stop`): before the usage chunk and [DONE]
  FAULT_BODIES_FILE=PATH  append one JSON line (path, headers, body) per generation request,
                        fault or not: what Spillway sent the child
  FAULT_MODE=abort      CUDA lines, then SIGABRT (default)
  FAULT_MODE=survive    answer HTTP 500 "Compute error." and log a Vulkan OOM line; stay alive
  FAULT_LINES=full      the whole CUDA out-of-memory message before the abort (default)
  FAULT_LINES=terse     only `ggml-cuda.cu:109: CUDA error`, as seen on a real H200
  FAULT_LINES=vulkan_lost  a Vulkan build's lost device (vk::DeviceLostError), then SIGABRT
  FAULT_LINES=vision    the vision encoder's compute buffer could not be allocated while it
                        encoded an image (cudaMalloc failed, then the failed GGML_ASSERT), as
                        a CUDA build with its projector on the GPU dies of a large image
  FAULT_EVERY_MODE=abort|stall|alternate  what FAULT_EVERY_S does: abort (default); stall:
                        the real server is stopped (SIGSTOP: no byte, no /slots) while this
                        process still answers /health 200, as llama-server's HTTP thread does
                        while its inference loop is stuck; alternate: stall, abort, stall, ...
                        (counted in FAULT_COUNT_FILE=PATH across restarts)
  FAULT_EVERY_S=S       abort S seconds after the real server became ready (answered
                        /health), whatever it is doing: only a READY child dies (chaos: the
                        restarted child dies again S seconds after it is back)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
from aiohttp import web

ENV = os.environ
CUDA_FULL = [
    "CUDA error: out of memory",
    "  current device: 0, in function ggml_cuda_pool_vmm::alloc at "
    "llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:445",
    "  cuMemCreate(&handle, reserve_size, &prop, 0)",
    "llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error",
]
CUDA_TERSE = ["llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error"]
VULKAN_OOM = "ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory"
# A Vulkan build whose device was lost (llama.cpp#17334, verbatim): std::terminate, SIGABRT.
VULKAN_LOST = ["terminate called after throwing an instance of 'vk::DeviceLostError'",
               "  what():  vk::Queue::submit: ErrorDeviceLost"]
# A vision encoder (the projector, --mmproj, offloaded) out of memory while it encodes an image:
# a user's log of a CUDA build of llama-server and a 3 MB image (llama.cpp#13414, verbatim): the
# CUDA buffer type's allocation, ggml-alloc's, then the abort.
VISION_OOM = [
    "srv  process_chun: processing image...",
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4514.05 MiB on device 0: "
    "cudaMalloc failed: out of memory",
    "ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 4733328896",
    "/devel/tools/llama.cpp/ggml/src/ggml-backend.cpp:1662: GGML_ASSERT((char *)addr + "
    "ggml_backend_buffer_get_alloc_size(buffer, tensor) <= (char *)"
    "ggml_backend_buffer_get_base(buffer) + ggml_backend_buffer_get_size(buffer)) failed",
]
GENERATION = ("/completion", "/completions", "/v1/completions", "/chat/completions",
              "/v1/chat/completions", "/v1/responses", "/responses", "/v1/messages", "/infill",
              "/embedding", "/embeddings", "/v1/embeddings")
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
       "te", "trailer", "proxy-connection"}


class State:
    def __init__(self) -> None:
        self.requests = 0
        self.launches = 0
        self.launched = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.real: subprocess.Popen[bytes] | None = None
        self.real_port = 0
        self.output_done = threading.Event()
        self.dying = False
        self.stalled = False  # the real server stopped, /health still answered here


state = State()


def write(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def relay_output(real: subprocess.Popen[bytes]) -> None:
    """The real server's lines, passed through; `launch_slot_` lines counted."""
    assert real.stdout is not None
    for raw in real.stdout:
        line = raw.decode(errors="replace").rstrip("\n")
        write(line)
        if "launch_slot_" in line and state.loop is not None:
            state.loop.call_soon_threadsafe(_launched)
    state.output_done.set()


def _launched() -> None:
    state.launches += 1
    state.launched.set()
    state.launched = asyncio.Event()


def should_fire(path: str, body: bytes, forwarded: bool = True) -> bool:
    if ENV.get("FAULT_CLIENTS_ONLY") == "1" and not forwarded:
        return False
    if ENV.get("FAULT_ON_PATH") is not None:
        return path == ENV["FAULT_ON_PATH"] and _first_time()
    if path not in GENERATION and ENV.get("FAULT_PATHS") != "*":
        return False
    state.requests += 1
    marker = ENV.get("FAULT_MARKER")
    nth = int(ENV.get("FAULT_NTH", "0"))
    hit = (marker is not None and marker.encode() in body) or (nth and state.requests == nth)
    return hit and _first_time()


def _first_time() -> bool:
    """False once it fired, with FAULT_ONCE_FILE (across restarts)."""
    once = ENV.get("FAULT_ONCE_FILE")
    if once:
        if Path(once).exists():
            return False
        Path(once).write_text(str(os.getpid()))
    return True


def record_body(request: web.Request, body: bytes) -> None:
    path = ENV.get("FAULT_BODIES_FILE")
    if not path or request.path not in GENERATION:
        return
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    with open(path, "a") as f:
        f.write(json.dumps({"path": request.path, "headers": dict(request.headers),
                            "body": parsed}) + "\n")


def counts(part: bytes, unit: str) -> bool:
    """Whether one SSE event counts toward FAULT_WHEN's K: any data event (`events`), one
    that carries generated text (`tokens`), or one with the answer's finish (`finish`)."""
    data = b"\n".join(line[5:].strip() for line in part.split(b"\n")
                      if line.startswith(b"data:"))
    if not data:
        return False  # a comment (llama-server's ping): no event
    if unit == "events":
        return True
    try:
        event = json.loads(data)
    except ValueError:
        return False
    if not isinstance(event, dict):
        return False
    if unit == "finish":
        return event.get("stop") is True or any(
            isinstance(ch, dict) and ch.get("finish_reason") for ch in event.get("choices") or [])
    pieces = [event.get("content"), event.get("text")]
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        pieces += [delta.get("content"), delta.get("reasoning_content"), choice.get("text")]
    return any(isinstance(p, str) and p for p in pieces)


def die() -> None:
    """As a CUDA build dies: the real server aborts, the CUDA lines are the last ones out."""
    state.dying = True  # from now on nothing answers: a dying process sends no responses
    real = state.real
    if real is not None and real.poll() is None:
        real.send_signal(signal.SIGABRT)
        real.wait(10)
        state.output_done.wait(5)
    lines = {"terse": CUDA_TERSE, "vulkan_lost": VULKAN_LOST, "vision": VISION_OOM}.get(
        ENV.get("FAULT_LINES", "full"), CUDA_FULL)
    for line in lines:
        write(line)
    signal.signal(signal.SIGABRT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGABRT)


async def proxy(request: web.Request) -> web.StreamResponse:
    if state.stalled and request.path == "/health":
        return web.json_response({"status": "ok"})  # the HTTP thread, alive while stuck
    body = await request.read()
    record_body(request, body)
    fire = should_fire(request.path, body, "X-Request-Id" in request.headers)
    mode = ENV.get("FAULT_MODE", "abort")
    when = ENV.get("FAULT_WHEN", "launch")
    if fire and mode == "survive":
        for line in (VULKAN_LOST if ENV.get("FAULT_LINES") == "vulkan_lost" else [VULKAN_OOM]):
            write(line)
        await asyncio.sleep(0.1)  # the lines reach Spillway before the answer does
        return web.json_response({"error": {"code": 500, "message": "Compute error.",
                                             "type": "server_error"}}, status=500)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    url = f"http://127.0.0.1:{state.real_port}{request.raw_path}"
    launched = state.launched
    session = request.app["session"]
    try:
        upstream_cm = session.request(request.method, url, data=body or None, headers=headers,
                                      auto_decompress=False)
        if fire and when == "launch":
            task = asyncio.ensure_future(upstream_cm.__aenter__())
            if request.path in GENERATION:
                await asyncio.wait_for(launched.wait(), 30)
            else:  # no task to launch: the request has reached the real server
                await asyncio.sleep(0.05)
            die()
        async with upstream_cm as upstream:
            resp = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP})
            await resp.prepare(request)
            events = 0
            unit, _, k = when.partition(":")
            limit = int(k) if fire and unit in ("events", "tokens", "finish") \
                else None
            pending = b""
            async for chunk in upstream.content.iter_any():
                if limit is not None:
                    # Relay whole events one by one, to die right after the Kth.
                    *parts, pending = (pending + chunk).split(b"\n\n")
                    for part in parts:
                        if not part:
                            continue
                        await resp.write(part + b"\n\n")
                        events += counts(part, unit)
                        if events >= limit:
                            await asyncio.sleep(0.05)  # let it reach Spillway
                            die()
                else:
                    await resp.write(chunk)
            if pending:
                await resp.write(pending)
            await resp.write_eof()
            return resp
    except aiohttp.ClientConnectorError:
        if state.dying:
            await asyncio.sleep(3600)
        return web.json_response({"error": {"code": 503, "message": "Loading model",
                                            "type": "unavailable_error"}}, status=503)
    except (aiohttp.ClientError, ConnectionError):
        # The real server died under this request (the GPU's abort): so does this process in a
        # moment; a real server would close the connection without a word, not answer 500.
        await asyncio.sleep(3600)
        raise
    finally:
        if fire and when == "launch":
            task.cancel()


def die_after_ready(port: int, seconds: float) -> None:
    """Wait until the real server answers /health with 200, then die `seconds` later."""
    import time
    import urllib.error
    import urllib.request
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.05)
    time.sleep(seconds)
    if every_mode() == "stall":
        state.stalled = True
        write("fault injector: the inference loop is stuck (SIGSTOP to the real server)")
        if state.real is not None:
            state.real.send_signal(signal.SIGSTOP)
        return
    die()


def every_mode() -> str:
    """What this process's FAULT_EVERY_S does (alternate: by the count of faults so far)."""
    mode = ENV.get("FAULT_EVERY_MODE", "abort")
    if mode != "alternate":
        return mode
    path = ENV.get("FAULT_COUNT_FILE")
    count = 0
    if path:
        with contextlib.suppress(OSError, ValueError):
            count = int(Path(path).read_text() or "0")
        Path(path).write_text(str(count + 1))
    return "stall" if count % 2 == 0 else "abort"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    args = sys.argv[1:]
    if "--list-devices" in args:
        os.execv(ENV["REAL_LLAMA_SERVER"], [ENV["REAL_LLAMA_SERVER"], *args])
    port = int(args[args.index("--port") + 1])
    state.real_port = free_port()
    real_args = list(args)
    real_args[real_args.index("--port") + 1] = str(state.real_port)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    state.real = subprocess.Popen(
        [ENV["REAL_LLAMA_SERVER"], *real_args], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, preexec_fn=lambda: libc.prctl(1, signal.SIGKILL))
    threading.Thread(target=relay_output, args=(state.real,), daemon=True).start()

    def on_term(signum: int, frame: object) -> None:
        if state.real is not None and state.real.poll() is None:
            state.real.send_signal(signal.SIGTERM)
            code = state.real.wait()
            state.output_done.wait(5)
            os._exit(max(code, 0))
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    every = float(ENV.get("FAULT_EVERY_S", "0"))
    if every > 0:
        threading.Thread(target=die_after_ready, args=(state.real_port, every),
                         daemon=True).start()

    async def serve() -> None:
        state.loop = asyncio.get_running_loop()
        app = web.Application(client_max_size=1 << 30)
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        app.router.add_route("*", "/{tail:.*}", proxy)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        while state.real is not None and state.real.poll() is None:
            await asyncio.sleep(0.1)
        state.output_done.wait(5)
        code = state.real.returncode if state.real is not None else 1
        if code < 0:  # the real server died by a signal: so does its GPU
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)

    asyncio.run(serve())


if __name__ == "__main__":
    main()
