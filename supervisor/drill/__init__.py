"""`spillway drill`: the deliberate memory test, against a running Spillway.

Scenarios, in order: (1) a non-streaming request over the GPU's profile; (2) the same streamed;
(3) the client leaves during the failover; (4) several clients during the failure; (5) an agent
whose simulated tool must run exactly once. On a GPU the failure is real (ballast); without one
it is simulated and every result says so. The report (table, JSON, HTML with an SVG timeline)
takes its figures from the daemon's own incident records.
"""

from __future__ import annotations

import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from .. import __version__
from ..client import Target
from ..timefmt import rfc3339
from . import provoke, report
from .client import DrillClient
from .scenarios import Drill, ScenarioResult, judge

ALL = (1, 2, 3, 4, 5)


def say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


async def run(target: Target, how: str = "auto", only: tuple[int, ...] = ALL,
              prompt_tokens: int | None = None, model_path: str | None = None,
              binary: str | None = None) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = DrillClient(target, session)
        status = await client.status()
        provoker = await provoke.choose(client, status, how, model_path, binary)
        gpu = status.get("gpu")
        say(f"spillway drill against {target.url}: {provoker.description}")
        if provoker.simulated:
            say("no GPU failure will be real: every result below is labelled SIMULATED")
        # A prompt long enough to be "over the profile", yet one the CPU child can take.
        ctx = min(filter(None, (c.get("ctx_per_slot") for c in status["children"].values())),
                  default=1024)
        tokens = prompt_tokens or max(32, min(int(ctx * 0.6), 24000))
        drill = Drill(client, provoker, say, tokens)
        if not await client.wait_state("gpu", ("READY",), 120):
            raise RuntimeError("the GPU child is not ready; the drill needs it up")
        started = time.time()
        steps = {1: drill.non_streaming, 2: drill.streaming, 3: drill.cancellation,
                 4: drill.concurrent, 5: drill.agent}
        results: list[ScenarioResult] = []
        try:
            for number in ALL:
                if number in only:
                    results.append(await steps[number]())
        finally:
            await provoker.close()
        await drill.attach_incidents(results)
        for r in results:
            judge(r)
            say(f"  [{r.number}] {'PASS' if r.passed else 'FAIL'}: {r.verdict}")
        ended = time.time()
        timeline = await client.get(f"/spillway/timeline?since={started - 600:.3f}")
        return {
            "spillway": status.get("version", __version__),
            "url": target.url,
            "date": rfc3339(started),
            "mode": "simulated (no GPU)" if provoker.simulated else "real GPU",
            "simulated": provoker.simulated,
            "provoked_by": provoker.description,
            "prompt_tokens": tokens,
            "machine": {"host": socket.gethostname(), "cpu": _cpu_name(),
                        "gpu": f"{gpu['name']} ({gpu['total_mib']} MiB)" if gpu else
                        f"none ({status.get('gpu_note')})"},
            "passed": all(r.passed for r in results),
            "scenarios": [r.to_json() for r in results],
            "timeline": {"start": started, "end": ended, "events": timeline["events"]},
        }


def write(result: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stamp = result["date"][:19].replace(":", "").replace("-", "")
    json_path = out / f"drill-{stamp}.json"
    html_path = out / f"drill-{stamp}.html"
    report.write_json(result, json_path)
    report.write_html(result, html_path)
    return json_path, html_path
