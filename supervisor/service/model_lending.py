"""Router mode's GPU lent when idle (issue 49), model by model: `gpu.idle_release_s` after the
last request for a model, that model's instance on the GPU router is unloaded and its VRAM
freed, while its instance on the CPU router answers; the next request for it loads it again.

A router's models load and unload one by one (router/models.py), so the lending is per model,
not the whole GPU router: a model in use keeps its place while an idle one gives its memory
back. The model's CPU instance is loaded first where it is not (the CPU router loads on demand,
and RAM allows it: the resources say), so that the next request is answered at once; the GPU
instance is unloaded on the next tick once the CPU one is READY. The next generation request
for the model wakes its GPU instance (its pool asks `wake`, as single-model mode's pool does),
where the card has room for it (the same fit check as a load on demand): it is then admitted by
the usual rules, to the CPU instance at once or waiting for the GPU one where that is sooner.

Yielding to another program (gpu.yield_to_other_processes) is the whole GPU router's
(service/lending.py): the card is the other program's, whichever models are loaded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from ..config.schema import Config
from ..policy import fleet as fleet_rules
from ..policy.lifecycle import ChildState
from ..records.incidents import IncidentLog, child_episode
from ..records.metrics import Metrics
from ..records.timefmt import rfc3339
from ..router.models import ModelEntry, RouterModels
from ..router.upstream import ModelUpstream
from .fleet import IDLE, Lent

log = logging.getLogger("spillway.lending")

WAKE_WAIT_S = 5.0  # the longest a request waits for the woken instance's load to be taken


class ModelLending:
    def __init__(self, models: RouterModels, config: Callable[[], Config],
                 incidents: IncidentLog, metrics: Metrics | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.models = models
        self.config = config  # the running config (a reload replaces it)
        self.incidents = incidents
        self.metrics = metrics
        self.clock = clock
        self.released: dict[str, Lent] = {}  # the models whose GPU instance is lent

    @property
    def gpu(self) -> str:
        return self.config().gpu_child

    @property
    def cpu(self) -> str:
        return self.config().cpu_child

    def tick(self) -> None:
        """Each model idle on the GPU router for gpu.idle_release_s: its CPU instance loaded,
        then its GPU instance unloaded."""
        release_s = self.config().gpu_settings.idle_release_s
        for name, entry in list(self.models.entries.items()):
            gpu, cpu = entry.upstreams.get(self.gpu), entry.upstreams.get(self.cpu)
            if gpu is None or cpu is None:
                continue
            if name in self.released:
                if gpu.state is not ChildState.STOPPED:  # loaded again by a request meanwhile
                    self._forget(name, entry)
                continue
            if release_s:
                self._release_if_idle(name, entry, gpu, cpu, release_s)

    def _release_if_idle(self, name: str, entry: ModelEntry, gpu: ModelUpstream,
                         cpu: ModelUpstream, release_s: float) -> None:
        now = self.clock()
        idle = now - max(entry.pool.last_used[self.gpu], gpu.state_since)
        busy = gpu.load.in_flight + len(entry.pool.line)
        if gpu.state is not ChildState.READY or busy or idle < release_s:
            return
        if cpu.state is ChildState.STOPPED:  # warm the CPU instance first, where it may load
            startable, ram_ok = entry.resources.startable(self.cpu, cpu.state)
            if startable and ram_ok:
                log.info("[%s:%s] idle for %.0f s on the GPU router: loading it on the CPU "
                         "router before its GPU instance is unloaded", self.cpu, name, idle)
                entry.resources.start_child(self.cpu)
            return
        if not fleet_rules.idle_release(release_s, gpu.state, busy, idle, cpu.state, False):
            return
        reason = (f"idle for {idle:.0f} s (gpu.idle_release_s = {release_s:g}): its GPU "
                  f"instance unloaded, its VRAM lent back to the card; its CPU instance "
                  f"answers, and the next request for it loads it again")
        log.warning("[%s:%s] %s", self.gpu, name, reason)
        gpu.unload(reason)
        self.released[name] = Lent(IDLE, reason, time.time(), now, entry.pool.answers[self.cpu])
        entry.pool.wake = functools.partial(self.wake, name)
        self._record(name, "lent", reason)
        if self.metrics is not None:
            self.metrics.gpu_lendings.labels(IDLE).inc()

    def wake(self, name: str) -> asyncio.Future[None] | None:
        """Before a generation request for `name` is admitted: its GPU instance, unloaded when
        idle, is loaded again where the card has room for it; the future is done once the load
        is taken (or after WAKE_WAIT_S). None: nothing to wake."""
        released = self.released.get(name)
        entry = self.models.entries.get(name)
        if released is None or entry is None:
            return None
        gpu = entry.upstreams[self.gpu]
        startable, _ = entry.resources.startable(self.gpu, gpu.state)
        if not startable:
            return None  # (no room on the card now: its CPU instance answers; asked again)
        self._forget(name, entry)
        entry.resources.start_child(self.gpu)
        self._record(name, "woken", f"a request for {name}, after "
                                    f"{self.clock() - released.since_monotonic:.0f} s lent when "
                                    f"idle ({entry.pool.answers[self.cpu] - released.answers_then}"
                                    f" answered by its CPU instance meanwhile)")
        if self.metrics is not None:
            self.metrics.gpu_wakes.labels(IDLE).inc()
        return asyncio.ensure_future(self._taken(gpu))

    async def _taken(self, gpu: ModelUpstream) -> None:
        await gpu.wait_state(*(set(ChildState) - {ChildState.STOPPED}), timeout=WAKE_WAIT_S)

    def _forget(self, name: str, entry: ModelEntry) -> None:
        self.released.pop(name, None)
        entry.pool.wake = lambda: None

    def to_json(self) -> dict[str, Any] | None:
        """The models whose GPU instance is lent when idle, for the GPU router's status."""
        if not self.released:
            return None
        now = self.clock()
        out = {}
        for name, released in self.released.items():
            entry = self.models.entries.get(name)
            answered = (entry.pool.answers[self.cpu] - released.answers_then
                        if entry is not None else 0)
            out[name] = {"why": IDLE, "since": rfc3339(released.since),
                         "for_s": round(now - released.since_monotonic, 1),
                         "answered_by_cpu": answered}
        return out

    def _record(self, model: str, decision: str, reason: str) -> None:
        self.incidents.write(child_episode(self.gpu, "lent_idle", decision, reason,
                                           model=model))
