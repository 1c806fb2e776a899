"""A fake clock for the supervisor's back-off waits (supervisor/clock.py's seam).

Time moves only when something waits on it: a wait that is not cut short by its event jumps
the clock to the wait's end at once, so a test of minutes of back-off runs in moments and the
waits it saw are exact. Each wait is recorded.
"""

from __future__ import annotations

import asyncio


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self.waits: list[float] = []  # every timed wait that ran out, in order

    def now(self) -> float:
        return self.t

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        await asyncio.sleep(0)  # let whoever would set the event run first
        if event.is_set():
            return True
        if timeout is None:
            await event.wait()
            return True
        self.t += timeout
        self.waits.append(timeout)
        return False
