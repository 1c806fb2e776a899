"""The warm CPU child and the earliest expected finish, measured (issue 39's figures).

Real llama-server children serving the embedded SmolLM2-135M-Instruct behind one Spillway per
scenario. There is no GPU on the machine this was written for: the "GPU child" runs CPU-only
too, given the GPU's advantage by a large batch (`-b 2048 -ub 512`) where the CPU child
prefills one token at a time (`-b 32 -ub 1`), each with one thread (`-t 1 -tb 1`); see
tests/test_earliest_finish_integration.py for why not two threads for the GPU child on this
machine. Both children share the machine's cores (with each other and with other workers), so a
busy CPU child slows the GPU child too, which a real GPU would not. Three parts, in one run:

- a. warm against cold: a conversation's turn 1 (a ~2,000-token prefix) on the GPU child; with
  cpu.mirror = true, wait until the status says it was mirrored (`mirror.mirrored` >= 1); pause
  the GPU child (POST /spillway/gpu/pause); turn 2 (turn 1's messages, its answer, a new user
  message) streamed from the CPU child: its time to first token, and its timings (cache_n,
  prompt_n) against turn 1's prompt tokens. The same with cpu.mirror = false. A fresh daemon
  each, warm and cold taking turns, `--warm-rounds` of each.
- b. the GPU child's throughput with mirroring on against off: `--clients` closed loops of
  chat completions (a fresh ~250-token conversation each, 64 tokens generated, ignore_eos) for
  `--seconds` after a warm-up; tokens generated per second in that window. Mirrors only start
  once every child has been idle a second, so under steady load they should not run: the mirror
  counts at the end of the window, and a few seconds after it, say whether they did. A fresh
  daemon each, in ABBA order, `--throughput-rounds` of each.
- c. time to answer of a mixed stream (short and long prompts, seeded Poisson arrivals, the same
  schedule in every run) while the GPU child is SIGKILLed (its pid from /spillway/status) every
  `--kill-every` seconds from the start, each death followed at once by a probe (one more long
  prompt, the case 5w is for); restart.backoff_initial_s 0.3, quick_failure_s 1 (the kills
  never add up to FATAL). The earliest expected finish (failover.wait_for_gpu = true, the
  default) against always the CPU child (false). Both children's speeds are learned first (two
  requests on each), as in the integration test. Mean and p95 of everything, of the probes, of
  the stream alone, by kind, and of the requests sent during an outage (kill to READY);
  mirroring off in both (no conversation goes on, and mirrors would only take the cores). A
  fresh daemon each, in ABBA order.

    PYTHONPATH=. /work/main/.venv/bin/python -m bench.warm_failover [--parts a,b,c]
        [--warm-rounds 2] [--throughput-rounds 4] [--seconds 25] [--stream-rounds 1]
        [--duration 180] [--interval 6] [--kill-every 12]

Prints the tables and writes bench/results/warm-failover.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness import Spillway, real_config  # noqa: E402

from bench.real_children import (chat, fmt, kill_gpu, learn_speeds, mean, pct,  # noqa: E402
                                 start, stream_turn, text, wait_for)
from bench.small_child import machine, stop_daemon  # noqa: E402
from supervisor.commands import bootstrap  # noqa: E402

MODEL_ARGS = ["-c", "8192", "-np", "2"]
GPU_ARGS = ["-ngl", "99", "-t", "1", "-tb", "1", "-b", "2048", "-ub", "512"]
CPU_ARGS = ["--device", "none", "-ngl", "0", "-t", "1", "-tb", "1", "-b", "32", "-ub", "1"]
PREFIX_WORDS = 1950  # turn 1's system text: with the template, about 2,000 tokens
SHORT_WORDS, LONG_WORDS = 40, 800  # part c: about 70 and 830 prompt tokens
ANSWER_TOKENS = 16  # part c's answers


def config(binary: Path, model: Path, mirror: bool, wait_for_gpu: bool = True,
           **sections: dict[str, Any]) -> dict[str, Any]:
    cfg = real_config(binary, model, model={"args": MODEL_ARGS}, server={"access_log": True},
                      **sections)
    cfg["gpu"] = {"args": GPU_ARGS}
    cfg["cpu"] = {**cfg["cpu"], "args": CPU_ARGS, "mirror": mirror}
    cfg["failover"] = {"wait_for_gpu": wait_for_gpu}
    return cfg


# --- a. a failed-over turn, warm and cold ----------------------------------------------------



async def warm_round(folder: Path, binary: Path, model: Path, mirror: bool, seed: int
                     ) -> dict[str, Any]:
    name = f"a-{'warm' if mirror else 'cold'}-{seed}"
    print(f"--- {name}", flush=True)
    s = start(folder, name, config(binary, model, mirror))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            system = text(PREFIX_WORDS, seed)
            question = "Summarise the report in three sentences."
            t0 = time.perf_counter()
            async with http.post(f"{s.url}/v1/chat/completions",
                                 json=chat(system, question, 32)) as r:
                one = await r.json()
                one_child = r.headers.get("X-Spillway-Child")
            one_s = time.perf_counter() - t0
            assert one_child == "gpu", (one_child, one)
            # The conversation so far, which turn 2 begins with: turn 1's prompt and answer.
            prefix = one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"]
            answer = one["choices"][0]["message"]["content"]
            mirror_wait_s = None
            if mirror:
                t0 = time.perf_counter()
                await wait_for(s, lambda st: (st.get("mirror") or {}).get("mirrored", 0) >= 1,
                               300, "not mirrored")
                mirror_wait_s = time.perf_counter() - t0
            status = await asyncio.to_thread(s.status)
            mirror_status = status.get("mirror")
            code, body = await asyncio.to_thread(s.post, "/spillway/gpu/pause", {})
            assert code == 200, body
            await wait_for(s, lambda st: st["children"]["gpu"]["state"] == "STOPPED", 60,
                           "the GPU child is not paused")
            two = await stream_turn(http, s.url, {
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question},
                             {"role": "assistant", "content": answer},
                             {"role": "user", "content": "Which part matters most, and why?"}],
                "max_tokens": 32, "temperature": 0})
        assert two["status"] == 200 and two["child"] == "cpu", two
        mirrored = re.findall(r"mirrored a conversation of (\d+) tokens to the cpu child in "
                              r"([\d.]+)s", s.log_text())
    finally:
        stop_daemon(s)
    timings = two["timings"] or {}
    cache_n = timings.get("cache_n")
    result = {"mirror": mirror, "seed": seed, "prefix_tokens": prefix, "turn1_s": one_s,
              "mirror_wait_s": mirror_wait_s, "mirror_status": mirror_status,
              "mirror_log": [{"tokens": int(n), "s": float(t)} for n, t in mirrored],
              "ttft_s": two["ttft_s"], "first_event_s": two["first_event_s"],
              "total_s": two["total_s"], "cache_n": cache_n,
              "prompt_n": timings.get("prompt_n"), "prompt_ms": timings.get("prompt_ms"),
              "cached_share": round(min(1.0, cache_n / prefix), 3)
              if isinstance(cache_n, int) else None}
    print(f"    ttft {result['ttft_s']:.2f} s, cache_n {cache_n} of a {prefix}-token prefix, "
          f"prompt_n {result['prompt_n']}", flush=True)
    return result


async def part_a(folder: Path, binary: Path, model: Path, rounds: int) -> dict[str, Any]:
    runs = []
    for k in range(rounds):
        for mirror in ((True, False) if k % 2 == 0 else (False, True)):
            runs.append(await warm_round(folder, binary, model, mirror, 100 + k))
    warm = [r for r in runs if r["mirror"]]
    cold = [r for r in runs if not r["mirror"]]
    med = {key: {"warm": statistics.median([r[key] for r in warm]),
                 "cold": statistics.median([r[key] for r in cold])}
           for key in ("ttft_s", "total_s", "prefix_tokens")}
    ratios = [w["ttft_s"] / c["ttft_s"] for w, c in zip(warm, cold, strict=True)]
    return {"runs": runs, "median": med,
            "ttft_ratio": med["ttft_s"]["warm"] / med["ttft_s"]["cold"],
            "ttft_ratio_per_round": [round(x, 3) for x in ratios],
            "cached_share_warm": statistics.median([r["cached_share"] for r in warm]),
            "cached_share_cold": statistics.median([r["cached_share"] for r in cold])}


# --- b. the GPU child's throughput, mirroring on and off ------------------------------------

async def closed_loop(http: aiohttp.ClientSession, url: str, client: int, stop: asyncio.Event,
                      out: list[dict[str, Any]]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        body = chat(text(250, 1000 * client + n), "What is it about?", 64, ignore_eos=True)
        t0 = time.monotonic()
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            answer = await r.json()
            out.append({"start": t0, "end": time.monotonic(), "status": r.status,
                        "child": r.headers.get("X-Spillway-Child"),
                        "tokens": (answer.get("usage") or {}).get("completion_tokens", 0)})


async def throughput_run(folder: Path, binary: Path, model: Path, mirror: bool, k: int,
                         clients: int, warmup: float, seconds: float) -> dict[str, Any]:
    name = f"b-{'on' if mirror else 'off'}-{k}"
    print(f"--- {name}", flush=True)
    s = start(folder, name, config(binary, model, mirror))
    try:
        rows: list[dict[str, Any]] = []
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            loops = [asyncio.create_task(closed_loop(http, s.url, c, stop, rows))
                     for c in range(clients)]
            began = time.monotonic()
            await asyncio.sleep(warmup)
            window = (time.monotonic(), time.monotonic() + seconds)
            await asyncio.sleep(seconds)
            at_end = (await asyncio.to_thread(s.status)).get("mirror")
            stop.set()
            await asyncio.gather(*loops)
        await asyncio.sleep(4)  # idle: now the mirrors may run
        after_idle = (await asyncio.to_thread(s.status)).get("mirror")
    finally:
        stop_daemon(s)
    # Tokens of the answers that ended in the window, each counted in proportion to the share
    # of its time inside it (a closed loop's answers straddle the window's edges).
    tokens = 0.0
    for row in rows:
        inside = min(row["end"], window[1]) - max(row["start"], window[0])
        if inside > 0 and row["status"] == 200:
            tokens += row["tokens"] * inside / (row["end"] - row["start"])
    result = {"mirror": mirror, "round": k, "tokens_per_s": tokens / seconds,
              "requests": len(rows), "failed": sum(1 for r in rows if r["status"] != 200),
              "by_child": {c: sum(1 for r in rows if r["child"] == c)
                           for c in {r["child"] for r in rows}},
              "mirror_at_end": at_end, "mirror_after_idle": after_idle,
              "run_s": time.monotonic() - began}
    print(f"    {result['tokens_per_s']:.1f} tokens/s, {result['requests']} requests "
          f"{result['by_child']}, mirror at the end {at_end}", flush=True)
    return result


async def part_b(folder: Path, binary: Path, model: Path, rounds: int, clients: int,
                 warmup: float, seconds: float) -> dict[str, Any]:
    runs = []
    for k in range(rounds):
        for mirror in ((True, False) if k % 2 == 0 else (False, True)):
            runs.append(await throughput_run(folder, binary, model, mirror, k, clients, warmup,
                                             seconds))
    on = [r["tokens_per_s"] for r in runs if r["mirror"]]
    off = [r["tokens_per_s"] for r in runs if not r["mirror"]]
    return {"runs": runs, "clients": clients, "seconds": seconds, "warmup_s": warmup,
            "median_on": statistics.median(on), "median_off": statistics.median(off),
            "ratio": statistics.median(on) / statistics.median(off),
            "ratio_per_round": [round(a / b, 3) for a, b in zip(on, off, strict=True)]}


# --- c. a mixed stream through repeated GPU restarts -----------------------------------------

def schedule(duration: float, interval: float, long_share: float, seed: int
             ) -> list[dict[str, Any]]:
    """Seeded Poisson arrivals: when (s from the start), long or short, its own text."""
    rng = random.Random(seed)
    out, t, n = [], 0.0, 0
    while True:
        t += rng.expovariate(1 / interval)
        if t >= duration:
            return out
        n += 1
        out.append({"at": t, "long": rng.random() < long_share, "seed": seed * 10000 + n})


async def one_request(http: aiohttp.ClientSession, url: str, item: dict[str, Any],
                      began: float, out: list[dict[str, Any]]) -> None:
    await asyncio.sleep(max(0.0, began + item["at"] - time.monotonic()))
    words = LONG_WORDS if item["long"] else SHORT_WORDS
    body = chat(text(words, item["seed"]), "What is it about?", ANSWER_TOKENS, ignore_eos=True)
    sent_wall, t0 = time.time(), time.monotonic()
    row: dict[str, Any] = {"long": item["long"], "sent": sent_wall,
                           "probe": item.get("probe", False)}
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            await r.read()
            row.update(status=r.status, child=r.headers.get("X-Spillway-Child", ""),
                       attempts=r.headers.get("X-Spillway-Attempts"),
                       waited=("queue;dur=" in r.headers.get("Server-Timing", "")))
    except (TimeoutError, aiohttp.ClientError) as e:
        row.update(status=0, child="", error=repr(e))
    row["latency_s"] = time.monotonic() - t0
    row["done"] = time.time()
    out.append(row)


async def killer(s: Spillway, http: aiohttp.ClientSession, every: float, began: float,
                 stop: asyncio.Event, kills: list[float], probes: list[asyncio.Task[None]],
                 rows: list[dict[str, Any]]) -> None:
    """SIGKILL the GPU child at `every`, 2 x `every`, ... seconds from the start (the same
    times in every run; a kill whose moment finds the GPU child not READY waits for it), and
    at once, once the death is seen, send a probe: a long prompt."""
    n = 0
    while True:
        n += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, began + n * every - time.monotonic()))
        if stop.is_set():
            return
        pid = await kill_gpu(s)
        kills.append(time.time())

        def dead(st: dict[str, Any], pid: int = pid) -> bool:
            return bool(st["children"]["gpu"]["pid"] != pid
                        or st["children"]["gpu"]["state"] != "READY")

        await wait_for(s, dead, 30, "no death seen")
        probe = {"at": time.monotonic() - began, "long": True, "seed": 900000 + n,
                 "probe": True}
        probes.append(asyncio.create_task(one_request(http, s.url, probe, began, rows)))




async def stream_run(folder: Path, binary: Path, model: Path, wait_for_gpu: bool, k: int,
                     plan: list[dict[str, Any]], duration: float, every: float
                     ) -> dict[str, Any]:
    name = f"c-{'earliest' if wait_for_gpu else 'cpu'}-{k}"
    print(f"--- {name}", flush=True)
    cfg = config(binary, model, mirror=False, wait_for_gpu=wait_for_gpu,
                 restart={"backoff_initial_s": 0.3, "backoff_max_s": 1.0,
                          "quick_failure_s": 1.0})
    s = start(folder, name, cfg)
    try:
        await learn_speeds(s)
        rows: list[dict[str, Any]] = []
        kills: list[float] = []
        probes: list[asyncio.Task[None]] = []
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            began = time.monotonic()
            kill_task = asyncio.create_task(
                killer(s, http, every, began, stop, kills, probes, rows))
            senders = [asyncio.create_task(one_request(http, s.url, item, began, rows))
                       for item in plan]
            await asyncio.sleep(duration)
            stop.set()
            await kill_task
            await asyncio.gather(*senders, *probes)
        _, timeline = await asyncio.to_thread(s.get, "/spillway/timeline?since=0")
        log = s.log_text()
    finally:
        stop_daemon(s)
    gpu = [e for e in timeline["events"] if e.get("child") == "gpu" and "model" not in e]
    outages = []
    for kill in kills:
        ready = next((e["time"] for e in gpu if e["time"] > kill and e["state"] == "READY"),
                     None)
        outages.append((kill, ready if ready is not None else math.inf))
    for row in rows:
        row["in_outage"] = any(a <= row["sent"] < b for a, b in outages)
        row["in_flight_at_kill"] = any(row["sent"] < a <= row["done"] for a, _ in outages)
    result = {"wait_for_gpu": wait_for_gpu, "round": k, "kills": len(kills),
              "outage_s": [round(b - a, 3) for a, b in outages if b != math.inf],
              "waited_for_gpu_log": log.count("waiting for the GPU child ("),
              "rows": rows, **summary(rows)}
    print(f"    {len(kills)} kills, mean {result['all']['mean_s']:.2f} s, p95 "
          f"{result['all']['p95_s']:.2f} s; probes: mean {fmt(result['probes']['mean_s'])}, "
          f"by {result['probes']['by_child']}; waited for the GPU child "
          f"{result['waited_for_gpu_log']}", flush=True)
    return result


def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r["latency_s"] for r in rows if r.get("status") == 200]
    return {"n": len(rows), "failed": sum(1 for r in rows if r.get("status") != 200),
            "mean_s": mean(ok), "p95_s": pct(ok, 0.95),
            "by_child": {c: sum(1 for r in rows if r.get("child") == c)
                         for c in sorted({r.get("child", "") for r in rows})}}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    stream = [r for r in rows if not r["probe"]]
    outage = [r for r in stream if r["in_outage"]]
    return {"all": stats(rows), "probes": stats([r for r in rows if r["probe"]]),
            "stream": stats(stream), "short": stats([r for r in stream if not r["long"]]),
            "long": stats([r for r in stream if r["long"]]), "outage": stats(outage),
            "outage_long": stats([r for r in outage if r["long"]]),
            "outage_short": stats([r for r in outage if not r["long"]]),
            "in_flight_at_kill": stats([r for r in stream if r["in_flight_at_kill"]])}


async def part_c(folder: Path, binary: Path, model: Path, rounds: int, duration: float,
                 interval: float, long_share: float, every: float) -> dict[str, Any]:
    plan = schedule(duration, interval, long_share, seed=39)
    runs = []
    for k in range(rounds):
        for wait in ((True, False) if k % 2 == 0 else (False, True)):
            runs.append(await stream_run(folder, binary, model, wait, k, plan, duration, every))
    pooled = {}
    for wait in (True, False):
        rows = [row for r in runs if r["wait_for_gpu"] == wait for row in r["rows"]]
        pooled["earliest" if wait else "cpu"] = {
            **summary(rows), "kills": sum(r["kills"] for r in runs if r["wait_for_gpu"] == wait),
            "outage_median_s": statistics.median([o for r in runs if r["wait_for_gpu"] == wait
                                                  for o in r["outage_s"]] or [math.nan]),
            "waited_for_gpu_log": sum(r["waited_for_gpu_log"] for r in runs
                                      if r["wait_for_gpu"] == wait)}
    return {"runs": runs, "pooled": pooled, "duration_s": duration, "interval_s": interval,
            "long_share": long_share, "kill_every_s": every, "requests_per_run": len(plan),
            "long_per_run": sum(1 for p in plan if p["long"])}


# --- report ------------------------------------------------------------------------------



def report(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = ["# The warm CPU child and the earliest expected finish", "",
             f"{data['date']}: {m['cpu']} ({m['cores']} cores, shared with other workers' test "
             f"runs; load average {m['load_before']} before, {m['load_after']} after). No GPU: "
             "the \"GPU child\" runs CPU-only too, given the GPU's advantage by its batch "
             f"(`{' '.join(GPU_ARGS)}`) where the CPU child prefills one token at a time "
             f"(`{' '.join(CPU_ARGS)}`); both `{' '.join(MODEL_ARGS)}`, SmolLM2-135M-Instruct "
             "Q4_1. The two children share the cores, so a busy CPU child slows the GPU child "
             "too (a real GPU would not), and other workers' load makes every figure noisy: "
             "each comparison's arms take turns in the same run. Run time "
             f"{data['run_time_s']:.0f} s.", ""]
    if "a" in data:
        a = data["a"]
        lines += ["## a. A failed-over turn's time to first token: warm against cold", "",
                  "Turn 1 on the GPU child; the warm run waits until the status says it was "
                  "mirrored; the GPU child paused; turn 2 (turn 1's messages, its answer, a new "
                  "question) streamed from the CPU child. A fresh daemon each run.", "",
                  "| run | cpu.mirror | prefix tokens (turn 1's prompt and answer) | waited for "
                  "the mirror | mirror's prefill (log) | turn 2 TTFT | turn 2 total | cache_n "
                  "| prompt_n | cached share of the prefix |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in a["runs"]:
            mir = "; ".join(f"{x['tokens']} tokens in {x['s']:.1f} s" for x in r["mirror_log"])
            lines.append(f"| {r['seed']} | {str(r['mirror']).lower()} | {r['prefix_tokens']} | "
                         f"{fmt(r['mirror_wait_s'])} | {mir or '—'} | {fmt(r['ttft_s'])} | "
                         f"{fmt(r['total_s'])} | {r['cache_n']} | {r['prompt_n']} | "
                         f"{fmt(r['cached_share'], '', 3)} |")
        md = a["median"]
        lines += ["", f"Median TTFT warm {fmt(md['ttft_s']['warm'])} against cold "
                  f"{fmt(md['ttft_s']['cold'])}: **{a['ttft_ratio']:.3f}x** (target <= 0.35; "
                  f"per round {a['ttft_ratio_per_round']}); the prefix from the cache: "
                  f"**{a['cached_share_warm']:.1%}** warm (target >= 80%), "
                  f"{a['cached_share_cold']:.1%} cold.", ""]
    if "b" in data:
        b = data["b"]
        lines += ["## b. The GPU child's throughput, mirroring on against off", "",
                  f"{b['clients']} closed loops of chat completions (a fresh ~250-token "
                  "conversation each, 64 tokens, ignore_eos), tokens generated per second over "
                  f"{b['seconds']:g} s after {b['warmup_s']:g} s of warm-up. Mirror counts at "
                  "the window's end and 4 s after the loops stopped (idle).", "",
                  "| run | cpu.mirror | tokens/s | requests (by child) | failed | mirror at the "
                  "end: queued / mirrored / cancelled / running | after 4 s idle: mirrored / "
                  "cancelled |", "|---|---|---|---|---|---|---|"]
        for r in b["runs"]:
            e, i = r["mirror_at_end"] or {}, r["mirror_after_idle"] or {}
            lines.append(
                f"| {r['round']} | {'on' if r['mirror'] else 'off'} | {r['tokens_per_s']:.1f} "
                f"| {r['requests']} ({', '.join(f'{k} {v}' for k, v in r['by_child'].items())})"
                f" | {r['failed']} | {e.get('queued')} / {e.get('mirrored')} / "
                f"{e.get('cancelled')} / {e.get('running')} | {i.get('mirrored')} / "
                f"{i.get('cancelled')} |")
        lines += ["", f"Median on {b['median_on']:.1f} tokens/s, off {b['median_off']:.1f}: "
                  f"**{b['ratio']:.3f}** (target >= 0.97; per round {b['ratio_per_round']}).",
                  ""]
    if "c" in data:
        c = data["c"]
        lines += ["## c. A mixed stream through repeated GPU restarts: the earliest expected "
                  "finish against always the CPU child", "",
                  "Each run: both children's speeds learned first (two requests on each); then "
                  f"seeded Poisson arrivals, one every {c['interval_s']:g} s on average for "
                  f"{c['duration_s']:g} s ({c['requests_per_run']} requests, "
                  f"{c['long_per_run']} long): {int(c['long_share'] * 100)}% long (~830 prompt "
                  f"tokens), the rest short (~70), {ANSWER_TOKENS} tokens each (ignore_eos), the "
                  "same schedule in every run; the GPU child SIGKILLed every "
                  f"{c['kill_every_s']:g} s from the start (restart.backoff_initial_s 0.3, "
                  "quick_failure_s 1), and at once, once the death is seen, a probe: one more "
                  "long prompt (~830 tokens). failover.wait_for_gpu = true (the default, 5w) "
                  "against false. \"In an outage\": sent between a kill and the GPU child's "
                  "READY; \"in flight at a kill\": on the GPU child when it died, replayed on "
                  "the CPU child in both arms (5w does not apply to replays). Times to answer "
                  "(the whole answer), pooled over the runs.", "",
                  "| | kills | outage (median) | waits for the GPU child (log) | everything: "
                  "mean | p95 | probes: mean | p95 | answered by | the stream: mean | p95 | "
                  "failed |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        arms = (("earliest", "earliest finish (true)"), ("cpu", "always the CPU child (false)"))

        def by(counts: dict[str, int]) -> str:
            return ", ".join(f"{k or 'none'} {v}" for k, v in counts.items())

        for key, label in arms:
            p = c["pooled"][key]
            lines.append(
                f"| {label} | {p['kills']} | {fmt(p['outage_median_s'])} | "
                f"{p['waited_for_gpu_log']} | {fmt(p['all']['mean_s'])} | "
                f"{fmt(p['all']['p95_s'])} | {fmt(p['probes']['mean_s'])} | "
                f"{fmt(p['probes']['p95_s'])} | {by(p['probes']['by_child'])} | "
                f"{fmt(p['stream']['mean_s'])} | {fmt(p['stream']['p95_s'])} | "
                f"{p['all']['failed']} |")
        lines += ["", "The stream alone, by kind and by when it was sent:", "",
                  "| | long: n | mean | p95 | short: n | mean | p95 | sent in an outage: n | "
                  "mean | (long: n, mean) | (short: n, mean) | in flight at a kill: n | mean |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, label in arms:
            p = c["pooled"][key]
            lines.append(
                f"| {label} | {p['long']['n']} | {fmt(p['long']['mean_s'])} | "
                f"{fmt(p['long']['p95_s'])} | {p['short']['n']} | {fmt(p['short']['mean_s'])} | "
                f"{fmt(p['short']['p95_s'])} | {p['outage']['n']} | "
                f"{fmt(p['outage']['mean_s'])} | {p['outage_long']['n']}, "
                f"{fmt(p['outage_long']['mean_s'])} | {p['outage_short']['n']}, "
                f"{fmt(p['outage_short']['mean_s'])} | {p['in_flight_at_kill']['n']} | "
                f"{fmt(p['in_flight_at_kill']['mean_s'])} |")
        e, b_ = c["pooled"]["earliest"], c["pooled"]["cpu"]
        lines.append("")
        for what, key in (("everything", "all"), ("the probes", "probes"),
                          ("the stream without the probes", "stream")):
            if e[key]["mean_s"] and b_[key]["mean_s"]:
                lines.append(f"- {what}: earliest finish against always the CPU child, mean "
                             f"**{e[key]['mean_s'] / b_[key]['mean_s']:.3f}x**, p95 "
                             f"**{e[key]['p95_s'] / b_[key]['p95_s']:.3f}x**")
        lines.append("")
    return "\n".join(lines)


async def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    binary = bootstrap.ensure_llama_server()
    model = bootstrap.ensure_model()
    parts = set(args.parts.split(","))
    data: dict[str, Any] = {"llama_server": str(binary), "model": model.name,
                            "gpu_args": GPU_ARGS, "cpu_args": CPU_ARGS,
                            "model_args": MODEL_ARGS}
    if "a" in parts:
        data["a"] = await part_a(folder, binary, model, args.warm_rounds)
    if "b" in parts:
        data["b"] = await part_b(folder, binary, model, args.throughput_rounds, args.clients,
                                 args.warmup, args.seconds)
    if "c" in parts:
        data["c"] = await part_c(folder, binary, model, args.stream_rounds, args.duration,
                                 args.interval, args.long_share, args.kill_every)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="a,b,c")
    parser.add_argument("--warm-rounds", type=int, default=2)
    parser.add_argument("--throughput-rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--stream-rounds", type=int, default=1,
                        help="part c: rounds, each a run of both arms (ABBA)")
    parser.add_argument("--duration", type=float, default=180.0)
    parser.add_argument("--interval", type=float, default=6.0)
    parser.add_argument("--long-share", type=float, default=0.35)
    parser.add_argument("--kill-every", type=float, default=12.0)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--report", type=Path, help="only print (and write the .md of) the "
                        "tables of a results JSON written before")
    parser.add_argument("--keep", type=Path, help="keep the daemons' folders here")
    args = parser.parse_args()
    if args.report is not None:
        text_ = report(json.loads(args.report.read_text()))
        print(text_)
        if not args.no_write:
            args.report.with_suffix(".md").write_text(text_ + "\n")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    info = machine()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="warm-bench-") as tmp:
        data = asyncio.run(run(args, args.keep or Path(tmp)))
    info["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    data.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=info,
                run_time_s=round(time.monotonic() - started, 1), args=vars(args) | {
                    "report": None, "keep": None})
    text_ = report(data)
    print(text_)
    if not args.no_write:
        out = REPO / "bench" / "results"
        (out / "warm-failover.json").write_text(json.dumps(data, indent=1) + "\n")
        (out / "warm-failover.md").write_text(text_ + "\n")


if __name__ == "__main__":
    main()
