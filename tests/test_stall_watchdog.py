"""Failures that are not deaths, the stall: a child that stops making progress with work in
flight while its /health still answers (llama.cpp#13085) is ended as a hang, its streams are
continued and its other requests replayed on the other child (fake llama-server children that
get stuck on demand); and a real llama-server stopped with SIGSTOP in the middle of a stream is
caught long before the 120 s /health rule."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from harness import Spillway, fake_config, real_config

from conftest import SpillwayFactory
from supervisor.commands import bootstrap

STALL_S = 2.0


def stream_events(s: Spillway, max_tokens: int, on_event: Any = None) -> tuple[list[str], dict[
        str, str], float]:
    """A streamed chat answer through Spillway, read raw: its data lines, headers, duration."""
    import http.client
    began = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
    body = json.dumps({"messages": [{"role": "user", "content": "count"}],
                       "max_tokens": max_tokens, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    headers = {k: v for k, v in resp.getheaders()}
    events: list[str] = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:])
            if on_event is not None:
                on_event(len(events))
    conn.close()
    return events, headers, time.monotonic() - began


def test_a_stream_stuck_while_health_answers_is_continued_on_the_cpu_child(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_STALL_AFTER_EVENTS": "3"}},
                      restart={"stall_timeout_s": STALL_S, "hang_timeout_s": 120})
    s = spillway(cfg)
    events, headers, took = stream_events(s, max_tokens=10)
    assert headers["X-Spillway-Child"] == "gpu"
    assert events[-1] == "[DONE]"  # one stream, ended properly, from the CPU child
    texts = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
             if json.loads(e).get("choices")]
    assert "".join(texts).startswith("tok0 tok1 tok2 ")
    assert took < STALL_S + 5, took
    [record] = s.wait_incidents(1)
    assert record["kind"] == "hang" and record["child"] == "gpu"
    assert record["evidence"].startswith("no progress for ")
    assert "1 request(s) in flight; last byte" in record["evidence"]
    last = s.wait_state(("gpu",), ("READY",))["children"]["gpu"]["last_exit"]
    assert last["kind"] == "hang" and "/slots unchanged" in last["evidence"]


def test_a_non_streamed_request_on_a_stuck_child_is_replayed(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    # (Not waiting for the GPU child's return: the fake one is back at once and fast, so the
    # replay would wait for it; test_failback_integration covers that.)
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_HANG_AFTER": "1"}},
                      restart={"stall_timeout_s": STALL_S, "hang_timeout_s": 120},
                      failover={"wait_for_gpu": False})
    s = spillway(cfg)
    oa = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=60)

    def ask() -> Any:
        return oa.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)

    assert ask().headers["X-Spillway-Child"] == "gpu"  # the first one answers
    began = time.monotonic()
    answer = ask()  # the second never would
    assert time.monotonic() - began < STALL_S + 5
    assert answer.headers["X-Spillway-Child"] == "cpu"
    assert answer.headers["X-Spillway-Failover"] == "hang"
    assert answer.parse().choices[0].message.content
    [record] = s.wait_incidents(1)
    assert record["kind"] == "hang" and record["decision"] == "replayed"


def test_without_slots_a_silent_non_streamed_answer_is_not_judged(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """--no-slots: a long non-streamed answer sends nothing until it is done, and nothing else
    tells progress: it is let be (the /health rule and the read timeout still apply)."""
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_NO_SLOTS": "1", "FAKE_PROMPT_DELAY_S": "4"}},
                      restart={"stall_timeout_s": 1.0})
    s = spillway(cfg)
    oa = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=60)
    answer = oa.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.headers["X-Spillway-Child"] == "gpu"
    assert "X-Spillway-Failover" not in answer.headers
    assert s.child("gpu")["restarts"] == 0


@pytest.mark.integration
def test_a_real_llama_server_stopped_mid_stream_is_caught_by_the_watchdog(
        spillway: SpillwayFactory, llama_server: Path) -> None:
    """SIGSTOP: no byte, no /slots, no /health either; the stall rule acts within its timeout,
    long before the 120 s /health rule, and the stream goes on from the CPU child."""
    model = bootstrap.ensure_model()
    stall_s = 3.0
    cfg = real_config(llama_server, model, restart={"stall_timeout_s": stall_s,
                                                    "hang_timeout_s": 120})
    s = spillway(cfg)
    gpu_pid = s.child("gpu")["pid"]
    stopped_at: list[float] = []

    def stop_after(n: int) -> None:
        if n == 5 and not stopped_at:
            os.kill(gpu_pid, signal.SIGSTOP)
            stopped_at.append(time.monotonic())

    first_after: list[float] = []
    events, headers, _ = stream_events(
        s, max_tokens=200, on_event=lambda n: stop_after(n) if not stopped_at else (
            first_after.append(time.monotonic()) if not first_after else None))
    try:
        assert stopped_at, "the stream ended before it could be stopped"
        assert events[-1] == "[DONE]"
        assert headers["X-Spillway-Child"] == "gpu"
        detected = first_after[0] - stopped_at[0]
        print(f"SIGSTOP -> first byte from the CPU child: {detected:.2f} s "
              f"(stall_timeout_s {stall_s})")
        assert detected < stall_s + 5
        [record] = s.wait_incidents(1)
        assert record["kind"] == "hang" and "/slots unanswered" in record["evidence"]
        last = s.wait_state(("gpu",), ("READY",))["children"]["gpu"]["last_exit"]
        assert last["kind"] == "hang"
    finally:
        try:
            os.kill(gpu_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
