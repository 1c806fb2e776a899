"""The outage ends when the GPU child is back: fail-back, and replays and continuations that wait
when waiting is sooner, measured (issue 48's benchmark).

Real llama-server children serving the embedded SmolLM2-135M-Instruct behind one Spillway per
run (a fresh daemon each: no cache of one run helps the next). There is no GPU here: the "GPU
child" runs on the CPU too, made faster than the CPU child as the issue measured it: two threads
(`-t 2 -tb 2`, llama-server's default batch) against one thread and 32-token micro-batches for
the CPU child (`-t 1 -tb 1 -b 32 -ub 32`; `--gpu-args` to change the GPU child's). The speeds
each run saw are printed beside its figures: on two cores shared with other workers, a second
thread for the GPU child is an advantage only while the other core is free (quiet: 74 tokens/s
generated against the CPU child's ~40, prefill 3.4x; beside a busy loop on the other core: 2-6
tokens/s generated, `--poll 0` or not, while one thread kept 42), so read the ratios with the
speeds; the report says when the GPU child generated slower. The GPU child is SIGKILLed by the pid
its status names; restart.backoff_initial_s 0.3 (quick_failure_s 1), but where a part says the
restart is slow. Each run learns both children's speeds first (two short answers on each, as
bench.warm_failover does). Mirroring is off (cpu.mirror = false): the CPU child's cores are
for the work measured. Each comparison: "with" against "without" in the same run, the order
alternating from round to round; mean and p95 (nearest rank) over the rounds, and their ratio.

1. Replays: a ~4,480-token prompt (non-streamed, 8 tokens) in flight on the GPU child, which is
   SIGKILLed `--kill-after` seconds into its prefill (its task launched, from the status);
   time from the request to its answer. "with": `failover.wait_for_gpu = true` (the default:
   a replay may wait for the GPU child's return when that is the earliest expected finish);
   "without": wait_for_gpu and fail_back both false (always the CPU child). Beside them each
   GPU child's own time for a prompt of the same size, alone (a fresh daemon), and the CPU
   child's own (its timings in the answers of "without"). Each incident's decision,
   forecast_s and took_s.
2. Streams: a greedy stream (temperature 0, ignore_eos) of `--long` and `--short` tokens, cut
   after `--cut` events with text by a SIGKILL of the GPU child: time from the death to its
   last token, and whether the whole text equals the uncut greedy answer (taken first from
   the GPU child of a daemon of its own). "with": the defaults (waiting and fail-back on);
   "without": wait_for_gpu and fail_back false (the rest on the CPU child alone: the issue's
   reference). Once with a quick restart (0.3 s back-off), once with a slow one
   (`--slow-restart` s of back-off) so that the continuation goes to the CPU child first and
   fail-back may move it back once the GPU child is READY. Incident decisions.
3. The next turn on the restarted GPU child, warm against cold: conversation A (turn 1 on
   the GPU child, `--prefix-words`), the GPU child SIGKILLed (idle; 3 s back-off),
   conversation B's turn 1 sent during the outage (to the CPU child: wait_for_gpu false in
   both arms), then, once the GPU child is READY and B answered, until the GPU child has been
   idle (its process using no CPU, no task started) for `--idle` s (3), turn 2 of A and of B
   streamed: time to first token and timings.cache_n. "with": gpu.rewarm true; "without": false.
4. The hot path: `python -m bench --only hotpath --baseline REV` and `python -m bench.relay
   --baseline REV` run as they are (chat at concurrency 64 against the bare aiohttp
   pass-through; the stream relay's CPU per event), this tree against `--baseline`, their
   figures folded into this report.

A key that the running code does not know yet (`failover.fail_back`, `gpu.rewarm`: issue 48's
features, being built) is left out of the config, and the report says so: until they land,
"with" and "without" differ only in what the code has.

    .venv/bin/python -m bench.failback [--quick] [--parts 1,2,3,4] [--rounds 3]
        [--baseline cd2a268] [--report FILE.json]

Prints the tables and writes bench/results/failback.{json,md} (`--quick`: one round, shorter
answers, failback-quick.{json,md}).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.__main__ import settle
from bench.continuation import STORY
from bench.real_children import (REPO, back_after, chat, fmt, incidents_of_one_request,
                                 kill_gpu, learn_speeds, mean, pct, start, stream_turn, text,
                                 wait_for)
from bench.small_child import machine, stop_daemon
from harness import Spillway, real_config
from supervisor.commands import bootstrap
from supervisor.config.schema import SCHEMA
from supervisor.policy.continuation import Transcript, continuation_body

MODEL_ARGS = ["-c", "12288", "-np", "2"]  # 6,144 tokens a slot: the 4,480-token prompt fits
# Two threads make the GPU child faster than the CPU child only while the other core is free:
# under load its generation falls to a few tokens a second (`--gpu-args` to change it).
GPU_ARGS = ["-ngl", "99", "-t", "2", "-tb", "2"]
CPU_ARGS = ["--device", "none", "-ngl", "0", "-t", "1", "-tb", "1", "-b", "32", "-ub", "32"]
QUICK_RESTART_S = 0.3
OUTAGE_RESTART_S = 3.0  # part 3: long enough for conversation B to be sent inside the outage
REPLAY_TOKENS = 8
TURN_TOKENS = 32
ARMS = (True, False)  # with, without
BASELINE = "cd2a268"  # main when this benchmark was written


def known(section: str, key: str) -> bool:
    """A key of the running code's config (this tree's schema: the daemon runs this tree)."""
    return key in SCHEMA.get(section, {})


def config(binary: Path, model: Path, gpu: list[str], arm: bool, backoff_s: float,
           wait_in_both: bool | None = None) -> tuple[dict[str, Any], list[str]]:
    """The config of one run, and the keys left out because the code does not know them.
    `arm` True: issue 48's features on (their defaults); False: off (always the CPU child, no
    fail-back, no rewarm). `wait_in_both`: failover.wait_for_gpu whatever the arm."""
    cfg = real_config(binary, model, model={"args": MODEL_ARGS}, server={"access_log": True},
                      restart={"backoff_initial_s": backoff_s,
                               "backoff_max_s": max(1.0, backoff_s), "quick_failure_s": 1.0})
    wanted = {"failover": {"wait_for_gpu": arm if wait_in_both is None else wait_in_both,
                           "fail_back": arm},
              "gpu": {"rewarm": arm}}
    left_out = [f"{section}.{k}" for section, keys in wanted.items() for k in keys
                if not known(section, k)]
    cfg["failover"] = {k: v for k, v in wanted["failover"].items() if known("failover", k)}
    cfg["gpu"] = {"args": gpu,
                  **{k: v for k, v in wanted["gpu"].items() if known("gpu", k)}}
    cfg["cpu"] = {**cfg["cpu"], "args": CPU_ARGS, "mirror": False}
    if THROTTLE is not None:  # (--cpu-throttle: a CPU child slowed down, not a faster GPU one)
        on_ms, off_ms, wrapper = THROTTLE
        cfg["cpu"].update(llama_server=str(wrapper), env={
            "REAL_LLAMA_SERVER": str(binary), "THROTTLE_ON_MS": str(on_ms),
            "THROTTLE_OFF_MS": str(off_ms)})
    return cfg, left_out


# --cpu-throttle ON:OFF: the CPU child runs under tests/throttled_llama_server.py (stopped OFF ms
# of every ON+OFF), so the "GPU child" is faster with one thread on a loaded 2-core machine.
THROTTLE: tuple[int, int, Path] | None = None
CACHE_PROMPT = True  # --no-cache-prompt sets it false, in part 2's streams


def throttle_wrapper(folder: Path) -> Path:
    path = folder / "throttled-llama-server"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" '
                    f'"{REPO / "tests" / "throttled_llama_server.py"}" "$@"\n')
    path.chmod(0o755)
    return path


def arm_name(arm: bool) -> str:
    return "with" if arm else "without"


def interleaved(rounds: int) -> list[tuple[int, bool]]:
    """(round, arm): both arms each round, the order alternating (with first in even rounds)."""
    return [(k, arm) for k in range(rounds) for arm in (ARMS if k % 2 == 0 else ARMS[::-1])]


def compare(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Mean and p95 of `key` over the runs of each arm, and with / without."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        values = [r[key] for r in runs if r["arm"] == arm and r.get(key) is not None]
        out[arm_name(arm)] = {"n": len(values), "mean_s": mean(values),
                              "p95_s": pct(values, 0.95)}
    w, wo = out["with"], out["without"]
    out["ratio_mean"] = w["mean_s"] / wo["mean_s"] if w["mean_s"] and wo["mean_s"] else None
    out["ratio_p95"] = w["p95_s"] / wo["p95_s"] if w["p95_s"] and wo["p95_s"] else None
    return out


def incident_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the console shows of each incident (the results keep them whole: a fail-back's
    record may carry fields this benchmark does not know yet)."""
    keep = ("decision", "replay_child", "tokens_before", "continued_after_s", "forecast_s",
            "took_s", "latency_s")
    return [{k: r[k] for k in keep if k in r} for r in records]


async def watch_return(s: Spillway, pid: int, killed_at: float) -> float:
    """Seconds from the kill to the GPU child's READY (another process than `pid`)."""
    await wait_for(s, back_after(pid), 180, "the GPU child is not back")
    return time.perf_counter() - killed_at


# --- 1. replays ----------------------------------------------------------------------------

async def replay_run(folder: Path, binary: Path, model: Path, args: argparse.Namespace,
                     k: int, arm: bool) -> dict[str, Any]:
    name = f"1-{arm_name(arm)}-{k}"
    print(f"--- {name}", flush=True)
    cfg, left_out = config(binary, model, args.gpu_args, arm, QUICK_RESTART_S)
    s = start(folder, name, cfg)
    try:
        await learn_speeds(s)
        before = (await asyncio.to_thread(s.status))["children"]["gpu"]["tasks_started"]
        body = chat(text(args.prompt_words, 1000 + 10 * k + arm), "What is it about?",
                    REPLAY_TOKENS)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            async def ask() -> tuple[int, dict[str, Any], Any, float]:
                async with http.post(f"{s.url}/v1/chat/completions", json=body) as r:
                    return r.status, await r.json(), r.headers, time.perf_counter()

            sent = time.perf_counter()
            request = asyncio.create_task(ask())
            await wait_for(s, lambda st: st["children"]["gpu"]["tasks_started"] > before, 60,
                           "the GPU child did not take the prompt")
            launched_s = time.perf_counter() - sent
            await asyncio.sleep(args.kill_after)
            pid = await kill_gpu(s)
            killed = time.perf_counter()
            restart_s = await watch_return(s, pid, killed)
            code, answer, headers, done = await request
        assert code == 200, answer
        took = done - sent
        records = await asyncio.to_thread(incidents_of_one_request, s)
    finally:
        stop_daemon(s)
    run = {"arm": arm, "round": k, "total_s": took, "launched_s": launched_s,
           "killed_at_s": killed - sent, "restart_s": restart_s,
           "child": headers.get("X-Spillway-Child"), "attempts": headers.get("X-Spillway-Attempts"),
           "prompt_tokens": answer["usage"]["prompt_tokens"],
           # What the child that answered took by its own count (prefill and generation).
           "answer_s": (timings["prompt_ms"] + timings["predicted_ms"]) / 1000
           if (timings := answer.get("timings")) else None,
           "incidents": records, "left_out": left_out}
    print(f"    {took:.2f} s, answered by {run['child']}, the GPU child back "
          f"{restart_s:.2f} s after the kill; {incident_summary(records)}", flush=True)
    return run


async def gpu_alone(folder: Path, binary: Path, model: Path, args: argparse.Namespace,
                    k: int) -> dict[str, Any]:
    """The GPU child's own time for a prompt of the same size, alone."""
    name = f"1-gpu-alone-{k}"
    print(f"--- {name}", flush=True)
    s = start(folder, name, config(binary, model, args.gpu_args, True, QUICK_RESTART_S)[0])
    try:
        began = time.perf_counter()
        code, answer = await asyncio.to_thread(
            s.post, "/v1/chat/completions",
            chat(text(args.prompt_words, 2000 + k), "What is it about?", REPLAY_TOKENS), None,
            900.0)
        took = time.perf_counter() - began
        assert code == 200, answer
    finally:
        stop_daemon(s)
    print(f"    the GPU child alone: {took:.2f} s", flush=True)
    return {"round": k, "gpu_s": took, "timings": answer.get("timings")}


async def part_replays(folder: Path, binary: Path, model: Path,
                       args: argparse.Namespace) -> dict[str, Any]:
    runs, alone = [], []
    for k in range(args.rounds):
        for arm in ARMS if k % 2 == 0 else ARMS[::-1]:
            runs.append(await replay_run(folder, binary, model, args, k, arm))
        alone.append(await gpu_alone(folder, binary, model, args, k))
    # The CPU child's own time for the prompt: its timings when it answered the replay of
    # "without" (the same prompt, nothing else on it), not another 4,480 tokens of its time.
    cpu_mean = mean([r["answer_s"] for r in runs if not r["arm"] and r["child"] == "cpu"
                     and r["answer_s"] is not None])
    result = {"runs": runs, "alone": alone, **compare(runs, "total_s"),
              "cpu_alone_mean_s": cpu_mean, "gpu_alone_mean_s": mean([a["gpu_s"] for a in alone]),
              "restart_mean_s": mean([r["restart_s"] for r in runs])}
    for arm in ARMS:
        m = result[arm_name(arm)]["mean_s"]
        result[arm_name(arm)]["of_cpu_alone"] = m / cpu_mean if m and cpu_mean else None
    return result


# --- 2. streams ----------------------------------------------------------------------------

def story(tokens: int) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": STORY}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}
    # --no-cache-prompt: each answer computed from its first token, as the uncut one is (a
    # prefix the restarted GPU child holds, from the rewarm, was computed in other batches:
    # llama.cpp's greedy answer after it may differ from the uncut one's).
    return body if CACHE_PROMPT else {**body, "cache_prompt": False}


async def uncut_answers(folder: Path, binary: Path, model: Path, args: argparse.Namespace,
                        lengths: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """The greedy answer of each length, uncut, from the GPU child (the reference text), then
    from the CPU child (the GPU child paused): each child's own time for what follows the cut,
    and whether the two compute alike."""
    print("--- 2-uncut", flush=True)
    s = start(folder, "2-uncut", config(binary, model, args.gpu_args, True,
                                        QUICK_RESTART_S)[0])
    out: dict[int, dict[str, Any]] = {n: {} for n in lengths}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            for who in ("gpu", "cpu"):
                if who == "cpu":
                    await pause_gpu(s)
                for n in lengths:
                    times: list[float] = []
                    turn = await stream_turn(
                        http, s.url, story(n),
                        lambda _, times=times: times.append(time.perf_counter()))
                    assert turn["child"] == who, (who, turn["child"])
                    rest_s = times[-1] - times[min(args.cut, len(times)) - 1]
                    speed = (turn["timings"] or {}).get("predicted_per_second")
                    if who == "gpu":
                        out[n].update(text=turn["text"], gpu_rest_s=rest_s, gpu_speed=speed)
                        out[n]["gpu_self_difference"] = await own_continuation(
                            http, s.url, n, turn["pieces"], args.cut)
                    else:
                        out[n].update(cpu_rest_s=rest_s, cpu_speed=speed,
                                      cpu_identical=turn["text"] == out[n]["text"])
                    print(f"    the {who} child, {n} tokens: the rest after {args.cut} events "
                          f"in {rest_s:.2f} s ({fmt(speed, ' tokens/s', 1)})", flush=True)
    finally:
        stop_daemon(s)
    return out


async def own_continuation(http: aiohttp.ClientSession, url: str, tokens: int,
                           pieces: list[str], cut: int) -> int | None:
    """The control for "identical": the GPU child asked to continue its own uncut answer after
    `cut` events, with the very body Spillway sends a continuation (no death, no Spillway
    decision); the first character where its whole text differs from the uncut one (None: the
    same). llama.cpp computes the relayed text in one batch there, where the uncut answer
    computed it a token at a time: where these differ, so may any continuation's text."""
    before = "".join(pieces[:cut])
    body = continuation_body(story(tokens), Transcript("chat", text=before, tokens=cut))
    turn = await stream_turn(http, url, body)
    assert turn["child"] == "gpu", turn["child"]
    return first_difference(before + turn["text"], "".join(pieces))


async def pause_gpu(s: Spillway) -> None:
    code, paused = await asyncio.to_thread(s.post, "/spillway/gpu/pause", {})
    assert code == 200, paused
    await wait_for(s, lambda st: st["children"]["gpu"]["state"] == "STOPPED", 60,
                   "the GPU child is not paused")


def first_difference(a: str, b: str) -> int | None:
    """The first character where `a` and `b` differ; None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def stream_run(folder: Path, binary: Path, model: Path, args: argparse.Namespace,
                     case: str, backoff_s: float, tokens: int, uncut: dict[str, Any], k: int,
                     arm: bool) -> dict[str, Any]:
    name = f"2-{case}-{tokens}-{arm_name(arm)}-{k}"
    print(f"--- {name}", flush=True)
    cfg, left_out = config(binary, model, args.gpu_args, arm, backoff_s)
    s = start(folder, name, cfg)
    try:
        await learn_speeds(s)
        pid = (await wait_for(s, lambda st: st["children"]["gpu"]["state"] == "READY", 60,
                              "the GPU child is not READY"))["children"]["gpu"]["pid"]
        killed = asyncio.Event()
        killed_at: list[float] = []

        def cut(n: int) -> None:
            if n == args.cut:
                os.kill(pid, signal.SIGKILL)
                killed_at.append(time.perf_counter())
                killed.set()

        async def restart() -> float:
            await killed.wait()
            return await watch_return(s, pid, killed_at[0])

        back = asyncio.create_task(restart())
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
                turn = await stream_turn(http, s.url, story(tokens), cut)
            assert killed_at, f"the stream ended before its event {args.cut}: {turn}"
            restart_s = await back
        finally:
            back.cancel()
        records = await asyncio.to_thread(incidents_of_one_request, s)
    finally:
        stop_daemon(s)
    run = {"arm": arm, "round": k, "case": case, "tokens": tokens,
           "death_to_last_s": turn["began"] + turn["last_token_s"] - killed_at[0],
           "restart_s": restart_s, "events_with_text": turn["events_with_text"],
           "identical": turn["text"] == uncut["text"],
           "first_difference": first_difference(turn["text"], uncut["text"]),
           "chars": len(turn["text"]), "uncut_chars": len(uncut["text"]),
           "last_timings": turn["timings"], "incidents": records,
           "left_out": left_out}
    print(f"    death to last token {run['death_to_last_s']:.2f} s, the GPU child back "
          f"{restart_s:.2f} s after the kill, identical {run['identical']}; "
          f"{incident_summary(records)}", flush=True)
    return run


async def part_streams(folder: Path, binary: Path, model: Path,
                       args: argparse.Namespace) -> dict[str, Any]:
    lengths = (args.long, args.short)
    uncut = await uncut_answers(folder, binary, model, args, lengths)
    out: dict[str, Any] = {"uncut": {str(n): {k: v for k, v in u.items() if k != "text"}
                                     for n, u in uncut.items()},
                           "cases": {}}
    for case, backoff_s in (("quick", QUICK_RESTART_S), ("slow", args.slow_restart)):
        for n in lengths:
            runs = [await stream_run(folder, binary, model, args, case, backoff_s, n, uncut[n],
                                     k, arm) for k, arm in interleaved(args.rounds)]
            out["cases"][f"{case}-{n}"] = {
                "case": case, "backoff_s": backoff_s, "tokens": n, "runs": runs,
                **compare(runs, "death_to_last_s"),
                "gpu_rest_s": uncut[n]["gpu_rest_s"], "cpu_rest_s": uncut[n]["cpu_rest_s"],
                "restart_mean_s": mean([r["restart_s"] for r in runs])}
    return out


# --- 3. the next turn on the restarted GPU child -------------------------------------------

async def idle_gpu(s: Spillway, quiet_s: float, timeout: float) -> float:
    """Wait until the GPU child's process has used no CPU, and started no task, for `quiet_s`
    (whatever Spillway does in its idle time is done); the seconds it took."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        status = await asyncio.to_thread(s.status)
        gpu = status["children"]["gpu"]
        await asyncio.to_thread(settle, gpu["pid"], timeout)
        proc = psutil.Process(gpu["pid"])
        used = sum(proc.cpu_times()[:2])
        await asyncio.sleep(quiet_s)
        again = (await asyncio.to_thread(s.status))["children"]["gpu"]
        if again["tasks_started"] == gpu["tasks_started"] and \
                sum(proc.cpu_times()[:2]) - used < 0.05:
            return time.monotonic() - began
    raise TimeoutError(f"the GPU child was not idle in {timeout} s")


async def rewarm_run(folder: Path, binary: Path, model: Path, args: argparse.Namespace, k: int,
                     arm: bool) -> dict[str, Any]:
    name = f"3-{arm_name(arm)}-{k}"
    print(f"--- {name}", flush=True)
    cfg, left_out = config(binary, model, args.gpu_args, arm, OUTAGE_RESTART_S,
                           wait_in_both=False)
    s = start(folder, name, cfg)
    question = "Summarise the report in three sentences."
    follow_up = "Which part matters most, and why?"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            async def turn(system: str, history: list[dict[str, str]]
                           ) -> tuple[dict[str, Any], list[dict[str, str]]]:
                messages = [{"role": "system", "content": system}, *history]
                done = await stream_turn(http, s.url, {"messages": messages,
                                                       "max_tokens": TURN_TOKENS,
                                                       "temperature": 0})
                return done, [*history, {"role": "assistant", "content": done["text"]}]

            a_system = text(args.prefix_words, 5000 + 10 * k + arm)
            b_system = text(args.prefix_words // 2, 6000 + 10 * k + arm)
            a1, a_history = await turn(a_system, [{"role": "user", "content": question}])
            pid = await kill_gpu(s)
            killed = time.perf_counter()
            await wait_for(s, lambda st: st["children"]["gpu"]["state"] != "READY", 30,
                           "no death seen")
            b1, b_history = await turn(b_system, [{"role": "user", "content": question}])
            restart_s = await watch_return(s, pid, killed)
            idle_s = await idle_gpu(s, args.idle, 300)
            a2, _ = await turn(a_system, [*a_history, {"role": "user", "content": follow_up}])
            b2, _ = await turn(b_system, [*b_history, {"role": "user", "content": follow_up}])
    finally:
        stop_daemon(s)
    run: dict[str, Any] = {"arm": arm, "round": k, "restart_s": restart_s, "idle_wait_s": idle_s,
                           "turn1_children": [a1["child"], b1["child"]], "left_out": left_out}
    for label, one, two in (("a", a1, a2), ("b", b1, b2)):
        timings = two["timings"] or {}
        run[f"{label}_ttft_s"] = two["ttft_s"]
        run[f"{label}_child"] = two["child"]
        run[f"{label}_cache_n"] = timings.get("cache_n")
        run[f"{label}_prompt_n"] = timings.get("prompt_n")
        run[f"{label}_turn1_prompt_n"] = (one["timings"] or {}).get("prompt_n")
    run["ttft_s"] = (run["a_ttft_s"] + run["b_ttft_s"]) / 2
    print(f"    turn 2 on the {run['a_child']}/{run['b_child']} child: TTFT A "
          f"{run['a_ttft_s']:.2f} s (cache_n {run['a_cache_n']}), B {run['b_ttft_s']:.2f} s "
          f"(cache_n {run['b_cache_n']}); turn 1 of B on the {b1['child']} child", flush=True)
    return run


async def part_rewarm(folder: Path, binary: Path, model: Path,
                      args: argparse.Namespace) -> dict[str, Any]:
    runs = [await rewarm_run(folder, binary, model, args, k, arm)
            for k, arm in interleaved(args.rounds)]
    return {"runs": runs, "both": compare(runs, "ttft_s"), "a": compare(runs, "a_ttft_s"),
            "b": compare(runs, "b_ttft_s")}


# --- 4. the hot path, against the baseline -------------------------------------------------

def part_hotpath(args: argparse.Namespace) -> dict[str, Any]:
    """bench's `--only hotpath` and bench.relay, each with `--baseline`, in a folder of their
    own (the figures on file in bench/results stay as they were)."""
    out: dict[str, Any] = {"baseline": args.baseline}
    with tempfile.TemporaryDirectory(prefix="failback-hotpath-") as tmp:
        quick = ["--quick", "--rounds", "1"] if args.quick else []
        relay_quick = ["--rounds", "1", "--events", "1000"] if args.quick else []
        for name, module, extra in (("hotpath", "bench", ["--only", "hotpath", *quick]),
                                    ("relay", "bench.relay", relay_quick)):
            print(f"--- 4-{name}: python -m {module} {' '.join(extra)} --baseline "
                  f"{args.baseline}", flush=True)
            subprocess.run([sys.executable, "-m", module, *extra, "--baseline", args.baseline,
                            "--out", tmp], cwd=REPO, check=True)
            out[name] = json.loads((Path(tmp) / f"{name}.json").read_text())
    return out


# --- report --------------------------------------------------------------------------------

def ratio_line(c: dict[str, Any]) -> str:
    return (f"with {fmt(c['with']['mean_s'])} (p95 {fmt(c['with']['p95_s'])}) against without "
            f"{fmt(c['without']['mean_s'])} (p95 {fmt(c['without']['p95_s'])}): mean "
            f"**{fmt(c['ratio_mean'], 'x', 3)}**, p95 **{fmt(c['ratio_p95'], 'x', 3)}**")


def decisions(run: dict[str, Any]) -> str:
    parts = []
    for i in run["incidents"]:
        extra = [f"{k} {i[k]}" for k in ("replay_child", "tokens_before")
                 if i.get(k) is not None]
        extra += [f"forecast {fmt(i.get('forecast_s'))}", f"took {fmt(i.get('took_s'))}"]
        parts.append(f"`{i.get('decision')}`" + (f" ({', '.join(extra)})" if extra else ""))
    return "; ".join(parts) or "none"


def report_replays(p: dict[str, Any], words: int) -> list[str]:
    lines = ["## 1. A long prompt in flight at the GPU child's death: the earliest finish "
             "against always the CPU child", "",
             f"A {p['runs'][0]['prompt_tokens']}-token prompt ({words} words), "
             f"{REPLAY_TOKENS} tokens, non-streamed; the GPU child SIGKILLed during its "
             "prefill; time from the request to its answer.", "",
             "| run | time to answer | answered by | attempts | killed at (its task "
             "launched at) | GPU child back after the kill | incidents: decision (forecast, "
             "took) |", "|---|---|---|---|---|---|---|"]
    for r in p["runs"]:
        lines.append(f"| {arm_name(r['arm'])} {r['round']} | {fmt(r['total_s'])} | "
                     f"{r['child']} | {r['attempts']} | {fmt(r['killed_at_s'])} "
                     f"({fmt(r['launched_s'])}) | {fmt(r['restart_s'])} | {decisions(r)} |")
    lines += ["", "The GPU child alone, a prompt of the same size: " + "; ".join(
        f"round {a['round']}: {fmt(a['gpu_s'])}" for a in p["alone"]) + ". The CPU child's "
        "own time for the prompt: its timings (prompt_ms + predicted_ms) in the answers of "
        "\"without\": " + ", ".join(fmt(r["answer_s"]) for r in p["runs"]
                                    if not r["arm"]) + ".", "",
        f"- {ratio_line(p)}",
        f"- against the CPU child's own time ({fmt(p['cpu_alone_mean_s'])} mean): with "
        f"**{fmt(p['with']['of_cpu_alone'], 'x', 3)}** (target <= 0.6x), without "
        f"{fmt(p['without']['of_cpu_alone'], 'x', 3)}; the GPU child's own time "
        f"{fmt(p['gpu_alone_mean_s'])}, its return {fmt(p['restart_mean_s'])} after the kill "
        "(mean)", ""]
    return lines


def slower_gpu(uncut: dict[str, dict[str, Any]]) -> list[str]:
    """A warning where the premise failed: the "GPU child" generated slower than the CPU child
    (two threads on a machine whose other core was busy), so nothing can be gained by moving a
    stream to it, and "with" may rightly stay where "without" is."""
    slower = [n for n, u in uncut.items()
              if (u.get("gpu_speed") or 0) < (u.get("cpu_speed") or 0)]
    if not slower:
        return []
    return ["**In this run the GPU child generated slower than the CPU child** "
            f"({', '.join(slower)} tokens; see the load average): the comparison below cannot "
            "show what waiting or fail-back gain.", ""]


def report_streams(p: dict[str, Any], cut: int) -> list[str]:
    lines = ["## 2. A greedy stream cut by the GPU child's death: waiting and fail-back "
             "against the CPU child alone", "",
             f"Cut after {cut} events with text (a SIGKILL of the GPU child); time from the "
             "death to the last token; the text against the uncut greedy answer of the GPU "
             "child. \"without\" is the CPU child alone for the rest (the issue's reference). "
             "The uncut answers, each child alone: " + "; ".join(
                 f"{n} tokens: the GPU child at {fmt(u['gpu_speed'], ' tokens/s', 1)}, the "
                 f"rest after the cut in {fmt(u['gpu_rest_s'])}; the CPU child at "
                 f"{fmt(u['cpu_speed'], ' tokens/s', 1)}, {fmt(u['cpu_rest_s'])}, its text "
                 f"{'the same' if u['cpu_identical'] else 'not the same'}"
                 for n, u in p["uncut"].items()) + ".", "",
             *own_lines(p["uncut"], cut),
             *slower_gpu(p["uncut"]),
             "| case | run | death to last token | GPU child back after | whole text "
             "identical (first difference) | rest's speed (last timings) | incidents |",
             "|---|---|---|---|---|---|---|"]
    for c in p["cases"].values():
        for r in c["runs"]:
            t = r["last_timings"] or {}
            diff = "yes" if r["identical"] else f"no (char {r['first_difference']} of " \
                f"{r['uncut_chars']})"
            lines.append(f"| {c['case']} restart ({c['backoff_s']:g} s back-off), "
                         f"{c['tokens']} tokens | {arm_name(r['arm'])} {r['round']} | "
                         f"{fmt(r['death_to_last_s'])} | {fmt(r['restart_s'])} | {diff} | "
                         f"{t.get('predicted_per_second', 0):.1f} tokens/s | "
                         f"{decisions(r)} |")
    lines.append("")
    for c in p["cases"].values():
        lines.append(f"- {c['case']} restart, {c['tokens']} tokens: {ratio_line(c)} (target "
                     f"<= 0.85x); each child's own time for the rest, uncut: the GPU "
                     f"child {fmt(c['gpu_rest_s'])}, the CPU child {fmt(c['cpu_rest_s'])}")
    return [*lines, ""]


def own_lines(uncut: dict[Any, dict[str, Any]], cut: int) -> list[str]:
    """The control: the GPU child continuing its own answer straight, no death."""
    said = []
    for n, u in uncut.items():
        if "gpu_self_difference" not in u:
            continue  # (results from before the control)
        d = u["gpu_self_difference"]
        said.append(f"{n} tokens: " + ("identical" if d is None else
                                       f"differs from char {d} of {len(u['text'])}"))
    if not said:
        return []
    return [f"The control, no death: the GPU child asked to continue its own uncut answer after "
            f"{cut} events, with the body Spillway sends a continuation: " + "; ".join(said) +
            ". Where it differs, llama.cpp's batched computation of the relayed text is why a "
            "continuation there differs too (not the relay).", ""]


def report_rewarm(p: dict[str, Any], words: int, idle: float) -> list[str]:
    lines = ["## 3. The next turn on the restarted GPU child: warm against cold", "",
             f"Conversation A ({words} words of system text) answered by the GPU child, which "
             f"is then SIGKILLed (idle; {OUTAGE_RESTART_S:g} s back-off); conversation B "
             f"({words // 2} words) sent in the outage; once the GPU child is READY, B answered "
             f"and the GPU child idle {idle:g} s (its process using no CPU, no task started), "
             "turn 2 of each, streamed.", "",
             "| run | turn 1 of A, B by | turn 2 TTFT A | cache_n / prompt_n A | TTFT B | "
             "cache_n / prompt_n B | waited for the GPU child idle |",
             "|---|---|---|---|---|---|---|"]
    for r in p["runs"]:
        lines.append(f"| {arm_name(r['arm'])} {r['round']} | {', '.join(r['turn1_children'])} "
                     f"| {fmt(r['a_ttft_s'])} | {r['a_cache_n']} / {r['a_prompt_n']} | "
                     f"{fmt(r['b_ttft_s'])} | {r['b_cache_n']} / {r['b_prompt_n']} | "
                     f"{fmt(r['idle_wait_s'])} |")
    lines += ["", f"- A: {ratio_line(p['a'])}", f"- B: {ratio_line(p['b'])}",
              f"- both: {ratio_line(p['both'])}", ""]
    return lines


def report_hotpath(p: dict[str, Any]) -> list[str]:
    hot, relay = p["hotpath"]["hotpath"], p["relay"]
    base = hot.get("baseline", {})
    lines = [f"## 4. The hot path against {p['baseline']}", "",
             "`python -m bench --only hotpath` and `python -m bench.relay`, each with "
             f"`--baseline {p['baseline']}` (instant upstream; medians of "
             f"{hot['rounds']} and {relay['rounds']} interleaved rounds).", "",
             "| | this tree | baseline | this / baseline |", "|---|---|---|---|"]
    for label, c, key, digits in (("chat req/s at c=64", "64", "rps", 0),
                                  ("chat p50 at c=1 (ms)", "1", "p50_ms", 3)):
        mine, theirs = hot["spillway"][c][key], base.get(c, {}).get(key)
        lines.append(f"| {label} | {mine:.{digits}f} | {fmt(theirs, '', digits)} | "
                     f"{fmt(mine / theirs if theirs else None, 'x', 3)} |")
    lines.append(f"| req/s at c=64 / bare aiohttp's | {hot['spillway']['throughput_ratio_c64']}"
                 f" | {base.get('throughput_ratio_c64')} | |")
    us = relay["us_per_event"]
    lines.append(f"| relay µs of CPU per event (bare aiohttp {us['aiohttp']:.2f}) | "
                 f"{us['spillway']:.2f} | {fmt(us.get('baseline'), '', 2)} | "
                 f"{fmt(us['spillway'] / us['baseline'] if us.get('baseline') else None, 'x', 3)}"
                 " |")
    return [*lines, ""]


def throttled(spec: str | None) -> str:
    if not spec:
        return ""
    on_ms, off_ms = spec.split(":")
    return (f", run by tests/throttled_llama_server.py: stopped {off_ms} ms of every "
            f"{int(on_ms) + int(off_ms)} ms (a slower CPU, not a faster GPU child)")


def report(data: dict[str, Any]) -> str:
    m, a = data["machine"], data["args"]
    lines = ["# Fail-back and the earliest finish for what is in flight", "",
             f"{data['date']}{' (--quick)' if a['quick'] else ''}: {m['cpu']} ({m['cores']} "
             f"cores, shared with other workers; load average {m['load_before']} before, "
             f"{m['load_after']} after). SmolLM2-135M-Instruct on both children, `"
             f"{' '.join(MODEL_ARGS)}`; the \"GPU child\" CPU-only `{' '.join(data['gpu_args'])}`"
             f", the CPU child `{' '.join(CPU_ARGS)}`"
             f"{throttled(a.get('cpu_throttle'))}; cpu.mirror false"
             f"{'; part 2 with cache_prompt false' if a.get('no_cache_prompt') else ''}. "
             f"A fresh daemon each "
             f"run; {a['rounds']} round(s), \"with\" and \"without\" taking turns. Run time "
             f"{data['run_time_s']:.0f} s.", ""]
    if data["left_out"]:
        lines += [f"Not keys of this code, left out of every config: "
                  f"{', '.join(data['left_out'])} (where an arm differs only by them, it "
                  "runs today's behaviour).", ""]
    if "replays" in data:
        lines += report_replays(data["replays"], a["prompt_words"])
    if "streams" in data:
        lines += report_streams(data["streams"], a["cut"])
    if "rewarm" in data:
        lines += report_rewarm(data["rewarm"], a["prefix_words"], a.get("idle", 3.0))
    if "hotpath" in data:
        lines += report_hotpath(data["hotpath"])
    return "\n".join(lines)


async def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    binary = bootstrap.ensure_llama_server()
    model = bootstrap.ensure_model()
    parts = set(args.parts.split(","))
    steps: list[tuple[str, str, Callable[..., Any]]] = [
        ("1", "replays", part_replays), ("2", "streams", part_streams),
        ("3", "rewarm", part_rewarm)]
    data: dict[str, Any] = {"model": model.name, "gpu_args": args.gpu_args,
                            "cpu_args": CPU_ARGS, "model_args": MODEL_ARGS,
                            "left_out": config(binary, model, args.gpu_args, True, 1.0)[1]}
    for number, key, part in steps:
        if number in parts:
            data[key] = await part(folder, binary, model, args)
    if "4" in parts:
        data["hotpath"] = await asyncio.to_thread(part_hotpath, args)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one round, answers of 400 and 100 tokens, a 4 s slow restart")
    parser.add_argument("--parts", default="1,2,3,4")
    parser.add_argument("--rounds", type=int, help="rounds of each part (3; --quick 1)")
    parser.add_argument("--cpu-throttle", default=None, metavar="ON:OFF",
                        help="run the CPU child stopped OFF ms of every ON+OFF ms "
                             "(tests/throttled_llama_server.py): a faster \"GPU child\" on a "
                             "loaded machine, with --gpu-args \"-ngl 99 -t 1 -tb 1\"")
    parser.add_argument("--gpu-args", type=shlex.split, default=GPU_ARGS,
                        help=f"the GPU child's args (\"{' '.join(GPU_ARGS)}\")")
    parser.add_argument("--prompt-words", type=int, default=4460,
                        help="part 1's prompt: 4,460 words make ~4,480 tokens")
    parser.add_argument("--kill-after", type=float, default=2.0,
                        help="part 1: seconds into the GPU child's task")
    parser.add_argument("--long", type=int, help="part 2's long answer (1200; --quick 400)")
    parser.add_argument("--short", type=int, help="part 2's short answer (200; --quick 100)")
    parser.add_argument("--cut", type=int, default=30)
    parser.add_argument("--no-cache-prompt", action="store_true",
                        help="part 2's streams with cache_prompt false (each answer computed "
                             "from its first token)")
    parser.add_argument("--slow-restart", type=float,
                        help="part 2's slow restart: back-off seconds (10; --quick 4)")
    parser.add_argument("--prefix-words", type=int,
                        help="part 3: conversation A's system text (1950; --quick 950)")
    parser.add_argument("--idle", type=float, default=3.0,
                        help="part 3: seconds the GPU child must be idle before turn 2 (its "
                        "rewarm done)")
    parser.add_argument("--baseline", default=BASELINE, help="part 4's git revision")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--name", help="the results' file name in bench/results (failback, "
                        "failback-quick, with -throttled under --cpu-throttle)")
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
    defaults = {"rounds": (3, 1), "long": (1200, 400), "short": (200, 100),
                "slow_restart": (10.0, 4.0), "prefix_words": (1950, 950)}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    info = machine()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        folder = args.keep or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="failback-bench-")))
        global CACHE_PROMPT
        CACHE_PROMPT = not args.no_cache_prompt
        if args.cpu_throttle is not None:
            global THROTTLE
            on_ms, off_ms = (int(x) for x in args.cpu_throttle.split(":"))
            THROTTLE = (on_ms, off_ms, throttle_wrapper(folder))
        data = asyncio.run(run(args, folder))
    info["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    data.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=info,
                run_time_s=round(time.monotonic() - started, 1),
                args=vars(args) | {"report": None, "keep": None})
    text_ = report(data)
    print(text_)
    if not args.no_write:
        name = args.name or ("failback-quick" if args.quick else "failback") + (
            "-throttled" if args.cpu_throttle else "")
        out = REPO / "bench" / "results"
        (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        (out / f"{name}.md").write_text(text_ + "\n")


if __name__ == "__main__":
    main()
