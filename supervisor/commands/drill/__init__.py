"""`spillway drill`: the deliberate memory test, against a running Spillway.

Scenarios, in order: (1) a non-streaming request over the GPU's profile; (2) the same streamed;
(3) the client leaves during the failover; (4) several clients during the failure; (5) an agent
whose simulated tool must run exactly once; (6) router mode only: a second model loads on the
GPU router while the first one's requests run there; (7) a stream whose GPU child dies in the
middle of its answer, continued on the CPU child; (8) with a small child ([small]) only: the
small model answers the requests that accept it while the large one reloads; (9) with a
projector (`--mmproj`) only: an image request whose vision encoder takes the last VRAM is
replayed, image and all, on the CPU child; (10) with a warm CPU child (mirroring on) only: a
long conversation's second turn fails over to the CPU child, which holds its first turn, and its
first token comes sooner than a cold conversation's; (11) the GPU child comes back while the
stream its death cut is being answered: the stream waits for it or moves back to it (skipped,
with the figures, where the GPU child is not faster). On a GPU the failure is real (ballast);
without one it is simulated and every result says so. The report (table, JSON, HTML with an
SVG timeline) takes its figures from the daemon's own incident records.

In router mode every request names the drilled model (A: the routers' first, or `--model`),
and the failure is A's instance's on the GPU router; B (the second listed, or
`--second-model`) is the model scenario 6 loads next to it.
"""

from __future__ import annotations

import asyncio
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from ... import __version__
from ..remote import Target
from ...config.schema import SMALL_CHILD
from ...records.timefmt import rfc3339
from . import provoke, report
from .client import DrillClient, model_info, state_of
from .scenarios import Drill, ScenarioResult, judge

ALL = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)


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


def pick_models(status: dict[str, Any], model: str | None,
                second: str | None) -> tuple[str | None, str | None]:
    """(A, B): the drilled model and the one scenario 6 loads next to it; (None, None) in
    single-model mode. B is None when the routers list only A."""
    if not status.get("router"):
        if model is not None or second is not None:
            raise RuntimeError("--model and --second-model are for router mode; this Spillway "
                               "serves one model")
        return None, None
    names = [str(n) for n in status.get("models") or []]
    for name in (model, second):
        if name is not None and name not in names:
            raise RuntimeError(f"no model {name!r} on the routers (they list: "
                               f"{', '.join(names) or 'none'})")
    a = model or (names[0] if names else None)
    if a is None:
        raise RuntimeError("the routers list no model: put a GGUF file in the models folder")
    if second == a:
        raise RuntimeError("--second-model must be another model than --model")
    return a, second or next((n for n in names if n != a), None)


async def _loaded_on_gpu(client: DrillClient, model: str) -> dict[str, Any]:
    """Router mode: A loaded on the GPU router (loaded now when it is not), its slot context
    known; the status then."""
    if not await client.wait_state("gpu", ("READY",), 120):
        raise RuntimeError("the GPU router is not ready; the drill needs it up")
    if state_of(await client.status(), "gpu", model) == "STOPPED":
        code, text = await client.post("/models/load", {"model": model})
        if code != 200:
            raise RuntimeError(f"could not load model {model} on the GPU router: {code} "
                               f"{text[:200]}")
    if not await client.wait_state("gpu", ("READY",), 120, model):
        raise RuntimeError(f"model {model} is not ready on the GPU router; the drill needs it "
                           "loaded there")
    deadline = time.monotonic() + 10
    while True:
        status = await client.status()
        if model_info(status, "gpu", model).get("ctx_per_slot") or \
                time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.1)


def _slot_context(status: dict[str, Any], model: str | None) -> int:
    """The smallest slot context of the children (router mode: of A on each router)."""
    sources = status["children"].values() if model is None else \
        [model_info(status, name, model) for name in status["children"]]
    return min(filter(None, (c.get("ctx_per_slot") for c in sources)), default=1024)


def _lane_states(status: dict[str, Any], models: list[str]) -> dict[str, str | None]:
    """Each model's state on each router as the drill begins (the timeline's first states)."""
    return {f"{child}/{m}": state_of(status, child, m) for m in models
            for child in status["children"]}


async def _scenarios(drill: Drill, only: tuple[int, ...]) -> list[ScenarioResult]:
    steps = {1: drill.non_streaming, 2: drill.streaming, 3: drill.cancellation,
             4: drill.concurrent, 5: drill.agent, 6: drill.second_model,
             7: drill.continued_stream, 8: drill.smaller_model, 9: drill.image_request,
             10: drill.long_conversation, 11: drill.gpu_returns}
    results: list[ScenarioResult] = []
    try:
        for number in ALL:
            if number in only:
                results.append(await steps[number]())
    finally:
        await drill.provoker.close()
    return results


async def run(target: Target, how: str = "auto", only: tuple[int, ...] = ALL,
              prompt_tokens: int | None = None, model_path: str | None = None,
              binary: str | None = None, model: str | None = None,
              second_model: str | None = None) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = DrillClient(target, session)
        status = await client.status()
        client.model, second = pick_models(status, model, second_model)
        if client.model is not None:
            status = await _loaded_on_gpu(client, client.model)
            model_path = model_path or model_info(status, "gpu", client.model).get("file")
        await client.begin()  # the daemon's drill window: arming answers only inside it
        try:
            return await _drill(client, status, how, only, prompt_tokens, model_path, binary,
                                second)
        finally:
            await client.end()


async def _drill(client: DrillClient, status: dict[str, Any], how: str, only: tuple[int, ...],
                 prompt_tokens: int | None, model_path: str | None, binary: str | None,
                 second: str | None) -> dict[str, Any]:
    """The drill inside its window: the scenarios, their verdicts and the report's data."""
    provoker = await provoke.choose(client, status, how, model_path, binary)
    if SMALL_CHILD in status.get("children", {}):
        client.fallback = "none"  # a smaller model's answer only where scenario 8 asks for it
    gpu = status.get("gpu")
    say(f"spillway drill against {client.target.url}: {provoker.description}")
    if client.model is not None:
        say(f"router mode: every request is for model {client.model}"
            f"{f'; the second model is {second}' if second else ''}")
    if provoker.simulated:
        say("no GPU failure will be real: every result below is labelled SIMULATED")
    # A prompt long enough to be "over the profile", yet one the CPU child can take.
    ctx = _slot_context(status, client.model)
    tokens = prompt_tokens or max(32, min(int(ctx * 0.6), 24000))
    drill = Drill(client, provoker, say, tokens, second_model=second)
    if not await client.wait_state("gpu", ("READY",), 120, client.model):
        raise RuntimeError("the GPU child is not ready; the drill needs it up")
    started = time.time()
    drilled = [m for m in (client.model, second) if m is not None]
    initial = _lane_states(await client.status(), drilled) if drilled else {}
    results = await _scenarios(drill, only)
    await drill.attach_incidents([r for r in results if r.skipped is None])
    for r in results:
        if r.skipped is None:
            judge(r)  # (11 may find it ran and could not show what it is for: skipped)
        if r.skipped is not None:
            say(f"  [{r.number}] SKIPPED: {r.skipped}")
            continue
        say(f"  [{r.number}] {'PASS' if r.passed else 'FAIL'}: {r.verdict}")
    ran = [r for r in results if r.skipped is None]
    ended = time.time()
    timeline = await client.get(f"/spillway/timeline?since={started - 600:.3f}")
    return {
        "spillway": status.get("version", __version__),
        "url": client.target.url,
        "date": rfc3339(started),
        "mode": "simulated (no GPU)" if provoker.simulated else "real GPU",
        "simulated": provoker.simulated,
        "provoked_by": provoker.description,
        "prompt_tokens": tokens,
        # The CPU child's one answer before the scenarios, where Spillway knew no speed of its
        # (Drill.speeds_known); None when it knew one.
        "cpu_speed_learned": drill.learned,
        "router": client.model is not None,
        "model": client.model,
        "second_model": second,
        "machine": {"host": socket.gethostname(), "cpu": _cpu_name(),
                    "gpu": f"{gpu['name']} ({gpu['total_mib']} MiB)" if gpu else
                    f"none ({status.get('gpu_note')})"},
        "passed": all(r.passed for r in ran),
        "scenarios": [r.to_json() for r in ran],
        "skipped": [r.skip_json() for r in results if r.skipped is not None],
        "timeline": {"start": started, "end": ended, "events": timeline["events"],
                     "models": drilled, "initial": initial,
                     "children": list(status.get("children", {}))},
    }


def write(result: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stamp = result["date"][:19].replace(":", "").replace("-", "")
    json_path = out / f"drill-{stamp}.json"
    html_path = out / f"drill-{stamp}.html"
    report.write_json(result, json_path)
    report.write_html(result, html_path)
    return json_path, html_path
