"""One model on one router child: what a request for that model is sent to.

A router-mode llama-server runs one instance per loaded model. Spillway keeps, for each (child,
model), the same lifecycle words as for a child, with what the router says of the model:

    STOPPED (not loaded) -> STARTING (loading) -> READY (loaded) -> DRAINING -> STOPPING -> STOPPED
    STARTING|READY|DRAINING -> EXITED (its instance died) -> BACKOFF -> STARTING (Spillway loads
    it again) | STOPPED (it would not fit now: loaded again on demand)
    BACKOFF -> FATAL (too many quick failures) -> STARTING (the crash-loop back-off's next try)

The router passes requests to an instance; when it is not READY (starting, backing off, gone),
none of its models is: the model's state is then the router's. When the router is READY, it is
the model's own: the Life of its engine (engine.py, the same owner task and the same
`lifecycle.step` as a child's), which takes as events what the watch (watch.py) hears: the
router's `/models` listing, its `/models/sse` status changes, and its output lines (the spawn
line with the instance's port, the instance's own lines relayed with a `[port]` prefix, and
`instance name=M exited with status N`). The log line and the status event tell the same death
twice; the first one taken decides, the second finds the instance already ended.

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

from ..upstreams.children import STDERR_TAIL_LINES, Child, VramProbe
from ..upstreams.clock import Clock, MonotonicClock
from ..config.schema import RestartConfig
from ..upstreams.engine import Engine, Heard, LifeReader, exit_within
from ..policy import lifecycle
from ..policy.evidence import FailureKind
from ..policy.lifecycle import SERVING, ChildState, Life
from ..policy.router import ModelInfo, StatusChange, classify_instance_exit
from ..records.caches import figures, text_bytes
from ..records.timefmt import rfc3339
from ..vocabulary import Load, StateListener

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


class ModelUpstream(LifeReader):
    def __init__(self, child: Child, model: str, loader: Loader, *,
                 vram_probe: VramProbe | None = None, vram_short_mib: float = 512.0,
                 drain_timeout_s: float = lifecycle.DRAIN_TIMEOUT_S,
                 clock: Clock | None = None,
                 rng: Callable[[], float] = random.random) -> None:
        self.child = child
        self.model = model
        self.name = child.name  # the role: what X-Spillway-Child, incidents and metrics say
        self.serves_model: str | None = None  # its requests name it already
        self.loader = loader
        self.vram_probe = vram_probe
        self.vram_short_mib = vram_short_mib
        self.drain_timeout_s = drain_timeout_s
        self._clock: Clock = clock or MonotonicClock()
        self.load = Load()  # written by the pool
        # The lifecycle's one owner: the model's own state is its Life's. Always wanted: an
        # instance that dies is loaded again (an unload is not a death).
        self.engine = Engine(f"{child.name}:{model}", self, lifecycle.MODEL,
                             policy=child.backoff_policy,
                             drain_timeout_s=lambda: self.drain_timeout_s, idle=self.load.idle,
                             clock=self._clock, rng=rng,
                             life=Life(reason="not loaded", wanted=True,
                                       host_up=child.state is S.READY))
        self.listeners: list[StateListener] = []
        # Why a load would not fit now (VRAM, RAM, --models-max), or None: capacity.py's.
        self.load_guard: Callable[[], str | None] | None = None

        # What the watch heard, as it heard it (facts, not the lifecycle's state).
        self.info: ModelInfo | None = None  # the router's last word on it
        self.instance_port: int | None = None
        self.pid: int | None = None  # the instance's (a grandchild of Spillway's)
        # A pidfd on it, opened as the pid was found: the drill's signal goes to that very
        # process, or nowhere once it is gone, never to a later process given the same pid.
        self._pidfd: int | None = None
        self._lines: deque[str] = deque(maxlen=STDERR_TAIL_LINES)  # its instances' lines
        self._lines_heard = 0  # ... counted, so that an instance's own begin where it began
        self._instance_since = 0
        self._evicted = False  # the router said it is unloading it (its LRU under
        # --models-max): the next end is planned
        self.armed_signal: int | None = None  # the drill's (see arm)
        self.armed_on_neighbour_load = False

        self.state_since = time.monotonic()
        self.loads = 0
        self.failures = 0
        self.last_exit: ModelExit | None = None
        self.loaded_at: float | None = None
        self._exits: dict[int, asyncio.Future[ModelExit]] = {}
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._seen_state = self.state
        child.listeners.append(self._router_changed)

    # --- what the proxy and the pool read --------------------------------------------------------

    @property
    def state(self) -> ChildState:
        router = self.child.state
        return self.engine.life.state if router is S.READY else router

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
    def start_timeout_s(self) -> float:
        return self.child.start_timeout_s

    @property
    def is_ready(self) -> bool:
        return self.state is S.READY

    def cache_figures(self) -> dict[str, Any]:
        """For the status's caches: its instances' output lines kept."""
        return figures(len(self._lines), max_entries=self._lines.maxlen,
                       size=text_bytes(self._lines))

    @property
    def stderr_tail(self) -> Sequence[str]:
        """The current instance's lines (the router relays them with its port)."""
        own = self._lines_heard - self._instance_since
        return list(self._lines)[-own:] if own > 0 else []

    @property
    def restart_cfg(self) -> RestartConfig:
        return self.child.restart_cfg

    def running(self, generation: int) -> bool:
        fut = self._exits.get(generation)
        return (generation == self.generation and self.engine.life.running and fut is not None
                and not fut.done() and self.child.state in SERVING)

    async def exit_of(self, generation: int, timeout: float) -> ModelExit | None:
        return await exit_within(self._exits.get(generation), timeout)

    def next_try_in_s(self) -> float | None:
        if self.child.state is not S.READY:
            return self.child.next_try_in_s()  # its router's
        return self.own_next_try_in_s()

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
            "instance_port": self.instance_port if self.engine.life.running else None,
            "loads": self.loads,
            "failures": self.failures,
            "quick_failures": self.quick_failures,
            "next_try_in_s": self.next_try_in_s(),
            "last_exit": self.last_exit.to_json() if self.last_exit else None,
            "last_load_s": round(self.last_start_s, 3) if self.last_start_s is not None
            else None,
            "in_flight": self.load.in_flight,
        }

    # --- asking for changes: each is an event for the owner ---------------------------------------

    def start(self) -> None:
        """Load it now, if it is not loaded and may be (the pool's on-demand start)."""
        self.engine.post(lifecycle.Start("loaded on demand"))

    def drain(self, reason: str) -> None:
        """No new work; when its requests are done, unload it (it loads again on demand)."""
        self.engine.post(lifecycle.Drain(reason))

    def unload(self, reason: str) -> None:
        """Unload an idle model (to make room for another one under --models-max)."""
        if self.load.in_flight == 0:
            self.engine.post(lifecycle.Unload(reason))

    def reset(self, reason: str) -> None:
        """An operator's restart: forget the crash loop; a FATAL or backing-off model is loaded
        again on demand."""
        self.engine.post(lifecycle.Forgive(reason))

    async def close(self) -> None:
        await self.engine.close()
        for task in list(self._tasks):
            task.cancel()
        for fut in self._exits.values():
            if not fut.done():
                fut.cancel()

    # --- what the watch hears: facts kept, events posted ----------------------------------------

    def heard_listing(self, info: ModelInfo) -> None:
        """Its entry in the router's /models (read when the router is ready, and after the
        event stream dropped, so that nothing missed stays wrong)."""
        self.info = info
        if info.port:
            self.instance_port = info.port
        if info.status == "loaded":
            self._began("loaded (the router's listing)")
            self.engine.post(lifecycle.Ready())
        elif info.status == "loading":
            self._began("loading (the router's listing)")
        elif info.status == "unloaded":
            self._gone(info.exit_code if info.failed else 0)

    def heard_status(self, change: StatusChange) -> None:
        """A /models/sse status change."""
        if change.status == "loading":
            self._began("loading")
        elif change.status == "loaded":
            self._began("loaded")
            self.engine.post(lifecycle.Ready())
        elif change.status == "unloaded":
            self._gone(change.exit_code)

    def heard_spawn(self, port: int) -> None:
        """The router's `spawning server instance with name=M on port P`."""
        self.instance_port = port
        self.heard_pid(None)  # its process is looked up from the port next
        self._began("loading (the router spawned its instance)")

    def heard_pid(self, pid: int | None) -> None:
        """Its instance's process, found from its port (the watch looks it up)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
        self.pid, self._pidfd = pid, None
        if pid is not None:
            with contextlib.suppress(OSError):  # (gone already: nothing to signal)
                self._pidfd = os.pidfd_open(pid)

    def heard_instance_line(self, text: str) -> None:
        self._lines.append(text)
        self._lines_heard += 1
        if self.armed_signal is not None and not self.armed_on_neighbour_load \
                and "launch_slot_" in text:
            self._fire_armed()

    def heard_exit(self, status: int) -> None:
        """The router's `instance name=M exited with status N`."""
        self._gone(status)

    def heard_eviction(self) -> None:
        """The router is unloading it to make room under --models-max: planned, no failure."""
        self._evicted = True

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
        self._signal(sig)
        return True

    def _signal(self, sig: int) -> None:
        """`sig` to the instance found, through its pidfd: nothing when it is gone."""
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def _fire_armed(self) -> None:
        sig, self.armed_signal = self.armed_signal, None
        if sig is None or self.pid is None:
            return
        log.warning("[%s:%s] drill: sending %s to its instance (pid %d) as a task launches",
                    self.name, self.model, signal.Signals(sig).name, self.pid)
        self._signal(sig)

    def _began(self, reason: str) -> None:
        self.engine.post(lifecycle.Began(reason, since=self._lines_heard))

    def _gone(self, exit_code: int | None) -> None:
        self.engine.post(Heard(lambda life: self._judge_end(life, exit_code)))

    def _judge_end(self, life: Life, exit_code: int | None) -> lifecycle.Ended | None:
        """An instance's end, as of the moment the owner takes it: an unload (planned) or a
        death (with its evidence); None when it was told already."""
        if not life.running:
            return None  # the log line and the status event both say it
        loading = life.state is S.STARTING
        planned = self._evicted or life.state is S.STOPPING or (exit_code == 0 and not loading)
        self._evicted = False
        served = self.load.generation > 0
        run_s = 0.0 if loading or self.loaded_at is None else self._clock.now() - self.loaded_at
        vram = self.vram_probe(time.monotonic()) if self.vram_probe is not None else None
        verdict = classify_instance_exit(exit_code, list(self.stderr_tail), loading=loading,
                                         vram=vram, vram_short_mib=self.vram_short_mib)
        record = ModelExit(life.generation, exit_code, verdict.kind,
                           verdict.evidence if not planned else "unloaded", planned, served,
                           run_s, time.time())
        return lifecycle.Ended(life.generation, planned,
                               "unloaded" if planned else f"{verdict.kind}: {verdict.evidence}",
                               run_s=run_s, served=served, record=record)

    def _router_changed(self, child: Child, old: ChildState, new: ChildState,
                        reason: str) -> None:
        if new not in SERVING:
            self._evicted = False
        # The router's instances end with it (and its exit is the evidence).
        self.engine.post(lifecycle.HostChanged(ready=new is S.READY, serving=new in SERVING,
                                               reason=f"the {self.name} router is {new}"))
        self._notify(reason)

    def _notify(self, reason: str) -> None:
        """The model's state as the pool reads it (the router's, or its own) changed: tell."""
        now = self.state
        old, self._seen_state = self._seen_state, now
        if old is not now:
            self.state_since = time.monotonic()
            for listener in list(self.listeners):
                try:
                    listener(self, old, now, reason)
                except Exception:  # noqa: BLE001 - a listener must not break the owner
                    log.exception("state listener failed")
        self._changed.set()
        self._changed = asyncio.Event()

    # --- the effects: what the owner carries out (engine.Effects) ---------------------------------

    def entered(self, old: ChildState, new: ChildState, reason: str) -> None:
        log.info("[%s:%s] %s -> %s: %s", self.name, self.model, old, new, reason)
        if new is S.READY:
            self.loaded_at = self._clock.now()
            self.loads += 1
        self._notify(reason)

    def launch(self, generation: int, reason: str) -> None:
        self._spawn(self._ask_load())

    def opened(self, generation: int, since: int) -> None:
        self._instance_since = since
        self._exits[generation] = asyncio.get_running_loop().create_future()
        for older in [g for g in self._exits if g < generation - 2]:
            fut = self._exits.pop(older)
            if not fut.done():
                fut.cancel()

    def terminate(self, action: lifecycle.Terminate) -> None:
        self._spawn(self._ask_unload())  # its end, when the router tells it, is planned

    def recorded(self, end: lifecycle.Ended) -> None:
        record = end.record
        assert isinstance(record, ModelExit)
        fut = self._exits.get(record.generation)
        if fut is not None and not fut.done():
            fut.set_result(record)
        if not end.planned:
            self.failures += 1
            self.last_exit = record

    def orphaned(self, generation: int) -> None:
        self._spawn(self._end_with_router(generation, self.child.generation))

    def why_not_now(self) -> str | None:
        return self.load_guard() if self.load_guard is not None else None

    # The tasks below only wait (a load's or an unload's answer, the router's exit record) and
    # post what they learned, or (the router's end) complete the instance's exit record.

    async def _ask_load(self) -> None:
        problem = await self.loader.load(self.model)
        if problem is not None:
            # The router refused (its --models-max, a model it no longer lists): not a
            # failure of the model; it is loaded again on demand.
            log.warning("[%s:%s] the router did not load it: %s", self.name, self.model,
                        problem)
            self.engine.post(lifecycle.LoadRefused(problem))

    async def _ask_unload(self) -> None:
        if await self.loader.unload(self.model) is not None:
            self.engine.post(lifecycle.UnloadRefused())

    async def _end_with_router(self, generation: int, router_generation: int) -> None:
        record = await self.child.exit_of(router_generation, 2.0)
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
