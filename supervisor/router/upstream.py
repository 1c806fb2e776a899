"""One model on one router child: what a request for that model is sent to.

A router-mode llama-server runs one instance per loaded model. Spillway keeps, for each (child,
model), the same lifecycle words as for a child, with what the router says of the model:

    STOPPED (not loaded) -> STARTING (loading) -> READY (loaded) -> DRAINING -> STOPPING -> STOPPED
    STARTING|READY|DRAINING -> EXITED (its instance died) -> BACKOFF -> STARTING (Spillway loads
    it again) | STOPPED (it would not fit now: loaded again on demand)
    BACKOFF -> FATAL (too many quick failures) -> STARTING (the crash-loop back-off's next try)

The router passes requests to an instance; when it is not READY (starting, backing off, gone),
none of its models is: the model's state is then the router's. When the router is READY, it is
the model's own state, written here and nowhere else, from what the watch (watch.py) hears: the
router's `/models` listing, its `/models/sse` status changes, and its output lines (the spawn
line with the instance's port, the instance's own lines relayed with a `[port]` prefix, and
`instance name=M exited with status N`). The log line and the status event tell the same death
twice; the first one decides, the second finds the instance already ended.

Spillway loads the models itself (the routers run with `--no-models-autoload`): on demand when a
request needs one (the pool's `start_child`), after a back-off when its instance died, and from
FATAL on the crash-loop back-off's interval. So the router's own autoload can never turn a model
that does not fit into a crash loop on the card; `load_guard` (capacity.py) says when a load would
not fit now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..children import STDERR_TAIL_LINES, Child, ExitRecord, VramProbe
from ..clock import Clock, MonotonicClock
from ..config import ChildConfig, RestartConfig
from ..load import Load
from ..policy import lifecycle
from ..policy.evidence import FailureKind
from ..policy.lifecycle import SERVING, ChildState
from ..policy.router import ModelInfo, StatusChange, classify_instance_exit
from ..timefmt import rfc3339
from ..vocabulary import StateListener

log = logging.getLogger("spillway.router")

S = ChildState


class Loader(Protocol):
    """Asks a router to load or unload one model (watch.py provides it)."""

    async def load(self, model: str) -> str | None:
        """None when the router took the request, else why not."""
        ...

    async def unload(self, model: str) -> str | None: ...


@dataclass(frozen=True)
class ModelExit:
    """How one instance of a model ended, and what the evidence says it was."""

    generation: int
    exit_code: int | None
    kind: FailureKind
    evidence: str
    planned: bool  # an unload (Spillway's, an operator's, the router's LRU eviction)
    served: bool  # it was working on requests when it died
    run_s: float  # loaded for this long (0: it died while loading)
    time: float  # wall clock

    @property
    def known_crash(self) -> str:
        """Not read for a model's instance: its lines reach Spillway mixed in the router's."""
        return ""

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "exit_code": self.exit_code,
                "kind": str(self.kind), "evidence": self.evidence, "planned": self.planned,
                "run_s": round(self.run_s, 3), "time": rfc3339(self.time)}


class ModelUpstream(lifecycle.CrashLoopCounters):
    def __init__(self, child: Child, model: str, loader: Loader, *,
                 vram_probe: VramProbe | None = None, vram_short_mib: float = 512.0,
                 drain_timeout_s: float = lifecycle.DRAIN_TIMEOUT_S,
                 clock: Clock | None = None,
                 rng: Callable[[], float] = random.random) -> None:
        self.child = child
        self.model = model
        self.name = child.name  # the role: what X-Spillway-Child, incidents and metrics say
        self.loader = loader
        self.vram_probe = vram_probe
        self.vram_short_mib = vram_short_mib
        self.drain_timeout_s = drain_timeout_s
        self._clock: Clock = clock or MonotonicClock()
        self._rng = rng
        self.load = Load()  # written by the pool
        self.listeners: list[StateListener] = []
        # Why a load would not fit now (VRAM, RAM, --models-max), or None: capacity.py's.
        self.load_guard: Callable[[], str | None] | None = None
        self.info: ModelInfo | None = None  # the router's last word on it

        self._state = S.STOPPED
        self.reason = "not loaded"
        self.state_since = time.monotonic()
        self.generation = 0  # one per instance
        self._instance_open = False  # the current generation's instance has not ended
        self.instance_port: int | None = None
        self.pid: int | None = None  # the instance's (a grandchild of Spillway's)
        self.loads = 0
        self.failures = 0
        self.crash_loop = lifecycle.CrashLoop()  # quick failures, tries from FATAL
        self.next_try_at: float | None = None  # clock time, in BACKOFF and FATAL
        self.last_exit: ModelExit | None = None
        self.loading_since: float | None = None
        self.loaded_at: float | None = None
        self.last_start_s: float | None = None  # load time of the last load
        self.instance_lines: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._exits: dict[int, asyncio.Future[ModelExit]] = {}
        self._planned_end = False
        self.armed_signal: int | None = None  # the drill's (see arm)
        self.armed_on_neighbour_load = False
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._seen_state = self.state
        child.listeners.append(self._router_changed)

    # --- what the proxy and the pool read --------------------------------------------------------

    @property
    def state(self) -> ChildState:
        router = self.child.state
        return self._state if router is S.READY else router

    @property
    def api_key(self) -> str:
        return self.child.api_key

    @property
    def host(self) -> str:
        return self.child.host

    @property
    def port(self) -> int | None:
        return self.child.port  # requests go through the router, which picks the instance

    @property
    def base_url(self) -> str:
        return self.child.base_url

    @property
    def cfg(self) -> ChildConfig:
        return self.child.cfg

    @property
    def is_ready(self) -> bool:
        return self.state is S.READY

    @property
    def stderr_tail(self) -> Sequence[str]:
        return self.instance_lines

    @property
    def restart_cfg(self) -> RestartConfig:
        return self.child.restart_cfg

    def running(self, generation: int) -> bool:
        fut = self._exits.get(generation)
        return (generation == self.generation and self._instance_open and fut is not None
                and not fut.done() and self.child.state in SERVING)

    async def exit_of(self, generation: int, timeout: float) -> ModelExit | None:
        fut = self._exits.get(generation)
        if fut is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            return None
        except asyncio.CancelledError:
            if fut.cancelled():
                return None  # the model's upstream was closed, not the caller
            raise

    def next_try_in_s(self) -> float | None:
        if self.child.state is not S.READY:
            return self.child.next_try_in_s()
        if self.next_try_at is None or self._state not in (S.BACKOFF, S.FATAL):
            return None
        return round(max(0.0, self.next_try_at - self._clock.now()), 1)

    async def wait_state(self, *states: ChildState, timeout: float | None = None) -> bool:
        async def waiter() -> None:
            while self.state not in states:
                changed = self._changed
                await changed.wait()
        try:
            await asyncio.wait_for(waiter(), timeout)
            return True
        except TimeoutError:
            return False

    def to_json(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "state": str(self.state),
            "reason": self.reason if self.child.state is S.READY else
            f"the {self.name} router is {self.child.state}",
            "state_for_s": round(now - self.state_since, 3),
            "generation": self.generation,
            "pid": self.pid,
            "instance_port": self.instance_port if self._instance_open else None,
            "loads": self.loads,
            "failures": self.failures,
            "quick_failures": self.quick_failures,
            "next_try_in_s": self.next_try_in_s(),
            "last_exit": self.last_exit.to_json() if self.last_exit else None,
            "last_load_s": round(self.last_start_s, 3) if self.last_start_s is not None
            else None,
            "in_flight": self.load.in_flight,
        }

    # --- asking for changes -----------------------------------------------------------------------

    def start(self) -> None:
        """Load it now, if it is not loaded and may be (the pool's on-demand start)."""
        if self.child.state is S.READY and self._state is S.STOPPED:
            self._load("loaded on demand")

    def drain(self, reason: str) -> None:
        """No new work; when its requests are done, unload it (it loads again on demand)."""
        if self.state is not S.READY:
            return
        self._set(S.DRAINING, reason)
        self._spawn(self._until_drained())

    def unload(self, reason: str) -> None:
        """Unload an idle model (to make room for another one under --models-max)."""
        if self.state is S.READY and self.load.in_flight == 0:
            self._set(S.STOPPING, reason)
            self._unload_now()

    def reset(self, reason: str) -> None:
        """An operator's restart: forget the crash loop; a FATAL or backing-off model is loaded
        again on demand."""
        self.crash_loop = lifecycle.CrashLoop()
        self.next_try_at = None
        if self._state in (S.BACKOFF, S.FATAL):
            self._set(S.STOPPED, reason)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for fut in self._exits.values():
            if not fut.done():
                fut.cancel()

    # --- what the watch hears ---------------------------------------------------------------------

    def heard_listing(self, info: ModelInfo) -> None:
        """Its entry in the router's /models (read when the router is ready, and after the
        event stream dropped, so that nothing missed stays wrong)."""
        self.info = info
        if info.status == "loaded":
            self._begin_instance(info.port, "loaded (the router's listing)")
            self._loaded()
        elif info.status == "loading":
            self._begin_instance(info.port, "loading (the router's listing)")
        elif info.status == "unloaded" and self._instance_open:
            self._ended(info.exit_code if info.failed else 0)

    def heard_status(self, change: StatusChange) -> None:
        """A /models/sse status change."""
        if change.status == "loading":
            self._begin_instance(None, "loading")
        elif change.status == "loaded":
            self._begin_instance(None, "loaded")
            self._loaded()
        elif change.status == "unloaded":
            self._ended(change.exit_code)

    def heard_spawn(self, port: int) -> None:
        """The router's `spawning server instance with name=M on port P`."""
        self._begin_instance(port, "loading (the router spawned its instance)")

    def heard_pid(self, pid: int | None) -> None:
        """Its instance's process, found from its port (the watch looks it up)."""
        self.pid = pid

    def heard_instance_line(self, text: str) -> None:
        self.instance_lines.append(text)
        if self.armed_signal is not None and not self.armed_on_neighbour_load \
                and "launch_slot_" in text:
            self._fire_armed()

    def arm(self, sig: int | None, on_neighbour_load: bool = False) -> None:
        """The drill without a GPU: send `sig` to this model's instance as its next task
        launches (during its prompt processing), or, `on_neighbour_load`, as another model's
        instance is spawned on the same router (a second model taking the last VRAM),
        standing in for a GPU that runs out of memory. None disarms."""
        self.armed_signal = sig
        self.armed_on_neighbour_load = sig is not None and on_neighbour_load

    def heard_neighbour_load(self, model: str) -> None:
        """Another model's instance is being spawned on this router."""
        if self.armed_signal is not None and self.armed_on_neighbour_load:
            log.warning("[%s:%s] drill: %s is loading next to it", self.name, self.model, model)
            self._fire_armed()

    def signal_now(self, sig: int) -> bool:
        """The drill's failure in the middle of an answer: `sig` to this model's instance
        now. False when it has no instance."""
        if self.pid is None:
            return False
        log.warning("[%s:%s] drill: sending %s to its instance (pid %d) now", self.name,
                    self.model, signal.Signals(sig).name, self.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
        return True

    def _fire_armed(self) -> None:
        sig, self.armed_signal = self.armed_signal, None
        if sig is None or self.pid is None:
            return
        log.warning("[%s:%s] drill: sending %s to its instance (pid %d) as a task launches",
                    self.name, self.model, signal.Signals(sig).name, self.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def heard_exit(self, status: int) -> None:
        """The router's `instance name=M exited with status N`."""
        self._ended(status)

    def heard_eviction(self) -> None:
        """The router is unloading it to make room under --models-max: planned, no failure."""
        self._planned_end = True

    # --- the model's state ------------------------------------------------------------------------

    def _set(self, new: ChildState, reason: str) -> None:
        old = self._state
        lifecycle.check_transition(old, new)
        self._state = new
        self.reason = reason
        log.info("[%s:%s] %s -> %s: %s", self.name, self.model, old, new, reason)
        self._notify(reason)

    def _notify(self, reason: str) -> None:
        now = self.state
        old, self._seen_state = self._seen_state, now
        if old is not now:
            self.state_since = time.monotonic()
            for listener in list(self.listeners):
                try:
                    listener(self, old, now, reason)
                except Exception:  # noqa: BLE001 - a listener must not break the watch
                    log.exception("state listener failed")
        self._changed.set()
        self._changed = asyncio.Event()

    def _router_changed(self, child: Child, old: ChildState, new: ChildState,
                        reason: str) -> None:
        if new not in SERVING and self._instance_open:
            # The router's instances end with it (and its exit is the evidence).
            self._instance_open = False
            self._spawn(self._end_with_router(self.generation, child.generation))
        if new not in SERVING:
            self._planned_end = False
            self._walk_to_stopped(f"the {self.name} router is {new}")
        self._notify(reason)

    def _walk_to_stopped(self, reason: str) -> None:
        """Legal steps from wherever it is to STOPPED (a router that went away); BACKOFF and
        FATAL stay, with their timers."""
        steps = {S.READY: S.STOPPING, S.STARTING: S.STOPPING, S.DRAINING: S.STOPPING,
                 S.STOPPING: S.STOPPED, S.EXITED: S.STOPPED}
        while (step := steps.get(self._state)) is not None:
            self._set(step, reason)

    def _begin_instance(self, port: int | None, reason: str) -> None:
        if not self._instance_open:
            self.generation += 1
            self._instance_open = True
            self.instance_lines.clear()
            self.pid = None
            self.loading_since = self._clock.now()
            self._exits[self.generation] = asyncio.get_running_loop().create_future()
            for old in [g for g in self._exits if g < self.generation - 2]:
                fut = self._exits.pop(old)
                if not fut.done():
                    fut.cancel()
        if port:
            self.instance_port = port
        if self._state in (S.STOPPED, S.BACKOFF, S.FATAL):
            self.next_try_at = None
            self._set(S.STARTING, reason)

    def _loaded(self) -> None:
        if self._state is not S.STARTING:
            return
        now = self._clock.now()
        if self.loading_since is not None:
            self.last_start_s = now - self.loading_since
        self.loaded_at = now
        self.loads += 1
        took = f" in {self.last_start_s:.2f} s" if self.last_start_s is not None else ""
        self._set(S.READY, f"loaded{took}")

    def _ended(self, exit_code: int | None) -> None:
        """Its instance ended: an unload (planned) or a death (evidence, back-off)."""
        if not self._instance_open:
            return  # already told (the log line and the status event both say it)
        self._instance_open = False
        now = self._clock.now()
        loading = self._state is S.STARTING
        planned = self._planned_end or self._state is S.STOPPING or (
            exit_code == 0 and not loading)
        self._planned_end = False
        served = self.load.generation > 0
        run_s = 0.0 if loading or self.loaded_at is None else now - self.loaded_at
        vram = self.vram_probe(time.monotonic()) if self.vram_probe is not None else None
        verdict = classify_instance_exit(exit_code, list(self.instance_lines), loading=loading,
                                         vram=vram, vram_short_mib=self.vram_short_mib)
        record = ModelExit(self.generation, exit_code, verdict.kind,
                           verdict.evidence if not planned else "unloaded", planned, served,
                           run_s, time.time())
        fut = self._exits.get(self.generation)
        if fut is not None and not fut.done():
            fut.set_result(record)
        if planned:
            self._walk_to_stopped("unloaded")
            return
        self.failures += 1
        self.last_exit = record
        self._after_death(record)

    def _after_death(self, record: ModelExit) -> None:
        """STARTING|READY|DRAINING -> EXITED -> BACKOFF (-> FATAL), as lifecycle.after_death
        says; then it is loaded again when the wait is over."""
        after = lifecycle.after_death(
            self._state, self.crash_loop, self.child.backoff_policy(),
            what=f"{record.kind}: {record.evidence}", run_s=record.run_s, jitter=self._rng(),
            served=record.served, again="loaded again")
        self.crash_loop = after.loop
        assert after.wait_s is not None  # (always wanted: the router is READY)
        self.next_try_at = self._clock.now() + after.wait_s
        for state, reason in after.path:
            self._set(state, reason)
        self._spawn(self._until_try())

    # The tasks below only wait (the clock, the router, a load's answer) and hand what they
    # learned to a method that is not a coroutine: state is written there, never in a task.

    async def _until_try(self) -> None:
        """BACKOFF|FATAL: until the wait is over and the router READY; then _try_due."""
        while self._state in (S.BACKOFF, S.FATAL) and self.next_try_at is not None:
            left = self.next_try_at - self._clock.now()
            if left > 0:
                await self._clock.wait(asyncio.Event(), left)
                continue
            if self.child.state is not S.READY:
                await self.child.wait_state(S.READY)  # its instance needs a router
                continue
            self._try_due()
            return

    def _try_due(self) -> None:
        """The back-off's wait is over: load it again, if it would fit."""
        fatal = self._state is S.FATAL
        why_not = self.load_guard() if self.load_guard is not None else None
        if why_not is not None:
            if fatal:  # stays FATAL; looked at again after the next interval
                self.next_try_at = self._clock.now() + lifecycle.fatal_retry_s(
                    self.child.backoff_policy(), self.fatal_tries)
                self.reason = f"{self.reason.split('; not loaded:')[0]}; not loaded: " \
                              f"{why_not}"
                self._spawn(self._until_try())
                return
            self._set(S.STOPPED, f"back-off over; not loaded again yet: {why_not}")
            return
        if fatal:
            self.crash_loop = lifecycle.fatal_try(self.crash_loop, self.child.backoff_policy())
            self._load(f"try {self.fatal_tries} from FATAL (crash-loop back-off)")
        else:
            self._load("back-off over")

    def _load(self, reason: str) -> None:
        self.next_try_at = None
        self._set(S.STARTING, reason)
        self.loading_since = self._clock.now()
        self._spawn(self._ask_load())

    async def _ask_load(self) -> None:
        self._load_answered(await self.loader.load(self.model))

    def _load_answered(self, problem: str | None) -> None:
        if problem is None or self._state is not S.STARTING or self._instance_open:
            return
        # The router refused (its --models-max, a model it no longer lists): not a failure of
        # the model; it is loaded again on demand.
        log.warning("[%s:%s] the router did not load it: %s", self.name, self.model, problem)
        self._set(S.STOPPING, f"the router did not load it: {problem}")
        self._set(S.STOPPED, f"the router did not load it: {problem}")

    async def _until_drained(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.load.idle.wait(), self.drain_timeout_s)
        self._drained()

    def _drained(self) -> None:
        if self._state is S.DRAINING:
            self._set(S.STOPPING, "drained: unloading it")
            self._unload_now()

    def _unload_now(self) -> None:
        self._planned_end = True  # its end, when the router tells it, is no failure
        self._spawn(self._ask_unload())

    async def _ask_unload(self) -> None:
        self._unload_answered(await self.loader.unload(self.model))

    def _unload_answered(self, problem: str | None) -> None:
        if problem is not None and self._state is S.STOPPING and not self._instance_open:
            self._set(S.STOPPED, "unloaded")

    async def _end_with_router(self, generation: int, router_generation: int) -> None:
        self._router_ended(generation, await self.child.exit_of(router_generation, 2.0))

    def _router_ended(self, generation: int, record: ExitRecord | None) -> None:
        """The router's end, the evidence for its instance's (which it took along)."""
        fut = self._exits.get(generation)
        if fut is None or fut.done():
            return
        kind = record.kind if record is not None else FailureKind.CRASH
        evidence = (f"the {self.name} router died: {record.evidence}" if record is not None
                    else f"the {self.name} router stopped")
        fut.set_result(ModelExit(generation, None, kind, evidence, planned=False,
                                 served=self.load.generation > 0, run_s=0.0, time=time.time()))

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
