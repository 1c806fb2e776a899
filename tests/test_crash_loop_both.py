"""One crash loop for children and model instances (policy/lifecycle.step): a table of
deaths, run against the pure step, then against a child (on fake
processes, tests/fake_launcher.py) and a model's instance on a router (on a fake router and
loader, as in test_router_upstream.py), each on a fake clock. Both must take the table's path:
the same states, the same waits before each next try, the same counters."""

from __future__ import annotations

from dataclasses import dataclass
import pytest
from fake_clock import FakeClock
from test_child_lifecycle import Rig, quick_crash
from test_router_upstream import FakeLoader, FakeRouter, exited, loaded, settle

from supervisor.policy import lifecycle
from supervisor.policy.lifecycle import ChildState as S
from supervisor.router.upstream import ModelUpstream

# test_router_upstream.RESTART's figures: the fake router's back-off policy.
POLICY = lifecycle.BackoffPolicy(initial_s=0.5, max_s=30.0, quick_failure_s=10.0,
                                 max_quick_failures=3, fatal_retry_max_s=300.0)
RESTART = {"backoff_initial_s": 0.5, "backoff_max_s": 30.0, "quick_failure_s": 10.0,
           "max_quick_failures": 3, "fatal_retry_max_s": 300.0}


@dataclass(frozen=True)
class Case:
    name: str
    deaths: int  # quick deaths while starting, then a start that works
    path: tuple[str, ...]  # the states entered after the deaths (BACKOFF, FATAL)
    waits: tuple[float, ...]  # the wait before the next try, decided at each death
    fatal_tries: int


CASES = [
    Case("two quick deaths back off, doubling", 2, ("BACKOFF", "BACKOFF"), (0.5, 1.0), 0),
    Case("three are FATAL; its try fails quickly: FATAL again, twice as long", 4,
         ("BACKOFF", "BACKOFF", "BACKOFF", "FATAL", "BACKOFF", "FATAL"),
         (0.5, 1.0, 30.0, 60.0), 2),
]


def pure_path(case: Case) -> tuple[list[str], list[float], lifecycle.CrashLoop]:
    """The table, from the pure step alone: quick deaths while starting, each next try when
    its wait is over, then the start that works."""
    life = lifecycle.Life(state=S.STARTING, wanted=True, generation=1, running=True)
    path: list[str] = []
    waits: list[float] = []
    now = 1000.0

    def step(event: lifecycle.Event) -> list[lifecycle.Action]:
        nonlocal life
        ctx = lifecycle.Context(now=now, policy=POLICY, manner=lifecycle.CHILD)
        life, actions = lifecycle.step(life, event, ctx)
        return actions

    for _ in range(case.deaths):
        if life.next_try_at is not None:
            now = life.next_try_at
            step(lifecycle.Due(now))  # the next try, from BACKOFF or FATAL
        actions = step(lifecycle.Ended(life.generation, False, "crash: x", run_s=0.1))
        path += [str(a.new) for a in actions if isinstance(a, lifecycle.Enter)
                 and a.new in (S.BACKOFF, S.FATAL)]
        waits += [a.after_s for a in actions if isinstance(a, lifecycle.WakeAt)]
    if life.next_try_at is not None:
        now = life.next_try_at
        step(lifecycle.Due(now))  # the start that works is a try too
    return path, waits, life.loop


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_pure_step_takes_the_tables_path(case: Case) -> None:
    path, waits, loop = pure_path(case)
    assert tuple(path) == case.path and tuple(waits) == case.waits
    assert loop.fatal_tries == case.fatal_tries


def _entered(seen: list[tuple[S, S, float | None]]) -> tuple[list[str], list[float | None]]:
    """The BACKOFF and FATAL states entered, and the wait said as each death was told (on
    its EXITED -> BACKOFF)."""
    path = [str(new) for _, new, _ in seen if new in (S.BACKOFF, S.FATAL)]
    waits = [w for old, new, w in seen if old is S.EXITED and new is S.BACKOFF]
    return path, waits


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_a_child_takes_the_tables_path(case: Case) -> None:
    seen: list[tuple[S, S, float | None]] = []
    crashes = [quick_crash(1) for _ in range(case.deaths)]
    async with Rig(*crashes, **RESTART) as rig:
        rig.child.listeners.append(lambda _c, old, new, _why: seen.append((old, new, None)))
        rig.child.start()
        await rig.until(S.READY)
        path, _ = _entered(seen)
        assert tuple(path) == case.path
        # The child's owner waits each one out on its clock: the table's waits, in order.
        assert rig.clock.waits == list(case.waits)
        assert rig.child.fatal_tries == case.fatal_tries


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_a_model_instance_takes_the_tables_path(case: Case) -> None:
    router, loader, clock = FakeRouter(), FakeLoader(), FakeClock()
    upstream = ModelUpstream(router, "alpha", loader,  # type: ignore[arg-type]
                             clock=clock, rng=lambda: 0.5)
    seen: list[tuple[S, S, float | None]] = []
    upstream.listeners.append(
        lambda u, old, new, _why: seen.append((old, new, u.next_try_in_s())))
    upstream.start()
    await settle(clock)
    for _ in range(case.deaths):
        assert upstream.state is S.STARTING
        upstream.heard_spawn(5001)
        await exited(upstream, 1)  # dies while loading: a quick failure
        await settle(clock, upstream.next_try_in_s() or 0.0)
    await loaded(upstream)
    assert upstream.state is S.READY
    path, waits = _entered(seen)
    assert tuple(path) == case.path
    assert waits == list(case.waits)  # its status says each wait as the death is told
    assert upstream.fatal_tries == case.fatal_tries
    await upstream.close()
