"""Child states and backoff: the transition table and the restart arithmetic."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.policy.lifecycle import (
    TRANSITIONS, BackoffPolicy, ChildState, InvalidTransition, after_exit, check_transition,
    fatal_retry_s, quick_failures_after_fatal_try,
)

S = ChildState
POLICY = BackoffPolicy(initial_s=0.5, max_s=30.0, quick_failure_s=10.0, max_quick_failures=5,
                       fatal_retry_max_s=300.0)

# The lifecycle of the design, spelled out: any change here is a change of the design.
EXPECTED = {
    (S.STOPPED, S.STARTING), (S.STARTING, S.READY), (S.STARTING, S.EXITED),
    (S.STARTING, S.STOPPING), (S.READY, S.DRAINING), (S.READY, S.STOPPING),
    (S.READY, S.EXITED), (S.DRAINING, S.STOPPING), (S.DRAINING, S.READY),
    (S.DRAINING, S.EXITED), (S.STOPPING, S.STOPPED), (S.STOPPING, S.EXITED),
    (S.EXITED, S.BACKOFF),
    (S.EXITED, S.STOPPED), (S.BACKOFF, S.STARTING), (S.BACKOFF, S.FATAL),
    (S.BACKOFF, S.STOPPED), (S.FATAL, S.STARTING), (S.FATAL, S.STOPPED),
}


def test_the_table_is_the_design() -> None:
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == EXPECTED


@pytest.mark.parametrize("a,b", sorted(itertools.product(S, S)))
def test_only_listed_transitions_are_allowed(a: ChildState, b: ChildState) -> None:
    if (a, b) in EXPECTED:
        check_transition(a, b)
    else:
        with pytest.raises(InvalidTransition):
            check_transition(a, b)


def test_backoff_doubles_per_quick_failure_up_to_the_maximum() -> None:
    delays = []
    count = 0
    policy = BackoffPolicy(initial_s=0.5, max_s=3.0, quick_failure_s=10.0,
                           max_quick_failures=9, fatal_retry_max_s=300.0)
    for _ in range(6):
        d = after_exit(policy, count, run_s=1.0, jitter=0.5)  # 0.5: no jitter
        count = d.quick_failures
        delays.append(d.delay_s)
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_too_many_quick_failures_in_a_row_is_fatal() -> None:
    count = 0
    for i in range(1, 6):
        d = after_exit(POLICY, count, run_s=0.2, jitter=0.5)
        count = d.quick_failures
        assert d.fatal == (i == 5)


def test_a_death_while_serving_requests_is_not_a_quick_failure() -> None:
    d = after_exit(POLICY, quick_failures=4, run_s=0.5, jitter=0.5, served=True)
    assert not d.fatal and d.quick_failures == 0


def test_a_long_run_clears_the_quick_failure_count() -> None:
    d = after_exit(POLICY, quick_failures=4, run_s=3600.0, jitter=0.5)
    assert not d.fatal
    assert d.quick_failures == 0
    assert d.delay_s == POLICY.initial_s


@given(st.integers(0, 3), st.floats(0, 0.9999), st.floats(0, 9.99))
def test_jitter_stays_within_a_quarter_either_way(count: int, jitter: float, run_s: float) -> None:
    d = after_exit(POLICY, count, run_s, jitter)
    base = min(POLICY.max_s, POLICY.initial_s * 2 ** count)
    assert 0.75 * base <= d.delay_s <= 1.25 * base


def test_fatal_is_retried_after_a_capped_doubling_interval() -> None:
    # The first try after min(backoff_max_s, fatal_retry_max_s), doubling up to the cap.
    assert [fatal_retry_s(POLICY, n) for n in range(6)] == [30, 60, 120, 240, 300, 300]
    policy = BackoffPolicy(initial_s=0.5, max_s=30.0, quick_failure_s=10.0,
                           max_quick_failures=5, fatal_retry_max_s=10.0)
    assert [fatal_retry_s(policy, n) for n in range(3)] == [10, 10, 10]
    policy = BackoffPolicy(initial_s=0.5, max_s=30.0, quick_failure_s=10.0,
                           max_quick_failures=5, fatal_retry_max_s=1.0)
    assert fatal_retry_s(policy, 0) == 1.0
    assert fatal_retry_s(POLICY, 10_000) == 300  # no overflow after a long time FATAL


@given(st.floats(0.01, 1000), st.floats(1, 10_000), st.integers(0, 200))
def test_a_fatal_retry_never_waits_longer_than_the_cap(max_s: float, cap: float,
                                                      tries: int) -> None:
    policy = BackoffPolicy(initial_s=0.01, max_s=max_s, quick_failure_s=10.0,
                           max_quick_failures=5, fatal_retry_max_s=cap)
    wait = fatal_retry_s(policy, tries)
    assert min(max_s, cap) <= wait <= cap
    assert wait <= fatal_retry_s(policy, tries + 1)  # growing


def test_one_quick_failure_after_a_try_from_fatal_is_fatal_again() -> None:
    d = after_exit(POLICY, quick_failures_after_fatal_try(POLICY), run_s=0.2, jitter=0.5)
    assert d.fatal
