"""Time as the supervisor waits on it: a seam, so that back-off tests run on a fake clock
instead of sleeping (tests/fake_clock.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        """Wait for `event` up to `timeout` seconds (None: no limit); True if it was set."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return True
