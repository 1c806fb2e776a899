"""Prompt-cache affinity across machines: what keeping a conversation on one Spillway is worth.

llama-server keeps a slot's KV cache, and a follow-up turn that shares the conversation's
prefix only processes what is new, on the machine that served the earlier turns. Two Spillways
(real llama-server children, the tiny test model, a long first turn) stand in for two machines:
each conversation's first turn goes to A; its follow-up goes to A again (affinity: a balancer
hashing the conversation's header) or to B (none: round robin's worst case). The figure is the
follow-up's time to first token, streamed through Spillway, in the same run.

    .venv/bin/python -m bench.affinity [--conversations 6] [--words 1800]

Prints the table and writes bench/results/affinity.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
from tinymodel import write_tiny_model  # noqa: E402

from supervisor.commands import bootstrap  # noqa: E402

WORDS = ("memory server model request answer token cache card slot queue balance machine "
         "prompt stream replay child router context window fallback").split()


async def ttft(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> float:
    """Seconds to the first SSE data event of a streamed chat completion."""
    began = time.monotonic()
    body = {"messages": messages, "max_tokens": 4, "stream": True, "cache_prompt": True}
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data:"):
                first = time.monotonic() - began
                break
        else:
            raise RuntimeError("no event")
        await r.read()
    return first


async def measure(a: Spillway, b: Spillway, conversations: int, words: int) -> dict[str, Any]:
    rng = random.Random(7)
    out: dict[str, list[float]] = {"first_turn": [], "follow_up_same_machine": [],
                                   "follow_up_other_machine": []}
    async with aiohttp.ClientSession() as http:
        for i in range(conversations):
            for target, key in ((a, "follow_up_same_machine"), (b, "follow_up_other_machine")):
                text = " ".join(rng.choice(WORDS) for _ in range(words))
                history = [{"role": "user", "content": f"conversation {i} {key}: {text}"}]
                out["first_turn"].append(await ttft(http, a.url, history))
                history += [{"role": "assistant", "content": "noted"},
                            {"role": "user", "content": "and one more thing"}]
                out[key].append(await ttft(http, target.url, history))
    return {k: {"median_ms": round(statistics.median(v) * 1000, 1),
                "p90_ms": round(sorted(v)[int(0.9 * (len(v) - 1))] * 1000, 1), "n": len(v)}
            for k, v in out.items()}


def table(result: dict[str, Any], words: int) -> str:
    same = result["follow_up_same_machine"]["median_ms"]
    other = result["follow_up_other_machine"]["median_ms"]
    lines = [f"prompt-cache affinity (two Spillways, tiny model, a first turn of {words} words, "
             "time to first token streamed through Spillway):",
             "| turn | median ms | p90 ms | n |", "|---|---|---|---|"]
    for k, v in result.items():
        lines.append(f"| {k.replace('_', ' ')} | {v['median_ms']} | {v['p90_ms']} | {v['n']} |")
    lines += ["", f"follow-up on another machine / on the same machine: {other / same:.1f}x"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--words", type=int, default=500)
    args = ap.parse_args()
    binary = bootstrap.ensure_llama_server()
    tmp = Path(tempfile.mkdtemp(prefix="spillway-affinity-"))
    model = write_tiny_model(tmp / "tiny.gguf")
    cfg = real_config(binary, model, model={"args": ["-c", "8192", "-np", "2", "-t", "1",
                                                     "-tb", "1"]})
    daemons = [Spillway(tmp / name, cfg) for name in ("a", "b")]
    try:
        for d in daemons:
            d.start()
        result = asyncio.run(measure(daemons[0], daemons[1], args.conversations, args.words))
    finally:
        for d in daemons:
            d.stop()
    text = table(result, args.words)
    print(text)
    out = REPO / "bench" / "results"
    (out / "affinity.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "affinity.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
