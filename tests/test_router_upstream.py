"""One model on one router (supervisor/router/upstream.py), unit tested: what the router says
(listing, status events, its output lines) drives the model's state; a death backs off and
loads again, too many quick failures make the model FATAL alone, with the crash-loop back-off;
an unload is no failure; a router that goes away takes its instances with it. The router child
and its loads are fakes (FakeRouter, FakeLoader below); time is a fake clock.

What the watch hears is posted to the model's owner task (engine.py): `told` waits until the
owner has taken everything posted so far."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_clock import FakeClock

from supervisor.config.schema import RestartConfig
from supervisor.policy import lifecycle
from supervisor.policy.evidence import FailureKind, VramSample
from supervisor.policy.lifecycle import ChildState as S
from supervisor.policy.router import ModelInfo, StatusChange
from supervisor.router.upstream import ModelUpstream

RESTART = RestartConfig(backoff_initial_s=0.5, backoff_max_s=30.0, quick_failure_s=10.0,
                        max_quick_failures=3, hang_timeout_s=120.0, fatal_retry_max_s=300.0)


class FakeRouter:
    """Stands in for children.Child: a router process whose state the test sets."""

    name = "gpu"
    host = "127.0.0.1"
    port = 4321
    api_key = "k"
    generation = 1
    base_url = "http://127.0.0.1:4321"
    cfg: Any = None
    restart_cfg = RESTART

    def __init__(self) -> None:
        self.state = S.READY
        self.listeners: list[Any] = []
        self._changed = asyncio.Event()

    def backoff_policy(self) -> lifecycle.BackoffPolicy:
        r = RESTART
        return lifecycle.BackoffPolicy(r.backoff_initial_s, r.backoff_max_s, r.quick_failure_s,
                                       r.max_quick_failures, r.fatal_retry_max_s)

    def next_try_in_s(self) -> float | None:
        return None

    def to(self, new: S) -> None:
        old, self.state = self.state, new
        for listener in list(self.listeners):
            listener(self, old, new, "test")
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_state(self, *states: S, timeout: float | None = None) -> bool:
        while self.state not in states:
            await self._changed.wait()
        return True

    async def exit_of(self, generation: int, timeout: float) -> Any:
        return None


class FakeLoader:
    """The router's /models/load and /models/unload: records what was asked; the test plays
    the router's answer (events) itself."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.refuse: str | None = None

    async def load(self, model: str) -> str | None:
        self.loads.append(model)
        return self.refuse

    async def unload(self, model: str) -> str | None:
        self.unloads.append(model)
        return None


def make(vram: VramSample | None = None) -> tuple[ModelUpstream, FakeRouter, FakeLoader,
                                                  FakeClock]:
    router, loader, clock = FakeRouter(), FakeLoader(), FakeClock()
    upstream = ModelUpstream(router, "alpha", loader,  # type: ignore[arg-type]
                             vram_probe=(lambda _t: vram), vram_short_mib=512.0, clock=clock,
                             rng=lambda: 0.5)
    return upstream, router, loader, clock


async def told(upstream: ModelUpstream) -> None:
    """Until the owner has taken every event posted so far, and the tasks they started (a
    load's or an unload's ask, on the fake loader that answers at once) are done and their
    answers taken too."""
    while True:
        await upstream.engine.taken()
        pending = [t for t in upstream._tasks if not t.done()]
        if not pending:
            return
        await asyncio.wait(pending)


async def loaded(upstream: ModelUpstream, port: int = 5001) -> None:
    upstream.heard_spawn(port)
    upstream.heard_status(StatusChange("alpha", "loaded", None, None, 1024, 1000))
    await told(upstream)


async def exited(upstream: ModelUpstream, status: int) -> None:
    upstream.heard_exit(status)
    await told(upstream)


async def settle(clock: FakeClock, seconds: float = 0.0) -> None:
    await clock.sleep(seconds)
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_stopped_to_ready_on_demand_then_a_death_backs_off_and_loads_again() -> None:
    upstream, _, loader, clock = make()
    heard: list[tuple[S, S]] = []
    upstream.listeners.append(lambda _u, old, new, _r: heard.append((old, new)))
    assert upstream.state is S.STOPPED
    upstream.start()  # STOPPED -> STARTING: the pool's on-demand load
    await settle(clock)
    assert loader.loads == ["alpha"] and upstream.state is S.STARTING
    await loaded(upstream)  # STARTING -> READY
    assert upstream.state is S.READY and upstream.generation == 1 and upstream.loads == 1
    assert upstream.running(1)
    upstream.heard_instance_line("ggml.c:123: some assertion")
    await exited(upstream, 1)  # READY -> EXITED -> BACKOFF
    assert upstream.state is S.BACKOFF and not upstream.running(1)
    record = await upstream.exit_of(1, 0.1)
    assert record is not None and record.kind is FailureKind.CRASH and not record.planned
    assert "exited with status 1" in record.evidence
    # The same death, told again by the status event: no second failure.
    upstream.heard_status(StatusChange("alpha", "unloaded", 1, None, None, None))
    await told(upstream)
    assert upstream.failures == 1
    # BACKOFF -> STARTING: loaded again, by Spillway, after the back-off (0.5 s, jitter 1.0x).
    await settle(clock, 0.6)
    assert loader.loads == ["alpha", "alpha"] and upstream.state is S.STARTING
    await loaded(upstream, port=5002)
    assert upstream.state is S.READY and upstream.generation == 2
    assert (S.READY, S.EXITED) in heard and (S.EXITED, S.BACKOFF) in heard


@pytest.mark.asyncio
async def test_a_terse_cuda_line_with_vram_short_is_a_runtime_oom() -> None:
    upstream, _, _, _ = make(vram=VramSample(free_mib=61, total_mib=143771, age_s=0.4))
    await loaded(upstream)
    upstream.heard_instance_line("/src/ggml-cuda.cu:109: CUDA error")
    await exited(upstream, 1)
    assert upstream.last_exit is not None
    assert upstream.last_exit.kind is FailureKind.RUNTIME_OOM
    assert "61 MiB" in upstream.last_exit.evidence


@pytest.mark.asyncio
async def test_quick_failures_make_the_model_fatal_then_the_crash_loop_back_off_tries() -> None:
    upstream, _, loader, clock = make()
    for _ in range(RESTART.max_quick_failures):
        if upstream.state is S.BACKOFF:
            await settle(clock, upstream.next_try_in_s() or 0.0)
        else:
            upstream.start()
            await settle(clock)
        assert upstream.state is S.STARTING
        upstream.heard_spawn(5001)
        upstream.heard_instance_line("failed to allocate buffer for kv cache")
        await exited(upstream, 1)  # dies while loading: a quick failure
    assert upstream.state is S.FATAL
    assert upstream.last_exit is not None and upstream.last_exit.kind is FailureKind.LOAD_OOM
    assert len(loader.loads) == RESTART.max_quick_failures
    # FATAL means "stop hammering": not started on demand (nor by the router's autoload, which
    # Spillway turns off).
    upstream.start()
    await told(upstream)
    assert upstream.state is S.FATAL and len(loader.loads) == RESTART.max_quick_failures
    # The crash-loop back-off's first try: min(backoff_max_s, fatal_retry_max_s) = 30 s.
    assert upstream.next_try_in_s() == 30.0
    await settle(clock)
    assert 30.0 in clock.waits  # the wait the try came after (the fake clock jumps through it)
    assert upstream.state is S.STARTING and upstream.fatal_tries == 1
    assert len(loader.loads) == RESTART.max_quick_failures + 1
    # One more quick failure is FATAL again, with a doubled wait.
    upstream.heard_spawn(5001)
    await exited(upstream, 1)
    assert upstream.state is S.FATAL and upstream.next_try_in_s() == 60.0
    await settle(clock)
    assert upstream.state is S.STARTING and upstream.fatal_tries == 2
    await loaded(upstream)
    assert upstream.state is S.READY


@pytest.mark.asyncio
async def test_a_load_that_would_not_fit_after_the_back_off_waits_for_demand() -> None:
    upstream, _, loader, clock = make()
    upstream.load_guard = lambda: "loading it needs about 900 MiB of VRAM; 100 MiB free"
    await loaded(upstream)
    await exited(upstream, 1)
    await settle(clock, 1.0)
    # BACKOFF -> STOPPED: not loaded onto a card it does not fit.
    assert upstream.state is S.STOPPED and loader.loads == []
    assert "900 MiB" in upstream.reason


@pytest.mark.asyncio
async def test_an_unload_is_not_a_failure_even_with_status_one() -> None:
    upstream, _, loader, _ = make()
    await loaded(upstream)
    upstream.unload("--models-max reached")
    await told(upstream)
    assert loader.unloads == ["alpha"] and upstream.state is S.STOPPING
    # The router reports an unload that had to kill the instance as status 1, too.
    await exited(upstream, 1)
    assert upstream.state is S.STOPPED and upstream.failures == 0
    # The router's own LRU eviction (its log line) is planned as well.
    await loaded(upstream)
    upstream.heard_eviction()
    upstream.heard_status(StatusChange("alpha", "unloaded", 1, None, None, None))
    await told(upstream)
    assert upstream.state is S.STOPPED and upstream.failures == 0


@pytest.mark.asyncio
async def test_a_router_that_goes_away_takes_the_model_with_it() -> None:
    upstream, router, _, _ = make()
    await loaded(upstream)
    router.to(S.EXITED)
    assert upstream.state is S.EXITED  # the router's state while it is not ready, at once
    assert not upstream.running(1)
    record = await upstream.exit_of(1, 1.0)
    assert record is not None and "router" in record.evidence
    router.to(S.BACKOFF)
    router.to(S.STARTING)
    router.to(S.READY)
    await told(upstream)
    # A fresh router has loaded nothing: the model loads again on demand; no model failure.
    assert upstream.state is S.STOPPED and upstream.failures == 0


@pytest.mark.asyncio
async def test_the_listing_reconciles_what_the_events_missed() -> None:
    upstream, _, _, _ = make()
    info = ModelInfo(name="alpha", status="loaded", failed=False, exit_code=None, args=(),
                     path="/m/alpha.gguf", port=5009, n_ctx=1024, size=1000, aliases=())
    upstream.heard_listing(info)
    await told(upstream)
    assert upstream.state is S.READY and upstream.instance_port == 5009
    gone = ModelInfo(name="alpha", status="unloaded", failed=True, exit_code=1, args=(),
                     path="/m/alpha.gguf", port=5009, n_ctx=None, size=None, aliases=())
    upstream.heard_listing(gone)
    await told(upstream)
    assert upstream.state is S.BACKOFF and upstream.failures == 1


@pytest.mark.asyncio
async def test_a_drain_unloads_when_its_requests_are_done() -> None:
    upstream, _, loader, _ = make()
    await loaded(upstream)
    upstream.load.take(generation=True)
    upstream.drain("OOM survived")
    await told(upstream)
    assert upstream.state is S.DRAINING and loader.unloads == []
    upstream.load.give_back(generation=True)
    await told(upstream)
    await told(upstream)
    assert loader.unloads == ["alpha"] and upstream.state is S.STOPPING
    upstream.heard_status(StatusChange("alpha", "unloaded", 0, None, None, None))
    await told(upstream)
    assert upstream.state is S.STOPPED and upstream.failures == 0


@pytest.mark.asyncio
async def test_a_load_the_router_refuses_leaves_it_stopped_without_a_failure() -> None:
    upstream, _, loader, clock = make()
    loader.refuse = "/models/load answered 400: model limit reached, try again later"
    upstream.start()
    await settle(clock)
    assert upstream.state is S.STOPPED and upstream.failures == 0
    assert "model limit reached" in upstream.reason


@pytest.mark.asyncio
async def test_the_drill_arm_fires_on_the_task_or_on_a_neighbour_load() -> None:
    import signal
    upstream, _, _, _ = make()
    await loaded(upstream)
    for when_neighbour in (False, True):
        proc = await asyncio.create_subprocess_exec("sleep", "30")
        upstream.heard_pid(proc.pid)
        upstream.arm(signal.SIGABRT, on_neighbour_load=when_neighbour)
        upstream.heard_instance_line("slot launch_slot_: id  1 | task 3 | processing task")
        if when_neighbour:
            assert upstream.armed_signal is not None  # a task launching is not the trigger
            upstream.heard_neighbour_load("beta")
        assert await asyncio.wait_for(proc.wait(), 5) == -signal.SIGABRT
        assert upstream.armed_signal is None  # once


@pytest.mark.asyncio
async def test_the_drills_signal_never_reaches_a_process_that_took_a_dead_instances_pid() -> None:
    """The instance's pid is found once, at its load; when the drill fires later the instance
    may be gone and its pid another process's. The signal goes through a pidfd opened as the
    pid was found: to that instance, or nowhere."""
    import signal
    upstream, _, _, _ = make()
    await loaded(upstream)
    gone = await asyncio.create_subprocess_exec("true")
    upstream.heard_pid(gone.pid)
    await gone.wait()
    bystander = await asyncio.create_subprocess_exec("sleep", "30")
    upstream.pid = bystander.pid  # as if the pid were reused: only the pid is the same
    assert upstream.signal_now(signal.SIGKILL)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(bystander.wait()), 0.5)
    bystander.kill()
    await bystander.wait()


@pytest.mark.asyncio
async def test_an_instance_still_running_gives_no_exit_record_after_the_wait() -> None:
    upstream, _, _, _ = make()
    await loaded(upstream)
    assert await upstream.exit_of(1, 0.05) is None  # still running: the caller decides
    assert await upstream.exit_of(7, 0.05) is None  # no such instance
