"""The replay rule: each of the six conditions can refuse on its own."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.policy.evidence import FailureKind, Verdict
from supervisor.policy.replay import Refusal, ReplayCase, decide, unavailable
from supervisor.policy.routes import READ_ROUTES, RouteClass, read_only

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


# llama-server's GET routes (server.cpp, server-http.cpp, the pinned source), each with what it
# does: only those that change nothing are reads, and only they replay.
LLAMA_SERVER_GETS = [
    ("/health", True), ("/v1/health", True), ("/metrics", True), ("/props", True),
    ("/models", True), ("/v1/models", True), ("/models/sse", True), ("/slots", True),
    ("/lora-adapters", True),
    ("/", True), ("/index.html", True),  # the web UI's page
    ("/_app/immutable/entry/start.BQ1x2.js", True), ("/manifest.webmanifest", True),
    ("/sw.js", True), ("/_app/version.json", True), ("/favicon.svg", True),
    ("/cors-proxy", False),  # fetches the URL it is given: a replay fetches it twice
    ("/tools", False),  # never replayed (the rule names /tools)
    ("/v1/stream", False),  # Spillway answers it itself
    # Not llama-server's GET routes at all: nothing is a read by default.
    ("/v1/chat/completions", False), ("/slots/0", False), ("/models/load", False),
    ("/spillway/status", False), ("/props/", False), ("/.well-known", False),
    ("/unknown-route", False),
]


@pytest.mark.parametrize(("path", "reads"), LLAMA_SERVER_GETS)
def test_reads_are_an_allowlist_of_llama_servers_routes_that_change_nothing(
        path: str, reads: bool) -> None:
    assert read_only("GET", path, "", has_body=False) is reads
    assert read_only("HEAD", path, "", has_body=False) is reads


def test_every_read_route_is_in_the_table() -> None:
    assert {path for path, reads in LLAMA_SERVER_GETS if reads} >= READ_ROUTES


@pytest.mark.parametrize(("method", "path", "query", "has_body", "reads"), [
    ("GET", "/props", "model=qwen", False, True),  # which model's props: still a read
    ("GET", "/slots", "fail_on_no_slot=1", False, True),
    ("GET", "/v1/models", "autoload=false", False, False),  # named at all: not replayed
    ("GET", "/models", "autoload=true", False, False),  # loads a model on a router
    ("GET", "/props", "model=qwen&autoload=1", False, False),
    ("GET", "/props", "model=qwen&auto%6coad=1", False, False),  # as llama-server decodes it
    ("GET", "/models", "reload=1", False, False),  # reads the models' folder again
    ("GET", "/sw.js", "autoload=true", False, False),
    ("GET", "/props", "", True, False),  # a body: not a plain read
    ("POST", "/props", "", False, False),  # sets the props
    ("DELETE", "/models", "", False, False),
    ("OPTIONS", "/props", "", False, False),
])
def test_a_read_carries_no_body_and_no_query_that_acts(
        method: str, path: str, query: str, has_body: bool, reads: bool) -> None:
    assert read_only(method, path, query, has_body) is reads
