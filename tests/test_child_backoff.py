"""FATAL is not a dead end: a child that cannot start is tried again on a capped, growing
interval (the crash-loop back-off), and becomes READY without an operator once it can.

The child is real (the fake llama-server in a real process, aborting during its first starts);
the back-off's waits run on a fake clock, so the spacing of the tries is exact and nothing
sleeps through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fake_clock import FakeClock
from harness import fake_config

from supervisor.upstreams.children import Child
from supervisor.config.schema import build
from supervisor.policy.lifecycle import ChildState

pytestmark = pytest.mark.asyncio


def make_child(fake_server: Path, tiny_model: Path, tmp_path: Path, fail_starts: int,
               clock: FakeClock, **restart: Any) -> Child:
    raw = fake_config(fake_server, tiny_model, restart=restart, gpu={"env": {
        "FAKE_FAIL_STARTS": str(fail_starts),
        "FAKE_FAIL_STARTS_FILE": str(tmp_path / "starts")}})
    cfg = build(raw, base_dir=tmp_path)
    # rng 0.5: the back-off's jitter factor is exactly 1.
    return Child(cfg.gpu, cfg.restart, rng=lambda: 0.5, clock=clock)


async def test_a_child_that_fails_its_start_six_times_is_ready_without_an_operator(
        fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    clock = FakeClock()
    child = make_child(fake_server, tiny_model, tmp_path, fail_starts=6, clock=clock,
                       backoff_initial_s=1.0, backoff_max_s=4.0, max_quick_failures=3,
                       fatal_retry_max_s=20.0)
    starts: list[tuple[float, str]] = []
    fatal: list[dict[str, Any]] = []

    def listener(c: Child, old: ChildState, new: ChildState, reason: str) -> None:
        if new is ChildState.STARTING:
            starts.append((clock.now(), reason))
        if new is ChildState.FATAL:
            fatal.append(c.to_json())

    child.listeners.append(listener)
    child.start()
    try:
        assert await child.wait_state(ChildState.READY, timeout=60), child.to_json()
    finally:
        await child.close(grace_s=1.0)
    gaps = [b[0] - a[0] for a, b in zip(starts, starts[1:])]
    # Three quick failures (back-off 1 s, 2 s, then FATAL); from FATAL: min(backoff_max_s,
    # fatal_retry_max_s) = 4 s, doubling up to the cap of 20 s; the seventh start succeeds.
    assert gaps == [1.0, 2.0, 4.0, 8.0, 16.0, 20.0]
    assert [reason for _, reason in starts[3:]] == [
        f"try {n} from FATAL (crash-loop back-off)" for n in range(1, 5)]
    # Each FATAL said when the next try is, and why it is FATAL.
    assert [f["next_try_in_s"] for f in fatal] == [4.0, 8.0, 16.0, 20.0]
    assert all(f["state"] == "FATAL" and "CUDA error" in f["reason"] for f in fatal)
    assert child.to_json()["next_try_in_s"] is None  # READY: no try pending
    assert child.restarts == 6


async def test_an_operator_restart_from_fatal_starts_at_once_and_resets_the_back_off(
        fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    clock = FakeClock()
    child = make_child(fake_server, tiny_model, tmp_path, fail_starts=2, clock=clock,
                       backoff_initial_s=1.0, backoff_max_s=4.0, max_quick_failures=2,
                       fatal_retry_max_s=300.0)
    # Nobody advances this clock past FATAL: only an operator can bring the child back.
    clock_wait = clock.wait

    async def frozen_when_fatal(event: Any, timeout: float | None) -> bool:
        if child.state is ChildState.FATAL:
            return await clock_wait(event, None)
        return await clock_wait(event, timeout)

    clock.wait = frozen_when_fatal  # type: ignore[method-assign]
    child.start()
    try:
        assert await child.wait_state(ChildState.FATAL, timeout=30)
        assert child.fatal_tries == 0 and child.next_try_in_s() == 4.0
        child.restart("operator: spillway gpu restart")
        assert await child.wait_state(ChildState.READY, timeout=30), child.to_json()
        assert child.reason.startswith("ready in")
        assert child.quick_failures == 0 and child.fatal_tries == 0
    finally:
        await child.close(grace_s=1.0)
