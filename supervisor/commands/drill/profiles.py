"""`spillway drill --profiles`: one prompt set on three profiles, side by side.

GPU-resident (all layers on the card), a planned CPU/GPU split (half the layers: offload, not
failover), and the independent CPU child. Each runs as its own llama-server from the config
(the daemon's GPU child is paused meanwhile, when there is a GPU, so the card is free), and is
measured the same way: time to first token, prompt and generation tokens per second as
llama-server reports them, p50/p95 latency, peak VRAM (NVML, by pid) and peak RSS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import time
from typing import Any

import aiohttp
import psutil

from ...config import gguf_meta, llama_args
from .. import tables
from ...upstreams.children import pick_port
from ..remote import Target
from ...config.schema import Config
from ...gpu import MIB, GpuMonitor
from ...gpu.placement import Placement

PROMPTS = [
    ("Explain in one paragraph why a GPU runs out of memory with long prompts.", 64),
    ("Write three short lines about a river.", 48),
    ("List five uses of a home server. " * 12, 64),
    ("Summarise: " + "the supervisor replays the request on the CPU child exactly once. " * 30,
     64),
]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))
    return round(values[k], 3)


async def _one(session: aiohttp.ClientSession, url: str, prompt: str,
               max_tokens: int) -> dict[str, Any]:
    began = time.monotonic()
    first: float | None = None
    timings: dict[str, Any] = {}
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            if first is None:
                first = time.monotonic() - began
            data = json.loads(line[6:])
            if isinstance(data.get("timings"), dict):
                timings = data["timings"]
    return {"ttft": first, "latency": time.monotonic() - began, "timings": timings}


async def _measure(name: str, argv: list[str], env: dict[str, str],
                   monitor: GpuMonitor) -> dict[str, Any]:
    port = pick_port()
    proc = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    peak = {"rss": 0, "vram": 0}
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            with contextlib.suppress(psutil.Error):
                peak["rss"] = max(peak["rss"], psutil.Process(proc.pid).memory_info().rss)
            await monitor.sample_now()
            peak["vram"] = max(peak["vram"], sum(s.process_bytes.get(proc.pid, 0)
                                                 for s in monitor.devices))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    runs: list[dict[str, Any]] = []
    error = None
    try:
        # One connection per request: a llama-server that is still loading answers 503 and
        # closes the connection, which a pool can hand out again just as it closes.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {proc.returncode}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{url}/health") as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError("not ready in 300 s")
                await asyncio.sleep(0.2)
            await _one(session, url, "warm up", 4)
            for prompt, tokens in PROMPTS:
                runs.append(await _one(session, url, prompt, tokens))
    except (RuntimeError, aiohttp.ClientError) as e:
        error = str(e)
    finally:
        done.set()
        await sampler
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            proc.kill()
    ttfts = [r["ttft"] for r in runs if r["ttft"] is not None]
    prompt_tps = [float(r["timings"].get("prompt_per_second", 0)) for r in runs
                  if r["timings"].get("prompt_n", 0) > 8]
    gen_tps = [float(r["timings"].get("predicted_per_second", 0)) for r in runs
               if r["timings"]]
    return {
        "profile": name,
        "args": argv[3:],
        "error": error,
        "ttft_p50_s": _pct(ttfts, 0.5),
        "prompt_tps": round(statistics.mean(prompt_tps), 1) if prompt_tps else None,
        "gen_tps": round(statistics.mean(gen_tps), 1) if gen_tps else None,
        "latency_p50_s": _pct([r["latency"] for r in runs], 0.5),
        "latency_p95_s": _pct([r["latency"] for r in runs], 0.95),
        "peak_vram_mib": round(peak["vram"] / MIB),
        "peak_rss_mib": round(peak["rss"] / MIB),
    }


async def run(cfg: Config, target: Target | None) -> dict[str, Any]:
    try:
        layers = gguf_meta.model_shape(cfg.model.path).n_layer
    except (OSError, gguf_meta.GgufError):
        layers = 16
    monitor = GpuMonitor(0.2)
    placement = Placement(cfg.gpu, lambda: None)
    monitor.chooser = placement.choose
    await monitor.start()
    has_gpu = monitor.available
    paused = False
    if has_gpu and target is not None:
        # The card must be free for the profiles: the daemon's GPU child steps aside.
        from ..remote import call
        with contextlib.suppress(Exception):
            await asyncio.to_thread(call, target, "POST", "/spillway/gpu/pause")
            paused = True
    base = [a for a in cfg.gpu.args]
    for flag in ("-ngl", "-dev"):
        group = llama_args.find_flag(base, flag)
        if group is not None:
            del base[group.index:group.index + len(group.tokens)]
    env = {**os.environ, **placement.env(monitor.devices)}
    head = [cfg.gpu.llama_server, "-m", cfg.model.path]
    profiles = [
        ("GPU-resident (all layers)", [*head, *base, "-ngl", "999"]),
        (f"planned CPU/GPU split ({layers // 2} of {layers} layers)",
         [*head, *base, "-ngl", str(layers // 2)]),
        ("independent CPU child", [cfg.cpu.llama_server, "-m", cfg.model.path, *cfg.cpu.args]),
    ]
    results = []
    try:
        for name, argv in profiles:
            results.append(await _measure(name, argv, env if "CPU" not in name else
                                          {**env, "CUDA_VISIBLE_DEVICES": ""}, monitor))
    finally:
        if paused and target is not None:
            from ..remote import call
            with contextlib.suppress(Exception):
                await asyncio.to_thread(call, target, "POST", "/spillway/gpu/resume")
        await monitor.close()
    note = ("measured on the GPU" if has_gpu else
            "no GPU here: all three profiles ran on the CPU, so they differ only by noise")
    return {"note": note, "prompts": len(PROMPTS), "results": results}


def table(result: dict[str, Any]) -> str:
    rows = [[r["profile"], r["ttft_p50_s"], r["prompt_tps"], r["gen_tps"], r["latency_p50_s"],
             r["latency_p95_s"], r["peak_vram_mib"], r["peak_rss_mib"], r["error"] or ""]
            for r in result["results"]]
    return (f"profiles ({result['note']}):\n" +
            tables.render(["profile", "TTFT p50 s", "prompt tok/s", "gen tok/s",
                           "p50 s", "p95 s", "peak VRAM MiB", "peak RSS MiB", "error"], rows))
