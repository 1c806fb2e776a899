"""Time as the supervisor waits on it: a seam, so that the child lifecycle's tests (back-off,
health polls, start and hang timeouts, drain, grace) run on a fake clock instead of sleeping
(tests/fake_clock.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any, Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        """Wait for `event` up to `timeout` seconds (None: no limit); True if it was set."""
        ...

    async def wait_any(self, aws: Collection[asyncio.Future[Any]],
                       timeout: float | None) -> set[asyncio.Future[Any]]:
        """Wait until one of `aws` is done, up to `timeout` seconds (None: no limit); those
        done (empty on timeout). Nothing is cancelled."""
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

    async def wait_any(self, aws: Collection[asyncio.Future[Any]],
                       timeout: float | None) -> set[asyncio.Future[Any]]:
        done, _ = await asyncio.wait(aws, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return done
