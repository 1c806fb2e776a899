"""The pool: the one owner of what is known about the upstreams while serving.

An upstream is one child (its name is its identity; the router-mode issue makes it a child and
a model). The pool keeps, for each: its state (it hears every change itself), its load (the one
count of requests in flight, `load.Load`), its capacity, speeds and profile (through its
`CapacitySource`, resources.py), whether an operator paused it; and, for all of them, the waiting
line and the replays waiting for a place.

The proxy asks it for a **lease**: a place on an upstream that is ready at that moment, or a
refusal with the 503's figures. The proxy forwards on the lease and closes it with the
attempt's outcome; the pool then releases the place, learns from the answer (speeds, service
time), counts the failure and drains an upstream that survived an OOM, and lets the next
request in. Admission itself is pure (policy/admission.py); the pool turns its decisions into
places and waits: a decision and its place are taken in one step, with no await between.

The upstreams come in the config's order (today the GPU child's, then the CPU child's): the first
is preferred, and a request that fails on one is taken over by the next (serving/failover.py
decides with policy/replay.py and policy/continuation.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..config.schema import Config
from ..records.metrics import Metrics
from ..policy import admission, replay, sickness, waitline
from ..policy.admission import Action, Capacity, ChildView, Decision, Request
from ..policy.evidence import FailureKind
from ..policy.lifecycle import ChildState
from ..policy.estimate import Work
from ..policy.media import Modality
from ..vocabulary import Attempt, AttemptEnd, AttemptFailure, Upstream

log = logging.getLogger("spillway.pool")
ABANDONED = "start_abandoned"  # an upstream started for a request was stopped before ready
NO_STREAK = sickness.Streak()
NO_WORK = Work(0, 0)  # for a view of a child that weighs no request


class CapacitySource(Protocol):
    """What the pool learns of its upstreams' capacity, and where it puts what it learns
    (resources.Resources provides it; the tests give a fake)."""

    paused: set[str]

    def child_view(self, name: str, busy: int, work: Work,
                   with_estimate: bool = True) -> ChildView: ...

    def vram_free_mib(self) -> float | None: ...

    def vram_headroom_mib(self) -> float: ...

    def media_reserve_mib(self, items: int) -> float: ...

    def service_s(self) -> float | None: ...

    def ctx_per_slot(self, name: str) -> int | None: ...

    def expected_seconds(self, name: str, work: Work) -> float | None: ...

    def observe_timings(self, name: str, timings: Mapping[str, Any],
                        media_items: int = 0) -> None: ...

    def observe_duration(self, seconds: float) -> None: ...

    def start_child(self, name: str) -> None: ...

    async def wait_ready(self, name: str, within_s: float) -> float | None: ...


@dataclass(eq=False)
class Lease:
    """A place on one upstream, ready when handed out; closed once with the attempt's outcome.
    `counted` leases are generation requests, under the caps; the others (routes outside the
    caps) only count as in flight."""

    pool: Pool
    upstream: Upstream
    counted: bool
    decision: Decision | None = None
    waited_s: float = 0.0
    start_s: float = 0.0  # waiting for an on-demand upstream to start
    # The wait this request was told to expect when it joined the line (what a 503 gives in
    # Retry-After); None when it did not wait.
    estimated_wait_s: float | None = None
    estimate_basis: str = "measured"  # see waitline.service_estimate
    closed: bool = False
    media_items: int = 0  # images and audio its attempt carries (Pool.carry_media)

    @property
    def name(self) -> str:
        return self.upstream.name

    def close(self, attempt: Attempt | None, end: AttemptEnd | None) -> None:
        """The attempt is over (end None: it was cancelled, the client left)."""
        self.pool.close(self, attempt, end)


@dataclass
class _Waiter:
    ticket: waitline.Ticket
    request: Request
    work: Work
    future: asyncio.Future[Decision]


class Pool:
    def __init__(self, source: CapacitySource, upstreams: Mapping[str, Upstream], max_waiting: int,
                 max_wait_s: float, *, metrics: Metrics | None = None, boot: str = "",
                 on_change: Callable[[], None] | None = None,
                 smaller: Collection[str] = ()) -> None:
        self.source = source
        self.upstreams = dict(upstreams)
        # How an upstream is drained (sick, or an OOM it survived): asked of its owner, the
        # fleet for the children (service/fleet.py; wired by the daemon); a model's instance
        # in router mode is its own.
        self.drain_upstream: Callable[[str, str], None] = \
            lambda name, reason: self.upstreams[name].drain(reason)
        # The upstreams' names in the config's order: the first is preferred; who takes over
        # from whom follows it (policy/replay.takeover).
        self.roles: Sequence[str] = list(self.upstreams)
        # Those serving a smaller model than the others (the small child): only requests that
        # accept another model go there, and nothing is continued there or from there.
        self.smaller = frozenset(smaller)
        self.max_wait_s = max_wait_s
        self.line = waitline.WaitLine(max_waiting)
        self.metrics = metrics
        self.boot = boot  # part of each failure episode's id
        self.on_change = on_change  # the waiting line changed (the status line)
        # Told an upstream's name when it becomes READY, or a place on it is given back
        # (serving/failback.py: streams that may move back to the GPU child).
        self.on_room: list[Callable[[str], None]] = []
        now = time.monotonic()
        self.last_used = {name: now for name in self.upstreams}  # a generation answered
        # Answers each upstream gave (its leases closed with a status): the status's count of
        # what the CPU child answered while the GPU was lent.
        self.answers = {name: 0 for name in self.upstreams}
        # Asked before each generation request is admitted: wakes the GPU child lent when
        # idle (service/fleet.py), the future done once it is starting; None: nothing to wake.
        self.wake: Callable[[], asyncio.Future[None] | None] = lambda: None
        # The upstreams' streaks of 5xx answers (none: no streak), and how long makes it sick.
        self._streaks: dict[str, sickness.Streak] = {}
        self.sick_after = sickness.DEFAULT_SICK_AFTER
        self.wait_for_gpu = True  # failover.wait_for_gpu: admission's 5w
        self._waiters: dict[int, _Waiter] = {}
        self._media: dict[str, int] = {}  # media items in flight, per upstream
        self._replays: deque[tuple[str, asyncio.Future[None]]] = deque()
        # When the first request was let through while none had been timed (a lower bound of
        # the service time until one finishes).
        self._first_unmeasured: float | None = None
        for member in self.upstreams.values():
            member.listeners.append(self._heard)

    # --- what is known ------------------------------------------------------------------------

    def busy(self, name: str) -> int:
        return self.upstreams[name].load.generation

    def states(self) -> dict[str, ChildState]:
        return {name: u.state for name, u in self.upstreams.items()}

    @property
    def paused(self) -> set[str]:
        return self.source.paused

    def ctx_per_slot(self, name: str) -> int | None:
        return self.source.ctx_per_slot(name)

    def cap(self, name: str) -> int:
        """How many requests `name` works on at once."""
        return self.source.child_view(name, 0, NO_WORK, with_estimate=False).cap

    def expected_seconds(self, name: str, work: Work) -> float | None:
        return self.source.expected_seconds(name, work)

    def configure(self, config: Config) -> None:
        """A reload: the waiting line's new bounds (a shorter line keeps who is in it)."""
        self.max_wait_s = config.queue.max_wait_s
        self.line.max_waiting = config.queue.max_waiting
        self.sick_after = config.restart.sick_after_errors
        self.wait_for_gpu = config.failover.wait_for_gpu

    def first_ready(self, media: frozenset[Modality] = frozenset()) -> Upstream | None:
        """The upstream a question outside the caps (a token count) goes to: one serving the
        model the request named (never the smaller one: its tokenizer is not that model's),
        whose projector takes the request's media when one does."""
        ready = [name for name in self.roles
                 if self.upstreams[name].is_ready and name not in self.smaller]
        able = [name for name in ready if self.takes(name, media)]
        chosen = able or ready
        return self.upstreams[chosen[0]] if chosen else None

    def takeovers(self, name: str, smaller_ok: bool = False,
                  after_bytes: bool = False) -> list[str]:
        """Who may take over a request that failed on `name`, first choice first
        (policy/replay.successors: the next upstreams in the config's order). A smaller
        model's only for a request that accepts one, and never after bytes: a stream is never
        continued on another model, nor from one (its tokenizer and text differ)."""
        if after_bytes and name in self.smaller:
            return []
        skip = self.smaller if after_bytes or not smaller_ok else frozenset()
        return replay.successors(self.roles, name, skip)

    def takeover(self, name: str, smaller_ok: bool = False,
                 after_bytes: bool = False) -> str | None:
        """The first of `takeovers`."""
        return next(iter(self.takeovers(name, smaller_ok, after_bytes)), None)

    def episode_id(self, name: str, generation: int) -> str:
        return f"{name}-{self.boot}-{generation}"

    def retry_after_s(self, name: str) -> float:
        """A Retry-After for a failed upstream: its back-off left plus its last start time."""
        member = self.upstreams[name]
        start = member.last_start_s if member.last_start_s is not None else 5.0
        if member.state is ChildState.READY:
            return 1.0
        if name in self.paused:
            return 60.0
        next_try = member.next_try_in_s()  # in BACKOFF and FATAL: when it is started again
        if next_try is not None:
            return min(60.0, next_try + start)
        if member.state is ChildState.FATAL:
            return 60.0
        return 1.0 + start

    def fits(self, name: str, prompt_tokens: int) -> bool:
        """Whether the prompt has room in one of its slots (unknown: it does)."""
        ctx = self.source.ctx_per_slot(name)
        return ctx is None or prompt_tokens < ctx

    def takes(self, name: str, media: frozenset[Modality]) -> bool:
        """Whether the upstream's projector takes the request's images, audio or video."""
        return not media or self.source.child_view(name, 0, NO_WORK, with_estimate=False) \
            .takes(media)

    def can_take_replay(self, name: str) -> bool:
        view = self.source.child_view(name, 0, NO_WORK)
        return view.state in (ChildState.READY, ChildState.STARTING) or view.startable

    def service_estimate(self) -> tuple[float, str]:
        running = (None if self._first_unmeasured is None
                   else time.monotonic() - self._first_unmeasured)
        return waitline.service_estimate(self.source.service_s(), running)

    def _headroom_mib(self, work: Work) -> float:
        """The GPU's headroom for this request: the configured margin, and for one with
        images or audio, room for its encoder's run and those of the media in flight."""
        headroom = self.source.vram_headroom_mib()
        if work.media:
            items = len(work.media.items) + self.media_in_flight(self.roles[0])
            headroom += self.source.media_reserve_mib(items)
        return headroom

    def media_in_flight(self, name: str) -> int:
        """The images and audio clips in the requests an upstream is working on."""
        return self._media.get(name, 0)

    def carry_media(self, lease: Lease, items: int) -> None:
        """The lease's attempt carries `items` media items (given back when it closes)."""
        if items and not lease.closed:
            lease.media_items += items
            self._media[lease.name] = self._media.get(lease.name, 0) + items

    def capacity(self, waiting: int, work: Work,
                 with_estimate: bool = True) -> Capacity:
        children = tuple(self.source.child_view(name, self.busy(name), work,
                                                with_estimate) for name in self.roles)
        servers = sum(c.cap for c in children if c.ready)
        returning = [(c.back_in_s, c.cap) for c in children
                     if not c.ready and c.back_in_s is not None]
        return Capacity(
            children=children,
            vram_free_mib=self.source.vram_free_mib(),
            vram_headroom_mib=self._headroom_mib(work),
            waiting=waiting,
            max_waiting=self.line.max_waiting,
            wait_s=waitline.estimated_wait(waiting + 1, self.service_estimate()[0], servers,
                                           returning),
            max_wait_s=self.max_wait_s,
            wait_for_gpu=self.wait_for_gpu,
        )

    def waiting(self) -> list[dict[str, float]]:
        now = time.monotonic()
        return [{"position": i, "waited_s": round(now - t.joined, 3)}
                for i, t in enumerate(self.line.tickets(), start=1)]

    # --- places -------------------------------------------------------------------------------

    def _take(self, name: str) -> None:
        self.upstreams[name].load.take(generation=True)
        if self._first_unmeasured is None and self.source.service_s() is None:
            self._first_unmeasured = time.monotonic()

    def _give_back(self, name: str) -> None:
        self.upstreams[name].load.give_back(generation=True)
        self.dispatch()

    def _heard(self, member: Any, old: ChildState, new: ChildState, reason: str) -> None:
        """A state change: capacity may have come back."""
        self.dispatch()
        if new is ChildState.READY:
            self._room(member.name)

    def _room(self, name: str) -> None:
        for listener in self.on_room:
            listener(name)

    # --- leases -------------------------------------------------------------------------------

    def passthrough(self, pin: str | None) -> Lease | Decision:
        """A lease for a route outside the caps: the GPU role when ready, else the CPU role,
        or the upstream pinned with X-Spillway-Child."""
        decision = admission.passthrough(self.states(), pin, self.smaller)
        if decision.child is None:
            return decision
        member = self.upstreams[decision.child]
        member.load.take(generation=False)
        return Lease(self, member, counted=False, decision=decision)

    async def lease(self, req: Request, work: Work) -> Lease | Decision:
        """A lease for a generation request (branches 3 to 7 of the admission order), or a
        REJECT/TOO_LONG decision. Handed out only for an upstream that is ready now: a request
        served from the waiting line resumes a moment after its place was taken, and in that
        moment its upstream may have begun to drain (a reload, an OOM it survived); then it
        goes through admission again, here, with what is left of its deadline."""
        began = time.monotonic()
        woken = self.wake()
        if woken is not None:
            # The GPU child lent when idle starts for this request; the request is admitted
            # once it is STARTING: to the CPU child now, or waiting for it where that is
            # sooner (5w), or where only it can take the request (6).
            await woken
            self.last_used[self.roles[0]] = time.monotonic()
        abandoned = 0
        while True:
            got = await self._admit(req, work)
            if isinstance(got, Decision) and got.cause == ABANDONED and abandoned < 2:
                abandoned += 1  # its upstream was stopped as it started: admitted anew
            elif isinstance(got, Decision) or got.upstream.is_ready:
                return got
            else:
                self._give_back(got.name)
            if req.deadline_s is not None:
                req = dataclasses.replace(
                    req, deadline_s=req.deadline_s - (time.monotonic() - began))
                began = time.monotonic()

    async def _admit(self, req: Request, work: Work) -> Lease | Decision:
        began = time.monotonic()
        estimate: float | None = None
        basis = "measured"
        if not self.line:
            fast = self._gpu_fast_path(req, work)
            if fast is not None:
                self._take(self.roles[0])
                return Lease(self, self.upstreams[self.roles[0]], counted=True, decision=fast)
        # Expected times cost a little: weighed for a deadline, and in an outage (the GPU
        # child not ready), where the earliest expected finish decides (admission's 5w).
        cap = self.capacity(len(self.line), work,
                            with_estimate=req.deadline_s is not None
                            or not self.upstreams[self.roles[0]].is_ready)
        decision = admission.decide(req, cap)
        if decision.action is Action.FORWARD and len(self.line) > 0:
            # A newcomer never passes those already waiting (no starvation): with anyone in
            # line, a request that could go now waits its turn too.
            position = len(self.line) + 1
            decision = (Decision(Action.REJECT, 7, "the waiting line is full",
                                 retry_after_s=cap.wait_s, queue_position=position,
                                 cause="queue_full")
                        if self.line.full else
                        Decision(Action.WAIT, 6, "waiting behind earlier requests",
                                 retry_after_s=cap.wait_s, queue_position=position))
        if decision.action is Action.FORWARD:
            assert decision.child is not None
            self._take(decision.child)  # in the same step as the decision: no race
        elif decision.action is Action.WAIT:
            estimate = decision.retry_after_s
            basis = self.service_estimate()[1]
            decision = await self._wait(req, decision, work)
            if decision.action is not Action.FORWARD:
                return decision  # dispatch took no place for these
        else:
            return decision
        name = decision.child
        assert name is not None
        lease = Lease(self, self.upstreams[name], counted=True, decision=decision,
                      waited_s=time.monotonic() - began, estimated_wait_s=estimate,
                      estimate_basis=basis)
        if decision.warm is not None:
            self.source.start_child(decision.warm)
        if decision.start_child:
            self.source.start_child(name)
            within = self.max_wait_s if req.deadline_s is None else req.deadline_s
            try:
                started = await self.source.wait_ready(name, within)
            except asyncio.CancelledError:
                self._give_back(name)
                raise
            if started is None:
                self._give_back(name)
                if self.upstreams[name].state in (ChildState.STOPPED, ChildState.FATAL):
                    # Stopped before it was ready (an on-demand small child making way for
                    # the GPU child): not a wait that ran out.
                    return Decision(Action.REJECT, 7, f"the {name} child was stopped as it "
                                                      "started", retry_after_s=2.0,
                                    cause=ABANDONED)
                return Decision(Action.REJECT, 7, f"the {name} child did not start in time",
                                retry_after_s=10.0, cause="start_timeout")
            lease.start_s = started
        return lease

    def _gpu_fast_path(self, req: Request, work: Work) -> Decision | None:
        """Branch 4 for the common case, without building the whole picture: nobody waiting,
        the GPU child ready with room and headroom, the prompt known to fit. Gives the same
        answer decide() would (the tests hold the two to it); None when in doubt."""
        name = self.roles[0]
        gpu = self.source.child_view(name, self.busy(name), NO_WORK, with_estimate=False)
        if not gpu.has_room or not gpu.fits(req.prompt_tokens) or not gpu.takes(req.media):
            return None
        free = self.source.vram_free_mib()
        if free is not None and free < self._headroom_mib(work):
            return None
        return Decision(Action.FORWARD, 4, "GPU child has room", child=name)

    async def _wait(self, req: Request, decision: Decision, work: Work) -> Decision:
        ticket = self.line.join(time.monotonic())
        if ticket is None:
            return Decision(Action.REJECT, 7, "the waiting line is full",
                            retry_after_s=decision.retry_after_s,
                            queue_position=self.line.max_waiting + 1, cause="queue_full")
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.id] = _Waiter(ticket, req, work, future)
        allowed = self.max_wait_s if req.deadline_s is None else min(self.max_wait_s,
                                                                     req.deadline_s)
        log.info("queued at position %d: %s", self.line.position(ticket), decision.reason)
        self._changed()
        # Half-way through its wait the line is asked again: a GPU child it waits for that is
        # late by then is waited for no longer (admission.sooner_on_return), and the CPU child
        # takes it with the half that is left. (A timer, not a second wait: most requests in
        # line are served long before, and a wait costs the hot path at concurrency 64.)
        half_way = asyncio.get_running_loop().call_later(allowed / 2, self.dispatch)
        try:
            self.dispatch()
            return await asyncio.wait_for(asyncio.shield(future), allowed)
        except TimeoutError:
            position = self.line.position(ticket)
            cap = self.capacity(position - 1, work)
            return Decision(Action.REJECT, 7, f"waited {allowed:.0f} s without capacity "
                                              f"freeing", retry_after_s=cap.wait_s,
                            queue_position=position, cause="wait_timeout")
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                served = future.result()
                if served.child is not None:
                    self._give_back(served.child)  # served just as the client left
            raise
        finally:
            half_way.cancel()
            self.line.leave(ticket)
            self._waiters.pop(ticket.id, None)
            if not future.done():
                future.cancel()
            self._changed()

    def dispatch(self) -> None:
        """Serve replays first, then the head of the line, while capacity allows."""
        while self._replays:
            name, fut = self._replays[0]
            if fut.done():
                self._replays.popleft()
                continue
            view = self.source.child_view(name, self.busy(name), NO_WORK)
            if not view.has_room:
                break
            self._replays.popleft()
            self._take(name)
            fut.set_result(None)
        while (head := self.line.head()) is not None:
            waiter = self._waiters.get(head.id)
            if waiter is None or waiter.future.done():
                self.line.leave(head)
                continue
            cap = self.capacity(0, waiter.work)
            decision = admission.can_serve_now(waiter.request, cap,
                                               time.monotonic() - head.joined)
            if decision is None:
                break
            self.line.leave(head)
            if decision.child is not None:
                self._take(decision.child)
            # (A TOO_LONG keeps its figures: its 400 names the context the prompt exceeds.)
            waiter.future.set_result(dataclasses.replace(decision, reason="served from the line"))
            self._changed()

    async def replay_lease(self, name: str, within_s: float | None,
                           returning: bool = False) -> Lease | None:
        """A lease on `name` for a replay, ahead of the line; starts an on-demand upstream.
        None if it could not take the replay in time. Like every lease, handed out only for an
        upstream that is ready now (see `lease`). `returning`: `name` is on its way back from
        a death (in its back-off or restart), and the replay waits for it."""
        began = time.monotonic()
        while True:
            left = None if within_s is None else within_s - (time.monotonic() - began)
            start_s = await self._acquire_replay(name, left, returning)
            if start_s is None:
                return None
            member = self.upstreams[name]
            if member.is_ready:
                return Lease(self, member, counted=True, start_s=start_s)
            self._give_back(name)

    async def _acquire_replay(self, name: str, within_s: float | None,
                              returning: bool = False) -> float | None:
        """A place on `name` for a replay: the seconds spent waiting for it to start (0 when it
        was running), or None."""
        began = time.monotonic()
        limit = self.max_wait_s if within_s is None else min(within_s, self.max_wait_s)
        view = self.source.child_view(name, self.busy(name), NO_WORK)
        start_s = 0.0  # it was running
        if view.ready and not view.has_room:
            # Busy: wait only if the estimated wait fits; a replay that would sit out the
            # whole limit is better answered now, with a Retry-After.
            expected = waitline.estimated_wait(len(self._replays) + 1,
                                               self.service_estimate()[0], view.cap)
            if expected > limit:
                log.info("replay on the %s child refused: it is busy and the wait would be "
                         "about %.0f s", name, expected)
                return None
        if not view.ready:
            if view.startable:
                self.source.start_child(name)
            elif view.state != ChildState.STARTING and not (
                    returning and view.back_in_s is not None):
                return None
            waited = await self.source.wait_ready(name, limit)
            if waited is None:
                return None
            start_s = waited
        view = self.source.child_view(name, self.busy(name), NO_WORK)
        if view.has_room and not self._replays:
            self._take(name)
            return start_s
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._replays.append((name, future))
        try:
            self.dispatch()
            await asyncio.wait_for(asyncio.shield(future),
                                   max(0.0, limit - (time.monotonic() - began)))
            return start_s
        except TimeoutError:
            return None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._give_back(name)
            raise
        finally:
            if not future.done():
                future.cancel()

    # --- closing ------------------------------------------------------------------------------

    def close(self, lease: Lease, attempt: Attempt | None, end: AttemptEnd | None) -> None:
        """Learn from the attempt, count its failure, give its place back, let the next in."""
        if lease.closed:
            return
        lease.closed = True
        name = lease.name
        now = time.monotonic()
        end = end or AttemptEnd()
        if end.failure is not None:
            self._failed(end.failure)
        elif lease.counted and end.status is not None:
            self._answered(name, end)
            self.answers[name] += 1
        if attempt is not None and attempt.timings and end.timed:
            self.source.observe_timings(name, attempt.timings, attempt.media_items)
        if lease.counted and attempt is not None and end.ok:
            self.source.observe_duration(now - attempt.started)
        if lease.counted:  # (a read such as GET /health or /props is no use of the model:
            self.last_used[name] = now  # it keeps no idle child awake)
        if lease.media_items:
            self._media[name] = max(0, self._media.get(name, 0) - lease.media_items)
        self.upstreams[name].load.give_back(generation=lease.counted)
        if lease.counted:
            self.dispatch()
            self._room(name)

    def _answered(self, name: str, end: AttemptEnd) -> None:
        """The sick-child rule (policy/sickness.py): a streak of 5xx answers to different
        requests drains and restarts the child; an answer to the request's own content (an
        image for a child with no projector) leaves the streak as it was."""
        assert end.status is not None
        if sickness.request_fault(end.status, end.error_message):
            return
        if not sickness.counts(end.status):
            self._streaks.pop(name, None)  # the common case: no streak, nothing made
            return
        streak = sickness.after(self._streaks.get(name, NO_STREAK), end.status, end.error_line,
                                end.body_digest, end.error_message)
        self._streaks[name] = streak
        if not sickness.is_sick(streak, self.sick_after):
            return
        del self._streaks[name]
        upstream = self.upstreams[name]
        verdict = sickness.verdict(streak, list(upstream.stderr_tail)[-50:])
        log.warning("[%s] sick (%s): %s; draining and restarting it", name, verdict.kind,
                    verdict.evidence)
        if self.metrics is not None:
            self.metrics.failovers.labels(name, str(verdict.kind)).inc()
        self.drain_upstream(name, f"sick ({verdict.kind}): {verdict.evidence}")

    def _failed(self, failure: AttemptFailure) -> None:
        if self.metrics is not None:
            self.metrics.failovers.labels(failure.child, str(failure.verdict.kind)).inc()
        kind = failure.verdict.kind
        if kind is FailureKind.OOM_SURVIVED or kind is FailureKind.GPU_FAULT:
            # The upstream lives but its memory state is unknown, or its device is gone: no
            # new work, let its other requests finish, then restart it.
            what = "OOM survived" if kind is FailureKind.OOM_SURVIVED else "GPU lost"
            self.drain_upstream(failure.child, f"{what}: {failure.verdict.evidence}")

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
