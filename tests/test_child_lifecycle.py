"""The child's lifecycle, unit tested: the owner task of supervisor/upstreams/children.py on fake
processes (tests/fake_launcher.py) and a fake clock (tests/fake_clock.py). No process is
started and nothing sleeps: minutes of back-off, hang and grace run in moments, and the
times the child saw are exact.

The tests are named after the transitions they take (policy/lifecycle.py's table); the last
ones check that every transition of the table is taken by the test named for it.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import pytest
from fake_clock import FakeClock
from fake_launcher import FakeLauncher, FakeProcess, Script

from supervisor.upstreams import children
from supervisor.upstreams.children import HEALTH_POLL_S, LIVENESS_POLL_S, LIVENESS_TIMEOUT_S, Child
from supervisor.config.schema import ChildConfig, RestartConfig
from supervisor.upstreams.launcher import pick_port as real_pick_port
from supervisor.policy.evidence import VramSample
from supervisor.policy.lifecycle import TRANSITIONS, ChildState

S = ChildState
Edge = tuple[ChildState, ChildState]
CUDA_LINE = "/src/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error"
SIGTERM, SIGKILL, SIGABRT = int(signal.SIGTERM), int(signal.SIGKILL), int(signal.SIGABRT)

TAKEN: set[Edge] = set()  # every transition any rig saw (the edge tests clear it first)


def quick_crash(code: int = -SIGABRT, *last_words: str, after_s: float = 0.05) -> Script:
    """Dies while loading, before its first health probe says ready."""
    return Script(ready_after=None, exit_after_s=after_s, exit_code=code,
                  last_words=last_words)


class Rig:
    """A child on a fake launcher and a fake clock, and what it did."""

    def __init__(self, *scripts: Script, default: Script | None = None,
                 jitter: Iterable[float] = (0.5,), start_timeout_s: float = 60.0,
                 stop_grace_s: float = 5.0, hang_timeout_s: float = 30.0,
                 drain_timeout_s: float = 20.0, vram: VramSample | None = None,
                 **restart: Any) -> None:
        self.clock = FakeClock(fake_processes=True)
        self.launcher = FakeLauncher(self.clock, *scripts, default=default)
        cfg = ChildConfig(name="gpu", llama_server="/opt/llama/llama-server",
                          model_path="/models/tiny.gguf", args=("-c", "4096"),
                          env={"CHILD_SETTING": "1"}, start_timeout_s=start_timeout_s,
                          stop_grace_s=stop_grace_s, max_concurrency=None)
        policy: dict[str, Any] = dict(backoff_initial_s=1.0, backoff_max_s=8.0,
                                      quick_failure_s=30.0, max_quick_failures=3,
                                      hang_timeout_s=hang_timeout_s, fatal_retry_max_s=60.0)
        policy.update(restart)
        self.jitters = itertools.cycle(jitter)  # rng 0.5: the jitter factor is exactly 1
        self.vram_at: list[float] = []
        self.child = Child(cfg, RestartConfig(**policy), drain_timeout_s=drain_timeout_s,
                           hang_timeout_s=hang_timeout_s, rng=lambda: next(self.jitters),
                           vram_probe=self._vram if vram is not None else None,
                           extra_env={"CUDA_VISIBLE_DEVICES": "GPU-1"},
                           clock=self.clock, launcher=self.launcher)
        self.vram = vram
        # (clock time, from, to, reason, the child's status then)
        self.seen: list[tuple[float, ChildState, ChildState, str, dict[str, Any]]] = []
        self._changed = asyncio.Event()
        self.child.listeners.append(self._saw)

    def _saw(self, child: Child, old: ChildState, new: ChildState, reason: str) -> None:
        self.seen.append((self.clock.now(), old, new, reason, child.to_json()))
        TAKEN.add((old, new))
        self._changed.set()

    def _vram(self, moment: float) -> VramSample | None:
        self.vram_at.append(moment)
        return self.vram

    async def __aenter__(self) -> Rig:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.child.close()

    async def until(self, *states: ChildState) -> None:
        # A real timeout only as a guard: virtual time gets anywhere in moments.
        assert await self.child.wait_state(*states, timeout=10), (self.path(), self.child.to_json())

    async def reached(self, state: ChildState, nth: int = 0) -> None:
        """Until the child has entered `state` `nth` + 1 times (it may have left it since: a
        transient state such as EXITED cannot be waited for with `until`)."""
        async def entered() -> None:
            while sum(new is state for _, _, new, _, _ in self.seen) <= nth:
                self._changed.clear()
                await self._changed.wait()
        try:
            await asyncio.wait_for(entered(), 10)
        except TimeoutError:
            raise AssertionError((self.path(), self.child.to_json())) from None

    def path(self) -> list[str]:
        return [f"{old} -> {new}" for _, old, new, _, _ in self.seen]

    def when(self, new: ChildState, nth: int = 0) -> float:
        """The clock's time of the `nth` transition into `new`."""
        return [t for t, _, state, _, _ in self.seen if state is new][nth]

    def reasons(self, new: ChildState) -> list[str]:
        return [reason for _, _, state, reason, _ in self.seen if state is new]

    def status_at(self, new: ChildState) -> list[dict[str, Any]]:
        return [status for _, _, state, _, status in self.seen if state is new]

    @property
    def procs(self) -> list[FakeProcess]:
        return self.launcher.processes


# --- STOPPED -> STARTING -> READY ----------------------------------------------------------


async def test_stopped_to_starting_to_ready() -> None:
    async with Rig(Script(ready_after=3, lines=["main: loading model"])) as rig:
        rig.child.start()
        await rig.until(S.READY)
        assert rig.path() == ["STOPPED -> STARTING", "STARTING -> READY"]
        # Probes 1 and 2 say "loading", probe 3 says ready: two whole polls between them.
        assert rig.procs[0].probes == 3
        assert rig.clock.process_waits == [HEALTH_POLL_S, HEALTH_POLL_S]
        assert rig.when(S.READY) - rig.when(S.STARTING) == pytest.approx(2 * HEALTH_POLL_S)
        assert rig.child.last_start_s == pytest.approx(2 * HEALTH_POLL_S)
        assert rig.reasons(S.STARTING) == ["starting"]
        assert rig.child.pid == rig.procs[0].pid and rig.child.generation == 1
        assert rig.child.stderr_tail[-1] == "main: loading model"
        assert rig.child.restarts == 0 and rig.child.last_exit is None


async def test_the_key_travels_in_the_environment_and_each_start_gets_a_new_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    avoided: list[int | None] = []

    def pick_port(avoid: int | None = None) -> int:
        avoided.append(avoid)
        return real_pick_port(avoid)

    monkeypatch.setattr(children, "pick_port", pick_port, raising=True)
    async with Rig() as rig:
        rig.child.start()
        await rig.until(S.READY)
        first = rig.child.port
        rig.child.restart("new port")
        await rig.until(S.STOPPING)
        await rig.until(S.READY)
        (argv1, env1), (argv2, env2) = rig.launcher.spawns
        assert argv2[:3] == ["/opt/llama/llama-server", "-m", "/models/tiny.gguf"]
        assert argv2[3:] == ["-c", "4096", "--host", "127.0.0.1", "--port", str(rig.child.port)]
        assert rig.child.port != first and argv1[-1] == str(first)
        assert avoided == [None, first]  # never the last process's port
        # The key is never on a command line (readable in /proc by every local user).
        assert "--api-key" not in argv2 and rig.child.api_key not in argv2
        assert env2["LLAMA_API_KEY"] == rig.child.api_key != env1["LLAMA_API_KEY"]
        assert env2["CHILD_SETTING"] == "1" and env2["CUDA_VISIBLE_DEVICES"] == "GPU-1"
        assert env2["GGML_NO_BACKTRACE"] == "1"


def test_two_children_starting_together_never_get_the_same_port() -> None:
    # The kernel may say the same port is free to two asks in a row (nothing bound it in
    # between): the second child must not be given it.
    answers = iter([41001, 41001, 41001, 41002, 41001, 41003])
    first = real_pick_port(probe=lambda: next(answers))
    second = real_pick_port(probe=lambda: next(answers))
    assert (first, second) == (41001, 41002)
    with pytest.raises(StopIteration):  # 41001 (given) and 41003 (avoided): none it may give
        real_pick_port(avoid=41003, probe=lambda: next(answers))


# --- STARTING -> EXITED -> BACKOFF -> STARTING, and FATAL -----------------------------------


async def test_starting_to_exited_to_backoff_to_starting_with_jitter() -> None:
    async with Rig(quick_crash(1), quick_crash(1), jitter=(0.0, 0.9),
                   backoff_initial_s=1.0, backoff_max_s=8.0, max_quick_failures=5) as rig:
        rig.child.start()
        await rig.until(S.READY)
        assert rig.path() == [
            "STOPPED -> STARTING", "STARTING -> EXITED", "EXITED -> BACKOFF",
            "BACKOFF -> STARTING", "STARTING -> EXITED", "EXITED -> BACKOFF",
            "BACKOFF -> STARTING", "STARTING -> READY"]
        # Back-off 1 s then 2 s, times the jitter factor 0.75 + 0.5 * rng: 0.75 and 1.2.
        assert rig.clock.waits == pytest.approx([1.0 * 0.75, 2.0 * 1.2])
        for n, delay in enumerate([0.75, 2.4]):
            assert rig.when(S.STARTING, n + 1) - rig.when(S.BACKOFF, n) == pytest.approx(delay)
        assert rig.reasons(S.BACKOFF)[0] == "restart in 0.8 s after crash: exited with code 1"
        assert rig.reasons(S.STARTING)[1:] == ["backoff over", "backoff over"]
        assert rig.child.quick_failures == 2 and rig.child.restarts == 2
        assert [p.signals for p in rig.procs[:2]] == [[], []]  # they died on their own


async def test_quick_failures_in_a_row_go_fatal_then_the_crash_loop_back_off_tries_again(
        ) -> None:
    crash = quick_crash(-SIGABRT, CUDA_LINE)
    async with Rig(crash, crash, crash, crash, backoff_initial_s=1.0, backoff_max_s=4.0,
                   max_quick_failures=3, fatal_retry_max_s=20.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        # 1 s, 2 s, then FATAL: min(backoff_max_s, fatal_retry_max_s) = 4 s; the try from
        # FATAL fails quickly too: FATAL again, twice as long; the next try is ready.
        assert rig.clock.waits == [1.0, 2.0, 4.0, 8.0]
        assert rig.path() == [
            "STOPPED -> STARTING", "STARTING -> EXITED", "EXITED -> BACKOFF",
            "BACKOFF -> STARTING", "STARTING -> EXITED", "EXITED -> BACKOFF",
            "BACKOFF -> STARTING", "STARTING -> EXITED", "EXITED -> BACKOFF", "BACKOFF -> FATAL",
            "FATAL -> STARTING", "STARTING -> EXITED", "EXITED -> BACKOFF", "BACKOFF -> FATAL",
            "FATAL -> STARTING", "STARTING -> READY"]
        assert rig.reasons(S.STARTING)[3:] == [
            "try 1 from FATAL (crash-loop back-off)", "try 2 from FATAL (crash-loop back-off)"]
        fatal = rig.reasons(S.FATAL)
        assert fatal[0] == (f"3 quick failures in a row; last: cuda_error: {CUDA_LINE.strip()} "
                            "(killed by SIGABRT); next try in 4 s")
        assert fatal[1].endswith("next try in 8 s")
        assert [s["next_try_in_s"] for s in rig.status_at(S.FATAL)] == [4.0, 8.0]
        assert rig.when(S.STARTING, 3) - rig.when(S.FATAL, 0) == pytest.approx(4.0)
        assert rig.child.fatal_tries == 2 and rig.child.restarts == 4


async def test_a_long_run_clears_the_quick_failures() -> None:
    async with Rig(quick_crash(1), Script(exit_after_s=45.0, exit_code=-SIGABRT),
                   backoff_initial_s=2.0) as rig:
        rig.child.start()
        await rig.reached(S.BACKOFF, 1)  # the 45 s run died
        assert rig.child.quick_failures == 0
        assert rig.child.last_exit is not None and rig.child.last_exit.run_s == pytest.approx(45)
        await rig.reached(S.READY, 1)
        assert rig.clock.waits == [2.0, 2.0]  # the initial back-off again, not 4 s


# --- READY -> EXITED, DRAINING -> EXITED ----------------------------------------------------


async def test_ready_to_exited_on_a_crash_records_the_evidence() -> None:
    last_words = ["slot update_slots: id 0 | task 3 | prompt processing", CUDA_LINE]
    async with Rig(Script(exit_after_s=100.0, exit_code=-SIGABRT, last_words=last_words),
                   backoff_initial_s=3.0) as rig:
        rig.child.start()
        await rig.reached(S.EXITED)
        record = rig.child.last_exit
        assert record is not None and record is await rig.child.exit_of(1, timeout=1)
        assert (record.returncode, record.signal_name, record.kind) == (
            -SIGABRT, "SIGABRT", "cuda_error")
        assert record.evidence == f"{CUDA_LINE} (killed by SIGABRT)"
        assert record.pid == rig.procs[0].pid and not record.planned and not record.served
        assert record.run_s == pytest.approx(100.0)
        assert rig.path()[1:4] == ["STARTING -> READY", "READY -> EXITED", "EXITED -> BACKOFF"]
        assert rig.reasons(S.EXITED) == [f"cuda_error: {record.evidence}"]
        # A long run: not a quick failure; the initial back-off.
        assert rig.child.quick_failures == 0
        await rig.reached(S.READY, 1)
        assert rig.clock.waits == [3.0]
        assert rig.child.pid == rig.procs[1].pid


async def test_a_sigabrt_with_the_card_short_of_memory_is_a_runtime_oom() -> None:
    vram = VramSample(free_mib=120.0, total_mib=24576.0, age_s=0.5)
    async with Rig(Script(exit_after_s=10.0, exit_code=-SIGABRT, last_words=[CUDA_LINE]),
                   vram=vram) as rig:
        rig.child.start()
        await rig.reached(S.EXITED)
        record = rig.child.last_exit
        assert record is not None and record.kind == "runtime_oom"
        assert "free VRAM 120 MiB of 24576 MiB" in record.evidence
        assert len(rig.vram_at) == 1  # asked once, at the death


async def test_a_run_that_served_a_request_is_not_a_quick_failure_and_an_armed_signal_fires(
        ) -> None:
    async with Rig(backoff_initial_s=2.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        rig.child.arm(SIGABRT)  # the drill without a GPU
        rig.procs[0].say("slot launch_slot_: id  0 | task 0 | processing task")
        await rig.reached(S.EXITED)
        assert rig.procs[0].signal_numbers == [SIGABRT]  # sent as the task launched
        record = rig.child.last_exit
        assert record is not None and record.served and record.returncode == -SIGABRT
        assert record.run_s < 30.0 and rig.child.tasks_started == 1
        await rig.reached(S.BACKOFF)
        assert rig.child.quick_failures == 0 and rig.child.armed_signal is None


async def test_draining_to_exited_when_it_dies_while_draining() -> None:
    async with Rig() as rig:
        rig.child.start()
        await rig.until(S.READY)
        rig.child.load.take(generation=True)
        rig.child.drain("OOM survived")
        await rig.until(S.DRAINING)
        rig.procs[0].crash(-SIGKILL)
        await rig.until(S.BACKOFF)
        assert rig.path()[2:] == ["READY -> DRAINING", "DRAINING -> EXITED", "EXITED -> BACKOFF"]
        assert rig.procs[0].signals == []
        assert rig.child.last_exit is not None and rig.child.last_exit.kind == "crash"
        rig.child.load.give_back(generation=True)


# --- hang and start timeouts ----------------------------------------------------------------


async def test_a_hung_child_is_killed_after_the_hang_timeout() -> None:
    # Ready at its spawn; /health stops answering 5 s later, and SIGTERM is ignored.
    async with Rig(Script(hang_after_s=5.0, ignores_sigterm=True), hang_timeout_s=30.0) as rig:
        rig.child.start()
        await rig.reached(S.EXITED)
        t0 = rig.when(S.READY)
        assert t0 == rig.procs[0].spawned_at
        # Probes answer at +2 and +4; each later one takes its whole 10 s: +6..16, +18..28,
        # +30..40, when nothing has answered for 36 s > 30 s. SIGTERM, 1 s, SIGKILL.
        assert (LIVENESS_POLL_S, LIVENESS_TIMEOUT_S) == (2.0, 10.0)
        assert rig.procs[0].signals == [(t0 + 40.0, SIGTERM), (t0 + 41.0, SIGKILL)]
        assert rig.procs[0].probes == 6  # the one that found it ready, 2 answered, 3 not
        record = rig.child.last_exit
        assert record is not None and record.kind == "hang" and not record.planned
        assert record.evidence == "/health unanswered for 30 s (killed by SIGKILL)"
        assert rig.path()[:3] == ["STOPPED -> STARTING", "STARTING -> READY", "READY -> EXITED"]


async def test_hang_detection_off_never_kills() -> None:
    async with Rig(Script(hang_after_s=5.0), hang_timeout_s=0.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        while rig.procs[0].probes < 20:  # 20 probes that got no answer: minutes of silence
            await rig.clock.sleep(1.0)
        assert rig.child.state is S.READY and rig.procs[0].signals == []


async def test_start_timeout() -> None:
    async with Rig(Script(ready_after=None), start_timeout_s=5.0, stop_grace_s=2.0) as rig:
        rig.child.start()
        await rig.reached(S.EXITED)
        t0 = rig.when(S.STARTING)
        [(term_at, sig)] = rig.procs[0].signals
        assert sig == SIGTERM and 5.0 < term_at - t0 <= 5.0 + 2 * HEALTH_POLL_S
        record = rig.child.last_exit
        assert record is not None and record.kind == "crash" and not record.planned
        assert record.evidence == "not ready after 5 s (start timeout) (exited with code 0)"
        assert rig.path()[:3] == ["STOPPED -> STARTING", "STARTING -> EXITED",
                                  "EXITED -> BACKOFF"]


async def test_start_timeout_kills_a_child_that_ignores_sigterm_after_the_grace() -> None:
    async with Rig(Script(ready_after=None, ignores_sigterm=True), start_timeout_s=5.0,
                   stop_grace_s=2.0) as rig:
        rig.child.start()
        await rig.reached(S.EXITED)
        (term_at, term), (kill_at, kill) = rig.procs[0].signals
        assert (term, kill) == (SIGTERM, SIGKILL) and kill_at - term_at == 2.0


# --- stopping -------------------------------------------------------------------------------


async def test_stop_is_sigterm_then_grace_then_sigkill() -> None:
    async with Rig(Script(ignores_sigterm=True), stop_grace_s=7.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        t = rig.clock.now()
        await rig.child.stop("operator: stop")
        assert rig.procs[0].signals == [(t, SIGTERM), (t + 7.0, SIGKILL)]
        assert rig.path()[-2:] == ["READY -> STOPPING", "STOPPING -> STOPPED"]
        assert rig.reasons(S.STOPPING) == ["operator: stop"]
        assert rig.reasons(S.STOPPED) == ["stopped (killed by SIGKILL)"]
        record = await rig.child.exit_of(1, timeout=1)
        assert record is not None and record.planned and record.returncode == -SIGKILL
        assert rig.child.last_exit is None  # a planned stop is not a failure
        assert rig.child.pid is None


async def test_a_process_that_even_sigkill_does_not_end_is_given_up_on() -> None:
    # (a process stuck in uninterruptible sleep, on a dying GPU driver, say): the stop ends
    # after the grace and SIGKILL's 10 s, and its end is recorded as it is.
    async with Rig(Script(unkillable=True), stop_grace_s=2.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        t = rig.clock.now()
        await rig.child.stop()
        # SIGTERM, the grace, SIGKILL, 10 s; one more SIGKILL as it is reaped, 5 s.
        assert rig.procs[0].signals == [(t, SIGTERM), (t + 2.0, SIGKILL), (t + 12.0, SIGKILL)]
        assert rig.when(S.STOPPED) == t + 17.0
        assert rig.child.state is S.STOPPED and rig.child.pid is None
        record = await rig.child.exit_of(1, timeout=1)
        assert record is not None and record.planned and record.returncode == -SIGKILL


async def test_stop_of_a_child_that_obeys_sigterm_sends_nothing_more() -> None:
    async with Rig(Script(sigterm_exit_s=3.0), stop_grace_s=7.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        t = rig.clock.now()
        await rig.child.stop()
        assert rig.procs[0].signals == [(t, SIGTERM)]
        assert rig.when(S.STOPPED) == t + 3.0
        assert rig.reasons(S.STOPPED) == ["stopped (exited with code 0)"]


async def test_a_stop_with_its_own_grace_overrides_the_configured_one() -> None:
    async with Rig(Script(ignores_sigterm=True), stop_grace_s=7.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        await rig.child.stop(grace_s=0.5)
        (term_at, _), (kill_at, _) = rig.procs[0].signals
        assert kill_at - term_at == 0.5


async def test_starting_to_stopping_when_a_stop_comes_while_loading() -> None:
    async with Rig(Script(ready_after=None)) as rig:
        rig.child.start()
        await rig.until(S.STARTING)
        await rig.child.stop()
        assert rig.path() == ["STOPPED -> STARTING", "STARTING -> STOPPING",
                              "STOPPING -> STOPPED"]
        assert rig.procs[0].signal_numbers == [SIGTERM]


async def test_stop_from_backoff_and_fatal() -> None:
    # BACKOFF -> STOPPED: the 60 s back-off is cut short, nothing more is started.
    async with Rig(quick_crash(1), backoff_initial_s=60.0) as rig:
        rig.child.start()
        await rig.until(S.BACKOFF)
        await rig.child.stop()
        assert rig.path()[-2:] == ["EXITED -> BACKOFF", "BACKOFF -> STOPPED"]
        assert rig.reasons(S.STOPPED) == ["stop asked for"]
        assert rig.clock.waits == [] and len(rig.launcher.spawns) == 1
    # FATAL -> STOPPED, then STOPPED -> STARTING when started again.
    async with Rig(quick_crash(1), max_quick_failures=1) as rig:
        rig.child.start()
        await rig.until(S.FATAL)
        await rig.child.stop()
        assert rig.path()[-2:] == ["BACKOFF -> FATAL", "FATAL -> STOPPED"]
        assert rig.child.next_try_in_s() is None
        rig.child.start()
        await rig.until(S.READY)
        assert rig.reasons(S.STARTING)[-1] == "start asked for"
        assert rig.clock.waits == [] and len(rig.launcher.spawns) == 2


async def test_stopping_to_exited_to_stopped_when_it_dies_as_a_stop_comes() -> None:
    async with Rig() as rig:
        rig.child.start()
        await rig.until(S.READY)
        # The death and the stop in the same moment: the owner takes the stop first (the
        # exit reaches its inbox once the process is reaped), but the stop never reached the
        # process: its end is a death, with its evidence, and nothing restarts it.
        rig.procs[0].crash(-SIGABRT)
        await rig.child.stop()
        assert rig.path()[-3:] == ["READY -> STOPPING", "STOPPING -> EXITED",
                                   "EXITED -> STOPPED"]
        assert rig.reasons(S.STOPPED) == ["exited while stopping"]
        assert rig.procs[0].signals == []
        assert rig.child.last_exit is not None and rig.child.last_exit.returncode == -SIGABRT


# --- draining -------------------------------------------------------------------------------


async def test_draining_to_stopping_when_idle() -> None:
    async with Rig(drain_timeout_s=20.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        rig.child.load.take(generation=True)
        rig.child.drain("reload: the command changed")
        await rig.until(S.DRAINING)
        rig.child.load.give_back(generation=True)  # the last request finishes
        await rig.until(S.STOPPING)
        assert rig.when(S.STOPPING) == rig.when(S.DRAINING)
        await rig.until(S.READY)
        assert rig.path() == [
            "STOPPED -> STARTING", "STARTING -> READY", "READY -> DRAINING",
            "DRAINING -> STOPPING", "STOPPING -> STOPPED", "STOPPED -> STARTING",
            "STARTING -> READY"]
        assert rig.reasons(S.DRAINING) == rig.reasons(S.STOPPING) == [
            "reload: the command changed"]
        assert rig.procs[0].signal_numbers == [SIGTERM] and rig.child.generation == 2
        assert rig.child.last_exit is None and rig.child.restarts == 1


async def test_draining_to_stopping_on_the_drain_timeout() -> None:
    async with Rig(drain_timeout_s=20.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        rig.child.load.take(generation=True)  # never released
        rig.child.drain("OOM survived")
        await rig.until(S.STOPPING)
        assert rig.when(S.STOPPING) - rig.when(S.DRAINING) == 20.0
        assert 20.0 in rig.clock.process_waits
        assert rig.procs[0].signal_numbers == [SIGTERM]


async def test_a_stop_while_draining_stops_at_once() -> None:
    async with Rig(drain_timeout_s=20.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        rig.child.load.take(generation=True)
        rig.child.drain("OOM survived")
        await rig.until(S.DRAINING)
        await rig.child.stop("daemon shutting down")
        assert rig.when(S.STOPPING) == rig.when(S.DRAINING)
        assert rig.reasons(S.STOPPING) == ["daemon shutting down"]
        assert rig.child.state is S.STOPPED
        rig.child.load.give_back(generation=True)


async def test_drain_is_ignored_unless_ready() -> None:
    async with Rig(Script(ready_after=None)) as rig:
        rig.child.start()
        await rig.until(S.STARTING)
        rig.child.drain("too early")
        await rig.clock.sleep(1.0)
        assert rig.child.state is S.STARTING and "READY -> DRAINING" not in rig.path()


# --- commands -------------------------------------------------------------------------------


async def test_restart_command_from_ready() -> None:
    async with Rig() as rig:
        rig.child.start()
        await rig.until(S.READY)
        rig.child.restart("operator: spillway gpu restart")
        await rig.until(S.STOPPING)
        await rig.until(S.READY)
        assert rig.path() == [
            "STOPPED -> STARTING", "STARTING -> READY", "READY -> STOPPING",
            "STOPPING -> STOPPED", "STOPPED -> STARTING", "STARTING -> READY"]
        assert rig.reasons(S.STOPPING) == ["operator: spillway gpu restart"]
        assert rig.reasons(S.STARTING) == ["starting", "restart after stop"]
        assert [p.signal_numbers for p in rig.procs] == [[SIGTERM], []]
        assert rig.child.restarts == 1 and rig.child.generation == 2
        assert rig.child.pid == rig.procs[1].pid


async def test_a_restart_cuts_the_back_off_short() -> None:
    async with Rig(quick_crash(1), backoff_initial_s=60.0) as rig:
        rig.child.start()
        await rig.until(S.BACKOFF)
        rig.child.restart("operator: spillway gpu restart")
        await rig.until(S.READY)
        assert rig.when(S.STARTING, 1) == rig.when(S.BACKOFF)  # no time waited
        assert rig.reasons(S.STARTING)[1] == "operator: spillway gpu restart"
        assert rig.clock.waits == []


async def test_a_restart_from_fatal_starts_at_once_and_resets_the_count() -> None:
    async with Rig(quick_crash(1), quick_crash(1), max_quick_failures=2,
                   fatal_retry_max_s=300.0, backoff_max_s=300.0) as rig:
        rig.child.start()
        await rig.until(S.FATAL)
        assert rig.child.quick_failures == 2
        rig.child.restart("operator: spillway gpu restart")
        await rig.until(S.READY)
        assert rig.path()[-2:] == ["FATAL -> STARTING", "STARTING -> READY"]
        assert rig.when(S.STARTING, 2) == rig.when(S.FATAL)
        assert rig.reasons(S.STARTING)[2] == "operator: spillway gpu restart"
        assert rig.child.quick_failures == 0 and rig.child.fatal_tries == 0
        assert rig.clock.waits == [1.0]  # the one back-off before FATAL


async def test_a_start_that_cannot_spawn_is_an_exit_with_code_127() -> None:
    # A fork that fails for a moment (a missing binary is FATAL at once: test_child_commands)
    error = BlockingIOError(11, "Resource temporarily unavailable")
    async with Rig(Script(spawn_error=error)) as rig:
        rig.child.start()
        await rig.until(S.READY)
        assert rig.path()[:4] == ["STOPPED -> STARTING", "STARTING -> EXITED",
                                  "EXITED -> BACKOFF", "BACKOFF -> STARTING"]
        record = await rig.child.exit_of(1, timeout=1)
        assert record is not None and record.returncode == 127 and record.kind == "crash"
        assert record.evidence.startswith("cannot start '/opt/llama/llama-server': ")
        assert len(rig.launcher.spawns) == 2 and len(rig.procs) == 1


# --- every transition of the table ----------------------------------------------------------

Scenario = Callable[[], Awaitable[None]]

# Each transition of policy/lifecycle.py's table, and the test named for it.
EDGES: dict[Edge, Scenario] = {
    (S.STOPPED, S.STARTING): test_stopped_to_starting_to_ready,
    (S.STARTING, S.READY): test_stopped_to_starting_to_ready,
    (S.STARTING, S.EXITED): test_starting_to_exited_to_backoff_to_starting_with_jitter,
    (S.STARTING, S.STOPPING): test_starting_to_stopping_when_a_stop_comes_while_loading,
    (S.READY, S.DRAINING): test_draining_to_stopping_when_idle,
    (S.READY, S.STOPPING): test_restart_command_from_ready,
    (S.READY, S.EXITED): test_ready_to_exited_on_a_crash_records_the_evidence,
    (S.DRAINING, S.STOPPING): test_draining_to_stopping_on_the_drain_timeout,
    (S.DRAINING, S.EXITED): test_draining_to_exited_when_it_dies_while_draining,
    (S.STOPPING, S.STOPPED): test_stop_is_sigterm_then_grace_then_sigkill,
    (S.STOPPING, S.EXITED): test_stopping_to_exited_to_stopped_when_it_dies_as_a_stop_comes,
    (S.EXITED, S.BACKOFF): test_starting_to_exited_to_backoff_to_starting_with_jitter,
    (S.EXITED, S.STOPPED): test_stopping_to_exited_to_stopped_when_it_dies_as_a_stop_comes,
    (S.BACKOFF, S.STARTING): test_starting_to_exited_to_backoff_to_starting_with_jitter,
    (S.BACKOFF, S.FATAL): test_quick_failures_in_a_row_go_fatal_then_the_crash_loop_back_off_tries_again,  # noqa: E501
    (S.BACKOFF, S.STOPPED): test_stop_from_backoff_and_fatal,
    (S.FATAL, S.STARTING): test_quick_failures_in_a_row_go_fatal_then_the_crash_loop_back_off_tries_again,  # noqa: E501
    (S.FATAL, S.STOPPED): test_stop_from_backoff_and_fatal,
}
# In the table, but the child has no way to it: nothing calls a drain off.
UNREACHABLE: set[Edge] = {(S.DRAINING, S.READY)}


def test_every_transition_of_the_table_has_a_test() -> None:
    table = {(old, new) for old, news in TRANSITIONS.items() for new in news}
    assert table - set(EDGES) == UNREACHABLE
    assert set(EDGES) <= table


@pytest.mark.parametrize("edge", sorted(EDGES), ids=lambda e: f"{e[0]}->{e[1]}")
async def test_the_transition_is_taken_by_its_test(edge: Edge) -> None:
    TAKEN.clear()
    await EDGES[edge]()
    assert edge in TAKEN
