"""The GPU lent to other programs (issue 49): the GPU child given back to the card when idle,
and woken by the next request, while the warm CPU child answers.

With `gpu.idle_release_s` set, the daemon's tick asks policy/fleet.idle_release: the GPU child
READY with nothing in flight for that long since the last request it answered (or since it
became READY), and the CPU child READY. It is then paused and stopped by the fleet (the one
owner of the children), its VRAM freed. Only requests for the model count as use: Spillway's
own routes (/spillway/*, its /health), the metrics, the status page and the mirror never lease
a child, so none of them keeps it awake.

The next generation request wakes it (the pool asks `wake` before admitting one): the GPU child
starts, and the request is admitted while it is STARTING, by the same rules as after a death:
the CPU child at once, or waiting for the GPU child where its measured start makes that sooner
(5w), or where only the GPU child can take the request (a prompt over the CPU child's context:
it waits, with Retry-After). A long stream the CPU child answers moves back to the GPU child
once it is READY (fail-back). A GPU child lent by the operator (`spillway gpu pause`) is not
woken by requests: `spillway gpu resume` brings it back.

Each lending and each wake is an incident (an episode with no request in it) and a log line;
the status says since when, why, and how many answers the CPU child gave meanwhile.

Router mode is not covered yet: its models are loaded and unloaded on the GPU router one by one
(router/models.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..config.schema import Config
from ..policy import fleet as fleet_rules
from ..records.incidents import Incident, IncidentLog, new_incident_id
from ..records.metrics import Metrics
from ..records.timefmt import rfc3339
from ..serving.pool import Pool
from .fleet import IDLE, OPERATOR, Fleet, Lent

log = logging.getLogger("spillway.lending")


class Lending:
    def __init__(self, fleet: Fleet, pool: Pool, config: Callable[[], Config],
                 incidents: IncidentLog, metrics: Metrics | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet = fleet
        self.pool = pool
        self.config = config  # the running config (a reload replaces it)
        self.incidents = incidents
        self.metrics = metrics
        self.clock = clock
        self.gpu = pool.roles[0]
        self.cpu = pool.roles[-1]
        pool.wake = self.wake

    def tick(self) -> None:
        """The GPU child idle for gpu.idle_release_s is lent back to the card."""
        release_s = self.config().gpu_settings.idle_release_s
        if not release_s:
            return
        gpu, cpu = self.fleet.children[self.gpu], self.fleet.children[self.cpu]
        now = self.clock()
        idle = now - max(self.pool.last_used[self.gpu], gpu.state_since)
        # (A request waiting in line is use to come: it may be waiting for the GPU child.)
        busy = gpu.load.in_flight + len(self.pool.line)
        if not fleet_rules.idle_release(release_s, gpu.state, busy, idle, cpu.state,
                                        self.gpu in self.fleet.paused):
            return
        reason = (f"idle for {idle:.0f} s (gpu.idle_release_s = {release_s:g}): stopped, its "
                  f"VRAM lent back to the card; the {cpu.cfg.label} answers, and the next "
                  f"request wakes it")
        log.warning("[%s] %s", self.gpu, reason)
        self.fleet.pause(self.gpu, reason, Lent(IDLE, reason, time.time(), now,
                                                self.pool.answers[self.cpu]))
        self._record("lent", "idle", reason)
        if self.metrics is not None:
            self.metrics.gpu_lendings.labels(IDLE).inc()
        self.observe()

    def wake(self) -> asyncio.Future[None] | None:
        """Before a generation request is admitted: the GPU child lent when idle starts (the
        future is done once its start is taken), else None. On the hot path: a dict lookup."""
        lent = self.fleet.lent.get(self.gpu)
        woken = self.fleet.wake(self.gpu) if lent is not None else None  # (idle alone wakes)
        if woken is not None and lent is not None:
            self._record("woken", "idle", f"a request for the model, after "
                                          f"{self.clock() - lent.since_monotonic:.0f} s lent when "
                                          f"idle ({self._answered(lent)} answered by the CPU "
                                          f"child meanwhile)")
            if self.metrics is not None:
                self.metrics.gpu_wakes.inc()
            self.observe()
        return woken

    def to_json(self) -> dict[str, Any] | None:
        """The GPU child's lending, for its status: None when it is not lent."""
        lent = self.fleet.lent.get(self.gpu)
        if lent is None:
            return None
        return {"why": lent.why, "reason": lent.reason, "since": rfc3339(lent.since),
                "for_s": round(self.clock() - lent.since_monotonic, 1),
                "answered_by_cpu": self._answered(lent)}

    def _answered(self, lent: Lent) -> int:
        """The CPU child's answers since the GPU child was lent."""
        return self.pool.answers[self.cpu] - lent.answers_then

    def observe(self) -> None:
        """The metrics' gauge: at each lending and wake, and on the tick (the operator's pause
        and resume)."""
        if self.metrics is None:
            return
        lent = self.fleet.lent.get(self.gpu)
        for why in (IDLE, OPERATOR):
            self.metrics.gpu_lent.labels(why).set(1 if lent is not None and lent.why == why
                                                  else 0)

    def _record(self, decision: str, kind: str, reason: str) -> None:
        """An episode of the GPU child's with no request in it: what was done, and why."""
        self.incidents.write(Incident(
            id=new_incident_id(), episode=new_incident_id(), time=rfc3339(time.time()),
            request_id="", child=self.gpu, kind=f"lent_{kind}", evidence=reason,
            decision=decision, reason=reason, cpu_start_s=0.0, status=0, tokens=0,
            latency_s=0.0, client_connected=False))
