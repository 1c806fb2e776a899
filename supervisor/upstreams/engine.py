"""The owner of an upstream's lifecycle: one task, one inbox, the only writer of its Life.

A child (children.py) and a model's instance on a router (router/upstream.py) each have one
Engine. Whatever happens to the upstream (a command, a health probe's answer, a process's exit,
the router's word on an instance, the clock) is posted to the inbox as an event of
policy/lifecycle.py; the owner task takes them one at a time, asks `lifecycle.step` what each
comes to, and carries out the actions: the transitions are told (the upstream's `entered`), the
launches and stops go through the upstream's effects (processes for a child, the router's load
and unload for a model), and the two waits are the engine's own (the next try's time, a
drain's end).

Nobody else writes the Life; everyone may read it (`life`). Events are taken in the order they
were posted, so an answer from an older process or instance is recognised as such by `step`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .clock import Clock
from ..policy import lifecycle
from ..policy.lifecycle import Action, BackoffPolicy, ChildState, Ended, Event, Life

log = logging.getLogger("spillway.engine")


class Effects(Protocol):
    """What an upstream does when its lifecycle says so."""

    def launch(self, generation: int, reason: str) -> None:
        """Start it (its answers come back as events: Ready, Ended, ...)."""
        ...

    def opened(self, generation: int, since: int) -> None:
        """A model's instance began (a child's process begins with its launch)."""
        ...

    def terminate(self, action: lifecycle.Terminate) -> None:
        """End what runs; its Ended comes back as an event."""
        ...

    def recorded(self, end: Ended) -> None:
        """An end, as the lifecycle took it."""
        ...

    def orphaned(self, generation: int) -> None:
        """A model's instance ended with its router."""
        ...

    def entered(self, old: ChildState, new: ChildState, reason: str) -> None:
        """A transition: the log, the listeners."""
        ...

    def why_not_now(self) -> str | None:
        """Why a try that is due would not fit now (a model's capacity guard), or None."""
        ...


@dataclass(frozen=True)
class Heard:
    """Something the upstream heard that only makes sense as of the moment its owner takes
    it (a model's instance ended: was it loading, how long did it run, was it planned?):
    `judge` turns it into the lifecycle's event then, or None (nothing to tell)."""

    judge: Callable[[Life], Event | None]


class Engine:
    def __init__(self, name: str, effects: Effects, manner: lifecycle.Manner, *,
                 policy: Callable[[], BackoffPolicy], drain_timeout_s: Callable[[], float],
                 idle: asyncio.Event, clock: Clock, rng: Callable[[], float],
                 life: Life | None = None) -> None:
        self.name = name
        self.effects = effects
        self.manner = manner
        self._policy = policy  # read at each step: a reload may replace it
        self._drain_timeout_s = drain_timeout_s
        self._idle = idle  # set while the upstream has no request in flight
        self._clock = clock
        self._rng = rng
        self.life = life or Life()
        # (an event, or None to mark a place; a future when its poster waits for it)
        self._inbox: asyncio.Queue[tuple[Event | Heard | None, asyncio.Future[None] | None]] \
            = asyncio.Queue()
        self._owner: asyncio.Task[None] | None = None
        self._waiting: asyncio.Task[None] | None = None  # the next try's timer, or a drain's
        self._changed = asyncio.Event()
        self._closed = False

    # --- what others do ---------------------------------------------------------------------------

    def post(self, event: Event | Heard) -> None:
        """Into the inbox; taken in order, soon."""
        if self._closed:
            return
        self._inbox.put_nowait((event, None))
        self._ensure_owner()

    async def ask(self, event: Event | Heard | None) -> None:
        """Into the inbox; back once the owner has taken it."""
        if self._closed:
            return
        taken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait((event, taken))
        self._ensure_owner()
        await taken

    async def taken(self) -> None:
        """Back once every event posted before has been taken."""
        await self.ask(None)

    async def wait_state(self, *states: ChildState, timeout: float | None = None) -> bool:
        """Until the Life is in one of `states`; False on timeout."""
        return await self.until(lambda life: life.state in states, timeout)

    async def until(self, check: Callable[[Life], bool], timeout: float | None = None) -> bool:
        """Until `check(life)` holds, looked at after each change; False on timeout."""
        async def waiter() -> None:
            while not check(self.life):
                await self._changed.wait()
        try:
            await asyncio.wait_for(waiter(), timeout)
            return True
        except TimeoutError:
            return False

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """The owner and its waits end; what is still in the inbox is dropped."""
        self._closed = True
        for task in (self._waiting, self._owner):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        while not self._inbox.empty():
            _, taken = self._inbox.get_nowait()
            if taken is not None and not taken.done():
                taken.cancel()

    # --- the owner --------------------------------------------------------------------------------

    def _ensure_owner(self) -> None:
        if self._owner is None or self._owner.done():
            self._owner = asyncio.create_task(self._own(), name=f"lifecycle-{self.name}")

    async def _own(self) -> None:
        while True:
            event, taken = await self._inbox.get()
            try:
                self._take(event)
            except Exception:  # noqa: BLE001 - a bug in one event must not end the owner
                log.exception("[%s] the lifecycle could not take %r", self.name, event)
            finally:
                if taken is not None and not taken.done():
                    taken.set_result(None)

    def _take(self, event: Event | Heard | None) -> None:
        if event is None:
            return
        if isinstance(event, Heard):
            judged = event.judge(self.life)
            if judged is None:
                return
            event = judged
        ctx = lifecycle.Context(now=self._clock.now(), policy=self._policy(),
                                manner=self.manner, drain_timeout_s=self._drain_timeout_s(),
                                jitter=self._rng, why_not_now=self.effects.why_not_now)
        self.life, actions = lifecycle.step(self.life, event, ctx)
        for action in actions:
            self._do(action)
        self._tell_changed()

    def _do(self, action: Action) -> None:
        e = self.effects
        match action:
            case lifecycle.Enter(old, new, reason, life):
                self._cancel_wait()
                # While it is told, the Life reads as it was on entering (a listener told of
                # STARTING reads the generation before the launch's).
                final, self.life = self.life, life
                try:
                    e.entered(old, new, reason)
                finally:
                    self.life = final
                self._tell_changed()
            case lifecycle.Launch(generation, reason):
                e.launch(generation, reason)
            case lifecycle.Opened(generation, since):
                e.opened(generation, since)
            case lifecycle.Terminate():
                e.terminate(action)
            case lifecycle.Record(end):
                e.recorded(end)
            case lifecycle.Orphaned(generation):
                e.orphaned(generation)
            case lifecycle.WakeAt(at, after_s):
                self._wait_for(self._wake_at(at, after_s))
            case lifecycle.WaitIdle(timeout_s):
                self._wait_for(self._until_idle(timeout_s))

    def _tell_changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- the engine's own waits: each posts one event when it is over ---

    def _cancel_wait(self) -> None:
        if self._waiting is not None and not self._waiting.done():
            self._waiting.cancel()
        self._waiting = None

    def _wait_for(self, wait: Coroutine[Any, Any, None]) -> None:
        self._cancel_wait()
        self._waiting = asyncio.create_task(wait, name=f"lifecycle-{self.name}-wait")

    async def _wake_at(self, at: float, after_s: float) -> None:
        await self._clock.wait(asyncio.Event(), after_s)
        self.post(lifecycle.Due(at))

    async def _until_idle(self, timeout_s: float) -> None:
        idle = asyncio.ensure_future(self._idle.wait())
        try:
            await self._clock.wait_any({idle}, timeout_s)
        finally:
            idle.cancel()
        self.post(lifecycle.Idle())


class LifeReader:
    """What an upstream (a child, a model's instance) reads of its Life, said once."""

    engine: Engine
    _clock: Clock

    @property
    def reason(self) -> str:
        """Why it is in its state, for status."""
        return self.engine.life.reason

    @property
    def generation(self) -> int:
        """Its processes (a child) or instances (a model) so far."""
        return self.engine.life.generation

    @property
    def crash_loop(self) -> lifecycle.CrashLoop:
        """Its quick failures in a row, and its tries from FATAL since the last good run."""
        return self.engine.life.loop

    @property
    def quick_failures(self) -> int:
        return self.engine.life.loop.quick_failures

    @property
    def fatal_tries(self) -> int:
        return self.engine.life.loop.fatal_tries

    @property
    def next_try_at(self) -> float | None:
        """Clock time of the next try, in BACKOFF and FATAL."""
        return self.engine.life.next_try_at

    @property
    def last_start_s(self) -> float | None:
        """STARTING to READY (a start, a load), the last time."""
        return self.engine.life.last_start_s

    def own_next_try_in_s(self) -> float | None:
        """Seconds to its next try, in BACKOFF or FATAL; None in other states."""
        life = self.engine.life
        if life.next_try_at is None or life.state not in (ChildState.BACKOFF,
                                                          ChildState.FATAL):
            return None
        return round(max(0.0, life.next_try_at - self._clock.now()), 1)


Exit = TypeVar("Exit")


async def exit_within(fut: asyncio.Future[Exit] | None, timeout: float) -> Exit | None:
    """An upstream's exit record once its process (or instance) ends, waiting up to `timeout`;
    None when there is none to wait for, it did not end in time, or the upstream was closed
    (its futures cancelled: that is not the caller's own cancellation)."""
    if fut is None:
        return None
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        return None
    except asyncio.CancelledError:
        if fut.cancelled():
            return None
        raise
