"""Chaos: many requests, a third of them streamed, against real llama-server children while the
GPU child is aborted (captured CUDA out-of-memory lines, then SIGABRT) every few seconds.

Every request must end in a complete 200 or a controlled error (a 503/502/504 JSON from
Spillway, or a stream ended by one error event): none lost, none hung past its deadline, none
delivered twice; the counts reconcile; Spillway's memory stays bounded; afterwards both children
are ready. CI runs a short version; the full one:

    CHAOS_REQUESTS=2000 .venv/bin/python -m pytest tests/test_chaos.py -s
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil
import pytest
from harness import real_config, settled

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]

REQUESTS = int(os.environ.get("CHAOS_REQUESTS", "400"))
CONCURRENCY = int(os.environ.get("CHAOS_CONCURRENCY", "32"))
STREAMED = 0.3
ABORT_EVERY_S = float(os.environ.get("CHAOS_ABORT_EVERY_S", "3"))
DEADLINE_S = 120.0


def classify(status: int, stream: bool, body: bytes) -> str:
    """complete | controlled | lost"""
    if status == 200 and stream:
        events = [e for e in body.split(b"\n\n") if e.startswith(b"data: ")]
        errors = [e for e in events if b'"error"' in e]
        if events and events[-1] == b"data: [DONE]" and not errors:
            return "complete"
        if len(errors) == 1 and events[-1] is errors[0] and b"[DONE]" not in body:
            return "controlled"
        return "lost"
    try:
        data = json.loads(body)
    except ValueError:
        return "lost"
    if status == 200 and data.get("choices"):
        return "complete"
    if status in (502, 503, 504) and data.get("error", {}).get("src") == "spillway":
        return "controlled"
    return "lost"


@pytest.mark.asyncio
async def test_no_request_is_lost_while_the_gpu_child_keeps_dying(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    cfg = real_config(llama_server, tiny_model,
                      queue={"max_waiting": 256, "max_wait_s": 60},
                      restart={"backoff_initial_s": 0.2, "backoff_max_s": 1.0})
    cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector),
                  "env": {"REAL_LLAMA_SERVER": str(llama_server), "FAULT_LINES": "terse",
                          "FAULT_EVERY_S": str(ABORT_EVERY_S)}}
    s = spillway(cfg)
    assert s.proc is not None
    daemon = psutil.Process(s.proc.pid)
    rss_start = daemon.memory_info().rss
    rng = random.Random(7)
    outcomes: Counter[str] = Counter()
    attempts: Counter[int] = Counter()
    seen_ids: Counter[str] = Counter()
    slowest = 0.0
    lost: list[tuple[int, bool, int, dict[str, str], bytes]] = []
    # At least REQUESTS, and for long enough that the GPU child dies several times (a fast
    # machine would otherwise be done between two aborts).
    serial = iter(range(10**9))
    until = time.monotonic() + 3.5 * ABORT_EVERY_S
    sent = 0

    def next_request() -> int | None:
        nonlocal sent
        if sent >= REQUESTS and time.monotonic() >= until:
            return None
        sent += 1
        return next(serial)

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal slowest
        while (i := next_request()) is not None:
            stream = rng.random() < STREAMED
            body = {"messages": [{"role": "user", "content": f"chaos {i}"}],
                    "max_tokens": rng.choice([8, 32, 96]), "stream": stream,
                    "ignore_eos": True}
            began = time.monotonic()
            try:
                async with asyncio.timeout(DEADLINE_S):
                    async with http.post(f"{s.url}/v1/chat/completions", json=body,
                                         headers={"X-Request-Id": f"chaos-{i}",
                                                  "X-Spillway-Deadline": str(DEADLINE_S)}
                                         ) as r:
                        raw = await r.read()
                        seen_ids[r.headers.get("X-Request-Id", "?")] += 1
                        attempts[int(r.headers.get("X-Spillway-Attempts", "0"))] += 1
                        outcome = classify(r.status, stream, raw)
                        outcomes[outcome] += 1
                        if outcome == "lost":
                            lost.append((i, stream, r.status, dict(r.headers), raw[-400:]))
            except TimeoutError:
                outcomes["hung"] += 1
            except aiohttp.ClientError as e:
                outcomes["lost"] += 1
                lost.append((i, stream, 0, {}, repr(e).encode()))
            slowest = max(slowest, time.monotonic() - began)

    began = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(worker(http) for _ in range(CONCURRENCY)))
    took = time.monotonic() - began
    records = settled(s.incidents)
    deaths = s.log_text().count("[gpu] READY -> EXITED")
    replays = sum(1 for r in records if r["decision"] == "replayed")
    rss_end = daemon.memory_info().rss
    print(f"\nchaos: {sent} requests, concurrency {CONCURRENCY}, {int(STREAMED * 100)}% "
          f"streamed, GPU child aborted every {ABORT_EVERY_S:.0f} s: {took:.1f} s, "
          f"{deaths} GPU deaths, {len(records)} incidents, {replays} replays; outcomes "
          f"{dict(outcomes)}; attempts {dict(attempts)}; slowest {slowest:.1f} s; "
          f"Spillway RSS {rss_start / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB")
    assert outcomes["lost"] == 0 and outcomes["hung"] == 0, (outcomes, lost)
    assert sent >= REQUESTS
    assert outcomes["complete"] + outcomes["controlled"] == sent  # the counts reconcile
    assert outcomes["complete"] >= sent * 0.8
    assert set(seen_ids.values()) == {1} and len(seen_ids) == sent  # none twice
    assert set(attempts) <= {0, 1, 2}  # at most one replay each
    assert deaths >= 2
    assert all(r["request_id"].startswith("chaos-") for r in records)
    assert rss_end < rss_start + 64 * 2**20, "Spillway's memory grew"
    after = s.wait_state(("gpu", "cpu"), ("READY", "STARTING", "BACKOFF"), timeout=30)
    assert after["children"]["cpu"]["state"] == "READY"
    # Once the aborts stop (the injector's timer is per process: stop the traffic and let the
    # last restart come up), both children are ready.
    s.wait_state(("gpu",), ("READY",), timeout=30)


