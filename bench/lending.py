"""The GPU lent when idle (issue 49): the first token of the request that wakes it, against a
timer's peer (llama-swap's `ttl`, Ollama's `keep_alive`, llama-server's `--sleep-idle-seconds`),
whose next request waits for the model's load.

Real llama-server children serving the embedded SmolLM2-135M-Instruct (no GPU here: the "GPU
child" runs on the CPU with the GPU child's arguments). Each round:

- Spillway: `gpu.idle_release_s` = 3; once the GPU child is lent (STOPPED, `lent.why` idle),
  a streamed request (a prompt of its own, 32 tokens): its time to the first token and who
  answered it (the warm CPU child), and how long after it was sent the GPU child was READY
  again (the wake's load, paid by nobody's answer).
- The reference, in the same run: llama-server started directly with the GPU child's command
  (binary, model, arguments), the same request sent as soon as its /health answers 200, as a
  peer's next request waits: time from its start to the first token.

Mean and p95 (nearest rank) over the rounds, and their ratio. The model is 135M parameters,
loaded in a fraction of a second from the page cache: the peer's figure here is mostly the
prompt's prefill, as Spillway's is. A real model on a real GPU loads in seconds to minutes, so
the peer's figure grows with it, and Spillway's does not (the CPU child's first token).

    .venv/bin/python -m bench.lending [--rounds 5]

Prints the table and writes bench/results/lending.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.real_children import (REPO, chat, fmt, mean, pct, start, stream_turn, text,
                                 wait_for)
from harness import real_config
from supervisor.commands import bootstrap

MODEL_ARGS = ["-c", "2048", "-np", "2", "-t", "1", "-tb", "1"]
GPU_ARGS = ["-ngl", "99"]
MAX_TOKENS = 32


def body(seed: int) -> dict[str, Any]:
    return chat(text(200, seed), "What is it about?", MAX_TOKENS)


async def spillway_round(s: Any, seed: int) -> dict[str, Any]:
    await wait_for(s, lambda st: (st["children"]["gpu"].get("lent") or {}).get("why") == "idle",
                   60, "the GPU child is not lent")
    async with aiohttp.ClientSession() as http:
        sent = time.monotonic()
        turn = await stream_turn(http, s.url, body(seed))
    await wait_for(s, lambda st: st["children"]["gpu"]["state"] == "READY", 120,
                   "the GPU child is not back")
    return {"ttft_s": turn["ttft_s"], "child": turn["child"], "status": turn["status"],
            "gpu_ready_after_s": time.monotonic() - sent}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def peer_round(binary: Path, model: Path, seed: int) -> dict[str, Any]:
    """llama-server started cold and asked at once: what a timer's next request waits for."""
    port = free_port()
    began = time.perf_counter()
    proc = subprocess.Popen([str(binary), "-m", str(model), "--port", str(port), *MODEL_ARGS,
                             *GPU_ARGS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.get(f"{url}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.02)
            loaded = time.perf_counter() - began
            turn = await stream_turn(http, url, body(seed))
    finally:
        proc.terminate()
        proc.wait(30)
    ttft = turn["ttft_s"]
    return {"loaded_s": loaded,
            "ttft_s": None if ttft is None else loaded + ttft, "status": turn["status"]}


async def run(rounds: int, folder: Path) -> dict[str, Any]:
    binary, model = bootstrap.ensure_llama_server(), bootstrap.ensure_model()
    cfg = real_config(binary, model, model={"args": MODEL_ARGS},
                      gpu={"args": GPU_ARGS, "idle_release_s": 3},
                      monitor={"sample_interval_s": 0.5})
    s = await asyncio.to_thread(start, folder, "lending", cfg)
    ours, peers = [], []
    try:
        for n in range(rounds):  # (alternating which goes first)
            pair = [spillway_round(s, 100 + n), peer_round(binary, model, 200 + n)]
            if n % 2:
                pair.reverse()
            first, second = [await one for one in pair]
            ours.append(first if "child" in first else second)
            peers.append(second if "child" in first else first)
            print(f"round {n + 1}: Spillway {fmt(ours[-1]['ttft_s'])} ({ours[-1]['child']}), "
                  f"peer {fmt(peers[-1]['ttft_s'])} (loaded {fmt(peers[-1]['loaded_s'])})",
                  flush=True)
    finally:
        await asyncio.to_thread(s.stop)
    return {"model": model.name, "rounds": rounds, "model_args": MODEL_ARGS,
            "gpu_args": GPU_ARGS, "spillway": ours, "peer": peers}


def report(data: dict[str, Any]) -> str:
    ours = [r["ttft_s"] for r in data["spillway"] if r["ttft_s"] is not None]
    peers = [r["ttft_s"] for r in data["peer"] if r["ttft_s"] is not None]
    woke = [r["gpu_ready_after_s"] for r in data["spillway"]]
    loads = [r["loaded_s"] for r in data["peer"]]
    children = sorted({r["child"] for r in data["spillway"]})
    m_ours, m_peer = mean(ours), mean(peers)
    ratio = m_ours / m_peer if m_ours and m_peer else None
    return "\n".join([
        f"# The first token after the GPU was lent when idle ({data['model']}, "
        f"{data['rounds']} rounds)",
        "",
        "| | mean | p95 |",
        "|---|---|---|",
        f"| Spillway: the request that wakes the lent GPU child, first token (answered by: "
        f"{', '.join(children)}) | {fmt(m_ours)} | {fmt(pct(ours, 0.95))} |",
        f"| peer: llama-server started cold, asked as soon as /health is 200, first token | "
        f"{fmt(m_peer)} | {fmt(pct(peers, 0.95))} |",
        f"| Spillway / peer | {fmt(ratio, 'x')} | |",
        f"| of it, the peer's load (its start to /health 200) | {fmt(mean(loads))} | "
        f"{fmt(pct(loads, 0.95))} |",
        f"| the GPU child READY again after the waking request was sent | {fmt(mean(woke))} | "
        f"{fmt(pct(woke, 0.95))} |",
        "",
        f"The rest of both first tokens is the prompt's prefill on one thread. The peer's load "
        f"here is this model's ({fmt(mean(loads))}, from the page cache); a real model on a GPU "
        "loads in seconds to minutes, which the peer's first token waits for and Spillway's "
        "does not.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spillway-lending-") as tmp:
        data = asyncio.run(run(args.rounds, Path(tmp)))
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "lending.json").write_text(json.dumps(data, indent=1) + "\n")
    text_ = report(data)
    (out / "lending.md").write_text(text_ + "\n")
    print(text_)
    os.sync()


if __name__ == "__main__":
    main()
