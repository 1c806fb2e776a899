"""What comes after a failed attempt (serving/failover.py), on the real pool with a fake
capacity source and fake upstreams (test_pool.py's): who takes over, the replay and the
continuation rules asked with the pool's figures, a place taken, or why not."""

from __future__ import annotations

import dataclasses

import pytest
from test_pool import FakeSource, make_pool

from supervisor.policy.admission import ChildView
from supervisor.policy.estimate import Work
from supervisor.policy import replay
from supervisor.policy.continuation import Transcript
from supervisor.policy.evidence import FailureKind, Verdict
from supervisor.policy.routes import RouteClass
from supervisor.serving.failover import Cut, Failed, Failover, GiveUp, GoOn, Replay
from supervisor.vocabulary import AttemptFailure

OOM = AttemptFailure("gpu", 1, Verdict(FailureKind.RUNTIME_OOM, "CUDA error: out of memory"))


def failed(failure: AttemptFailure = OOM, **more: object) -> Failed:
    values: dict[str, object] = dict(failure=failure, route=RouteClass.GENERATION,
                                     body_replayable=True, opted_out=False, attempts=1,
                                     deadline_left_s=None, work=Work(33, 16))
    values.update(more)
    return Failed(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(("order", "failed_on", "takes_over"), [
    (("gpu", "cpu"), "gpu", "cpu"), (("gpu", "cpu"), "cpu", "gpu"),
    (("gpu", "small", "cpu"), "gpu", "small"), (("gpu", "small", "cpu"), "cpu", "gpu"),
    (("gpu",), "gpu", None), (("gpu", "cpu"), "other", None),
])
def test_who_takes_over_is_the_next_in_the_configs_order(
        order: tuple[str, ...], failed_on: str, takes_over: str | None) -> None:
    assert replay.takeover(order, failed_on) == takes_over


async def test_a_failure_before_any_byte_is_replayed_on_the_next_upstream() -> None:
    pool = make_pool(FakeSource({"gpu": 1, "cpu": 1}), 4, 30.0)
    nxt = await Failover(pool).after_failure(failed())
    assert isinstance(nxt, Replay) and nxt.lease.name == "cpu"
    assert pool.busy("cpu") == 1  # the place is taken for the replay
    nxt.lease.close(None, None)
    assert pool.busy("cpu") == 0


@pytest.mark.parametrize(("case", "refusal"), [
    (failed(opted_out=True), replay.Refusal.OPTED_OUT),
    (failed(attempts=2), replay.Refusal.ALREADY_REPLAYED),
    (failed(body_replayable=False), replay.Refusal.BODY),
    (failed(route=RouteClass.PASSTHROUGH), replay.Refusal.ROUTE),
    (failed(AttemptFailure("gpu", 1, OOM.verdict, timed_out=True)), replay.Refusal.TIMED_OUT),
])
async def test_the_replay_rule_says_no_and_nothing_is_taken(case: Failed,
                                                            refusal: replay.Refusal) -> None:
    pool = make_pool(FakeSource({"gpu": 1, "cpu": 1}), 4, 30.0)
    nxt = await Failover(pool).after_failure(case)
    assert isinstance(nxt, GiveUp) and nxt.refusal is refusal, nxt
    assert pool.busy("cpu") == 0 and nxt.retry_after_s > 0


async def test_no_upstream_to_take_over_is_a_refusal_for_capacity() -> None:
    source = FakeSource({"gpu": 1, "cpu": 1}, {"gpu": "READY", "cpu": "FATAL"})
    nxt = await Failover(make_pool(source, 4, 30.0)).after_failure(failed())
    assert isinstance(nxt, GiveUp) and nxt.refusal is replay.Refusal.NO_TARGET


def transcript(tokens: int = 3, kind: str = "chat") -> Transcript:
    t = Transcript(kind=kind)
    t.tokens = tokens
    t.text = "Once upon"
    return t


def cut(**more: object) -> Cut:
    values: dict[str, object] = dict(
        failure=OOM, payload={"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 64, "stream": True},
        so_far=transcript(), continued_before=False, deadline_left_s=None,
        work=Work(33, 64), no_prefill=frozenset())
    values.update(more)
    return Cut(**values)  # type: ignore[arg-type]


async def test_a_cut_stream_goes_on_from_the_next_upstream_or_says_why_not() -> None:
    pool = make_pool(FakeSource({"gpu": 1, "cpu": 1}), 4, 30.0)
    nxt = await Failover(pool).after_cut(cut())
    assert isinstance(nxt, GoOn) and nxt.lease.name == "cpu", nxt
    nxt.lease.close(None, None)
    again = await Failover(pool).after_cut(cut(continued_before=True))
    assert isinstance(again, GiveUp) and "at most once" in again.reason
    # An Anthropic stream is continued by prefilling the answer so far: not on an upstream
    # that runs with --no-prefill-assistant.
    no_prefill = await Failover(pool).after_cut(cut(so_far=transcript(kind="messages"),
                                                    no_prefill=frozenset({"cpu"})))
    assert isinstance(no_prefill, GiveUp) and "no-prefill-assistant" in no_prefill.reason
    assert pool.busy("cpu") == 0


class ReturningSource(FakeSource):
    """The GPU child in its back-off after a death, back in a second (ready once waited for),
    10 s a request there; the CPU child ready, its time `cpu_s` (None: not measured yet)."""

    def __init__(self, cpu_s: float | None) -> None:
        super().__init__({"gpu": 1, "cpu": 1}, {"gpu": "BACKOFF", "cpu": "READY"})
        self.cpu_s = cpu_s

    def child_view(self, name: str, busy: int, work: Work,
                   with_estimate: bool = True) -> ChildView:
        gpu = name == "gpu"
        return dataclasses.replace(super().child_view(name, busy, work, with_estimate),
                                   expected_s=10.0 if gpu else self.cpu_s,
                                   back_in_s=1.0 if gpu and self.states[name] != "READY"
                                   else None)

    def expected_seconds(self, name: str, work: Work) -> float | None:
        return 10.0 if name == "gpu" else self.cpu_s

    async def wait_ready(self, name: str, within_s: float) -> float | None:
        self.states[name] = "READY"
        return 1.0


CRASH = AttemptFailure("gpu", 1, Verdict(FailureKind.CRASH, "killed by SIGKILL"))


async def test_a_request_caught_by_a_gpu_death_waits_for_its_return_when_that_is_sooner(
        ) -> None:
    pool = make_pool(ReturningSource(cpu_s=40.0), 4, 60.0)
    nxt = await Failover(pool).after_failure(failed(CRASH))
    assert isinstance(nxt, Replay) and nxt.waited and nxt.lease.name == "gpu", nxt
    assert nxt.forecast_s == 11.0 and "against about 40 s on the CPU child" in nxt.reason


@pytest.mark.parametrize(("case", "cpu_s", "waits"), [
    (failed(CRASH), 12.0, False),  # the CPU child is about as soon
    (failed(CRASH), None, False),  # its time is not known: nothing says waiting is sooner
    (failed(OOM), 40.0, False),  # its own prefill may be what ran out of memory
    (failed(AttemptFailure("gpu", 1, OOM.verdict, stream_started=True)), 40.0, True),
])
async def test_a_request_waits_only_where_the_rule_says_so(case: Failed, cpu_s: float | None,
                                                            waits: bool) -> None:
    pool = make_pool(ReturningSource(cpu_s), 4, 60.0)
    nxt = await Failover(pool).after_failure(case)
    assert isinstance(nxt, Replay) and nxt.waited is waits, nxt
    assert nxt.lease.name == ("gpu" if waits else "cpu")


async def test_without_waiting_the_cpu_child_takes_it() -> None:
    pool = make_pool(ReturningSource(cpu_s=40.0), 4, 60.0)
    pool.wait_for_gpu = False
    nxt = await Failover(pool).after_failure(failed(CRASH))
    assert isinstance(nxt, Replay) and not nxt.waited and nxt.lease.name == "cpu"
