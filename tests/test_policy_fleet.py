"""The rules that span several children (policy/fleet.py), pure."""

from __future__ import annotations

import pytest

from supervisor.policy.fleet import (
    GPU_WAITING, SMALL_UP, gpu_back_after_fatal, idle_release, idle_stop, small_holds_gpu,
    small_starts,
)
from supervisor.policy.lifecycle import ChildState as S

MIB = 1 << 20


@pytest.mark.parametrize("old,new,starts", [
    (S.EXITED, S.BACKOFF, True),   # a death: the GPU child waits for its next try
    (S.BACKOFF, S.FATAL, False),   # (already waiting: the small child started before)
    (S.READY, S.EXITED, False),    # EXITED alone may walk on to STOPPED
    (S.BACKOFF, S.STARTING, False),
    (S.READY, S.STOPPED, False),   # a stop asked for: nothing freed to serve from
])
def test_the_small_child_starts_when_the_gpu_child_begins_to_wait(old: S, new: S,
                                                                  starts: bool) -> None:
    assert small_starts(old, new, S.STOPPED, paused=False) is starts


def test_the_small_child_does_not_start_twice_nor_when_paused() -> None:
    for small in SMALL_UP:
        assert not small_starts(S.EXITED, S.BACKOFF, small, paused=False)
    assert not small_starts(S.EXITED, S.BACKOFF, S.STOPPED, paused=True)


def test_the_small_child_holds_the_gpu_child_while_it_holds_vram_or_will() -> None:
    assert {s for s in S if small_holds_gpu(s)} == set(SMALL_UP)
    assert not small_holds_gpu(S.STOPPED) and not small_holds_gpu(S.FATAL)
    assert S.EXITED not in GPU_WAITING and S.FATAL in GPU_WAITING


def test_a_fatal_gpu_child_comes_back_only_with_room_and_memory_freed_by_another() -> None:
    slack = 512 * MIB
    # Room, and 1 GiB freed since it went FATAL: back.
    assert gpu_back_after_fatal(9000 * MIB, 8000 * MIB, slack, short=False)
    # Room, but nothing freed: its need may be underestimated; not on every tick.
    assert not gpu_back_after_fatal(8100 * MIB, 8000 * MIB, slack, short=False)
    # Freed, but still short of what it needs.
    assert not gpu_back_after_fatal(9000 * MIB, 1000 * MIB, slack, short=True)
    # No figure from when it went FATAL: room is enough.
    assert gpu_back_after_fatal(9000 * MIB, None, slack, short=False)


def test_an_on_demand_child_idle_long_enough_is_stopped() -> None:
    assert idle_stop(True, S.READY, 0, 301.0, 300.0)
    assert not idle_stop(True, S.READY, 1, 301.0, 300.0)  # something in flight
    assert not idle_stop(True, S.READY, 0, 299.0, 300.0)
    assert not idle_stop(False, S.READY, 0, 9999.0, 300.0)  # a hot child stays
    assert not idle_stop(True, S.STARTING, 0, 301.0, 300.0)


def test_the_gpu_child_idle_long_enough_is_lent_while_the_cpu_child_serves() -> None:
    ready = S.READY
    assert idle_release(5.0, ready, 0, 5.0, ready, lent=False)
    assert not idle_release(0.0, ready, 0, 3600.0, ready, lent=False)  # off
    assert not idle_release(5.0, ready, 0, 4.9, ready, lent=False)  # not yet
    assert not idle_release(5.0, ready, 1, 60.0, ready, lent=False)  # an answer in flight
    assert not idle_release(5.0, S.STARTING, 0, 60.0, ready, lent=False)
    assert not idle_release(5.0, ready, 0, 60.0, ready, lent=True)  # lent already
    # Without the CPU child serving, the next request would wait for a whole model load.
    for cpu in (S.STARTING, S.BACKOFF, S.STOPPED, S.FATAL):
        assert not idle_release(5.0, ready, 0, 60.0, cpu, lent=False)
