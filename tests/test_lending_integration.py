"""Issue 49: the GPU lent back to the card when idle (gpu.idle_release_s), with real
llama-server children and the tiny model, driven by the real OpenAI client.

Idle for its 5 s while /health (llama-server's, through Spillway) and the status are read every
second, the GPU child is stopped, its process gone, and the status, metrics and incidents say it
is lent; a streamed request then gets its first token from the warm CPU child within 2 s and its
whole answer, while the GPU child starts again and is READY after it."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
from harness import Spillway, eventually, pid_alive, real_config

from test_upgrade import upgrade

from conftest import SpillwayFactory
from supervisor.commands.cli import format_status

pytestmark = pytest.mark.integration

HELLO = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def lent_gauge(s: Spillway) -> dict[str, float]:
    return s.samples("spillway_gpu_lent", "why")


def test_an_idle_gpu_child_is_lent_and_the_next_stream_is_answered_by_the_cpu_child_at_once(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    # The CPU child holds 256 tokens a slot, the GPU child 1024: a longer prompt is the GPU
    # child's alone.
    s = spillway(real_config(llama_server, tiny_model, gpu={"idle_release_s": 5},
                             cpu={"args": ["--device", "none", "-ngl", "0", "-c", "512"]},
                             monitor={"sample_interval_s": 0.5}))
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=120, max_retries=0)
    answer = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    assert answer.headers["X-Spillway-Child"] == "gpu"
    last_request = time.monotonic()
    pid = s.status()["children"]["gpu"]["pid"]

    # Polled every second as a dashboard would: neither keeps it awake.
    stopped_after = None
    while time.monotonic() - last_request < 20:
        assert s.get("/health")[0] == 200
        gpu = s.status()["children"]["gpu"]
        if gpu["state"] == "STOPPED":
            stopped_after = time.monotonic() - last_request
            break
        time.sleep(1.0)
    assert stopped_after is not None and stopped_after <= 10, s.log_tail()
    assert eventually(lambda: not pid_alive(pid))
    status = s.status()
    lent = status["children"]["gpu"]["lent"]
    assert lent["why"] == "idle" and lent["answered_by_cpu"] == 0
    assert (f"  GPU lent (idle) since {lent['since']}" in format_status(status)
            and "the next request wakes it" in format_status(status))
    assert lent_gauge(s) == {"idle": 1.0, "operator": 0.0, "yield": 0.0}
    print(f"lent {stopped_after:.1f} s after the last request")

    # The next request: the CPU child answers it at once, while the GPU child starts.
    began = time.monotonic()
    first_token_s = None
    text = []
    with client.chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": "Tell a story"}],
            max_tokens=48, stream=True) as response:
        assert response.headers["X-Spillway-Child"] == "cpu"
        finish = None
        for chunk in response.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                first_token_s = first_token_s or time.monotonic() - began
                text.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    assert first_token_s is not None and first_token_s <= 2.0, first_token_s
    assert finish in ("length", "stop") and "".join(text)
    print(f"first token from the CPU child {first_token_s:.2f} s after the request")

    assert eventually(lambda: s.status()["children"]["gpu"]["state"] == "READY")
    gpu = s.status()["children"]["gpu"]
    assert "lent" not in gpu and not gpu["paused"] and gpu["pid"] != pid
    assert lent_gauge(s)["idle"] == 0.0
    records = s.wait_incidents(2)
    assert [(r["decision"], r["kind"], r["child"]) for r in records] == [
        ("lent", "lent_idle", "gpu"), ("woken", "lent_idle", "gpu")]
    assert "idle for" in records[0]["reason"]
    # The GPU child answers again.
    again = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    assert again.headers["X-Spillway-Child"] == "gpu"

    # Lent again: a prompt only the GPU child can take waits for it, and is answered.
    assert eventually(lambda: s.status()["children"]["gpu"]["state"] == "STOPPED", 20)
    status, counted = s.post("/tokenize", {"content": "harbour " * 100})
    assert status == 200
    words = int(600 / (len(counted["tokens"]) / 100))  # some 600 tokens: over 256, under 1024
    began = time.monotonic()
    long = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "harbour " * words}], max_tokens=4)
    assert long.headers["X-Spillway-Child"] == "gpu"
    assert long.parse().choices[0].finish_reason == "length"
    print(f"a prompt for the GPU child alone answered {time.monotonic() - began:.1f} s after it "
          "woke it")


def test_an_upgrade_keeps_the_gpu_child_lent_and_the_next_request_wakes_it(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        new_daemons: list[int]) -> None:
    """An upgrade in place while the GPU child is lent when idle: the new daemon adopts the CPU
    child and leaves the GPU child stopped and lent (it does not load the model into the card
    it gave back); the next request wakes it there."""
    s = spillway(real_config(llama_server, tiny_model, gpu={"idle_release_s": 3},
                             monitor={"sample_interval_s": 0.5}))
    assert s.proc is not None
    old_pid = s.proc.pid
    code, _ = s.post("/v1/chat/completions", HELLO)
    assert code == 200
    assert eventually(lambda: "lent" in s.status()["children"]["gpu"], 20)
    since = s.status()["children"]["gpu"]["lent"]["since"]
    cpu_pid = s.status()["children"]["cpu"]["pid"]

    done = upgrade(s)
    assert done.returncode == 0, (done.stdout, done.stderr, s.log_tail())
    new_pid = s.status()["daemon"]["pid"]
    new_daemons.append(new_pid)
    assert new_pid != old_pid and s.proc.wait(60) == 0
    assert eventually(lambda: s.status()["daemon"]["upgrade"]["took_over"])
    time.sleep(2)  # (a start would show by now)
    status = s.status()
    gpu = status["children"]["gpu"]
    assert gpu["state"] == "STOPPED" and gpu["pid"] is None and gpu["paused"]
    assert gpu["lent"]["why"] == "idle" and gpu["lent"]["since"] == since
    assert status["children"]["cpu"]["pid"] == cpu_pid  # adopted: no model reload
    assert f"the gpu child stays lent (idle) since {since}" in s.log_text()

    code, _ = s.post("/v1/chat/completions", HELLO)
    assert code == 200
    assert eventually(lambda: s.status()["children"]["gpu"]["state"] == "READY")
    assert "lent" not in s.status()["children"]["gpu"]
