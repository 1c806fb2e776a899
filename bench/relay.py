"""The stream relay's cost: CPU time of the proxy process per relayed SSE event, Spillway
against a bare streaming aiohttp pass-through (bench/bare_proxy.py with `stream`), in the same
run, interleaved.

The upstream is bench/stream_upstream.py (an aiohttp server posing as llama-server that
streams chunk events one by one, a millisecond apart); the clients read STREAMS streams at
once, each of EVENTS events, and the proxy's CPU time (user + system, from /proc) is divided by
the events relayed. Only the proxy process is counted: the upstream and the clients run in
processes of their own (the clients on the load core). `--baseline REV` measures Spillway at
that git revision too.

    .venv/bin/python -m bench.relay [--rounds 3] [--events 2000] [--streams 8] [--baseline REV]

Prints a table; writes bench/results/relay.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.__main__ import (LOAD_CORE, REPO, Stack, baseline_code, cores, machine, say, settle,
                            short_rev)
from tinymodel import write_tiny_model

UPSTREAM = REPO / "bench" / "stream_upstream.py"


async def _read(session: aiohttp.ClientSession, url: str) -> int:
    body = {"model": "bench", "stream": True, "max_tokens": 100000,
            "messages": [{"role": "user", "content": "hi"}]}
    events = 0
    async with session.post(url, json=body) as r:
        assert r.status == 200, (url, r.status, await r.text())
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                events += 1
    return events


async def _streams(url: str, streams: int) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return sum(await asyncio.gather(*(_read(session, url) for _ in range(streams))))


def cpu_us_per_event(url: str, pid: int, streams: int, events: int) -> float:
    proc = psutil.Process(pid)
    before = sum(proc.cpu_times()[:2])
    relayed = asyncio.run(_streams(url, streams))
    used = sum(proc.cpu_times()[:2]) - before
    assert relayed == streams * events, (url, relayed, streams * events)
    return used / relayed * 1e6


def upstream_script(st: Stack, events: int) -> Path:
    """The streaming upstream as Spillway starts a child: one executable."""
    script = st.tmp / "stream-upstream.sh"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{UPSTREAM}" --events {events} '
                      '"$@"\n')
    script.chmod(0o755)
    return script


def config(model: Path, upstream: Path) -> dict[str, Any]:
    return {"model": {"llama_server": str(upstream), "path": str(model), "args": []},
            "gpu": {"args": [], "max_concurrency": 1024},
            "cpu": {"args": [], "max_concurrency": 1024}, "queue": {"max_waiting": 1024}}


def run(rounds: int, events: int, streams: int, baseline: str | None) -> dict[str, Any]:
    if cores() >= 2:
        os.sched_setaffinity(0, {int(LOAD_CORE)})  # the clients apart from the proxies
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "machine": machine(), "rounds": rounds, "events": events,
                           "streams": streams}
    with Stack() as st:
        model = write_tiny_model(st.tmp / "tiny.gguf")
        upstream = upstream_script(st, events)
        up = st.serve(lambda port: [str(upstream), "--port", str(port)])
        bare = st.serve(lambda port: [sys.executable, str(REPO / "bench" / "bare_proxy.py"),
                                      f"http://127.0.0.1:{up}", str(port), "stream"],
                        health=None)
        targets = {"aiohttp": (f"http://127.0.0.1:{bare}/v1/chat/completions",
                               st.procs[-1].pid)}
        daemons = {"spillway": st.spillway("relay", config(model, upstream))}
        if baseline:
            daemons["baseline"] = st.spillway("relay-baseline", config(model, upstream),
                                              code=baseline_code(baseline))
            out["baseline_rev"] = short_rev(baseline)
        for name, d in daemons.items():
            assert d.proc is not None
            targets[name] = (f"{d.url}/v1/chat/completions", d.proc.pid)
        runs: dict[str, list[float]] = {name: [] for name in targets}
        names = list(targets)
        for k in range(rounds):
            for name in names[k % len(names):] + names[:k % len(names)]:
                url, pid = targets[name]
                cpu_us_per_event(url, pid, 2, events)  # warm up
                settle(pid)
                runs[name].append(cpu_us_per_event(url, pid, streams, events))
                settle(pid)
                say(f"  round {k + 1}: {name:9s} {runs[name][-1]:.2f} µs of CPU per event")
    out["us_per_event"] = {name: round(statistics.median(r), 2) for name, r in runs.items()}
    out["runs"] = {name: [round(v, 2) for v in r] for name, r in runs.items()}
    bare_us = out["us_per_event"]["aiohttp"]
    out["ratio"] = {name: round(v / bare_us, 2) for name, v in out["us_per_event"].items()
                    if name != "aiohttp"}
    return out


def table(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [f"Stream relay, {r['date']}: {m['cpu']}, {m['cores']} cores, Python {m['python']}",
             "",
             f"CPU time of the proxy per relayed SSE event ({r['streams']} streams at once, "
             f"{r['events']} events each, an event a millisecond; median of {r['rounds']} "
             "interleaved rounds):",
             "| proxy | µs per event | against aiohttp | rounds |", "|---|---|---|---|"]
    for name, us in r["us_per_event"].items():
        label = f"baseline {r['baseline_rev']}" if name == "baseline" else name
        ratio = "1.00" if name == "aiohttp" else f"{r['ratio'][name]:.2f}"
        lines.append(f"| {label} | {us:.2f} | {ratio} | "
                     f"{', '.join(f'{v:.1f}' for v in r['runs'][name])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--baseline", metavar="REV")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    result = run(args.rounds, args.events, args.streams, args.baseline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "relay.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (out / "relay.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
