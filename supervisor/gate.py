"""The admission gate: turns policy/admission.py's decisions into reservations and waits.

The gate counts the generation requests each child is working on (`busy`), never letting one
exceed its cap: a decision and its reservation happen together, with no await between. A
request that must wait takes a place in the waiting line (policy/waitline.py) and a future;
whenever capacity may have freed (a release, a child's state change, a new GPU sample) the gate
serves the head of the line if it can go now. Replays of failed requests wait ahead of the line:
they were admitted once already.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .policy import admission, waitline
from .policy.admission import Action, Capacity, ChildView, Decision, Request
from .policy.lifecycle import ChildState

log = logging.getLogger("spillway.gate")


class CapacitySource(Protocol):
    """What the gate needs to know of the children (the daemon provides it)."""

    def child_view(self, name: str, busy: int, body_size: int, max_tokens: int,
                   with_estimate: bool = True) -> ChildView: ...

    def vram_free_mib(self) -> float | None: ...

    def vram_headroom_mib(self) -> float: ...

    def service_s(self) -> float | None: ...

    def start_child(self, name: str) -> None: ...

    async def wait_ready(self, name: str, within_s: float) -> float | None: ...


@dataclass
class Admitted:
    child: str
    decision: Decision
    waited_s: float = 0.0
    cpu_start_s: float = 0.0
    # The wait this request was told to expect when it joined the line (the same estimate a
    # 503 gives in Retry-After); None when it did not wait.
    estimated_wait_s: float | None = None
    estimate_basis: str = "measured"  # see waitline.service_estimate


@dataclass
class _Waiter:
    ticket: waitline.Ticket
    request: Request
    body_size: int
    max_tokens: int
    future: asyncio.Future[Decision]


class Gate:
    def __init__(self, source: CapacitySource, max_waiting: int, max_wait_s: float,
                 on_change: Callable[[], None] | None = None) -> None:
        self.source = source
        self.max_wait_s = max_wait_s
        self.line = waitline.WaitLine(max_waiting)
        self.busy = {"gpu": 0, "cpu": 0}
        self._waiters: dict[int, _Waiter] = {}
        self._replays: deque[tuple[str, asyncio.Future[None]]] = deque()
        # When the first request was let through while none had been timed (a lower bound of
        # the service time until one finishes).
        self._first_unmeasured: float | None = None
        self.on_change = on_change

    # --- capacity -----------------------------------------------------------------------------

    def service_estimate(self) -> tuple[float, str]:
        running = (None if self._first_unmeasured is None
                   else time.monotonic() - self._first_unmeasured)
        return waitline.service_estimate(self.source.service_s(), running)

    def capacity(self, waiting: int, body_size: int, max_tokens: int,
                 with_estimate: bool = True) -> Capacity:
        gpu = self.source.child_view("gpu", self.busy["gpu"], body_size, max_tokens,
                                     with_estimate)
        cpu = self.source.child_view("cpu", self.busy["cpu"], body_size, max_tokens,
                                     with_estimate)
        servers = sum(c.cap for c in (gpu, cpu) if c.ready)
        returning = [(c.back_in_s, c.cap) for c in (gpu, cpu)
                     if not c.ready and c.back_in_s is not None]
        return Capacity(
            gpu=gpu, cpu=cpu,
            vram_free_mib=self.source.vram_free_mib(),
            vram_headroom_mib=self.source.vram_headroom_mib(),
            waiting=waiting,
            max_waiting=self.line.max_waiting,
            wait_s=waitline.estimated_wait(waiting + 1, self.service_estimate()[0], servers,
                                           returning),
            max_wait_s=self.max_wait_s,
        )

    def reserve(self, child: str) -> None:
        self.busy[child] += 1
        if self._first_unmeasured is None and self.source.service_s() is None:
            self._first_unmeasured = time.monotonic()

    def release(self, child: str) -> None:
        self.busy[child] = max(0, self.busy[child] - 1)
        self.dispatch()

    # --- admitting ----------------------------------------------------------------------------

    async def admit(self, req: Request, body_size: int, max_tokens: int) -> Admitted | Decision:
        """Admitted (holding a reservation on its child), or a REJECT/TOO_LONG decision."""
        began = time.monotonic()
        estimate: float | None = None
        basis = "measured"
        if not self.line:
            fast = self._gpu_fast_path(req)
            if fast is not None:
                self.reserve("gpu")
                return Admitted("gpu", fast)
        cap = self.capacity(len(self.line), body_size, max_tokens,
                            with_estimate=req.deadline_s is not None)
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
            self.reserve(decision.child)  # in the same step as the decision: no race
        elif decision.action is Action.WAIT:
            estimate = decision.retry_after_s
            basis = self.service_estimate()[1]
            decision = await self._wait(req, decision, body_size, max_tokens)
            if decision.action is not Action.FORWARD:
                return decision  # dispatch reserved nothing for these
        else:
            return decision
        child = decision.child
        assert child is not None
        admitted = Admitted(child, decision, waited_s=time.monotonic() - began,
                            estimated_wait_s=estimate, estimate_basis=basis)
        if decision.start_child:
            self.source.start_child(child)
            within = self.max_wait_s if req.deadline_s is None else req.deadline_s
            try:
                started = await self.source.wait_ready(child, within)
            except asyncio.CancelledError:
                self.release(child)
                raise
            if started is None:
                self.release(child)
                return Decision(Action.REJECT, 7, f"the {child} child did not start in time",
                                retry_after_s=10.0, cause="start_timeout")
            admitted.cpu_start_s = started
        return admitted

    def _gpu_fast_path(self, req: Request) -> Decision | None:
        """Branch 4 for the common case, without building the whole picture: nobody waiting,
        the GPU child ready with room and headroom, the prompt known to fit. Gives the same
        answer decide() would (the tests hold the two to it); None when in doubt."""
        gpu = self.source.child_view("gpu", self.busy["gpu"], 0, 0, with_estimate=False)
        if not gpu.has_room or not gpu.fits(req.prompt_tokens):
            return None
        free = self.source.vram_free_mib()
        if free is not None and free < self.source.vram_headroom_mib():
            return None
        return Decision(Action.FORWARD, 4, "GPU child has room", child="gpu")

    async def _wait(self, req: Request, decision: Decision, body_size: int,
                    max_tokens: int) -> Decision:
        ticket = self.line.join(time.monotonic())
        if ticket is None:
            return Decision(Action.REJECT, 7, "the waiting line is full",
                            retry_after_s=decision.retry_after_s,
                            queue_position=self.line.max_waiting + 1, cause="queue_full")
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.id] = _Waiter(ticket, req, body_size, max_tokens, future)
        allowed = self.max_wait_s if req.deadline_s is None else min(self.max_wait_s,
                                                                     req.deadline_s)
        log.info("queued at position %d: %s", self.line.position(ticket), decision.reason)
        self._changed()
        try:
            self.dispatch()
            return await asyncio.wait_for(asyncio.shield(future), allowed)
        except TimeoutError:
            position = self.line.position(ticket)
            cap = self.capacity(position - 1, body_size, max_tokens)
            return Decision(Action.REJECT, 7, f"waited {allowed:.0f} s without capacity "
                                              f"freeing", retry_after_s=cap.wait_s,
                            queue_position=position, cause="wait_timeout")
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                served = future.result()
                if served.child is not None:
                    self.release(served.child)  # served just as the client left
            raise
        finally:
            self.line.leave(ticket)
            self._waiters.pop(ticket.id, None)
            if not future.done():
                future.cancel()
            self._changed()

    def dispatch(self) -> None:
        """Serve replays first, then the head of the line, while capacity allows."""
        while self._replays:
            child, fut = self._replays[0]
            if fut.done():
                self._replays.popleft()
                continue
            view = self.source.child_view(child, self.busy[child], 0, 0)
            if not view.has_room:
                break
            self._replays.popleft()
            self.reserve(child)
            fut.set_result(None)
        while (head := self.line.head()) is not None:
            waiter = self._waiters.get(head.id)
            if waiter is None or waiter.future.done():
                self.line.leave(head)
                continue
            cap = self.capacity(0, waiter.body_size, waiter.max_tokens)
            decision = admission.can_serve_now(waiter.request, cap)
            if decision is None:
                break
            self.line.leave(head)
            if decision.child is not None:
                self.reserve(decision.child)
            waiter.future.set_result(Decision(
                decision.action, decision.branch, "served from the line", child=decision.child,
                start_child=decision.start_child))
            self._changed()

    async def acquire_replay(self, child: str, within_s: float | None) -> float | None:
        """A reservation on `child` for a replay, ahead of the line; starts an on-demand child.
        Returns the seconds spent waiting for it to start (0 when it was running), or None if
        it could not take the replay in time."""
        began = time.monotonic()
        limit = self.max_wait_s if within_s is None else min(within_s, self.max_wait_s)
        view = self.source.child_view(child, self.busy[child], 0, 0)
        start_s = 0.0  # the child was running
        if view.ready and not view.has_room:
            # Busy: wait only if the estimated wait fits; a replay that would sit out the
            # whole limit is better answered now, with a Retry-After.
            expected = waitline.estimated_wait(len(self._replays) + 1,
                                               self.service_estimate()[0], view.cap)
            if expected > limit:
                log.info("replay on the %s child refused: it is busy and the wait would be "
                         "about %.0f s", child, expected)
                return None
        if not view.ready:
            if view.startable:
                self.source.start_child(child)
            elif view.state != ChildState.STARTING:
                return None
            waited = await self.source.wait_ready(child, limit)
            if waited is None:
                return None
            start_s = waited
        view = self.source.child_view(child, self.busy[child], 0, 0)
        if view.has_room and not self._replays:
            self.reserve(child)
            return start_s
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._replays.append((child, future))
        try:
            self.dispatch()
            await asyncio.wait_for(asyncio.shield(future),
                                   max(0.0, limit - (time.monotonic() - began)))
            return start_s
        except TimeoutError:
            return None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(child)
            raise
        finally:
            if not future.done():
                future.cancel()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def waiting(self) -> list[dict[str, float]]:
        now = time.monotonic()
        return [{"position": i, "waited_s": round(now - t.joined, 3)}
                for i, t in enumerate(self.line.tickets(), start=1)]
