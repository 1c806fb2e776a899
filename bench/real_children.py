"""What the benchmarks on real llama-server children behind one Spillway share (bench.warm_failover,
bench.failback): prompts that share no prefix, a daemon started and waited on, a streamed turn
timed event by event, both children's speeds learned, the GPU child killed by its pid, and the
figures' mean, quantile and printing."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness import Spillway  # noqa: E402

WORDS = ("a careful reader follows the long report on memory servers and cards while the "
         "kernel schedules every thread and the queue waits for capacity").split()


def text(n_words: int, seed: int) -> str:
    """Distinct from the second token on for each seed (no prefix shared between requests)."""
    return f"{seed}: " + " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


def chat(system: str, user: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


def start(folder: Path, name: str, cfg: dict[str, Any]) -> Spillway:
    s = Spillway(folder / name, cfg)
    s.start(wait_ready=False)
    s.wait_ready(timeout=180)
    return s


async def wait_for(s: Spillway, check: Any, timeout: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status: dict[str, Any] = await asyncio.to_thread(s.status)
        if check(status):
            return status
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{what} after {timeout} s\n{s.log_tail()}")


def incidents_of_one_request(s: Spillway, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The incident records of the one request a run fails: one for each thing done with it
    (a death's continuation, then a fail-back: two), written together once it is answered."""
    deadline = time.monotonic() + timeout
    while not s.incidents() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)  # (the request's other records, written with its first)
    return s.incidents()


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile, nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def fmt(x: Any, unit: str = " s", digits: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else \
        f"{x:.{digits}f}{unit}"


async def stream_turn(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      on_token: Callable[[int], None] | None = None) -> dict[str, Any]:
    """A streamed chat completion: its time to the first event, to the first token (the first
    event with text), to the last token, to the end; who answered; the final event's timings.
    `on_token(n)` is called as the nth event with text arrives (times are from the start)."""
    began = time.perf_counter()
    first_event = first_token = last_token = None
    timings: dict[str, Any] | None = None
    content = []
    async with http.post(f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
        child = r.headers.get("X-Spillway-Child", "")
        status = r.status
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter() - began
            first_event = now if first_event is None else first_event
            event = json.loads(line[6:])
            delta = (event.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                first_token = now if first_token is None else first_token
                last_token = now
                content.append(delta["content"])
                if on_token is not None:
                    on_token(len(content))
            if isinstance(event.get("timings"), dict):
                timings = event["timings"]
    return {"status": status, "child": child, "first_event_s": first_event,
            "ttft_s": first_token, "last_token_s": last_token,
            "total_s": time.perf_counter() - began, "timings": timings,
            "text": "".join(content), "pieces": content, "events_with_text": len(content),
            "began": began}


async def learn_speeds(s: Spillway, answer_tokens: int = 16) -> None:
    """Both children's speeds, learned from their answers as the integration test does (the
    GPU child paused: two requests on the CPU child; resumed: two on the GPU child), so that
    the first outage already has both forecasts."""
    def ask(seed: int) -> None:
        code, body = s.post("/v1/chat/completions", chat(text(250, seed), "What is it about?",
                                                         answer_tokens))
        assert code == 200, body

    for path, state in (("/spillway/gpu/pause", "STOPPED"), ("/spillway/gpu/resume", "READY")):
        code, body = await asyncio.to_thread(s.post, path, {})
        assert code == 200, body
        await wait_for(s, lambda st, state=state: st["children"]["gpu"]["state"] == state,
                       120, f"the GPU child is not {state}")
        for seed in (1, 2):
            await asyncio.to_thread(ask, seed + (10 if state == "READY" else 0))


async def kill_gpu(s: Spillway) -> int:
    """SIGKILL the GPU child by the pid its status names, once it is READY; its pid."""
    status = await wait_for(s, lambda st: st["children"]["gpu"]["state"] == "READY", 120,
                            "the GPU child is not back")
    pid: int = status["children"]["gpu"]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def back_after(pid: int) -> Callable[[dict[str, Any]], bool]:
    """A status check: the GPU child is READY again, another process than `pid`."""
    def check(st: dict[str, Any]) -> bool:
        gpu = st["children"]["gpu"]
        return bool(gpu["state"] == "READY" and gpu["pid"] != pid)
    return check
