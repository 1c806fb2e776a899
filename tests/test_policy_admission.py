"""Admission: the decision table, branch by branch, and the waiting line's properties."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from supervisor.policy.admission import (
    Action, Capacity, ChildView, Request, can_serve_now, decide, loading, passthrough,
)
from supervisor.policy.lifecycle import ChildState
from supervisor.policy.routes import RouteClass
from supervisor.policy.waitline import (
    DEFAULT_SERVICE_S, MIN_SERVICE_S, WaitLine, estimated_wait, service_estimate,
)

GPU = ChildView("gpu", "READY", busy=0, cap=2, ctx_per_slot=4096)
CPU = ChildView("cpu", "READY", busy=0, cap=1, ctx_per_slot=8192, expected_s=20.0)
CAP = Capacity(children=(GPU, CPU), vram_free_mib=8000, vram_headroom_mib=1024, waiting=0,
               max_waiting=4, wait_s=5.0, max_wait_s=60)
REQ = Request(route=RouteClass.GENERATION, prompt_tokens=100, cpu_allowed=True,
              deadline_s=None)


def with_(cap: Capacity = CAP, gpu: dict[str, object] | None = None,
          cpu: dict[str, object] | None = None, **kw: object) -> Capacity:
    return dataclasses.replace(
        cap, children=(dataclasses.replace(cap.gpu, **(gpu or {})),  # type: ignore[arg-type]
                       dataclasses.replace(cap.cpu, **(cpu or {}))),  # type: ignore[arg-type]
        **kw)  # type: ignore[arg-type]


# (name, request changes, capacity, expected action, branch, child)
TABLE = [
    ("gpu has room", {}, CAP, Action.FORWARD, 4, "gpu"),
    ("over the gpu context, cpu has room", {"prompt_tokens": 6000}, CAP, Action.FORWARD, 5,
     "cpu"),
    ("over every context", {"prompt_tokens": 9000}, CAP, Action.TOO_LONG, 3, None),
    # llama-server refuses a prompt that fills its slot (it needs room for one more token).
    ("exactly the gpu's context: cpu", {"prompt_tokens": 4096}, CAP, Action.FORWARD, 5, "cpu"),
    ("exactly every context", {"prompt_tokens": 8192}, CAP, Action.TOO_LONG, 3, None),
    ("one under the gpu's context", {"prompt_tokens": 4095}, CAP, Action.FORWARD, 4, "gpu"),
    # A count that is not the child's own (infill, embeddings): the largest context judges it.
    ("not the child's count, over every context: the largest",
     {"prompt_tokens": 9000, "exact_count": False}, CAP, Action.FORWARD, 5, "cpu"),
    ("not the child's count, the gpu's context the largest",
     {"prompt_tokens": 9000, "exact_count": False}, with_(gpu={"ctx_per_slot": 16384}),
     Action.FORWARD, 4, "gpu"),
    ("not the child's count, over every context, opted out of the cpu: the gpu",
     {"prompt_tokens": 9000, "exact_count": False, "cpu_allowed": False}, CAP, Action.FORWARD,
     4, "gpu"),
    ("not the child's count, over the gpu's only: cpu",
     {"prompt_tokens": 6000, "exact_count": False}, CAP, Action.FORWARD, 5, "cpu"),
    ("gpu full: cpu", {}, with_(gpu={"busy": 2}), Action.FORWARD, 5, "cpu"),
    ("vram under headroom: cpu", {}, with_(vram_free_mib=500), Action.FORWARD, 5, "cpu"),
    ("no gpu figures: headroom not applied", {}, with_(vram_free_mib=None), Action.FORWARD, 4,
     "gpu"),
    ("gpu restarting: cpu", {}, with_(gpu={"state": "BACKOFF"}), Action.FORWARD, 5, "cpu"),
    ("opted out: waits for the gpu", {"cpu_allowed": False}, with_(gpu={"busy": 2}),
     Action.WAIT, 6, None),
    ("cpu too slow for the deadline: wait", {"deadline_s": 10.0}, with_(gpu={"busy": 2}),
     Action.WAIT, 6, None),
    ("cpu without RAM: wait", {}, with_(gpu={"busy": 2}, cpu={"ram_ok": False}), Action.WAIT,
     6, None),
    ("on-demand cpu: start it", {}, with_(gpu={"busy": 2}, cpu={"state": "STOPPED",
                                                               "startable": True}),
     Action.FORWARD, 5, "cpu"),
    ("both full: wait", {}, with_(gpu={"busy": 2}, cpu={"busy": 1}), Action.WAIT, 6, None),
    ("both full, line full: 503", {}, with_(gpu={"busy": 2}, cpu={"busy": 1}, waiting=4),
     Action.REJECT, 7, None),
    ("both full, wait too long: 503", {}, with_(gpu={"busy": 2}, cpu={"busy": 1}, wait_s=90),
     Action.REJECT, 7, None),
    ("both full, deadline shorter than the wait: 503", {"deadline_s": 2.0},
     with_(gpu={"busy": 2}, cpu={"busy": 1}), Action.REJECT, 7, None),
    ("both fatal: 503 at once", {}, with_(gpu={"state": "FATAL"}, cpu={"state": "FATAL"}),
     Action.REJECT, 7, None),
    ("gpu fatal, cpu stopped and not startable: 503", {},
     with_(gpu={"state": "FATAL"}, cpu={"state": "STOPPED"}), Action.REJECT, 7, None),
    ("both starting: wait", {}, with_(gpu={"state": "STARTING"}, cpu={"state": "STARTING"}),
     Action.WAIT, 6, None),
    # Router mode: a model not loaded on the GPU router, whose load would fit (startable).
    ("model loadable on the gpu, cpu has it: cpu now", {},
     with_(gpu={"state": "STOPPED", "startable": True}), Action.FORWARD, 5, "cpu"),
    ("model loadable on the gpu, cpu full: load it on the gpu", {},
     with_(gpu={"state": "STOPPED", "startable": True}, cpu={"busy": 1}), Action.FORWARD, 4,
     "gpu"),
    ("model loadable on both: the gpu", {},
     with_(gpu={"state": "STOPPED", "startable": True},
           cpu={"state": "STOPPED", "startable": True}), Action.FORWARD, 4, "gpu"),
    ("model would not fit the gpu: loaded on the cpu", {},
     with_(gpu={"state": "STOPPED"}, cpu={"state": "STOPPED", "startable": True}),
     Action.FORWARD, 5, "cpu"),
    ("model would not fit the gpu, opted out of the cpu: 503", {"cpu_allowed": False},
     with_(gpu={"state": "STOPPED"}, cpu={"state": "STOPPED", "startable": True}),
     Action.REJECT, 7, None),
]


@pytest.mark.parametrize("name,change,cap,action,branch,child", TABLE, ids=[t[0] for t in TABLE])
def test_the_decision_table(name: str, change: dict[str, object], cap: Capacity, action: Action,
                            branch: int, child: str | None) -> None:
    d = decide(dataclasses.replace(REQ, **change), cap)  # type: ignore[arg-type]
    assert (d.action, d.branch, d.child) == (action, branch, child), d.reason
    if action is Action.WAIT:
        assert d.queue_position == cap.waiting + 1
    if action is Action.REJECT:
        assert d.retry_after_s > 0


def test_too_long_names_the_largest_context_in_llama_servers_words() -> None:
    d = decide(dataclasses.replace(REQ, prompt_tokens=9000), CAP)
    assert d.n_ctx == 8192 and d.cause == "too_long"
    assert d.reason == ("request (9000 tokens) exceeds the available context size (8192 tokens),"
                        " try increasing it")


LOADING_TABLE = [
    # (states, pin, llama-server would say "Loading model")
    ({"gpu": "STARTING", "cpu": "STARTING"}, None, True),
    ({"gpu": "STARTING", "cpu": "BACKOFF"}, None, True),
    ({"gpu": "STARTING", "cpu": "READY"}, None, False),  # someone is ready: not loading
    ({"gpu": "FATAL", "cpu": "BACKOFF"}, None, False),  # nobody loading: llama-server is gone
    ({"gpu": "STARTING", "cpu": "READY"}, "gpu", True),  # the pinned one loads
    ({"gpu": "READY", "cpu": "STARTING"}, "gpu", False),
    ({"gpu": "STOPPED", "cpu": "STARTING"}, "gpu", False),
]


@pytest.mark.parametrize("states,pin,expected", LOADING_TABLE)
def test_loading_is_what_llama_server_would_call_it(states: dict[str, ChildState],
                                                     pin: str | None, expected: bool) -> None:
    assert loading(states, pin) is expected


def test_a_startable_cpu_child_is_started_first() -> None:
    d = decide(REQ, with_(gpu={"busy": 2}, cpu={"state": "STOPPED", "startable": True}))
    assert d.start_child


def test_a_model_loads_on_the_gpu_router_in_the_background_while_the_cpu_serves() -> None:
    d = decide(REQ, with_(gpu={"state": "STOPPED", "startable": True}))
    assert (d.child, d.warm, d.start_child) == ("cpu", "gpu", False)
    d = decide(REQ, with_(gpu={"state": "STOPPED", "startable": True}, cpu={"busy": 1}))
    assert (d.child, d.warm, d.start_child) == ("gpu", None, True)


def test_reasons_say_what_is_full() -> None:
    d = decide(REQ, with_(gpu={"busy": 2}, cpu={"busy": 1}, waiting=4))
    assert "gpu busy (2/2)" in d.reason and "cpu busy (1/1)" in d.reason
    d = decide(REQ, with_(vram_free_mib=500, cpu={"busy": 1}))
    assert "500 MiB free, under the 1024 MiB headroom" in d.reason


def test_a_prompt_only_a_stopped_gpu_child_can_take_is_told_why_and_when() -> None:
    """The GPU child stopped (lent to another program, paused: not coming back by itself),
    the prompt over the CPU child's context: refused, saying so, with a Retry-After that is
    not the waiting line's estimate for requests it could serve."""
    lent = with_(gpu={"state": "STOPPED", "back_in_s": None}, cpu={"ctx_per_slot": 256})
    d = decide(dataclasses.replace(REQ, prompt_tokens=600), lent)
    assert (d.action, d.cause, d.retry_after_s) == (Action.REJECT, "no_child", 30.0)
    assert d.reason == ("no child can take it: gpu is STOPPED, cpu busy (0/1); the prompt "
                        "(about 600 tokens) is over the CPU child's context (256 tokens a "
                        "slot)"), d.reason
    # On its way back (a restart under way), it is waited for instead.
    back = with_(gpu={"state": "BACKOFF", "back_in_s": 4.0}, cpu={"ctx_per_slot": 256})
    assert decide(dataclasses.replace(REQ, prompt_tokens=600), back).action is Action.WAIT


def test_the_head_of_the_line_goes_only_when_it_can_be_forwarded() -> None:
    assert can_serve_now(REQ, with_(gpu={"busy": 2}, cpu={"busy": 1})) is None
    d = can_serve_now(REQ, with_(gpu={"busy": 1}, cpu={"busy": 1}))
    assert d is not None and d.child == "gpu"


def test_routes_outside_generation_are_outside_the_caps() -> None:
    assert passthrough({"gpu": "READY", "cpu": "READY"}, None).child == "gpu"
    assert passthrough({"gpu": "BACKOFF", "cpu": "READY"}, None).child == "cpu"
    assert passthrough({"gpu": "READY", "cpu": "READY"}, "cpu").child == "cpu"
    assert passthrough({"gpu": "READY", "cpu": "STOPPED"}, "cpu").action is Action.REJECT


def test_the_estimated_wait_grows_with_the_position() -> None:
    assert estimated_wait(0, 4.0, 2) == 0
    assert estimated_wait(1, 4.0, 2) == 2.0
    assert estimated_wait(4, 4.0, 2) == 8.0
    assert estimated_wait(2, None, 1) > 0


@given(st.integers(0, 5), st.integers(0, 3), st.integers(0, 2), st.integers(0, 2),
       st.booleans(), st.sampled_from(["READY", "BACKOFF", "FATAL", "STARTING"]))
def test_never_forwards_past_a_cap(gpu_busy: int, cpu_busy: int, gpu_cap: int, cpu_cap: int,
                                   cpu_allowed: bool, gpu_state: str) -> None:
    cap = with_(gpu={"busy": gpu_busy, "cap": gpu_cap, "state": gpu_state},
                cpu={"busy": cpu_busy, "cap": cpu_cap})
    d = decide(dataclasses.replace(REQ, cpu_allowed=cpu_allowed), cap)
    if d.action is Action.FORWARD:
        chosen = cap.child(d.child or "")
        assert chosen.ready and chosen.busy < chosen.cap
        assert cpu_allowed or d.child == "gpu"


class WaitLineMachine(RuleBasedStateMachine):
    """Random arrivals, departures and services: order kept, positions only fall, nothing
    lost, the bound held."""

    def __init__(self) -> None:
        super().__init__()
        self.line = WaitLine(max_waiting=8)
        self.model: list[int] = []  # ticket ids in arrival order
        self.positions: dict[int, int] = {}
        self.served: list[int] = []
        self.left: list[int] = []
        self.refused = 0
        self.arrived = 0
        self.now = 0.0

    @rule()
    def arrive(self) -> None:
        self.now += 1
        self.arrived += 1
        ticket = self.line.join(self.now)
        if ticket is None:
            assert len(self.model) == 8
            self.refused += 1
        else:
            self.model.append(ticket.id)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def depart(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(self.model))
        ticket = next(t for t in self.line.tickets() if t.id == tid)
        self.line.leave(ticket)
        self.model.remove(tid)
        self.left.append(tid)

    @precondition(lambda self: self.model)
    @rule()
    def serve(self) -> None:
        head = self.line.head()
        assert head is not None and head.id == self.model[0]  # first in, first out
        self.line.leave(head)
        self.served.append(self.model.pop(0))

    @invariant()
    def order_positions_and_bound(self) -> None:
        tickets = self.line.tickets()
        assert [t.id for t in tickets] == self.model
        assert len(tickets) <= 8
        for t in tickets:
            position = self.line.position(t)
            assert position == self.model.index(t.id) + 1
            assert position <= self.positions.get(t.id, position)  # positions only fall
            self.positions[t.id] = position

    @invariant()
    def nothing_lost(self) -> None:
        assert self.arrived == (len(self.model) + len(self.served) + len(self.left)
                                + self.refused)
        assert self.served == sorted(self.served)  # served in arrival order


TestWaitLine = WaitLineMachine.TestCase
TestWaitLine.settings = settings(max_examples=60, stateful_step_count=60)


def test_the_service_estimate_says_what_it_rests_on() -> None:
    assert service_estimate(2.5, 10.0) == (2.5, "measured")
    # None finished yet: at least as long as the first has been running (and a floor).
    assert service_estimate(None, 3.0) == (3.0, "running")
    assert service_estimate(None, 0.0) == (MIN_SERVICE_S, "running")
    assert service_estimate(None, None) == (DEFAULT_SERVICE_S, "default")


def test_a_child_on_its_way_back_shortens_the_estimated_wait() -> None:
    # One slot ready (1 s a request); the GPU child's two slots are back in 2 s.
    assert estimated_wait(2, 1.0, 1, [(2.0, 2)]) == 2.0  # served before it returns
    # Position 5: 2 served in the first 2 s, then 3 slots: 3 more in 1 s.
    assert estimated_wait(5, 1.0, 1, [(2.0, 2)]) == 3.0
    assert estimated_wait(5, 1.0, 1) == 5.0  # counting only the ready child
    # Nothing ready: nothing is served until it returns.
    assert estimated_wait(4, 1.0, 0, [(3.0, 2)]) == 5.0
    assert estimated_wait(4, 1.0, 0) == 4.0  # as before: one server assumed


@given(st.integers(1, 200), st.floats(0.01, 30), st.integers(0, 4), st.floats(0, 60),
       st.integers(1, 4))
def test_a_returning_child_never_makes_the_wait_longer(position: int, service: float,
                                                       servers: int, back_in: float,
                                                       cap: int) -> None:
    alone = estimated_wait(position, service, servers)
    with_it = estimated_wait(position, service, servers, [(back_in, cap)])
    if servers > 0:
        assert with_it <= alone + 1e-9
    assert with_it >= position * service / (servers + cap) - 1e-9  # never beyond all of them


def test_the_earliest_expected_finish_waits_for_the_gpu_child_when_it_is_clearly_sooner() -> None:
    """5w: the GPU child back in 5 s and 2 s of its own time beats the CPU child's 60 s."""
    restarting = {"state": ChildState.STARTING, "back_in_s": 5.0, "expected_s": 2.0}
    d = decide(REQ, with_(gpu=restarting, cpu={"expected_s": 60.0}))
    assert (d.action, d.branch, d.child) == (Action.WAIT, 6, None)
    assert d.expected_s == pytest.approx(7.0) and d.retry_after_s == pytest.approx(7.0)
    assert "answered in about 7 s there, against about 60 s on the CPU child" in d.reason
    # Not clearly sooner (7 against 8: within the margin): the CPU child now.
    close = decide(REQ, with_(gpu=restarting, cpu={"expected_s": 8.0}))
    assert (close.action, close.child, close.expected_s) == (Action.FORWARD, "cpu", 8.0)
    # Requests ahead in line go to the GPU child first: 3 ahead of 2 s each on one slot make
    # 5 + 6 + 2 = 13 s, not clearly sooner than 12 s: the CPU child.
    crowded = with_(gpu={**restarting, "cap": 1}, cpu={"expected_s": 12.0}, waiting=3)
    assert decide(REQ, crowded).child == "cpu"
    assert decide(REQ, dataclasses.replace(crowded, waiting=1)).action is Action.WAIT  # 9 s
    # A full line: the CPU child takes it now rather than refusing it.
    assert decide(REQ, with_(gpu=restarting, cpu={"expected_s": 60.0}, waiting=4)).child \
        == "cpu"
    # The GPU's speed unknown, or not coming back by itself: no forecast, the CPU child.
    for gpu in ({**restarting, "expected_s": None}, {**restarting, "back_in_s": None},
                {"state": ChildState.FATAL, "expected_s": 2.0}):
        assert decide(REQ, with_(gpu=gpu, cpu={"expected_s": 60.0})).child == "cpu"
    # The client's deadline still rules: it will not wait 7 s.
    hurried = dataclasses.replace(REQ, deadline_s=6.0)
    assert decide(hurried, with_(gpu=restarting, cpu={"expected_s": 5.0})).child == "cpu"


def test_no_wait_for_a_gpu_child_already_overdue_or_a_wait_past_half_the_limit() -> None:
    """A GPU child whose start already took longer than its last one (no time left in its
    forecast) is no reason to wait; nor is a wait over half of what the client allows: a late
    return must leave the CPU child time to answer."""
    overdue = {"state": ChildState.STARTING, "back_in_s": 0.0, "expected_s": 2.0}
    assert decide(REQ, with_(gpu=overdue, cpu={"expected_s": 60.0})).child == "cpu"
    # One already waiting for it goes on waiting while it is only a little late (the head of
    # the line is asked again as capacity changes), for up to half of its allowed wait (60 s
    # here), and not once the child is far past its forecast (back in: None).
    waiting = with_(gpu=overdue, cpu={"expected_s": 60.0}, max_wait_s=60)
    assert can_serve_now(REQ, waiting, waited_s=3.0) is None
    assert can_serve_now(REQ, waiting, waited_s=30.0).child == "cpu"
    late = {**overdue, "back_in_s": None}
    assert can_serve_now(REQ, with_(gpu=late, cpu={"expected_s": 60.0}), 3.0).child == "cpu"
    restarting = {"state": ChildState.STARTING, "back_in_s": 5.0, "expected_s": 2.0}
    assert decide(REQ, with_(gpu=restarting, cpu={"expected_s": 60.0}, max_wait_s=9)).child \
        == "cpu"  # a wait of 5 s is over half of 9
    assert decide(REQ, with_(gpu=restarting, cpu={"expected_s": 60.0}, max_wait_s=10)).action \
        is Action.WAIT
    # The limit bounds the wait, not the answer: a long prompt's 40 s on the GPU child after
    # a return in 1 s still beats 200 s on the CPU child, with 60 s allowed in line.
    long = {**restarting, "back_in_s": 1.0, "expected_s": 40.0}
    assert decide(REQ, with_(gpu=long, cpu={"expected_s": 200.0}, max_wait_s=60)).action \
        is Action.WAIT
    # A client's deadline bounds the whole answer: 41 s is over half of its 60 s, and the
    # CPU child's 55 s fit in it.
    hurried = dataclasses.replace(REQ, deadline_s=60.0)
    assert decide(hurried, with_(gpu=long, cpu={"expected_s": 55.0})).child == "cpu"
    assert decide(REQ, with_(gpu=long, cpu={"expected_s": 55.0})).action is Action.WAIT


def test_the_earliest_expected_finish_is_off_with_failover_wait_for_gpu_false() -> None:
    """failover.wait_for_gpu = false: the CPU child takes what it can take now, however soon
    the GPU child is back (the behaviour before 5w, and the benchmark's baseline)."""
    restarting = {"state": ChildState.STARTING, "back_in_s": 5.0, "expected_s": 2.0}
    off = with_(gpu=restarting, cpu={"expected_s": 60.0}, wait_for_gpu=False)
    d = decide(REQ, off)
    assert (d.action, d.branch, d.child, d.expected_s) == (Action.FORWARD, 5, "cpu", 60.0)
    # With the CPU child full it still waits in line, as any request does (branch 6), and
    # whichever child frees first serves it.
    full = with_(gpu=restarting, cpu={"expected_s": 60.0, "busy": 1}, wait_for_gpu=False)
    assert (decide(REQ, full).action, decide(REQ, full).branch) == (Action.WAIT, 6)
