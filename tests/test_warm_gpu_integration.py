"""The GPU child warmed again after its restart, against real llama-server children (the tiny
model): the conversations it served before its death, and those the CPU child served while it
was down, are prefilled into the restarted GPU child in its idle time (the mirror's rewarm
lane), so that each one's next turn there finds its prefix in its cache (`timings.cache_n`),
where with `gpu.rewarm = false` the restarted child prefills it all. (The lane's rules and
order against a stand-in child: tests/test_mirror.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from harness import Spillway, eventually, real_config
from prometheus_client.parser import text_string_to_metric_families

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]
WORDS = ("the model reads a long document about memory and servers while the gpu holds "
         "every layer and the cpu waits ").split()


def config(llama_server: Path, tiny_model: Path, **gpu: Any) -> dict[str, Any]:
    # Two slots, one a conversation; the warm CPU child's mirror off: only the rewarm runs.
    return real_config(llama_server, tiny_model,
                       model={"args": ["-c", "4096", "-np", "2", "-t", "1", "-tb", "1"]},
                       gpu=gpu, cpu={"mirror": False})


def system(seed: int) -> dict[str, str]:
    """A long system prompt (some 1,500 tokens), its own from its first words."""
    words = " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(400))
    return {"role": "system", "content": f"conversation {seed}: {words}"}


def turn(s: Spillway, messages: list[dict[str, str]]) -> tuple[str, float, dict[str, Any]]:
    """One streamed turn: the child that answered it, its time to first token, and its text,
    usage and timings (from its last events)."""
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{s.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    began = time.monotonic()
    first: float | None = None
    text, end = "", {}
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        child = r.headers["X-Spillway-Child"]
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.monotonic() - began
                    text += piece
            end.update({k: event[k] for k in ("usage", "timings") if event.get(k)})
    assert first is not None and "timings" in end and "usage" in end, end
    return child, first, {"text": text, **end}


def next_turn(messages: list[dict[str, str]], answer: str, question: str,
              ) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer},
            {"role": "user", "content": question}]


def rewarmed(s: Spillway, count: int) -> dict[str, Any]:
    """The rewarm's status once `count` conversations were sent in all and none waits."""
    def done() -> dict[str, Any] | None:
        lane = s.status()["rewarm"]
        return lane if lane["mirrored"] >= count and not lane["queued"] and \
            not lane["running"] else None

    lane = eventually(done)
    assert lane, (s.status()["rewarm"], s.log_tail())
    return dict(lane)


def kill_gpu(s: Spillway) -> None:
    """SIGKILL the GPU child, as a crash would; back once READY under another pid."""
    pid = s.child("gpu")["pid"]
    os.kill(pid, signal.SIGKILL)
    assert eventually(lambda: (c := s.child("gpu"))["state"] == "READY" and c["pid"] != pid)


def test_a_restarted_gpu_child_is_warmed_with_what_it_and_the_cpu_child_served(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(config(llama_server, tiny_model))
    # Conversation a on the GPU child; the GPU child paused (its process ended), conversation b
    # on the CPU child meanwhile.
    a1 = [system(1), {"role": "user", "content": "summarise the document"}]
    child, _, one = turn(s, a1)
    assert child == "gpu"
    code, body = s.post("/spillway/gpu/pause", {})
    assert code == 200, body
    assert eventually(lambda: s.child("gpu")["state"] == "STOPPED")
    b1 = [system(2), {"role": "user", "content": "what is it about"}]
    child, _, other = turn(s, b1)
    assert child == "cpu"
    lane = s.status()["rewarm"]
    assert (lane["enabled"], lane["kept"], lane["queued"], lane["mirrored"]) == (True, 1, 1, 0)
    # Back: both are prefilled into it, in its idle time, before any turn asks.
    code, body = s.post("/spillway/gpu/resume", {})
    assert code == 200, body
    lane = rewarmed(s, 2)
    assert lane["warm_prefixes"] == 2 and lane["kept"] == 2
    assert lane["warm_tokens"] >= one["usage"]["prompt_tokens"] + other["usage"]["prompt_tokens"]
    caches = s.status()["caches"]
    assert caches["rewarm_queue"]["entries"] == 2 and caches["rewarm_warm"]["entries"] == 2
    a2 = next_turn(a1, one["text"], "and the gpu")
    child, _, two = turn(s, a2)
    assert child == "gpu"
    assert two["timings"]["cache_n"] >= 0.8 * one["usage"]["prompt_tokens"], two["timings"]
    b2 = next_turn(b1, other["text"], "and the cpu")
    child, _, other_two = turn(s, b2)
    assert child == "gpu"
    assert other_two["timings"]["cache_n"] >= 0.8 * other["usage"]["prompt_tokens"], \
        other_two["timings"]
    # Killed now: the turns it answered itself are what it is warmed with this time (the
    # earlier ones, which they hold, are not sent again).
    kill_gpu(s)
    lane = rewarmed(s, 4)
    assert (lane["warm_prefixes"], lane["failed"], lane["skipped"]) == (2, 0, 2)
    child, ttft, three = turn(s, next_turn(a2, two["text"], "and the servers"))
    assert child == "gpu"
    assert three["timings"]["cache_n"] >= 0.8 * two["usage"]["prompt_tokens"], three["timings"]
    code, text = s.get("/spillway/metrics")
    assert code == 200
    found = {(m.name, tuple(sorted(sample.labels.items()))): sample.value
             for m in text_string_to_metric_families(text) for sample in m.samples}
    assert found[("spillway_rewarms", (("outcome", "mirrored"),))] >= 4
    assert found[("spillway_rewarm_warm_tokens", ())] >= two["usage"]["prompt_tokens"]
    print(f"\nwarm: a restarted GPU child's next turn, time to first token {ttft:.3f} s, "
          f"cache_n {three['timings']['cache_n']} of {three['usage']['prompt_tokens']}")


def test_without_the_rewarm_a_restarted_gpu_child_prefills_it_all(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(config(llama_server, tiny_model, rewarm=False))
    a1 = [system(1), {"role": "user", "content": "summarise the document"}]
    child, _, one = turn(s, a1)
    assert child == "gpu"
    kill_gpu(s)
    assert s.status()["rewarm"]["enabled"] is False
    child, ttft, two = turn(s, next_turn(a1, one["text"], "and the gpu"))
    assert child == "gpu"
    assert two["timings"]["cache_n"] < 0.1 * one["usage"]["prompt_tokens"], two["timings"]
    print(f"\ncold: a restarted GPU child's next turn, time to first token {ttft:.3f} s, "
          f"cache_n {two['timings']['cache_n']} of {two['usage']['prompt_tokens']}")
