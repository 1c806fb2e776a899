"""The warm CPU child against real llama-server children (the tiny model): a conversation the
GPU child served is mirrored to the CPU child in its idle time, so that its next turn, failed
over while the GPU child is down, finds its prefix in the CPU child's cache (timings.cache_n),
where a cold CPU child prefills it all. (A mirror cancelled by real work: tests/test_mirror.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import Spillway, eventually, real_config
from prometheus_client.parser import text_string_to_metric_families

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]
WORDS = ("the model reads a long document about memory and servers while the gpu holds "
         "every layer and the cpu waits ").split()


def long_system(n_words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


def config(llama_server: Path, tiny_model: Path, mirror: bool) -> dict[str, Any]:
    return real_config(llama_server, tiny_model,
                       model={"args": ["-c", "8192", "-np", "1", "-t", "1", "-tb", "1"]},
                       cpu={"mirror": mirror})


def turn(s: Spillway, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    code, body = s.post("/v1/chat/completions", {"messages": messages, "max_tokens": 8,
                                                 "temperature": 0, **extra})
    assert code == 200, body
    return dict(body)


def conversation_fails_over(s: Spillway) -> tuple[dict[str, Any], int]:
    """Turn 1 on the GPU child, then the GPU child paused (drained, stopped), then turn 2:
    the CPU child's answer, and turn 1's prompt tokens (the prefix turn 2 shares)."""
    first = [{"role": "system", "content": long_system(900)},
             {"role": "user", "content": "summarise the document"}]
    one = turn(s, first)
    prefix = one["usage"]["prompt_tokens"]
    return one, prefix


def second_turn(s: Spillway, one: dict[str, Any]) -> dict[str, Any]:
    messages = [{"role": "system", "content": long_system(900)},
                {"role": "user", "content": "summarise the document"},
                {"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                {"role": "user", "content": "and the gpu"}]
    return turn(s, messages)


def pause_gpu(s: Spillway) -> None:
    code, body = s.post("/spillway/gpu/pause", {})
    assert code == 200, body
    assert eventually(lambda: s.child("gpu")["state"] == "STOPPED")


def test_a_failed_over_turn_finds_its_prefix_in_the_warm_cpu_childs_cache(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(config(llama_server, tiny_model, mirror=True))
    one, prefix = conversation_fails_over(s)
    assert prefix > 1000
    assert eventually(lambda: (s.status()["mirror"] or {}).get("mirrored", 0) >= 1)
    mirror = s.status()["mirror"]
    assert mirror["warm_prefixes"] == 1 and mirror["warm_tokens"] >= prefix
    assert mirror["budget_used_s"] > 0
    caches = s.status()["caches"]  # the queue (emptied) and what the CPU child holds
    assert caches["mirror_queue"]["entries"] == 0 and caches["mirror_queue"]["bytes"] == 0
    assert caches["mirror_queue"]["max_bytes"] == 8 * 1024 * 1024
    assert caches["mirror_warm"]["entries"] == 1
    code, text = s.get("/spillway/metrics")
    assert code == 200
    found = {(m.name, tuple(sorted(sample.labels.items()))): sample.value
             for m in text_string_to_metric_families(text) for sample in m.samples}
    assert found[("spillway_mirrors", (("outcome", "mirrored"),))] >= 1
    assert found[("spillway_mirror_warm_tokens", ())] >= prefix
    pause_gpu(s)
    two = second_turn(s, one)
    assert two["timings"]["cache_n"] >= 0.8 * prefix, two["timings"]
    # The incident-free path still says who answered: the CPU child.
    assert s.child("cpu")["state"] == "READY"


def test_without_the_mirror_the_cpu_child_prefills_it_all(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(config(llama_server, tiny_model, mirror=False))
    one, prefix = conversation_fails_over(s)
    assert s.status()["mirror"]["enabled"] is False
    pause_gpu(s)
    two = second_turn(s, one)
    assert two["timings"]["cache_n"] < 0.1 * prefix, two["timings"]

