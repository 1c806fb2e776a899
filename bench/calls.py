"""The hot path's work per request, counted: Python function calls and profiled time per chat
request through Spillway, this tree against a baseline revision, each daemon run under
cProfile in front of the instant upstream (bench/instant-upstream.sh).

    .venv/bin/python -m bench.calls [--baseline REV] [--seconds 10]

Why beside `python -m bench --only hotpath`: on a shared two-core machine two daemons of the
same code differ by up to 12% in req/s (interleaved rounds do not remove a daemon's own luck:
its port, its hash seed, its core), while the calls a request makes are the same in every run.
Each code runs twice for the same time, idle and loaded (wrk, 16 connections): the loaded
run's figures less the idle run's (its start, its ticks), over the requests answered; the time
is the main thread's busy time (not its wait in epoll). Profiling
slows every call alike: its time is a ratio to read beside the wall-clock one, not a latency.
Writes bench/results/calls.{json,md}."""

from __future__ import annotations

import argparse
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.__main__ import BODY, REPO, baseline_code, instant_config, lua_body, short_rev, wrk
from harness import Spillway
from tinymodel import write_tiny_model

CONNECTIONS = 16
WRAPPER = """#!/bin/sh
shift  # (the harness's own python: cProfile runs the daemon instead)
exec "{python}" -m cProfile -o "$PROF_OUT" "$@"
"""


def run_profiled(folder: Path, name: str, model: Path, code: Path | None, seconds: float,
                 loaded: bool) -> tuple[int, float, int]:
    """(calls, profiled seconds, requests answered) of one daemon's whole life under cProfile,
    `seconds` of it loaded by wrk or idle."""
    wrapper = folder / "profiled-python"
    wrapper.write_text(WRAPPER.format(python=sys.executable))
    wrapper.chmod(0o755)
    out = folder / f"{name}.pstats"
    s = Spillway(folder / name, instant_config(model), command_prefix=[str(wrapper)])
    s.env["PROF_OUT"] = str(out)
    if code is not None:
        s.env["PYTHONPATH"] = str(code)
    s.start()
    requests = 0
    try:
        if loaded:
            with lua_body(BODY) as lua:
                result = wrk(f"{s.url}/v1/chat/completions", CONNECTIONS, seconds, lua)
            assert result["non_2xx"] == 0, result
            requests = int(result["requests"])
        else:
            time.sleep(seconds)
    finally:
        s.stop()
    stats = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
    calls = sum(row[1] for row in stats.values())
    # Busy time: all but the event loop's wait for its sockets (the idle run is mostly that).
    busy = sum(row[2] for (_, _, function), row in stats.items() if "epoll" not in function)
    return calls, busy, requests


def per_request(folder: Path, label: str, model: Path, code: Path | None,
                seconds: float) -> dict[str, Any]:
    idle_calls, idle_s, _ = run_profiled(folder, f"{label}-idle", model, code, seconds, False)
    calls, took_s, requests = run_profiled(folder, f"{label}-loaded", model, code, seconds, True)
    return {"requests": requests,
            "calls_per_request": round((calls - idle_calls) / requests, 1),
            "profiled_us_per_request": round((took_s - idle_s) / requests * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="cd2a268")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="spillway-bench-calls-"))
    model = write_tiny_model(folder / "tiny.gguf")
    rev = short_rev(args.baseline)
    codes: dict[str, Path | None] = {f"baseline {rev}": baseline_code(args.baseline),
                                     "this tree": None}
    results = {label: per_request(folder, label.split()[0], model, code, args.seconds)
               for label, code in codes.items()}
    base, now = results[f"baseline {rev}"], results["this tree"]
    ratios = {k: round(now[k] / base[k], 3) for k in ("calls_per_request",
                                                      "profiled_us_per_request")}
    data = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "connections": CONNECTIONS, "seconds": args.seconds, "results": results,
            "ratios": ratios}
    lines = [f"# The hot path's work per request, counted ({data['date']})", "",
             f"POST /v1/chat/completions, the instant upstream, wrk with {CONNECTIONS} "
             f"connections for {args.seconds:g} s, each daemon under cProfile (less an idle run "
             "of the same length).", "",
             "| code | requests | Python calls a request | profiled time a request |",
             "|---|---|---|---|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['requests']} | {r['calls_per_request']} | "
                     f"{r['profiled_us_per_request']} us |")
    lines += ["", f"This tree against {rev}: calls {ratios['calls_per_request']}x, profiled "
                  f"time {ratios['profiled_us_per_request']}x."]
    text = "\n".join(lines)
    print(text)
    out = REPO / "bench" / "results"
    (out / "calls.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "calls.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
