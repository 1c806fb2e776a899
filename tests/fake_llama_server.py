#!/usr/bin/env python3
"""A fake llama-server for functional tests: a test double with fault switches.

It speaks enough of llama-server's HTTP API (health, chat completions streamed or not,
completion, props, slots, tokenize) with its shapes and status codes, and misbehaves on demand.
Switches come from environment variables (a child's `env` table in the Spillway config):

  FAKE_SLOW_START_S=N      answer 503 "Loading model" for N seconds before ready
  FAKE_HANG_START=1        never become ready (the start timeout must fire)
  FAKE_EXIT_AT_START=CODE  print the captured load-OOM lines and exit with CODE at start
  FAKE_EXIT_AT_START_FILE=PATH  the same, only while PATH exists
  FAKE_FAIL_STARTS=N       the first N starts abort (SIGABRT) while loading, after the terse
                           CUDA error line (a driver fault, or another process racing it for
                           the VRAM); counted in FAKE_FAIL_STARTS_FILE=PATH
  FAKE_CRASH_AFTER=N       abort (SIGABRT) during the Nth generation request, before answering
  FAKE_CRASH_LINES=terse|full|none  what to print before that abort (default: full CUDA lines)
  FAKE_HANG_AFTER=N        generation requests after the Nth never answer
  FAKE_CRASH_ON_PATH=PATH  abort (SIGABRT, after the lines of FAKE_CRASH_LINES) on a request for
                           PATH, whatever its route and method, before answering
  FAKE_STALL_AFTER_EVENTS=K  a stream stops after K events and never goes on (/health answers)
  FAKE_ABORT_AFTER_EVENTS=K  a chat stream's process aborts (SIGABRT, after the CUDA lines of
                           FAKE_CRASH_LINES) right after its Kth event
  FAKE_TOKENIZE_EXTRA=N    /tokenize answers, counting N tokens more than the text's words
                           (a text that re-tokenizes to more tokens than were generated)
  FAKE_TOOL_CALL_AT=K      a chat stream's Kth event (from 0) is a tool call delta, as
                           llama-server streams one (the call's id and name, empty arguments)
  FAKE_NO_SLOTS=1          /slots answers 501, as with llama-server --no-slots
  FAKE_SICK_FILE=PATH      while PATH exists, every generation request gets a 500 server_error
                           that names no cause, /health still 200; with FAKE_SICK_OOM_LINE=1
                           the captured load-time CUDA OOM line is logged once first
  FAKE_IGNORE_SIGTERM=1    ignore SIGTERM (only SIGKILL stops it)
  FAKE_FREEZE_AFTER_S=S    after S seconds, stop answering anything (/health included)
  FAKE_TOKEN_DELAY_S=S     delay between streamed tokens (default 0.01)
  FAKE_PROMPT_DELAY_S=S    delay before the first token, after the 200 is sent (default 0)
  FAKE_TOKENS=N            tokens per answer unless the request asks for fewer (default 8)
  FAKE_N_CTX=N             per-slot context reported by /props (default 4096)
  FAKE_SLOTS=N             number of slots (default 2)
  FAKE_STATE_FILE=PATH     append one JSON line per request seen (method, path, headers)
  FAKE_CUT_FILE=PATH       append one JSON line (`cut_after`: tokens sent) per stream whose
                           reader left before its end
  FAKE_LINGER_AFTER_DONE_S=S  a chat stream's answer ends S seconds after its [DONE] (a child
                           slow to end the response its client already has whole)
  FAKE_CLOSE_AFTER_STREAM=1  close the connection right after a streamed answer (as the real
                           llama-server does, though it says Keep-Alive)
  FAKE_DROP_REUSED=1       close a keep-alive connection, with no answer, when another request
                           arrives on it (cpp-httplib closing an idle connection just as the
                           proxy reuses it); /health and /props are exempt

Like the real server without `--mmproj`, a chat request with an image (`image_url`) or audio
(`input_audio`) part gets llama-server's 500 for a modality it has no projector for (its
server-common.cpp's words); with `--mmproj` among its arguments, the part is taken as text.

Every request needs `Authorization: Bearer $LLAMA_API_KEY` (or X-Api-Key), like the real
server started with --api-key; /health is open. One `launch_slot_` line goes to stderr per
generation task, like the real server's log. Like the real one, it takes Vertex AI's port: with
AIP_MODE=PREDICTION it listens on AIP_HTTP_PORT (8080 when unset), whatever --port says.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

from aiohttp import web

ENV = os.environ
AIP = ("AIP_MODE", "AIP_HTTP_PORT", "AIP_PREDICT_ROUTE", "AIP_HEALTH_ROUTE")
API_KEY = ENV.get("LLAMA_API_KEY", "")
START = time.monotonic()
CUDA_FULL = [
    "CUDA error: out of memory",
    "  current device: 0, in function ggml_backend_cuda_buffer_type_alloc_buffer at "
    "llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:1032",
    "  cudaMalloc(&ptr, size)",
    "llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error",
]
CUDA_TERSE = ["llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error"]
LOAD_OOM = [
    "E ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device 0: "
    "cudaMalloc failed: out of memory",
    "E ggml_backend_buft_alloc_buffer_n_default: failed to allocate CUDA0 buffer of size "
    "4294967296",
    "E llama_init_from_model: failed to initialize the context: failed to allocate buffer for "
    "kv cache",
    "E srv  llama_server: exiting due to model loading error",
]

state = {"generation_requests": 0, "task": 0}
# Requests seen per connection (the protocol object is kept so that its id stays unique).
connections: dict[int, tuple[object, int]] = {}


def log(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def record(request: web.Request) -> None:
    path = ENV.get("FAKE_STATE_FILE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "method": request.method,
                                "path": request.path, "headers": dict(request.headers),
                                "time": time.time()}) + "\n")


def record_cut(request: web.Request, sent: int) -> None:
    """A stream whose reader (Spillway) went away: the generation stops there, as the real
    server's does when its socket closes."""
    path = ENV.get("FAKE_CUT_FILE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "method": request.method,
                                "path": request.path, "cut_after": sent,
                                "time": time.time()}) + "\n")


def error(status: int, message: str, type_: str) -> web.Response:
    return web.json_response({"error": {"code": status, "message": message, "type": type_}},
                             status=status)


def dropped_on_reuse(request: web.Request) -> bool:
    if ENV.get("FAKE_DROP_REUSED") != "1" or request.path in ("/health", "/v1/health", "/props"):
        return False
    proto = request.protocol
    _, seen = connections.get(id(proto), (proto, 0))
    connections[id(proto)] = (proto, seen + 1)
    if seen == 0 or request.transport is None:
        return False
    log(f"fake: dropping a request on a reused connection ({seen + 1} on it)")
    request.transport.close()
    return True


@web.middleware
async def gate(request: web.Request, handler: Any) -> web.StreamResponse:
    record(request)
    if request.path == ENV.get("FAKE_CRASH_ON_PATH"):
        for line in {"full": CUDA_FULL, "terse": CUDA_TERSE}.get(
                ENV.get("FAKE_CRASH_LINES", "full"), []):
            log(line)
        os.abort()
    if dropped_on_reuse(request):
        return web.Response(status=500)  # never reaches the client: the connection is closed
    freeze = float(ENV.get("FAKE_FREEZE_AFTER_S", "0"))
    if freeze and time.monotonic() - START > freeze:
        await asyncio.sleep(3600)
    if request.path == "/health" and ENV.get("FAKE_HANG_START") == "1":
        return error(503, "Loading model", "unavailable_error")
    if time.monotonic() - START < float(ENV.get("FAKE_SLOW_START_S", "0")):
        return error(503, "Loading model", "unavailable_error")
    # Like llama-server: CORS preflights and health need no key.
    if request.method != "OPTIONS" and request.path not in ("/health", "/v1/health") and API_KEY:
        given = request.headers.get("Authorization", "") or request.headers.get("X-Api-Key", "")
        if given.removeprefix("Bearer ") != API_KEY:
            return error(401, "Invalid API Key", "authentication_error")
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def timings(count: int) -> dict[str, float]:
    """As llama-server reports them: what this answer took, by its fault switches."""
    delay = float(ENV.get("FAKE_TOKEN_DELAY_S", "0.01"))
    prompt_s = float(ENV.get("FAKE_PROMPT_DELAY_S", "0")) or 0.001
    return {"prompt_n": 10, "prompt_ms": prompt_s * 1000, "predicted_n": count,
            "predicted_ms": max(count * delay * 1000, 0.001)}


def n_tokens(body: dict[str, Any]) -> int:
    default = int(ENV.get("FAKE_TOKENS", "8"))
    asked = body.get("max_tokens", body.get("n_predict", default))
    return max(0, min(default, int(asked))) if isinstance(asked, int) and asked >= 0 else default


async def generation_faults() -> None:
    state["generation_requests"] += 1
    n = state["generation_requests"]
    task = state["task"]
    state["task"] += 1
    log(f"0.00.000.000 I slot launch_slot_: id  0 | task {task} | processing task, is_child = 0")
    crash_after = int(ENV.get("FAKE_CRASH_AFTER", "0"))
    if crash_after and n >= crash_after:
        kind = ENV.get("FAKE_CRASH_LINES", "full")
        for line in {"full": CUDA_FULL, "terse": CUDA_TERSE}.get(kind, []):
            log(line)
        os.abort()
    hang_after = int(ENV.get("FAKE_HANG_AFTER", "0"))
    if hang_after and n > hang_after:
        await asyncio.sleep(3600)


def sick() -> web.Response | None:
    """FAKE_SICK_FILE: alive and failing every request, as after an OOM at start-up."""
    path = ENV.get("FAKE_SICK_FILE")
    if not path or not os.path.exists(path):
        return None
    if ENV.get("FAKE_SICK_OOM_LINE") == "1" and not state.get("sick_logged"):
        state["sick_logged"] = 1
        log("0.00.153.679 E ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB "
            "on device 0: cudaMalloc failed: out of memory")
    return error(500, "failed to process the request", "server_error")


# llama-server's words for a media part it has no projector for (tools/server/server-common.cpp,
# oaicompat_content_load_media: a std::runtime_error, which its handler answers as a 500).
NO_PROJECTOR = {
    "image_url": "image input is not supported - hint: if this is unexpected, you may need to "
                 "provide the mmproj",
    "input_audio": "audio input is not supported - hint: if this is unexpected, you may need to "
                   "provide the mmproj",
}


def unsupported_media(body: dict[str, Any]) -> web.Response | None:
    """The 500 for the first image or audio part, when this server has no projector."""
    if "--mmproj" in sys.argv[1:]:
        return None
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            said = NO_PROJECTOR.get(part.get("type", "")) if isinstance(part, dict) else None
            if said is not None:
                return error(500, said, "server_error")
    return None


async def chat(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json()
    except ValueError:
        return error(400, "invalid JSON", "invalid_request_error")
    if (refused := unsupported_media(body)) is not None:
        return refused  # read as the request is parsed, before any slot: sick or not
    if (failing := sick()) is not None:
        return failing
    if not isinstance(body.get("messages"), list):
        return error(400, "Expected 'messages' to be an array", "invalid_request_error")
    stream = bool(body.get("stream"))
    count = n_tokens(body)
    rid = request.headers.get("X-Request-Id", "")
    if not stream:
        await generation_faults()
        await asyncio.sleep(float(ENV.get("FAKE_PROMPT_DELAY_S", "0")))
        await asyncio.sleep(float(ENV.get("FAKE_TOKEN_DELAY_S", "0.01")) * count)
        text = " ".join(f"tok{i}" for i in range(count))
        return web.json_response({
            "choices": [{"finish_reason": "length", "index": 0,
                         "message": {"role": "assistant", "content": text}}],
            "object": "chat.completion", "model": "fake", "id": f"chatcmpl-{os.getpid()}",
            "usage": {"completion_tokens": count, "prompt_tokens": 10,
                      "total_tokens": count + 10},
            "fake": {"pid": os.getpid(), "request_id": rid},
            "timings": timings(count),
        })
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)  # like llama-server: the 200 goes out before any token
    await asyncio.sleep(float(ENV.get("FAKE_PROMPT_DELAY_S", "0")))  # prompt processing
    await generation_faults()
    delay = float(ENV.get("FAKE_TOKEN_DELAY_S", "0.01"))
    stall_at = int(ENV.get("FAKE_STALL_AFTER_EVENTS", "0"))
    for i in range(count):
        if stall_at and i == stall_at:
            # Stuck mid-stream as a hung inference loop is: no more bytes, while /health
            # (and the rest of the HTTP side) still answers.
            log("0.00.000.000 W fake: the inference loop is stuck")
            await asyncio.sleep(3600)
        delta: dict[str, Any] = {"content": f"tok{i} "}
        if str(i) == ENV.get("FAKE_TOOL_CALL_AT"):
            delta = {"tool_calls": [{"index": 0, "id": "call_fake", "type": "function",
                                     "function": {"name": "get_datetime", "arguments": ""}}]}
        chunk = {"choices": [{"finish_reason": None, "index": 0, "delta": delta}],
                 "object": "chat.completion.chunk", "model": "fake",
                 "fake": {"pid": os.getpid(), "t": time.time(), "i": i}}
        try:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        except ConnectionError:
            record_cut(request, i)
            raise
        if str(i + 1) == ENV.get("FAKE_ABORT_AFTER_EVENTS"):
            await asyncio.sleep(0.05)  # the event reaches Spillway first
            for line in {"full": CUDA_FULL, "terse": CUDA_TERSE}.get(
                    ENV.get("FAKE_CRASH_LINES", "full"), []):
                log(line)
            os.abort()
        await asyncio.sleep(delay)
    final = {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}],
             "object": "chat.completion.chunk", "model": "fake", "timings": timings(count)}
    await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
    await asyncio.sleep(float(ENV.get("FAKE_LINGER_AFTER_DONE_S", "0")))
    await resp.write_eof()
    if ENV.get("FAKE_CLOSE_AFTER_STREAM") == "1":
        resp.force_close()
    return resp


async def tokenize(request: web.Request) -> web.Response:
    """One token a word (the fake's own answers: `tokN ` each), plus FAKE_TOKENIZE_EXTRA."""
    body = await request.json()
    words = str(body.get("content", "")).split()
    extra = int(ENV.get("FAKE_TOKENIZE_EXTRA", "0"))
    return web.json_response({"tokens": list(range(len(words) + extra))})


async def props(request: web.Request) -> web.Response:
    return web.json_response({
        "default_generation_settings": {"n_ctx": int(ENV.get("FAKE_N_CTX", "4096"))},
        "total_slots": int(ENV.get("FAKE_SLOTS", "2")),
        "model_path": "fake.gguf",
        "env": {k: ENV[k] for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
                                    "GGML_NO_BACKTRACE", "LLAMA_ARG_HOST", *AIP) if k in ENV},
    })


async def slots(request: web.Request) -> web.Response:
    if ENV.get("FAKE_NO_SLOTS") == "1":  # as llama-server --no-slots answers
        return error(501, "This server does not support slots endpoint.", "not_supported_error")
    return web.json_response([{"id": i, "is_processing": False}
                              for i in range(int(ENV.get("FAKE_SLOTS", "2")))])


async def echo(request: web.Request) -> web.Response:
    """Anything else: echo what arrived, so tests can see what the proxy forwarded."""
    body = await request.read()
    response = web.json_response({"method": request.method, "path": request.path,
                              "query": request.query_string, "body": body.decode(errors="replace"),
                              "headers": dict(request.headers)})
    return response


def main() -> None:
    args = sys.argv[1:]
    if "--list-devices" in args:  # as a CPU-only build answers
        print("Available devices:\n  (none)")
        return
    host, port = "127.0.0.1", 8080
    for i, a in enumerate(args):
        if a == "--host":
            host = args[i + 1]
        elif a == "--port":
            port = int(args[i + 1])
    if ENV.get("AIP_MODE") == "PREDICTION":  # Vertex AI's contract, followed as llama-server does
        port = int(ENV.get("AIP_HTTP_PORT") or 8080)
    if ENV.get("FAKE_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = ENV.get("FAKE_EXIT_AT_START")
    if ENV.get("FAKE_EXIT_AT_START_FILE") and os.path.exists(ENV["FAKE_EXIT_AT_START_FILE"]):
        code = "1"
    fail_starts = int(ENV.get("FAKE_FAIL_STARTS", "0"))
    if fail_starts:
        with open(ENV["FAKE_FAIL_STARTS_FILE"], "a+") as f:
            f.write("start\n")
            f.seek(0)
            starts = len(f.read().splitlines())
        if starts <= fail_starts:
            log("llama_model_load_from_file_impl: using device CUDA0")
            for line in CUDA_TERSE:
                log(line)
            os.abort()
    if code:
        for line in LOAD_OOM:
            log(line)
        sys.exit(int(code))
    log(f"fake llama-server {os.getpid()} listening on http://{host}:{port} args={args}")
    app = web.Application(middlewares=[gate])
    app.router.add_get("/health", health)
    app.router.add_get("/v1/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/chat/completions", chat)
    app.router.add_get("/props", props)
    if "FAKE_TOKENIZE_EXTRA" in ENV:  # (else /tokenize echoes, as the other tests expect)
        app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/slots", slots)
    app.router.add_route("*", "/{tail:.*}", echo)
    web.run_app(app, host=host, port=port, print=None, access_log=None,
                handle_signals=ENV.get("FAKE_IGNORE_SIGTERM") != "1")


if __name__ == "__main__":
    main()
