"""The small child in the pure rules and the pool: who goes to the smaller model (admission's
branch 4c), who takes over a failed request (a smaller model only for a request that accepts
one, never after bytes), and the drain that stops instead of restarting."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_failover_unit import OOM, cut, failed
from test_pool import FakeMember, FakeSource

from supervisor.policy import lifecycle
from supervisor.policy.admission import (
    Action, Capacity, ChildView, Request, decide, passthrough,
)
from supervisor.policy.lifecycle import ChildState
from supervisor.policy.replay import successors
from supervisor.policy.routes import RouteClass
from supervisor.serving.failover import Failover, GiveUp, GoOn, Replay
from supervisor.serving.pool import Pool
from supervisor.vocabulary import AttemptFailure

GPU = ChildView("gpu", ChildState.READY, busy=0, cap=2, ctx_per_slot=4096)
SMALL = ChildView("small", ChildState.READY, busy=0, cap=2, ctx_per_slot=4096, smaller=True)
CPU = ChildView("cpu", ChildState.READY, busy=0, cap=1, ctx_per_slot=8192, expected_s=20.0)
CAP = Capacity(children=(GPU, SMALL, CPU), vram_free_mib=8000, vram_headroom_mib=1024,
               waiting=0, max_waiting=4, wait_s=5.0, max_wait_s=60)
REQ = Request(route=RouteClass.GENERATION, prompt_tokens=100, cpu_allowed=True,
              deadline_s=None)
OPTED = dataclasses.replace(REQ, smaller_ok=True)


def cap(**changes: dict[str, Any]) -> Capacity:
    children = tuple(dataclasses.replace(c, **changes.get(c.name, {})) for c in CAP.children)
    return dataclasses.replace(CAP, children=children)


DOWN = {"state": ChildState.BACKOFF}


@pytest.mark.parametrize(("name", "req", "capacity", "action", "child"), [
    ("the gpu child first, opted in or not", OPTED, CAP, Action.FORWARD, "gpu"),
    ("gpu down, opted in: the small child", OPTED, cap(gpu=DOWN), Action.FORWARD, "small"),
    ("gpu down, not opted in: the cpu child", REQ, cap(gpu=DOWN), Action.FORWARD, "cpu"),
    ("gpu full, opted in: the small child", OPTED, cap(gpu={"busy": 2}), Action.FORWARD,
     "small"),
    ("vram under the headroom, opted in: the small child", OPTED,
     dataclasses.replace(CAP, vram_free_mib=100), Action.FORWARD, "small"),
    ("the small child full too: the cpu child", OPTED,
     cap(gpu=DOWN, small={"busy": 2}), Action.FORWARD, "cpu"),
    ("the prompt over the small child's context: the cpu child",
     dataclasses.replace(OPTED, prompt_tokens=5000),
     cap(gpu=DOWN), Action.FORWARD, "cpu"),
    ("the cpu child too slow for the deadline: the small child still answers",
     dataclasses.replace(OPTED, deadline_s=5.0), cap(gpu=DOWN), Action.FORWARD, "small"),
    ("opted out of replay but accepts a smaller model: the small child",
     dataclasses.replace(OPTED, cpu_allowed=False), cap(gpu=DOWN), Action.FORWARD, "small"),
    ("not opted in, cpu too slow: it waits for the gpu child, never the small one",
     dataclasses.replace(REQ, deadline_s=10.0), cap(gpu=DOWN), Action.WAIT, None),
    ("on demand and stopped: started for it", OPTED,
     cap(gpu=DOWN, small={"state": ChildState.STOPPED, "startable": True}),
     Action.FORWARD, "small"),
    ("stopped and not startable: the cpu child", OPTED,
     cap(gpu=DOWN, small={"state": ChildState.STOPPED}), Action.FORWARD, "cpu"),
])
def test_who_goes_to_the_smaller_model(name: str, req: Request, capacity: Capacity,
                                       action: Action, child: str | None) -> None:
    d = decide(req, capacity)
    assert (d.action, d.child) == (action, child), (name, d)
    if child == "small":
        assert "rerouted to the smaller model" in d.reason and d.branch == 4
        assert d.start_child == (capacity.child("small").state is ChildState.STOPPED)


def test_the_reason_says_why_the_gpu_child_could_not() -> None:
    assert "the GPU child is BACKOFF" in decide(OPTED, cap(gpu={**DOWN, "label": "GPU child"})
                                                ).reason
    assert "full (2/2)" in decide(OPTED, cap(gpu={"busy": 2})).reason
    assert "headroom" in decide(OPTED, dataclasses.replace(CAP, vram_free_mib=100)).reason


def test_routes_outside_generation_never_go_to_the_smaller_model_unless_pinned() -> None:
    states = {"gpu": ChildState.BACKOFF, "small": ChildState.READY, "cpu": ChildState.READY}
    assert passthrough(states, None, frozenset({"small"})).child == "cpu"
    assert passthrough(states, "small", frozenset({"small"})).child == "small"
    states["cpu"] = ChildState.STOPPED
    assert passthrough(states, None, frozenset({"small"})).action is Action.REJECT


@pytest.mark.parametrize(("failed_on", "skip", "expected"), [
    ("gpu", set(), ["small", "cpu"]),
    ("gpu", {"small"}, ["cpu"]),
    ("small", {"small"}, ["cpu", "gpu"]),
    ("cpu", {"small"}, ["gpu"]),
    ("other", set(), []),
])
def test_successors_follow_the_order_less_the_skipped(failed_on: str, skip: set[str],
                                                      expected: list[str]) -> None:
    assert successors(("gpu", "small", "cpu"), failed_on, skip) == expected


def three(source: FakeSource) -> Pool:
    members = {name: FakeMember(name, source) for name in ("gpu", "small", "cpu")}
    return Pool(source, members, 4, 30.0, smaller={"small"})  # type: ignore[arg-type]


def small_source(**states: str) -> FakeSource:
    return FakeSource({"gpu": 1, "small": 1, "cpu": 1},
                      {"gpu": "READY", "small": "READY", "cpu": "READY", **states})


def test_the_pool_offers_the_smaller_model_only_to_who_accepts_it() -> None:
    pool = three(small_source())
    assert pool.takeovers("gpu") == ["cpu"]
    assert pool.takeovers("gpu", smaller_ok=True) == ["small", "cpu"]
    assert pool.takeovers("gpu", smaller_ok=True, after_bytes=True) == ["cpu"]
    assert pool.takeovers("small", smaller_ok=True, after_bytes=True) == []
    assert pool.takeovers("small", smaller_ok=True) == ["cpu", "gpu"]
    assert pool.first_ready() is pool.upstreams["gpu"]
    pool.source.states["gpu"] = "BACKOFF"  # type: ignore[attr-defined]
    assert pool.first_ready() is pool.upstreams["cpu"]  # the tokenizer of the model asked for


async def test_an_opted_in_failure_is_rerouted_to_the_small_child_else_the_cpu_child() -> None:
    pool = three(small_source(gpu="EXITED"))
    nxt = await Failover(pool).after_failure(failed(smaller_ok=True))
    assert isinstance(nxt, Replay) and nxt.lease.name == "small" and nxt.smaller
    assert "rerouted to the smaller model" in nxt.reason
    nxt.lease.close(None, None)
    plain = await Failover(pool).after_failure(failed())
    assert isinstance(plain, Replay) and plain.lease.name == "cpu" and not plain.smaller
    plain.lease.close(None, None)
    # The small child cannot take it (stopped, not startable): the CPU child does.
    pool.source.states["small"] = "STOPPED"  # type: ignore[attr-defined]
    fallback = await Failover(pool).after_failure(failed(smaller_ok=True))
    assert isinstance(fallback, Replay) and fallback.lease.name == "cpu"
    fallback.lease.close(None, None)


async def test_a_cut_stream_is_never_continued_on_or_from_the_smaller_model() -> None:
    pool = three(small_source())
    nxt = await Failover(pool).after_cut(cut())
    assert isinstance(nxt, GoOn) and nxt.lease.name == "cpu"
    nxt.lease.close(None, None)
    from_small = AttemptFailure("small", 1, OOM.verdict, after_bytes=True)
    refused = await Failover(pool).after_cut(cut(failure=from_small))
    assert isinstance(refused, GiveUp) and "not continued on another model" in refused.reason
    assert pool.busy("cpu") == 0 and pool.busy("gpu") == 0


def test_a_drain_that_stops_leaves_the_child_stopped() -> None:
    ctx = lifecycle.Context(now=0.0, policy=lifecycle.BackoffPolicy(0.5, 30, 10, 5, 300),
                            manner=lifecycle.CHILD)
    life = lifecycle.Life(state=ChildState.READY, generation=1, running=True, wanted=True)
    life, _ = lifecycle.step(life, lifecycle.Drain("making way", stop=True), ctx)
    assert life.state is ChildState.DRAINING and not life.wanted and life.then is None
    life, _ = lifecycle.step(life, lifecycle.Idle(), ctx)
    assert life.state is ChildState.STOPPING
    life, _ = lifecycle.step(life, lifecycle.Ended(1, planned=True, what="stopped"), ctx)
    assert life.state is ChildState.STOPPED
    # The plain drain restarts.
    life = lifecycle.Life(state=ChildState.READY, generation=1, running=True, wanted=True)
    life, _ = lifecycle.step(life, lifecycle.Drain("oom survived"), ctx)
    life, _ = lifecycle.step(life, lifecycle.Idle(), ctx)
    life, actions = lifecycle.step(life, lifecycle.Ended(1, planned=True, what="stopped"), ctx)
    assert life.state is ChildState.STARTING


def test_router_mode_a_model_not_loaded_is_loaded_while_its_smaller_model_answers() -> None:
    """Branch 4b meets 4c: the larger model may be loaded on the GPU router (startable): the
    smaller model answers this request, and the larger one is loaded for those after."""
    d = decide(OPTED, cap(gpu={"state": ChildState.STOPPED, "startable": True}))
    assert (d.action, d.child, d.warm) == (Action.FORWARD, "small", "gpu")
    plain = decide(REQ, cap(gpu={"state": ChildState.STOPPED, "startable": True}))
    assert plain.child == "cpu" and plain.warm == "gpu"  # as before: not the smaller model
    down = decide(OPTED, cap(gpu=DOWN))
    assert down.child == "small" and down.warm is None  # backing off: nothing to load now


class ContextSource(FakeSource):
    """The small child's slots hold 256 tokens; the others' are unknown (room for any)."""

    def ctx_per_slot(self, name: str) -> int | None:
        return 256 if name == "small" else None


async def test_a_prompt_over_the_small_childs_slot_is_replayed_on_the_cpu_child() -> None:
    source = ContextSource({"gpu": 1, "small": 1, "cpu": 1},
                           {"gpu": "EXITED", "small": "READY", "cpu": "READY"})
    pool = three(source)
    long = await Failover(pool).after_failure(failed(smaller_ok=True, prompt_tokens=300))
    assert isinstance(long, Replay) and long.lease.name == "cpu" and not long.smaller
    long.lease.close(None, None)
    short = await Failover(pool).after_failure(failed(smaller_ok=True, prompt_tokens=100))
    assert isinstance(short, Replay) and short.lease.name == "small"
    short.lease.close(None, None)
