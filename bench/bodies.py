"""What a large request body costs in memory: a Spillway daemon's peak RSS growth per byte of
the bodies in flight, under a flood of concurrent chat requests each carrying a multi-MB
base64 image.

Real llama-server children (the tests' tiny model and its tiny projector, tests/tinymm.py: 16
tokens an image, whatever its size), `failover.max_held_mib = 0` (no bound: every body of the
flood is held at once, none refused). Each round and each side starts a fresh daemon (the
allocator keeps what a flood freed, so a second flood on the same daemon would cost less and
say nothing), warms it with one small image, then sends REQUESTS chat requests at once, each
an IMAGE-MiB noise PNG as a data URI (`max_tokens` 1), samples the daemon's RSS every 5 ms in
a thread, and divides the peak's growth over the RSS before the flood by the bytes of the
bodies sent. 1.0 is one copy of each body; the rest is the bodies' other copies (their parsed
JSON, what is being sent to a child) and what the flood's requests cost beyond their bodies.
`--baseline REV` measures Spillway at that git revision too, in the same run, the sides
alternating round by round.

Each is measured twice: with glibc's malloc as it comes (what an operator sees: its mmap
threshold rises once a large block is freed, so later large blocks come from the heap, and what
the transient copies took stays in RSS as free heap, by chance of their order), and with
`MALLOC_MMAP_THRESHOLD_=131072` (every block over 128 KiB mapped and given back when freed: the
peak is then the copies alive at once, and steady from round to round).

    .venv/bin/python -m bench.bodies [--requests 8] [--image-mib 4] [--rounds 3]
        [--baseline REV]

Prints a table; writes bench/results/bodies.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.__main__ import REPO, Stack, baseline_code, machine, say, short_rev
from harness import real_config
from tinymm import b64, png_bytes, write_tiny_projector
from tinymodel import write_tiny_model

from supervisor.commands import bootstrap

MIB = 1024 * 1024
CHAT = "/v1/chat/completions"
ALLOCATORS: dict[str, dict[str, str]] = {
    "glibc": {},
    "mmap 128 KiB": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
}
TINY_N_EMBD = 256  # the tests' tiny model (tests/conftest.py), which its projector must match


class PeakRss:
    """A process's resident memory, sampled every 5 ms in a thread until stopped."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.before = self.proc.memory_info().rss
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.proc.memory_info().rss)
            if self._stop.wait(0.005):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def image_body(seed: int, image_mib: float, text: str) -> bytes:
    """A chat request with one noise PNG of about `image_mib` MiB of base64."""
    side = int((image_mib * MIB * 3 / 4 / 3) ** 0.5)  # RGB noise barely compresses
    url = f"data:image/png;base64,{b64(png_bytes(side, side, seed))}"
    return json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 1}).encode()


async def flood(url: str, bodies: list[bytes]) -> list[int]:
    async def one(http: aiohttp.ClientSession, data: bytes) -> int:
        async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        return await asyncio.gather(*(one(http, b) for b in bodies))


def config(binary: Path, model: Path, projector: Path) -> dict[str, Any]:
    cfg = real_config(binary, model, failover={"max_held_mib": 0},
                      queue={"max_waiting": 256})
    cfg["model"]["args"] = [*cfg["model"]["args"], "--mmproj", str(projector)]
    return cfg


def one_round(st: Stack, name: str, cfg: dict[str, Any], code: Path | None,
              env: dict[str, str], bodies: list[bytes], warm: bytes) -> dict[str, Any]:
    """A fresh daemon, warmed, flooded once: its RSS before and at the peak."""
    s = st.spillway(name, cfg, code=code, env=env)
    try:
        assert s.proc is not None
        statuses = asyncio.run(flood(f"{s.url}{CHAT}", [warm]))
        assert statuses == [200], statuses
        with PeakRss(s.proc.pid) as rss:
            started = time.monotonic()
            statuses = asyncio.run(flood(f"{s.url}{CHAT}", bodies))
            took = time.monotonic() - started
        assert statuses == [200] * len(bodies), statuses
    finally:
        s.stop()
        st.daemons.remove(s)
    sent = sum(len(b) for b in bodies)
    growth = rss.peak - rss.before
    return {"before_mib": round(rss.before / MIB, 1), "peak_mib": round(rss.peak / MIB, 1),
            "growth_mib": round(growth / MIB, 1), "per_body_byte": round(growth / sent, 2),
            "took_s": round(took, 2)}


def run(requests: int, image_mib: float, rounds: int, baseline: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "machine": machine(), "requests": requests, "rounds": rounds}
    binary = bootstrap.ensure_llama_server()
    bodies = [image_body(700 + i, image_mib, f"picture {i}") for i in range(requests)]
    out["body_mib"] = round(len(bodies[0]) / MIB, 2)
    out["in_flight_mib"] = round(sum(len(b) for b in bodies) / MIB, 1)
    warm = image_body(699, 0.01, "warm")
    with Stack() as st:
        model = write_tiny_model(st.tmp / "tiny.gguf", n_embd=TINY_N_EMBD)
        projector = write_tiny_projector(st.tmp / "tiny-mmproj.gguf", n_embd_text=TINY_N_EMBD)
        cfg = config(binary, model, projector)
        sides: dict[str, Path | None] = {"current": None}
        if baseline:
            out["baseline_rev"] = short_rev(baseline)
            sides = {"baseline": baseline_code(baseline), **sides}
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            alloc: {name: [] for name in sides} for alloc in ALLOCATORS}
        names = list(sides)
        for k in range(rounds):
            for alloc, env in ALLOCATORS.items():
                for name in names[k % len(names):] + names[:k % len(names)]:
                    r = one_round(st, f"bodies-{name}-{k}-{'mmap' if env else 'glibc'}", cfg,
                                  sides[name], env, bodies, warm)
                    runs[alloc][name].append(r)
                    say(f"  round {k + 1}, {alloc}: {name:8s} +{r['growth_mib']:.1f} MiB for "
                        f"{out['in_flight_mib']:.1f} MiB of bodies: {r['per_body_byte']:.2f} "
                        f"bytes of RSS per body byte ({r['took_s']:.1f} s)")
    out["runs"] = runs
    out["per_body_byte"] = {
        alloc: {name: statistics.median(r["per_body_byte"] for r in rs)
                for name, rs in by_side.items()} for alloc, by_side in runs.items()}
    return out


def table(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [f"Large bodies' memory, {r['date']}: {m['cpu']}, {m['cores']} cores, "
             f"Python {m['python']}", "",
             f"Peak RSS growth of the daemon per byte of the bodies in flight ({r['requests']} "
             f"chat requests at once, each a {r['body_mib']:.2f} MiB body with one base64 PNG, "
             f"{r['in_flight_mib']:.1f} MiB in all; a fresh daemon a round; median of "
             f"{r['rounds']} rounds):", "",
             "| malloc | Spillway | RSS per body byte | growth, MiB (each round) |",
             "|---|---|---|---|"]
    for alloc, by_side in r["runs"].items():
        for name, rs in by_side.items():
            label = f"baseline {r['baseline_rev']}" if name == "baseline" else name
            lines.append(f"| {alloc} | {label} | {r['per_body_byte'][alloc][name]:.2f} | "
                         f"{', '.join(format(x['growth_mib'], '.1f') for x in rs)} |")
    if "baseline" in r["runs"]["glibc"]:
        lines.append("")
        for alloc, figures in r["per_body_byte"].items():
            lines.append(f"current / baseline, {alloc}: "
                         f"{figures['current'] / figures['baseline']:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--image-mib", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", metavar="REV")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    result = run(args.requests, args.image_mib, args.rounds, args.baseline)
    text = table(result)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bodies.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "bodies.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
