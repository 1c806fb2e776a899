"""The outage ends when the GPU child is back (issue 48), against real llama-server children
serving the embedded SmolLM2-135M-Instruct: a request caught by a GPU death goes where it is
expected to finish first, the CPU child now or the GPU child once it is back (`waited`); a
stream the CPU child answers while the GPU child was down moves back to it once it is READY
(`failed_back`).

The children are set up as in test_earliest_finish_integration.py (no GPU here: the "GPU child"
is given a GPU's advantage in prefill by a large batch, the CPU child prefills one token at a
time), so a long prompt's prefill is what makes the GPU child sooner."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from harness import Spillway, eventually
from test_earliest_finish_integration import ask, config, pause_gpu, resume_gpu, slowed_cpu, text

from conftest import SpillwayFactory
from supervisor.commands import bootstrap

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return bootstrap.ensure_model()


def learn_speeds(s: Spillway) -> None:
    """Each child's speeds, as Spillway learns them from its answers' timings."""
    pause_gpu(s)
    assert [ask(s, 250, seed)[0] for seed in (1, 2)] == ["cpu", "cpu"]
    resume_gpu(s)
    assert [ask(s, 250, seed)[0] for seed in (3, 4)] == ["gpu", "gpu"]


def kill_gpu_when_busy(s: Spillway, events: list[Any] | None = None, after: int = 0) -> int:
    """SIGKILL the GPU child once it works on a request (or once `events` holds `after`)."""
    pid = s.child("gpu")["pid"]
    if events is None:
        # (Its prefill takes seconds: in flight is in its prefill.)
        assert eventually(lambda: s.child("gpu")["busy"] >= 1, timeout=30)
    else:
        assert eventually(lambda: len(events) >= after, timeout=60)
    os.kill(pid, signal.SIGKILL)
    return pid


def stream(s: Spillway, body: dict[str, Any], events: list[Any]) -> tuple[str, dict[str, str]]:
    """A streamed chat answer through Spillway: its whole text, its headers; `events` gets
    each content event's text as it comes."""
    req = urllib.request.Request(f"{s.url}/v1/chat/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=300) as r:
        headers = dict(r.headers)
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    out.append(piece)
                    events.append(piece)
    return "".join(out), headers


def test_a_long_prompt_caught_by_a_gpu_death_waits_for_its_return(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, throttled: Path) -> None:
    s = spillway(slowed_cpu(config(llama_server, smollm2), llama_server, throttled))
    learn_speeds(s)
    answers: list[tuple[str, float, Any]] = []
    asking = threading.Thread(target=lambda: answers.append(ask(s, 1500, 5)))
    asking.start()
    pid = kill_gpu_when_busy(s)
    asking.join(timeout=300)
    [(child, _, headers)] = answers
    assert child == "gpu", s.log_tail()
    assert s.child("gpu")["pid"] != pid  # the GPU child after its restart
    assert headers["X-Spillway-Attempts"] == "2"
    [record] = s.wait_incidents(1)
    assert (record["decision"], record["replay_child"]) == ("waited", "gpu"), record
    assert "waiting for the GPU child" in record["reason"]
    assert record["forecast_s"] > 0 and record["took_s"] > 0, record


def test_without_waiting_the_same_prompt_is_replayed_on_the_cpu_child(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path) -> None:
    cfg = config(llama_server, smollm2)
    cfg["failover"] = {"wait_for_gpu": False}
    s = spillway(cfg)
    learn_speeds(s)
    answers: list[tuple[str, float, Any]] = []
    asking = threading.Thread(target=lambda: answers.append(ask(s, 1500, 5)))
    asking.start()
    kill_gpu_when_busy(s)
    asking.join(timeout=300)
    [(child, _, _)] = answers
    assert child == "cpu"
    [record] = s.wait_incidents(1)
    assert (record["decision"], record["replay_child"]) == ("replayed", "cpu"), record
    assert record["forecast_s"] is not None, record


def own_continuation(s: Spillway, body: dict[str, Any], text: str, tokens: int) -> str:
    """What llama-server adds to `text` (`tokens` of the answer) as the answer's start, asked
    of the GPU child (READY, so the first choice) in one request of the client's own."""
    asked = {**body, "messages": [*body["messages"], {"role": "assistant", "content": text}],
             "continue_final_message": True, "add_generation_prompt": False,
             "max_tokens": body["max_tokens"] - tokens, "stream": False}
    req = urllib.request.Request(f"{s.url}/v1/chat/completions", data=json.dumps(asked).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["X-Spillway-Child"] == "gpu"
        whole = str(json.loads(r.read())["choices"][0]["message"]["content"])
    # (A whole answer's message holds the assistant's start too.)
    assert whole.startswith(text)
    return whole[len(text):]


def greedy(words: int, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": f"7: {text(words, 7)}"},
                         {"role": "user", "content": "Go on about it at length."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            # Each answer computed from its first token, as the uncut one is (a cached prefix
            # is computed in other batches: its greedy answer may differ from the first).
            "cache_prompt": False}


def test_a_long_prompts_stream_cut_by_a_gpu_death_waits_for_its_return_byte_identical(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, throttled: Path) -> None:
    s = spillway(slowed_cpu(config(llama_server, smollm2), llama_server, throttled))
    learn_speeds(s)
    body = greedy(1500, 60)
    uncut, _ = stream(s, body, [])  # on the GPU child, whole
    events: list[str] = []
    got: list[tuple[str, dict[str, str]]] = []
    reading = threading.Thread(target=lambda: got.append(stream(s, body, events)))
    reading.start()
    kill_gpu_when_busy(s, events, after=10)
    reading.join(timeout=300)
    [(whole, headers)] = got
    assert whole == uncut, (len(whole), len(uncut))
    [record] = s.wait_incidents(1)
    assert (record["decision"], record["replay_child"]) == ("waited", "gpu"), record
    assert record["tokens_before"] >= 10


def test_a_stream_continued_on_the_cpu_child_fails_back_to_the_gpu_child_once_ready(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, throttled: Path) -> None:
    """The GPU child dies in a long answer; the CPU child continues it (waiting is off here,
    so the continuation goes there whatever the forecasts say); once the GPU child is READY,
    the rest is sooner there (the CPU child runs at a third of its speed:
    tests/throttled_llama_server), and the answer moves back to it: one stream, the whole
    greedy answer, byte for byte."""
    cfg = config(llama_server, smollm2)
    # Both compute alike (the same arguments); the CPU child is slowed down.
    args = ["-t", "1", "-tb", "1"]
    cfg["gpu"] = {"args": ["-ngl", "99", *args]}
    cfg["cpu"] = {**cfg["cpu"], "args": ["--device", "none", "-ngl", "0", *args],
                  "llama_server": str(throttled),
                  "env": {"REAL_LLAMA_SERVER": str(llama_server)}}
    cfg["failover"] = {"wait_for_gpu": False}
    s = spillway(cfg)
    learn_speeds(s)
    body = greedy(40, 300)
    uncut, _ = stream(s, body, [])  # on the GPU child, whole
    pieces: list[str] = []
    got: list[tuple[str, dict[str, str]]] = []
    reading = threading.Thread(target=lambda: got.append(stream(s, body, pieces)))
    reading.start()
    kill_gpu_when_busy(s, pieces, after=30)
    reading.join(timeout=200)
    assert got, s.log_tail()
    [(whole, _)] = got
    records = s.wait_incidents(2)
    assert [(r["decision"], r["replay_child"]) for r in records] == [
        ("continued", "cpu"), ("failed_back", "gpu")], (records, s.log_tail())
    moved = records[1]
    assert moved["tokens_before"] > records[0]["tokens_before"] >= 30, records
    assert moved["forecast_s"] > 0 and moved["took_s"] > 0, moved
    # The answer is whole: the text before the move, then what llama-server itself continues
    # from that text on the GPU child, byte for byte (nothing lost, nothing said twice). The
    # uncut answer shares it until llama.cpp's batched prefill of the moved text, which rounds
    # otherwise than its token-by-token generation did, lets a greedy choice differ.
    before = "".join(pieces[:moved["tokens_before"]])
    assert whole.startswith(before) and uncut.startswith(before)
    assert whole == before + own_continuation(s, body, before, moved["tokens_before"])
    code, page = s.get("/spillway/metrics")
    assert 'spillway_failbacks_total{result="completed"} 1.0' in page
