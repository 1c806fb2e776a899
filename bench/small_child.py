"""The small child through GPU deaths: what it answers while the GPU child is away, and what it
costs while the GPU child serves.

Real llama-server children behind one Spillway: Gemma 3 270M (Q4_K_M) is the "large" model of
the GPU and CPU children, SmolLM2-135M-Instruct (Q4_1) the small child's. There is no GPU on the
machine this was written for: the "GPU child" runs CPU-only too, every child with one thread
(`-t 1 -tb 1`, `-c 2048 -np 2`), so the speeds only show the mechanics. Scenarios, each its
own daemon, one after the other in the same run, for each restart.backoff_initial_s (= its
backoff_max_s) asked for:

- reference: no [small] section at all;
- resident: small.mode = "resident" (loaded at boot beside the GPU child);
- on-demand: small.mode = "on-demand" (started when the GPU child dies, drained and stopped
  before it starts again).

Steady traffic throughout: 2 client loops that send `X-Spillway-Fallback: smaller` ("opted
in") and 1 that does not ("plain"), chat completions of 32 tokens (ignore_eos), temperature 0.
Each round is a fresh daemon (so that every kill starts from the mode's own steady state): the
GPU child serves for `--settle` seconds, is SIGKILLed (its pid from /spillway/status), and the
traffic goes on until `--after` seconds past its return. The outage is from the kill until the
GPU child is READY again (Spillway's timeline). For each request sent during the outage: which
child answered (X-Spillway-Child) and its latency; the time from the kill to the first answer of
the small child (a request sent during the outage, or one in flight on the GPU child that was
rerouted); failures (any non-200, over the whole round). The small child's cost: its RSS in
resident mode (the stand-in for its VRAM on a card); in on-demand mode its start (STARTING to
READY in the timeline, and status last_start_s) and how long the GPU child's start was held for
it (the GPU child's "backoff over; not restart yet" STOPPED to its STARTING), and whether the
small child is started again beside the returning GPU child, and still runs once it serves.

    PYTHONPATH=. /work/main/.venv/bin/python -m bench.small_child [--kills 3]
        [--backoffs 3,0.5] [--settle 8] [--after 6]

Prints the tables and writes bench/results/small-child.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
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

from harness import Spillway, real_config, wait_gone  # noqa: E402

from supervisor.commands import bootstrap  # noqa: E402

SMALLER = {"X-Spillway-Fallback": "smaller"}
TOKENS = 32
PROMPT = "Name three colours and say what each one reminds you of."
ARGS = ["-c", "2048", "-np", "2", "-t", "1", "-tb", "1"]
MODES: tuple[str | None, ...] = (None, "resident", "on-demand")


def label(mode: str | None) -> str:
    return mode or "reference"


def config(binary: Path, large: Path, small: Path, mode: str | None,
           backoff_s: float) -> dict[str, Any]:
    template = list(bootstrap.GEMMA_TEMPLATE_ARGS)  # Gemma's file carries no chat template
    cfg: dict[str, Any] = real_config(binary, large, model={"args": ARGS},
                      restart={"backoff_initial_s": backoff_s, "backoff_max_s": backoff_s})
    cfg["gpu"] = {"args": ["-ngl", "99", *template]}
    cfg["cpu"] = {"args": ["--device", "none", "-ngl", "0", *template], "mode": "hot"}
    if mode is not None:
        cfg["small"] = {"path": str(small), "args": ["-ngl", "99"], "mode": mode,
                        "requests": "opt-in"}
    return cfg


# --- traffic --------------------------------------------------------------------------------------

async def client_loop(http: aiohttp.ClientSession, url: str, opted: bool, n: int,
                      stop: asyncio.Event, out: list[dict[str, Any]]) -> None:
    body = {"messages": [{"role": "user", "content": f"{PROMPT} ({n})"}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    headers = SMALLER if opted else {}
    while not stop.is_set():
        sent, t0 = time.time(), time.perf_counter()
        row: dict[str, Any] = {"opted": opted, "sent": sent}
        try:
            async with http.post(f"{url}/v1/chat/completions", json=body,
                                 headers=headers) as r:
                raw = await r.read()
                row.update(status=r.status, child=r.headers.get("X-Spillway-Child", ""),
                           attempts=r.headers.get("X-Spillway-Attempts"))
                if r.status == 200:
                    row["tokens"] = json.loads(raw).get("usage", {}).get("completion_tokens")
                else:
                    row["error"] = raw[:300].decode(errors="replace")
        except (TimeoutError, aiohttp.ClientError) as e:
            row.update(status=0, child="", error=repr(e))
        row["latency_s"] = time.perf_counter() - t0
        row["done"] = time.time()
        out.append(row)
        if row["status"] != 200:
            await asyncio.sleep(0.2)  # a failure is counted, not hammered


# --- reading the daemon ---------------------------------------------------------------------------

def rss(pid: int | None) -> dict[str, float] | None:
    """VmRSS, RssAnon, RssFile of a process, MiB."""
    if not pid:
        return None
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for key in ("VmRSS", "RssAnon", "RssFile"):
        m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
        if m:
            out[key] = round(int(m.group(1)) / 1024, 1)
    return out


def events_of(timeline: list[dict[str, Any]], child: str) -> list[dict[str, Any]]:
    return [e for e in timeline if e.get("child") == child and "model" not in e]


def first(events: list[dict[str, Any]], state: str, after: float,
          reason: str | None = None) -> float | None:
    for e in events:
        if e["time"] >= after and e["state"] == state and (reason is None or
                                                          reason in e.get("reason", "")):
            return float(e["time"])
    return None


def med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


# --- one round: a fresh daemon, one kill ---------------------------------------------------------

async def wait_for(s: Spillway, check: Any, timeout: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status: dict[str, Any] = await asyncio.to_thread(s.status)
        if check(status["children"]):
            return status
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{what} after {timeout} s\n{s.log_tail()}")


async def one_round(s: Spillway, mode: str | None, settle: float, after: float
                    ) -> dict[str, Any]:
    """Traffic; `settle` s of the GPU child serving; SIGKILL it; traffic until `after` s past
    its return. The requests, the timeline and what the status said."""
    results: list[dict[str, Any]] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        loops = [asyncio.create_task(client_loop(http, s.url, opted, n, stop, results))
                 for n, opted in enumerate((True, False, True))]
        try:
            began = time.time()
            await asyncio.sleep(settle)  # the GPU child serving, its slots warm
            children = (await asyncio.to_thread(s.status))["children"]
            pid = children["gpu"]["pid"]
            memory = {name: rss(c.get("pid")) for name, c in children.items()}
            kill = time.time()
            os.kill(pid, signal.SIGKILL)
            await wait_for(s, lambda c: c["gpu"]["state"] == "READY" and c["gpu"]["pid"] != pid,
                           120, "the GPU child is not back")
            back = time.time()
            # What the small child does once the GPU child serves again (on demand: it should
            # be STOPPED, or stop once drained).
            small_states: list[tuple[float, str]] = []
            while time.time() < back + after:
                c = (await asyncio.to_thread(s.status))["children"]
                if "small" in c:
                    small_states.append((round(time.time() - kill, 2), c["small"]["state"]))
                await asyncio.sleep(0.25)
            children = (await asyncio.to_thread(s.status))["children"]
            memory_after = {name: rss(c.get("pid")) for name, c in children.items()}
            _, timeline = await asyncio.to_thread(s.get, "/spillway/timeline?since=0")
        finally:
            stop.set()
            _, pending = await asyncio.wait(loops, timeout=120)
            for task in pending:
                task.cancel()
    return {"began": began, "kill": kill, "gpu_pid": pid, "memory_before_kill": memory,
            "memory_after": memory_after, "timeline": timeline["events"],
            "status_after": {n: {k: c.get(k) for k in ("state", "last_start_s", "pid")}
                             for n, c in children.items()},
            "small_states_after": small_states, "requests": results}


def judge(r: dict[str, Any], mode: str | None) -> dict[str, Any]:
    """One kill's figures from its timeline and the requests around it."""
    kill, results = r["kill"], r["requests"]
    gpu, small = events_of(r["timeline"], "gpu"), events_of(r["timeline"], "small")
    backoff = first(gpu, "BACKOFF", kill)
    held = first(gpu, "STOPPED", kill, "backoff over")  # on-demand: held for the small child
    starting = first(gpu, "STARTING", kill)
    ready = first(gpu, "READY", kill)
    assert ready is not None and starting is not None, r["timeline"]
    backoff_end = held if held is not None else starting
    small_starting = first(small, "STARTING", kill)
    small_ready = first(small, "READY", kill)
    small_stopped = first(small, "STOPPED", kill)
    # on demand: started again once the GPU child's start was asked for (a waiting request
    # that took it for startable), so loading beside the GPU child
    restarted = first(small, "STARTING", starting)
    during = [q for q in results if kill <= q["sent"] < ready]
    in_flight = [q for q in results if q["sent"] < kill <= q["done"]]
    steady = [q for q in results if q["done"] < kill]
    later = [q for q in results if q["sent"] >= ready]
    # the small child's answers because of the outage: sent during it, or in flight on the
    # GPU child at the kill and rerouted
    by_small = [q["done"] for q in results if q["child"] == "small" and (
        kill <= q["sent"] < ready or (q in in_flight and q.get("attempts") not in (None, "1")))]

    def lat(rows: list[dict[str, Any]], opted: bool, child: str | None = None) -> list[float]:
        return [round(q["latency_s"], 3) for q in rows if q["opted"] == opted
                and q["status"] == 200 and (child is None or q["child"] == child)]

    def counts(rows: list[dict[str, Any]], opted: bool) -> dict[str, int]:
        out: dict[str, int] = {}
        for q in rows:
            if q["opted"] == opted:
                key = q["child"] if q["status"] == 200 else f"failed {q['status']}"
                out[key] = out.get(key, 0) + 1
        return out

    final_small = r["small_states_after"][-1][1] if r["small_states_after"] else None
    return {
        "kill": kill,
        "outage_s": round(ready - kill, 3),
        "backoff_s": round(backoff_end - backoff, 3) if backoff and backoff_end else None,
        # the GPU child's start held for the small child's drain and stop (on demand)
        "held_for_small_s": round(starting - held, 3) if held else 0.0,
        "gpu_load_s": round(ready - starting, 3),
        "small_start_s": round(small_ready - small_starting, 3)
        if small_ready and small_starting and small_ready < ready else None,
        "small_last_start_s": r["status_after"].get("small", {}).get("last_start_s"),
        "small_started_after_kill_s": round(small_starting - kill, 3) if small_starting
        else None,
        "small_ready_after_kill_s": round(small_ready - kill, 3) if small_ready else None,
        "small_stopped_after_kill_s": round(small_stopped - kill, 3) if small_stopped else None,
        "small_restarted_beside_gpu_after_kill_s": round(restarted - kill, 3)
        if restarted and mode == "on-demand" else None,
        "small_state_after": final_small,
        "small_states_after": r["small_states_after"],
        "first_small_answer_after_kill_s": round(min(by_small) - kill, 3) if by_small else None,
        "small_answers": len(by_small),
        # on demand: of them, those of the instance started for the outage (answered before
        # it was drained and stopped for the GPU child), the rest from one started again
        "small_answers_before_stop": sum(1 for d in by_small if small_stopped is None
                                         or d <= small_stopped + 0.05),
        "sent_during_outage": len(during),
        "failed": sum(1 for q in results if q["status"] != 200),
        "requests": len(results),
        "opted_by": counts(during, True), "plain_by": counts(during, False),
        "steady_opted_by": counts(steady, True), "steady_plain_by": counts(steady, False),
        "after_opted_by": counts(later, True), "after_plain_by": counts(later, False),
        # each request sent during the outage: when (s after the kill), who answered, how long
        "outage_requests": [{"sent_s": round(q["sent"] - kill, 3), "opted": q["opted"],
                             "child": q["child"], "status": q["status"],
                             "latency_s": round(q["latency_s"], 3)} for q in during],
        "in_flight_at_kill": [{"opted": q["opted"], "child": q["child"], "status": q["status"],
                               "attempts": q.get("attempts"),
                               "latency_s": round(q["latency_s"], 3)} for q in in_flight],
        "latency_s": {
            "opted_small": lat(during, True, "small"),
            "opted_cpu": lat(during, True, "cpu"),
            "opted_gpu": lat(during, True, "gpu"),
            "opted_all": lat(during, True),
            "plain_cpu": lat(during, False, "cpu"),
            "plain_all": lat(during, False),
            "steady_gpu": lat(steady, True, "gpu") + lat(steady, False, "gpu"),
        },
        "memory_before_kill_mib": r["memory_before_kill"],
        "memory_after_mib": r["memory_after"],
        "errors": [q.get("error") for q in results if q["status"] != 200][:5],
        "timeline": [{"t": round(e["time"] - kill, 3), "child": e["child"],
                      "state": e["state"], "reason": e.get("reason", "")}
                     for e in r["timeline"] if e["time"] >= kill - 0.001],
    }


def summarize(mode: str | None, backoff_s: float, rounds: list[dict[str, Any]],
              logs: list[str]) -> dict[str, Any]:
    pooled = {key: [x for r in rounds for x in r["latency_s"][key]]
              for key in rounds[0]["latency_s"]}

    def total(key: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in rounds:
            for k, v in r[key].items():
                out[k] = out.get(k, 0) + v
        return out

    small_rss = [m for r in rounds if (m := r["memory_before_kill_mib"].get("small"))]
    return {
        "scenario": label(mode), "mode": mode, "backoff_s": backoff_s,
        "kills": len(rounds),
        "requests_total": sum(r["requests"] for r in rounds),
        "failed_total": sum(r["failed"] for r in rounds),
        "median": {
            **{key: med([r[key] for r in rounds]) for key in (
                "outage_s", "backoff_s", "gpu_load_s", "held_for_small_s", "small_start_s",
                "small_last_start_s", "small_ready_after_kill_s",
                "first_small_answer_after_kill_s")},
            **{f"{key}_latency_s": med(v) for key, v in pooled.items()},
        },
        "n": {key: len(v) for key, v in pooled.items()},
        "opted_by": total("opted_by"), "plain_by": total("plain_by"),
        "steady_opted_by": total("steady_opted_by"), "steady_plain_by": total("steady_plain_by"),
        "after_opted_by": total("after_opted_by"), "after_plain_by": total("after_plain_by"),
        "small_answers_per_kill": [r["small_answers"] for r in rounds],
        "small_answers_before_stop_per_kill": [r["small_answers_before_stop"] for r in rounds],
        "small_restarted_beside_gpu": sum(
            1 for r in rounds if r["small_restarted_beside_gpu_after_kill_s"] is not None),
        "small_state_after": [r["small_state_after"] for r in rounds],
        "small_rss_mib": {k: med([m[k] for m in small_rss if k in m])
                          for k in ("VmRSS", "RssAnon", "RssFile")} if small_rss else None,
        "gpu_rss_mib": {k: med([g[k] for r in rounds
                                if (g := r["memory_before_kill_mib"].get("gpu")) and k in g])
                        for k in ("VmRSS", "RssAnon", "RssFile")},
        "log_small_made_way": sum(log.count("[small] stopped: the GPU child starts again")
                                  for log in logs),
        "rounds": rounds,
    }


async def run_scenario(binary: Path, large: Path, small: Path, mode: str | None,
                       backoff_s: float, kills: int, settle: float, after: float,
                       folder: Path) -> dict[str, Any]:
    rounds, logs = [], []
    for k in range(kills):
        name = f"{label(mode)}-{backoff_s:g}s-{k + 1}"
        print(f"--- {name}", flush=True)
        s = Spillway(folder / name, config(binary, large, small, mode, backoff_s))
        try:
            s.start(wait_ready=False)
            s.wait_ready(timeout=180, children=("gpu", "cpu", "small") if mode == "resident"
                         else ("gpu", "cpu"))
            raw = await one_round(s, mode, settle, after)
            rounds.append(judge(raw, mode))
            logs.append(s.log_text())
            r = rounds[-1]
            print(f"    outage {r['outage_s']:.2f} s, opted-in {r['opted_by']}, plain "
                  f"{r['plain_by']}, first small answer {r['first_small_answer_after_kill_s']}"
                  f", held {r['held_for_small_s']}, small after: {r['small_state_after']}, "
                  f"failed {r['failed']}", flush=True)
        finally:
            stop_daemon(s)
    return summarize(mode, backoff_s, rounds, logs)


def stop_daemon(s: Spillway) -> None:
    """The daemon and every child it ran (the pids its status named), by pid."""
    with contextlib.suppress(Exception):
        s.status()  # its children's latest pids
    s.stop()
    left = wait_gone(set(s.known_child_pids), timeout=15)
    for pid in left:  # only our own children, by pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if left:
        print(f"    killed children left behind: {sorted(left)}", flush=True)


# --- report ---------------------------------------------------------------------------------------

def fmt(x: Any, unit: str = " s", digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}{unit}"


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}"


def by(counts: dict[str, int]) -> str:
    order = ["gpu", "small", "cpu"]
    keys = sorted(counts, key=lambda k: (order.index(k) if k in order else 9, k))
    return ", ".join(f"{k} {counts[k]}" for k in keys) or "—"


def report(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = ["# The small child through GPU deaths", "",
             f"{data['date']}: {m['cpu']} ({m['cores']} cores, shared with other engineers' "
             f"test runs; load average {m['load_before']} before, {m['load_after']} after), "
             "no GPU: the \"GPU child\" runs CPU-only as well, so the speeds only show the "
             "mechanics. Large model Gemma 3 270M Q4_K_M (GPU and CPU children), small model "
             f"SmolLM2-135M-Instruct Q4_1; every child `{' '.join(ARGS)}`. Traffic: 2 opted-in "
             "client loops (`X-Spillway-Fallback: smaller`) + 1 plain, chat completions of "
             f"{TOKENS} tokens (ignore_eos), temperature 0. {data['kills']} rounds per "
             f"scenario, each a fresh daemon: {data['settle_s']:g} s of serving, a SIGKILL of "
             f"the GPU child, {data['after_s']:g} s more once it is READY again. Latencies are "
             "medians over the requests sent during the outages (kill to GPU child READY), "
             "pooled over the rounds; the other figures are medians over the rounds. Run time "
             f"{data['run_time_s']:.0f} s.", ""]
    for backoff in data["backoffs"]:
        rows = [x for x in data["scenarios"] if x["backoff_s"] == backoff]
        ref = next((x for x in rows if x["mode"] is None), None)
        rm = ref["median"] if ref else {}
        lines += [f"## restart.backoff_initial_s = {backoff:g} s", "",
                  "During the outages:", "",
                  "| scenario | outage | opted-in answered by | opted-in median | ÷ reference "
                  "| opted-in by small | ÷ reference opted-in | plain answered by | plain "
                  "median (CPU) | ÷ reference | kill → first small answer | failed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in rows:
            md = x["median"]
            lines.append(
                f"| {x['scenario']} | {fmt(md['outage_s'])} | {by(x['opted_by'])} | "
                f"{fmt(md['opted_all_latency_s'])} | "
                f"{ratio(md['opted_all_latency_s'], rm.get('opted_all_latency_s'))} | "
                f"{fmt(md['opted_small_latency_s'])} | "
                f"{ratio(md['opted_small_latency_s'], rm.get('opted_all_latency_s'))} | "
                f"{by(x['plain_by'])} | {fmt(md['plain_cpu_latency_s'])} | "
                f"{ratio(md['plain_cpu_latency_s'], rm.get('plain_cpu_latency_s'))} | "
                f"{fmt(md['first_small_answer_after_kill_s'])} | "
                f"{x['failed_total']} of {x['requests_total']} |")
        lines += ["", "The restart and the small child's cost:", "",
                  "| scenario | GPU back-off | GPU start held for the small child | GPU load | "
                  "small start | small READY after kill | small answers per kill (on demand: "
                  "of them before its stop for the GPU child) | small "
                  "restarted beside the returning GPU child | small child after the GPU "
                  "child's return | small RSS (anon + file) | GPU child RSS |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in rows:
            md = x["median"]
            mem, gmem = x["small_rss_mib"], x["gpu_rss_mib"]
            small = x["mode"] is not None
            before = f" ({x['small_answers_before_stop_per_kill']})"
            lines.append(
                f"| {x['scenario']} | {fmt(md['backoff_s'])} | "
                f"{fmt(md['held_for_small_s']) if x['mode'] == 'on-demand' else '—'} | "
                f"{fmt(md['gpu_load_s'])} | "
                f"{fmt(md['small_start_s']) if x['mode'] == 'on-demand' else '—'} | "
                f"{fmt(md['small_ready_after_kill_s']) if x['mode'] == 'on-demand' else '—'} | "
                f"{x['small_answers_per_kill'] if small else '—'}"
                f"{before if x['mode'] == 'on-demand' else ''} | "
                f"{x['small_restarted_beside_gpu']} of {x['kills']}"
                f"{'' if x['mode'] == 'on-demand' else ' (n/a)'} | "
                f"{', '.join(str(s) for s in x['small_state_after']) if small else '—'} | "
                + (f"{mem['VmRSS']:.0f} MiB ({mem['RssAnon']:.0f} + {mem['RssFile']:.0f})"
                   if mem else "—")
                + (f" | {gmem['VmRSS']:.0f} MiB |" if gmem.get("VmRSS") else " | — |"))
        lines += ["", "Around the outages (the GPU child serving; -np 2 and 3 clients, so one "
                  "request in three finds it full):", "",
                  "| scenario | before the kill: opted-in answered by | plain answered by | "
                  "median answered by the GPU child | after its return: opted-in answered by "
                  "| plain answered by |", "|---|---|---|---|---|---|"]
        for x in rows:
            lines.append(
                f"| {x['scenario']} | {by(x['steady_opted_by'])} | {by(x['steady_plain_by'])} "
                f"| {fmt(x['median']['steady_gpu_latency_s'])} | {by(x['after_opted_by'])} | "
                f"{by(x['after_plain_by'])} |")
        for x in rows:
            for i, r in enumerate(x["rounds"]):
                if not r["failed"]:
                    continue
                where = [f"{'opted-in' if q['opted'] else 'plain'} {q['status']} after "
                         f"{q['latency_s']:.1f} s ({when})"
                         for when, rows in (("in flight at the kill", r["in_flight_at_kill"]),
                                            ("sent during the outage", r["outage_requests"]))
                         for q in rows if q["status"] != 200]
                lines += ["", f"Failed in {x['scenario']} round {i + 1}: {'; '.join(where)}; "
                          f"{' / '.join(e[:230] for e in r['errors'] if e)}"]
        lines.append("")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        m = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = m.group(1).strip() if m else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--backoffs", default="3,0.5",
                        help="restart.backoff_initial_s values, comma-separated")
    parser.add_argument("--modes", default="reference,resident,on-demand")
    parser.add_argument("--settle", type=float, default=8.0,
                        help="seconds of steady serving before each kill")
    parser.add_argument("--after", type=float, default=6.0,
                        help="seconds of traffic once the GPU child is READY again")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--report", type=Path, help="only print (and write the .md of) the "
                        "tables of a results JSON written before")
    parser.add_argument("--keep", type=Path, help="keep the daemons' folders (config, log) "
                        "here instead of a temporary folder")
    args = parser.parse_args()
    if args.report is not None:
        text = report(json.loads(args.report.read_text()))
        print(text)
        if not args.no_write:
            args.report.with_suffix(".md").write_text(text + "\n")
        return
    # SIGTERM ends the run through the finally blocks: every daemon is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    binary = bootstrap.ensure_llama_server()
    large = bootstrap.ensure_gemma()
    small = bootstrap.ensure_model()
    backoffs = [float(x) for x in args.backoffs.split(",")]
    modes = [None if m == "reference" else m for m in args.modes.split(",")]
    info = machine()
    started = time.monotonic()
    scenarios = []
    with tempfile.TemporaryDirectory(prefix="small-bench-") as tmp:
        folder = args.keep or Path(tmp)
        for backoff in backoffs:
            for mode in modes:
                scenarios.append(asyncio.run(run_scenario(
                    binary, large, small, mode, backoff, args.kills, args.settle, args.after,
                    folder)))
    info["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    data = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": info,
            "llama_server": str(binary), "large_model": large.name, "small_model": small.name,
            "args": ARGS, "tokens": TOKENS, "kills": args.kills, "settle_s": args.settle,
            "after_s": args.after,
            "backoffs": backoffs, "run_time_s": round(time.monotonic() - started, 1),
            "scenarios": scenarios}
    text = report(data)
    print(text)
    if not args.no_write:
        out = REPO / "bench" / "results"
        (out / "small-child.json").write_text(json.dumps(data, indent=1) + "\n")
        (out / "small-child.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
