"""Child supervision against the fake child's fault switches: slow start, start timeout, crash,
load OOM, freeze, SIGTERM ignored; and a daemon killed with SIGKILL leaving its children to the
next start, which adopts them."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import aiohttp
import pytest
from harness import fake_config, wait_gone

from conftest import SpillwayFactory

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def transitions(log: str, child: str) -> list[str]:
    """`A -> B` for each state change of `child`, in order, from the daemon's log."""
    out = []
    for line in log.splitlines():
        marker = f"[{child}] "
        if marker in line and " -> " in line and ":" in line.split(" -> ", 1)[1]:
            tail = line.split(marker, 1)[1]
            a, rest = tail.split(" -> ", 1)
            b = rest.split(":", 1)[0]
            if a.isupper() and b.isupper():
                out.append(f"{a} -> {b}")
    return out


def test_slow_start_stays_starting_until_health_answers_200(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model,
                             gpu={"env": {"FAKE_SLOW_START_S": "2"}}), wait_ready=False)
    s.wait_state(("cpu",), ("READY",))
    assert s.child("gpu")["state"] == "STARTING"  # 503 "Loading model" is not a failure
    s.wait_state(("gpu",), ("READY",))
    gpu = s.child("gpu")
    assert gpu["last_start_s"] >= 2.0
    assert gpu["restarts"] == 0 and gpu["last_exit"] is None
    assert transitions(s.log_text(), "gpu") == ["STOPPED -> STARTING", "STARTING -> READY"]


@pytest.mark.asyncio
async def test_start_timeout_backs_off_and_goes_fatal_and_the_daemon_stays_up(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_HANG_START": "1"}, "start_timeout_s": 0.5,
                           "stop_grace_s": 0.5},
                      cpu={"env": {"FAKE_HANG_START": "1"}, "start_timeout_s": 0.5,
                           "stop_grace_s": 0.5},
                      # backoff_max_s: the first try from FATAL is that far away.
                      restart={"backoff_initial_s": 0.05, "backoff_max_s": 60,
                               "max_quick_failures": 3})
    s = spillway(cfg, wait_ready=False)
    status = s.wait_state(("gpu", "cpu"), ("FATAL",))
    gpu = status["children"]["gpu"]
    assert "start timeout" in gpu["last_exit"]["evidence"]
    assert "3 quick failures" in gpu["reason"]
    assert gpu["restarts"] == 2
    assert status["serving"] is False
    assert "gpu is FATAL" in status["why_not_serving"]
    seq = transitions(s.log_text(), "gpu")
    assert seq[:4] == ["STOPPED -> STARTING", "STARTING -> EXITED", "EXITED -> BACKOFF",
                       "BACKOFF -> STARTING"]
    assert seq[-2:] == ["EXITED -> BACKOFF", "BACKOFF -> FATAL"]
    # Still up, still answering, saying why.
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503
            assert "FATAL" in (await r.json())["error"]["message"]
    assert s.proc is not None and s.proc.poll() is None


@pytest.mark.asyncio
async def test_an_abort_is_recorded_with_its_evidence_and_the_child_restarts(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_CRASH_AFTER": "1", "FAKE_CRASH_LINES": "full"}})
    s = spillway(cfg)
    first_pid = s.child("gpu")["pid"]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", json=CHAT) as r:
            await r.read()
    status = s.wait_state(("gpu",), ("READY",))
    gpu = status["children"]["gpu"]
    assert gpu["pid"] != first_pid
    assert gpu["restarts"] == 1
    last = gpu["last_exit"]
    assert last["code"] == -6 and last["signal"] == "SIGABRT"
    assert last["kind"] == "runtime_oom"
    assert "CUDA error: out of memory" in last["evidence"]
    assert transitions(s.log_text(), "gpu")[2:] == [
        "READY -> EXITED", "EXITED -> BACKOFF", "BACKOFF -> STARTING", "STARTING -> READY"]
    # Each line the child wrote went to the log under its prefix.
    assert "[gpu] llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error" in s.log_text()


@pytest.mark.asyncio
async def test_a_load_oom_at_start_is_load_oom_and_the_cpu_child_serves(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_EXIT_AT_START": "1"}},
                      restart={"backoff_initial_s": 0.05, "max_quick_failures": 2})
    s = spillway(cfg, wait_ready=False)
    status = s.wait_state(("gpu",), ("FATAL",))
    last = status["children"]["gpu"]["last_exit"]
    assert last["code"] == 1 and last["kind"] == "load_oom"
    assert "failed to allocate" in last["evidence"]
    s.wait_state(("cpu",), ("READY",))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            assert r.headers["X-Spillway-Child"] == "cpu"


def test_a_frozen_child_is_killed_after_the_hang_timeout_and_restarted(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_FREEZE_AFTER_S": "1"}},
                      restart={"hang_timeout_s": 1.0})
    s = spillway(cfg)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        last = s.child("gpu")["last_exit"]
        if last is not None:
            break
        time.sleep(0.2)
    assert last is not None
    assert "/health unanswered" in last["evidence"] and last["kind"] == "hang"


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_IGNORE_SIGTERM": "1"}, "stop_grace_s": 1.0})
    s = spillway(cfg)
    pids = {s.child(n)["pid"] for n in ("gpu", "cpu")}
    started = time.monotonic()
    assert s.stop() == 0
    took = time.monotonic() - started
    assert wait_gone(pids, 5) == set()
    assert took >= 1.0  # the grace period was given
    assert "still running 1 s after SIGTERM; sending SIGKILL" in s.log_text()


def test_a_daemon_killed_with_sigkill_leaves_its_children_to_the_next_start(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """Issue 40: the children outlive a crash of the daemon (no PR_SET_PDEATHSIG any more), and
    are never orphaned: the next start adopts them, and its stop ends them."""
    s = spillway(fake_config(fake_server, tiny_model))
    pids = {s.child(n)["pid"] for n in ("gpu", "cpu")}
    s.signal(signal.SIGKILL)
    assert s.proc is not None and s.proc.wait(10) == -signal.SIGKILL
    assert wait_gone(pids, 1) == pids  # still running, waiting for the next start
    s._log.close()
    s.start(wait_ready=True)
    assert {s.child(n)["pid"] for n in ("gpu", "cpu")} == pids  # adopted
    assert s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 4})[0] == 200
    assert s.stop() == 0
    assert wait_gone(pids, 10) == set()
