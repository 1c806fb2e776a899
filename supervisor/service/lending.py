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

With `gpu.yield_to_other_processes`, the GPU child also gives way to another program on its
cards (policy/yielding.py): when the others' memory there grew since the tightest card last
kept its headroom, and the card is under it now. It is paused at once (new work goes to the
CPU child), its answers in flight get a moment to finish (yielding.DRAIN_S), then it is
stopped: what is still running is cut and goes on by the failover's rules, as after a death (a
stream continued on the CPU child, a buffered request replayed there). It starts again once the
card has room for it (the resources' need, the headroom in it) and the others have held still
for `gpu.yield_quiet_s`, or the program it gave way to has left. A GPU child lent when idle is
not woken into a card another program has filled meanwhile: it is lent to that program
instead, and comes back by the same rule.

Each lending and each wake is an incident (an episode with no request in it) and a log line;
the status says since when, why, to whom, and how many answers the CPU child gave meanwhile.

In router mode the whole GPU router gives way to another program (its models' instances with
it: their answers in flight go on on the CPU router), while idle release is each model's
(service/model_lending.py): a router loads and unloads its models one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import psutil

from ..config.schema import ChildConfig, Config
from ..gpu.monitor import GpuMonitor
from ..policy import fleet as fleet_rules
from ..policy import yielding
from ..policy.lifecycle import ChildState
from ..records.incidents import IncidentLog, child_episode
from ..records.metrics import Metrics
from ..records.timefmt import rfc3339
from ..serving.pool import Pool
from ..serving.resources import Resources
from .fleet import IDLE, LENT_WHYS, YIELD, Fleet, Lent

log = logging.getLogger("spillway.lending")

MIB = 1024 * 1024


class Cards(Protocol):
    """What the lending reads of the GPU child's cards (CardsView; a fake in the tests)."""

    def sample(self) -> tuple[float, list[yielding.CardUse]] | None:
        """The latest sample of the GPU child's cards and when it was taken (monotonic);
        None without fresh figures."""

    def own(self) -> set[int]:
        """Spillway's own processes (every child's)."""

    def pids_of(self, name: str) -> list[int]:
        """One child's processes (a router's instances with it)."""

    def short(self) -> bool:
        """The cards have no room for the GPU child's start now (its need, the headroom)."""

    def name_of(self, pid: int) -> str | None:
        """A process's name, where it can be read."""

    def alive(self, pid: int) -> bool: ...

    async def now(self) -> list[yielding.CardUse] | None:
        """The GPU child's cards sampled now; None without figures."""


class CardsView:
    """Cards from the GPU monitor and the resources' word on room."""

    def __init__(self, monitor: GpuMonitor, resources: Resources) -> None:
        self.monitor = monitor
        self.resources = resources

    def sample(self) -> tuple[float, list[yielding.CardUse]] | None:
        taken = self.monitor.sampled_at()
        cards = self.monitor.child_devices
        fresh = max(10.0, 10 * self.monitor.interval_s)  # (as the resources read them)
        if taken is None or not cards or time.monotonic() - taken > fresh:
            return None
        return taken, [yielding.CardUse(c.free_bytes, c.used_bytes, c.process_bytes,
                                        c.lists_every_process) for c in cards]

    def own(self) -> set[int]:
        return {pid for pids in self.monitor.owners().values() if pids is not None
                for pid in pids}

    def pids_of(self, name: str) -> list[int]:
        return list(self.monitor.owners().get(name) or [])

    def short(self) -> bool:
        return self.resources.gpu_shortage() is not None

    def name_of(self, pid: int) -> str | None:
        with contextlib.suppress(psutil.Error):
            return str(psutil.Process(pid).name())
        return None

    def alive(self, pid: int) -> bool:
        return psutil.pid_exists(pid)

    async def now(self) -> list[yielding.CardUse] | None:
        cards = await self.monitor.cards_now()
        if cards is None:
            return None
        return [yielding.CardUse(c.free_bytes, 0, c.processes, c.lists_every_process)
                for c in cards]


class Lending:
    def __init__(self, fleet: Fleet, pool: Pool, config: Callable[[], Config],
                 incidents: IncidentLog, metrics: Metrics | None, cards: Cards | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 spawn: Callable[[Coroutine[Any, Any, None]], None] | None = None, *,
                 idle: bool = True, in_flight: Callable[[], int] | None = None,
                 answered: Callable[[], int] | None = None) -> None:
        """Router mode: `idle` False (its models are lent when idle one by one:
        model_lending.py), the GPU router's requests in flight (`in_flight`: its models'
        instances') and the CPU router's answers (`answered`: every model's) counted by the
        caller."""
        self.fleet = fleet
        self.pool = pool
        self.config = config  # the running config (a reload replaces it)
        self.incidents = incidents
        self.metrics = metrics
        self.cards = cards  # None: no figures, nothing to give way to
        self.clock = clock
        self.sleep = sleep
        self._tasks: set[asyncio.Task[None]] = set()
        self.spawn = spawn or self._spawn
        self.gpu = pool.roles[0]
        self.cpu = pool.roles[-1]
        self.idle = idle
        self.in_flight = in_flight or (lambda: self.fleet.children[self.gpu].load.in_flight)
        self.answered = answered or (lambda: self.pool.answers[self.cpu])
        self.watch = yielding.OthersWatch()
        # The lent GPU child's memory, checked on the card after its stop: the lending, and
        # what came back, in words (None: not checked yet, or no figures).
        self.freed: tuple[Lent, str] | None = None
        self._seen: float | None = None  # when the last sample looked at was taken
        self.others: yielding.Others | None = None  # in it, the other programs' memory
        pool.wake = self.wake

    def tick(self) -> None:
        """The GPU child idle for gpu.idle_release_s is lent back to the card; with
        gpu.yield_to_other_processes it gives way to another program, and comes back."""
        settings = self.config().gpu_settings
        self._watch_others(settings)
        if self.idle and settings.idle_release_s:
            self._idle(settings.idle_release_s)

    def _idle(self, release_s: float) -> None:
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
        lent = Lent(IDLE, reason, time.time(), now, self.answered())
        free, pids = self._free_now(), self._pids()
        stopped = self.fleet.pause(self.gpu, reason, lent)
        self.spawn(self._check_freed(lent, stopped, pids, free))
        self._record("lent", "idle", reason)
        if self.metrics is not None:
            self.metrics.gpu_lendings.labels(IDLE).inc()
        self.observe()

    def wake(self) -> asyncio.Future[None] | None:
        """Before a generation request is admitted: the GPU child lent when idle starts (the
        future is done once its start is taken), else None. On the hot path: a dict lookup.
        Not into a card another program has filled meanwhile: it is lent to that program
        instead (the request goes on without it), and comes back when the card has room."""
        lent = self.fleet.lent.get(self.gpu)
        if lent is None or lent.why != IDLE:
            return None
        if self._filled():
            self._filled_while_idle(lent)
            return None
        woken = self.fleet.wake(self.gpu)
        if woken is not None:
            self._record("woken", "idle", f"a request for the model, after "
                                          f"{self.clock() - lent.since_monotonic:.0f} s lent when "
                                          f"idle ({self._answered(lent)} answered by the CPU "
                                          f"child meanwhile)")
            self.watch.afresh()
            if self.metrics is not None:
                self.metrics.gpu_wakes.labels(IDLE).inc()
            self.observe()
        return woken

    # --- giving way to another program (gpu.yield_to_other_processes) -------------------------

    def _watch_others(self, settings: ChildConfig) -> None:
        """Each new sample of the cards: the others' memory watched; the GPU child gives way
        when they grew into its headroom, and comes back once they are done."""
        sample = None if self.cards is None else self.cards.sample()
        if sample is None or sample[0] == self._seen:
            return
        assert self.cards is not None
        self._seen, cards = sample
        now = self.clock()
        others = yielding.others_on(cards, self.cards.own())
        free = min(c.free_bytes for c in cards)
        headroom = settings.vram_headroom_mib * MIB
        self.watch.see(others, now, room=free >= headroom)
        self.others = others
        lent = self.fleet.lent.get(self.gpu)
        if lent is not None and lent.why == YIELD:
            self._come_back_if_done(lent, others, free, settings.yield_quiet_s)
        elif lent is None and yielding.gives_way(
                settings.yield_to_other_processes, self.fleet.children[self.gpu].state,
                self.gpu in self.fleet.paused, free, headroom, self.watch.grown_bytes(others)):
            self._give_way(others, free, headroom, settings.yield_quiet_s)

    def _whom(self, others: yielding.Others) -> tuple[str, int | None]:
        """The program that grew most since the card last had room (else the largest the
        driver lists), in words, and its pid."""
        pid = yielding.grower(others, self.watch.at_room or yielding.Others(0)) or max(
            others.by_pid, key=lambda p: others.by_pid[p], default=None)
        if pid is None:
            return "another program (its driver does not name it)", None
        assert self.cards is not None
        name = self.cards.name_of(pid)
        return (f"pid {pid} ({name})" if name else f"pid {pid}"), pid

    def _give_way(self, others: yielding.Others, free: int, headroom: int,
                  quiet_s: float) -> None:
        whom, pid = self._whom(others)
        grown = self.watch.grown_bytes(others)
        settle_s = yielding.DRAIN_S + yielding.GRACE_S
        reason = (f"{whom} took the card's memory ({grown // MIB} MiB more since it last had "
                  f"room; {free // MIB} MiB free, under the headroom of {headroom // MIB} MiB): "
                  f"the GPU child gives way, stopped within {settle_s:g} s (what it still "
                  f"answers then goes on on the CPU child), and starts again once the card has "
                  f"room and the others' memory held still for {quiet_s:g} s")
        log.warning("[%s] %s", self.gpu, reason)
        lent = Lent(YIELD, reason, time.time(), self.clock(), self.answered(),
                    to_whom=whom, pid=pid)
        self.fleet.lend(self.gpu, lent)
        self.watch.afresh()
        self._record("lent", YIELD, reason)
        if self.metrics is not None:
            self.metrics.gpu_lendings.labels(YIELD).inc()
        self.observe()
        self.spawn(self._stop_after_drain(lent))

    async def _stop_after_drain(self, lent: Lent) -> None:
        """The GPU child's answers in flight get DRAIN_S to finish; then it is stopped (what
        still runs is cut, and the failover takes it on), unless taken back meanwhile."""
        waited = 0.0
        while self.in_flight() and waited < yielding.DRAIN_S:
            await self.sleep(0.1)
            waited += 0.1
        if self.fleet.lent.get(self.gpu) is lent:
            free, pids = self._free_now(), self._pids()
            stopped = self.fleet.stop(self.gpu, lent.reason, grace_s=yielding.GRACE_S)
            await self._check_freed(lent, stopped, pids, free)

    def _pids(self) -> list[int]:
        """The GPU child's processes now (in router mode its models' instances too)."""
        return [] if self.cards is None else self.cards.pids_of(self.gpu)

    def _free_now(self) -> int | None:
        """The GPU child's cards' free memory in the latest sample (None: no figures)."""
        sample = None if self.cards is None else self.cards.sample()
        return None if sample is None else sum(c.free_bytes for c in sample[1])

    async def _check_freed(self, lent: Lent, stopped: asyncio.Future[None], pids: list[int],
                           free_before: int | None) -> None:
        """Once the lent GPU child has stopped, its memory checked on the card, as after a
        death: its pid gone from the driver's list (or holding nothing there), and how much
        came back. Said in the log and the status; a card that keeps it is warned of."""
        await stopped
        if self.cards is None or not pids or free_before is None:
            return
        which = f"pid {pids[0]}" if len(pids) == 1 else f"pids {', '.join(map(str, pids))}"
        waited = 0.0
        while True:
            cards = await self.cards.now()
            if cards is None or self.fleet.lent.get(self.gpu) is not lent:
                return
            held = sum(c.process_bytes.get(pid, 0) for c in cards for pid in pids)
            if not held:
                back = max(0, sum(c.free_bytes for c in cards) - free_before)
                self.freed = lent, f"{back // MIB} MiB back on the card"
                log.info("[%s] lent: the memory of %s is back on the card (%d MiB more free "
                         "than before its stop)", self.gpu, which, back // MIB)
                return
            if waited >= yielding.RELEASE_CHECK_S:
                self.freed = lent, f"{which} still holds {held // MIB} MiB on the card"
                log.warning("[%s] lent, but %s still holds %d MiB on the card %.0f s after "
                            "its stop", self.gpu, which, held // MIB, waited)
                return
            await self.sleep(0.5)
            waited += 0.5

    def _filled(self) -> bool:
        """The card has no room for the GPU child, by a sample taken since it stopped (an older
        one still shows its own memory)."""
        if self.cards is None:
            return False
        sample = self.cards.sample()
        stopped = self.fleet.children[self.gpu]
        return (sample is not None and stopped.state is ChildState.STOPPED
                and sample[0] > stopped.state_since and self.cards.short())

    def _filled_while_idle(self, lent: Lent) -> None:
        """A request would wake the GPU child lent when idle, but another program has taken
        the card's memory meanwhile: it is lent to that program now, so that it comes back by
        the same rule as after giving way."""
        assert self.cards is not None
        sample = self.cards.sample()
        others = yielding.others_on(sample[1], self.cards.own()) if sample else yielding.Others(0)
        whom, pid = self._whom(others)
        reason = (f"a request for the model, but the card has no room for the GPU child now: "
                  f"lent to {whom} instead; the CPU child answers, and the GPU child starts "
                  f"again once the card has room")
        log.warning("[%s] %s", self.gpu, reason)
        self.fleet.lend(self.gpu, Lent(YIELD, reason, lent.since, lent.since_monotonic,
                                       lent.answers_then, to_whom=whom, pid=pid))
        self._record("lent", YIELD, reason)
        if self.metrics is not None:
            self.metrics.gpu_lendings.labels(YIELD).inc()
        self.observe()

    def _come_back_if_done(self, lent: Lent, others: yielding.Others, free: int,
                           quiet_s: float) -> None:
        """Lent to another program: the GPU child starts again once the card has room for it
        and that program left or the others held still. Not before it has stopped."""
        assert self.cards is not None
        if self.fleet.children[self.gpu].state is not ChildState.STOPPED:
            return
        gone = lent.pid is not None and (
            (others.listed and lent.pid not in others.by_pid) or not self.cards.alive(lent.pid))
        quiet = self.watch.quiet_for(self.clock())
        if not yielding.comes_back(not self.cards.short(), quiet, quiet_s, gone):
            return
        lent_s = self.clock() - lent.since_monotonic
        why = f"{lent.to_whom} left it" if gone else \
            f"the others' memory on it held still for {quiet:.0f} s"
        reason = (f"the card has room for the GPU child again ({free // MIB} MiB free) and {why}: "
                  f"started after {lent_s:.0f} s lent ({self._answered(lent)} answered by the "
                  f"CPU child meanwhile)")
        log.warning("[%s] %s", self.gpu, reason)
        self.fleet.take_back(self.gpu)
        self.watch.afresh()
        self._record("returned", YIELD, reason)
        if self.metrics is not None:
            self.metrics.gpu_wakes.labels(YIELD).inc()
        self.observe()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def to_json(self) -> dict[str, Any] | None:
        """The GPU child's lending, for its status: None when it is not lent."""
        lent = self.fleet.lent.get(self.gpu)
        if lent is None:
            return None
        return {"why": lent.why, "reason": lent.reason, "since": rfc3339(lent.since),
                "for_s": round(self.clock() - lent.since_monotonic, 1),
                "answered_by_cpu": self._answered(lent),
                "vram": self.freed[1] if self.freed is not None and self.freed[0] is lent
                else None,
                **({"to_whom": lent.to_whom, "pid": lent.pid} if lent.why == YIELD else {})}

    def others_json(self) -> dict[str, Any] | None:
        """What other programs hold on the GPU child's cards, as the lending last saw it (None
        before its first sample): for the status, so that a user sees what it weighs."""
        others = self.others
        if others is None:
            return None
        return {"mib": others.bytes // MIB,
                "processes": {str(pid): used // MIB for pid, used in others.by_pid.items()},
                "grown_mib": self.watch.grown_bytes(others) // MIB,
                "still_for_s": round(self.watch.quiet_for(self.clock()), 1)}

    def _answered(self, lent: Lent) -> int:
        """The CPU child's answers since the GPU child was lent."""
        return self.answered() - lent.answers_then

    def observe(self) -> None:
        """The metrics' gauge: at each lending and wake, and on the tick (the operator's pause
        and resume)."""
        if self.metrics is None:
            return
        lent = self.fleet.lent.get(self.gpu)
        for why in LENT_WHYS:
            self.metrics.gpu_lent.labels(why).set(1 if lent is not None and lent.why == why
                                                  else 0)

    def _record(self, decision: str, kind: str, reason: str) -> None:
        """An episode of the GPU child's with no request in it: what was done, and why."""
        self.incidents.write(child_episode(self.gpu, f"lent_{kind}", decision, reason))
