"""A fake clock for the supervisor's waits (supervisor/upstreams/clock.py's seam).

Time moves only when something waits on it: a wait that is not cut short by its event jumps
the clock to the wait's end at once, so a test of minutes of back-off runs in moments and the
waits it saw are exact. Each wait is recorded.

Before it jumps, a wait lets everything else that can run run (a few turns of the event loop),
and fires the timers (`call_later`, the fake processes' own doings) due before its end, in
order: time jumps only when nothing else can happen first.

Waits on a process (`wait_any`: exit, command, idle, or timeout) are virtual only with
`fake_processes=True` (children on tests/fake_launcher.py). Without it they take real time,
because the process may be real (tests/test_child_backoff.py), and the clock stands still
through them: only the back-off's waits (`wait`) move it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Collection
from typing import Any

SETTLE_TURNS = 32  # turns of the event loop a wait gives the others before time jumps


class FakeClock:
    def __init__(self, start: float = 1000.0, *, fake_processes: bool = False) -> None:
        self.t = start
        self.waits: list[float] = []  # every timed wait that ran out, in order
        self.process_waits: list[float] = []  # every timed wait_any that ran out (virtual)
        self.fake_processes = fake_processes
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Call `fn` when the clock reaches now + `delay` (as a wait runs through it)."""
        heapq.heappush(self._timers, (self.t + delay, next(self._order), fn))

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        if await self._run_until(event.is_set, timeout):
            return True
        if timeout is None:
            await event.wait()
            return True
        self.waits.append(timeout)
        return False

    async def wait_any(self, aws: Collection[asyncio.Future[Any]],
                       timeout: float | None) -> set[asyncio.Future[Any]]:
        if not self.fake_processes:
            done, _ = await asyncio.wait(aws, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            return done
        if not await self._run_until(lambda: any(a.done() for a in aws), timeout):
            if timeout is not None:
                self.process_waits.append(timeout)
                return set()
            await asyncio.wait(aws, return_when=asyncio.FIRST_COMPLETED)
        return {a for a in aws if a.done()}

    async def sleep(self, seconds: float) -> None:
        """Virtual time passing for a fake (a probe that gets no answer), not recorded."""
        await self._run_until(lambda: False, seconds)

    async def _run_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """True as soon as `ready()`; False once the timeout is reached (the clock then at its
        end) or, with no timeout, once no timer is left."""
        deadline = None if timeout is None else self.t + timeout
        while True:
            for _ in range(SETTLE_TURNS):
                await asyncio.sleep(0)  # let whoever would make it ready run first
                if ready():
                    return True
            if self._timers and (deadline is None or self._timers[0][0] <= deadline):
                due, _, fn = heapq.heappop(self._timers)
                self.t = max(self.t, due)
                fn()
                continue
            if deadline is not None:
                self.t = max(self.t, deadline)
            return False
