"""The admission gate with a fake capacity source: caps never exceeded, first in first out,
clients that leave leave the line, nothing lost."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from supervisor.gate import Admitted, Gate
from supervisor.policy.admission import Action, ChildView, Decision, Request, decide
from supervisor.policy.routes import RouteClass

REQ = Request(route=RouteClass.GENERATION, prompt_tokens=10, cpu_allowed=True, deadline_s=None)


class FakeSource:
    """A test double of the daemon's capacity figures: fixed states and caps."""

    def __init__(self, caps: dict[str, int], states: dict[str, str] | None = None) -> None:
        self.caps = caps
        self.states = states or {"gpu": "READY", "cpu": "READY"}
        self.started: list[str] = []

    def child_view(self, name: str, busy: int, body_size: int, max_tokens: int,
                   with_estimate: bool = True) -> ChildView:
        return ChildView(name, self.states[name], busy, self.caps[name], ctx_per_slot=None,
                         startable=self.states[name] == "STOPPED" and name == "cpu")

    def vram_free_mib(self) -> float | None:
        return None

    def vram_headroom_mib(self) -> float:
        return 0.0

    def service_s(self) -> float | None:
        return 1.0

    def start_child(self, name: str) -> None:
        self.started.append(name)
        self.states[name] = "READY"

    async def wait_ready(self, name: str, within_s: float) -> float | None:
        return 0.25


@pytest.mark.asyncio
async def test_caps_hold_and_the_line_is_served_in_order() -> None:
    gate = Gate(FakeSource({"gpu": 2, "cpu": 1}), max_waiting=50, max_wait_s=30)
    served: list[int] = []
    peak = {"gpu": 0, "cpu": 0}

    async def client(i: int) -> None:
        got = await gate.admit(REQ, 100, 10)
        assert isinstance(got, Admitted)
        served.append(i)
        peak[got.child] = max(peak[got.child], gate.busy[got.child])
        await asyncio.sleep(random.uniform(0.001, 0.01))
        gate.release(got.child)

    tasks = []
    for i in range(40):
        tasks.append(asyncio.create_task(client(i)))
        await asyncio.sleep(0)  # arrivals in order
    await asyncio.gather(*tasks)
    assert peak == {"gpu": 2, "cpu": 1}
    assert gate.busy == {"gpu": 0, "cpu": 0}
    # The first three went at once; the rest were served from the line in arrival order.
    assert served[3:] == sorted(served[3:])
    assert len(served) == 40 and len(gate.line) == 0


@pytest.mark.asyncio
async def test_a_client_that_leaves_the_line_leaves_at_once_and_loses_nothing() -> None:
    gate = Gate(FakeSource({"gpu": 1, "cpu": 1}), max_waiting=10, max_wait_s=30)
    first = await gate.admit(REQ, 1, 1)
    second = await gate.admit(REQ, 1, 1)
    assert isinstance(first, Admitted) and isinstance(second, Admitted)
    waiters = [asyncio.create_task(gate.admit(REQ, 1, 1)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert len(gate.line) == 3
    waiters[1].cancel()
    await asyncio.sleep(0.01)
    assert len(gate.line) == 2
    assert [w["position"] for w in gate.waiting()] == [1, 2]
    gate.release(first.child)
    got = await waiters[0]
    assert isinstance(got, Admitted) and got.waited_s > 0
    gate.release(second.child)
    assert isinstance(await waiters[2], Admitted)
    assert len(gate.line) == 0


@pytest.mark.asyncio
async def test_a_full_line_and_a_short_wait_are_refused_with_position_and_retry_after() -> None:
    gate = Gate(FakeSource({"gpu": 1, "cpu": 1}), max_waiting=1, max_wait_s=0.6)
    for _ in range(2):
        assert isinstance(await gate.admit(REQ, 1, 1), Admitted)
    waiting = asyncio.create_task(gate.admit(REQ, 1, 1))
    await asyncio.sleep(0.01)
    full = await gate.admit(REQ, 1, 1)
    assert isinstance(full, Decision) and full.action is Action.REJECT
    assert full.queue_position == 2 and "full" in full.reason
    timed_out = await waiting  # nobody released within max_wait_s
    assert isinstance(timed_out, Decision) and timed_out.action is Action.REJECT
    assert timed_out.retry_after_s > 0 and timed_out.queue_position == 1


@pytest.mark.asyncio
async def test_replays_go_ahead_of_the_line() -> None:
    gate = Gate(FakeSource({"gpu": 1, "cpu": 1}), max_waiting=10, max_wait_s=30)
    held = [await gate.admit(REQ, 1, 1) for _ in range(2)]
    waiting = asyncio.create_task(gate.admit(REQ, 1, 1))
    await asyncio.sleep(0.01)
    replay = asyncio.create_task(gate.acquire_replay("cpu", None))
    await asyncio.sleep(0.01)
    assert isinstance(held[1], Admitted)
    gate.release(held[1].child)  # the CPU slot frees: the replay takes it, not the line
    assert await replay == 0.0
    assert not waiting.done()
    assert isinstance(held[0], Admitted)
    gate.release(held[0].child)
    assert isinstance(await waiting, Admitted)


@pytest.mark.asyncio
async def test_an_on_demand_child_is_started_and_its_start_time_measured() -> None:
    source = FakeSource({"gpu": 1, "cpu": 1}, {"gpu": "BACKOFF", "cpu": "STOPPED"})
    gate = Gate(source, max_waiting=10, max_wait_s=30)
    got = await gate.admit(REQ, 1, 1)
    assert isinstance(got, Admitted)
    assert got.child == "cpu" and got.cpu_start_s == 0.25 and source.started == ["cpu"]


@pytest.mark.parametrize("seed", range(200))
def test_the_gpu_fast_path_answers_as_the_full_decision_does(seed: int) -> None:
    rnd = random.Random(seed)
    states = {"gpu": rnd.choice(["READY", "STARTING", "BACKOFF", "DRAINING", "FATAL"]),
              "cpu": rnd.choice(["READY", "STOPPED", "FATAL"])}
    source = FakeSource({"gpu": rnd.randint(0, 3), "cpu": rnd.randint(0, 3)}, states)
    free = rnd.choice([None, 100.0, 5000.0])
    source.vram_free_mib = lambda: free  # type: ignore[method-assign]
    source.vram_headroom_mib = lambda: 1024.0  # type: ignore[method-assign]
    gate = Gate(source, max_waiting=4, max_wait_s=30)
    gate.busy = {"gpu": rnd.randint(0, 3), "cpu": rnd.randint(0, 3)}
    req = dataclasses.replace(REQ, prompt_tokens=rnd.choice([10, 5000]),
                              cpu_allowed=rnd.random() < 0.8)
    fast = gate._gpu_fast_path(req)
    full = decide(req, gate.capacity(0, 1, 1))
    if fast is not None:
        assert (full.action, full.child, full.branch) == (fast.action, fast.child, fast.branch)
    else:
        assert not (full.action is Action.FORWARD and full.child == "gpu")


@pytest.mark.asyncio
async def test_a_child_that_began_to_drain_after_its_reservation_is_not_used() -> None:
    """A request served from the line resumes a moment after its reservation; if its child
    began to drain in that moment, the handler goes through admission again."""
    from types import SimpleNamespace

    from multidict import CIMultiDict, CIMultiDictProxy

    from supervisor.proxy.forward import RequestCtx
    from supervisor.proxy.handler import ProxyHandler
    from supervisor.policy.routes import RouteClass as RC

    source = FakeSource({"gpu": 1, "cpu": 1})
    gate = Gate(source, max_waiting=4, max_wait_s=30)
    draining = SimpleNamespace(is_ready=False)  # the drain began after the reservation
    upstreams = {"gpu": draining, "cpu": SimpleNamespace(is_ready=True)}

    def gpu_now_draining(name: str, busy: int, body: int, tokens: int,
                         with_estimate: bool = True) -> ChildView:
        state = "DRAINING" if name == "gpu" and source.caps["gpu"] == 0 else "READY"
        return ChildView(name, state, busy, 1, ctx_per_slot=None)

    backend = SimpleNamespace(upstreams=lambda: upstreams, states=lambda: {},
                              ctx_per_slot=lambda _name: None)
    handler = ProxyHandler.__new__(ProxyHandler)
    handler.gate, handler.backend = gate, backend  # type: ignore[assignment]
    released: list[str] = []
    real_release = gate.release

    def release(child: str) -> None:
        released.append(child)
        source.caps["gpu"] = 0  # from now on admission sees the GPU child draining
        source.child_view = gpu_now_draining  # type: ignore[method-assign]
        real_release(child)

    gate.release = release  # type: ignore[method-assign]
    ctx = RequestCtx(request_id="r", method="POST", path="/v1/chat/completions",
                     path_qs="/v1/chat/completions", route=RC.GENERATION, body=b"{}",
                     payload={}, stream=False,
                     client_headers=CIMultiDictProxy(CIMultiDict()))
    got = await handler._admit(ctx)
    assert isinstance(got, Admitted) and got.child == "cpu"
    assert released == ["gpu"] and gate.busy == {"gpu": 0, "cpu": 1}


class UntimedSource(FakeSource):
    """No request has finished yet: the daemon has no service time to give."""

    def service_s(self) -> float | None:
        return None


@pytest.mark.asyncio
async def test_a_burst_before_any_request_finished_is_not_told_a_made_up_wait() -> None:
    # 30 clients at once on a fresh daemon: 2 go, the rest wait or are refused. No request has
    # been timed, so the estimate rests on how long the first has been running (a lower bound),
    # not on a fixed guess (5 s a request: waits of a minute told to a burst that was served in
    # half a second, in the chaos run).
    gate = Gate(UntimedSource({"gpu": 1, "cpu": 1}), max_waiting=20, max_wait_s=60)
    for _ in range(2):
        assert isinstance(await gate.admit(REQ, 1, 1), Admitted)
    waiting = [asyncio.create_task(gate.admit(REQ, 1, 1)) for _ in range(20)]
    await asyncio.sleep(0)
    refused = await gate.admit(REQ, 1, 1)
    assert isinstance(refused, Decision) and refused.action is Action.REJECT
    assert refused.retry_after_s is not None and refused.retry_after_s <= 2.0
    assert gate.service_estimate()[1] == "running"
    for _ in range(22):  # let them all through
        gate.release("gpu")
    got = await asyncio.gather(*waiting)
    assert all(isinstance(g, Admitted) and g.estimate_basis == "running" for g in got)
    assert max(g.estimated_wait_s or 0 for g in got if isinstance(g, Admitted)) <= 2.0
