"""The replay rule: each of the six conditions can refuse on its own."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.policy.evidence import FailureKind, Verdict
from supervisor.policy.replay import Refusal, ReplayCase, decide, unavailable
from supervisor.policy.routes import RouteClass

SAFE = ReplayCase(
    verdict=Verdict(FailureKind.RUNTIME_OOM, "CUDA error: out of memory"),
    route=RouteClass.GENERATION, body_replayable=True, bytes_sent=False, timed_out=False,
    opted_out=False, attempts=1, deadline_left_s=None, target_expected_s=None,
    target_available=True)


def test_a_safe_case_replays() -> None:
    d = decide(SAFE)
    assert d.replay and d.refusal is None and "runtime_oom" in d.reason


@pytest.mark.parametrize("change,refusal", [
    ({"body_replayable": False}, Refusal.BODY),                                   # 1
    ({"bytes_sent": True}, Refusal.BYTES_SENT),                                   # 2
    ({"verdict": Verdict(FailureKind.CLIENT_ERROR, "HTTP 400")}, Refusal.CHILD_COMPLETED),  # 3
    ({"verdict": Verdict(FailureKind.CONTEXT_EXCEEDED, "HTTP 400")},
     Refusal.CHILD_COMPLETED),
    ({"verdict": Verdict(FailureKind.NONE, "HTTP 200")}, Refusal.CHILD_COMPLETED),
    ({"timed_out": True}, Refusal.TIMED_OUT),
    ({"route": RouteClass.PASSTHROUGH}, Refusal.ROUTE),                           # 4
    ({"opted_out": True}, Refusal.OPTED_OUT),                                     # 5
    ({"deadline_left_s": 2.0, "target_expected_s": 9.0}, Refusal.DEADLINE),
    ({"deadline_left_s": -0.1}, Refusal.DEADLINE),
    ({"attempts": 2}, Refusal.ALREADY_REPLAYED),                                  # 6
    ({"target_available": False}, Refusal.NO_TARGET),
])
def test_each_condition_refuses_on_its_own(change: dict[str, object], refusal: Refusal) -> None:
    d = decide(dataclasses.replace(SAFE, **change))  # type: ignore[arg-type]
    assert not d.replay
    assert d.refusal is refusal
    assert d.reason.startswith(str(refusal))


READ = dataclasses.replace(SAFE, route=RouteClass.PASSTHROUGH, body_replayable=False,
                           safe_read=True)


def test_a_read_caught_in_a_death_goes_to_the_other_child() -> None:
    """The web UI's files and the routes it polls (a GET without a body) are answered alike by
    either child: one in flight when the GPU child dies is not a 502."""
    assert decide(READ).replay


@pytest.mark.parametrize("change,refusal", [
    ({"route": RouteClass.OWN}, Refusal.ROUTE),  # Spillway's own routes: never forwarded
    ({"safe_read": False}, Refusal.ROUTE),  # a POST to /tools, a slot's save, LoRA
    ({"bytes_sent": True}, Refusal.BYTES_SENT),
    ({"timed_out": True}, Refusal.TIMED_OUT),
    ({"verdict": Verdict(FailureKind.NONE, "HTTP 404")}, Refusal.CHILD_COMPLETED),
    ({"attempts": 2}, Refusal.ALREADY_REPLAYED),
    ({"opted_out": True}, Refusal.OPTED_OUT),
])
def test_a_read_keeps_the_other_conditions(change: dict[str, object],
                                           refusal: Refusal) -> None:
    d = decide(dataclasses.replace(READ, **change))  # type: ignore[arg-type]
    assert not d.replay and d.refusal is refusal


def test_a_deadline_with_room_or_without_an_estimate_allows_the_replay() -> None:
    assert decide(dataclasses.replace(SAFE, deadline_left_s=30.0, target_expected_s=4.0)).replay
    assert decide(dataclasses.replace(SAFE, deadline_left_s=30.0)).replay


@given(st.sampled_from(list(FailureKind)), st.booleans(), st.booleans(), st.booleans(),
       st.integers(1, 3), st.sampled_from(list(RouteClass)))
def test_a_replay_always_means_all_six_hold(kind: FailureKind, body: bool, sent: bool,
                                            opted: bool, attempts: int,
                                            route: RouteClass) -> None:
    case = dataclasses.replace(SAFE, verdict=Verdict(kind, "x"), body_replayable=body,
                               bytes_sent=sent, opted_out=opted, attempts=attempts, route=route)
    if decide(case).replay:
        assert body and not sent and not opted and attempts < 2
        assert route is RouteClass.GENERATION and case.verdict.child_failed


@pytest.mark.parametrize(("refusal", "safe_read", "answer"), [
    (Refusal.NO_TARGET, False, True),  # capacity: come back later
    (Refusal.NO_TARGET, True, True),
    # A read both children failed (issue 43: GET /health in a soak): nobody can answer it now.
    (Refusal.ALREADY_REPLAYED, True, True),
    (Refusal.ALREADY_REPLAYED, False, False),  # a generation: the upstream error, 502
    (Refusal.CHILD_COMPLETED, True, False),
    (None, True, False),
])
def test_what_is_answered_unavailable(refusal: Refusal | None, safe_read: bool,
                                      answer: bool) -> None:
    assert unavailable(refusal, safe_read) is answer
