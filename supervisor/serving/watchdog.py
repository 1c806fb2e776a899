"""The stall watchdog: a child with work in flight that gets nowhere is ended, its requests
failing over as after any death.

`/health` cannot tell (llama-server answers it from its HTTP thread while the inference loop is
stuck), so progress is read from the work itself (policy/progress.py): the proxy marks each
byte of an answer on the child's Load, and once a child has been quiet a while the watchdog
reads its `/slots` every turn, a change in the figures counting as progress (a long prefill
moves them batch by batch). Nothing moved for the stall timeout: the child is ended as a hang
(`Child.end_stalled`), with what was in flight, the age of its last byte and its slots as the
evidence. Its streams are then continued and its other requests replayed under the usual rules,
and it restarts.

Single-model mode: a router's children are watched by their instances' own deaths.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from ..policy.lifecycle import ChildState
from ..policy.progress import SlotsView, Watch, evidence, moved, read_slots, stalled
from ..upstreams.children import Child

log = logging.getLogger("spillway.watchdog")

WATCH_EVERY_S = 1.0
QUIET_S = 2.0  # quiet this long (or a quarter of the timeout): the slots are read


class StallWatchdog:
    def __init__(self, children: Mapping[str, Child], timeout_of: Callable[[str], float],
                 session: Callable[[], aiohttp.ClientSession],
                 end_stalled: Callable[[str, str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.children = children
        self.end_stalled = end_stalled  # the fleet's (service/fleet.py): it ends the process
        self.timeout_of = timeout_of  # a child's stall timeout now (0: off)
        self.session = session
        self.clock = clock
        self._slots: dict[str, SlotsView] = {}  # the last reading of each child's /slots
        self._answer: dict[str, str] = {}  # how the last read went
        self._ended: dict[str, int] = {}  # the process generation each was last ended in
        self.stalls = 0  # children ended as stalled, since the start

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            await self.check()

    async def check(self) -> None:
        await asyncio.gather(*(self._check(name, child)
                               for name, child in self.children.items()))

    async def _check(self, name: str, child: Child) -> None:
        load = child.load
        timeout = self.timeout_of(name)
        generation = child.generation
        if child.state is not ChildState.READY or load.generation == 0 or timeout <= 0 or \
                self._ended.get(name) == generation:  # being ended: its exit is on its way
            self._slots.pop(name, None)
            self._answer.pop(name, None)
            return
        if self.clock() - load.progress >= min(QUIET_S, timeout / 4):
            view, answer = await self._read_slots(child, timeout)
            self._answer[name] = answer
            if view is not None:
                if moved(self._slots.get(name), view):
                    load.moved(self.clock(), byte=False)
                self._slots[name] = view
        if child.generation != generation or child.state is not ChildState.READY:
            return  # it ended meanwhile: not this process's stall
        now = self.clock()
        watch = Watch(busy=load.generation, since_progress_s=now - load.progress,
                      since_byte_s=None if load.last_byte is None else now - load.last_byte,
                      slots=self._slots.get(name), slots_answer=self._answer.get(name, ""))
        if stalled(watch, timeout):
            line = evidence(watch, timeout)
            log.warning("[%s] stalled: %s; ending it (its requests fail over)", name, line)
            self.stalls += 1
            self._slots.pop(name, None)
            self._ended[name] = generation
            self.end_stalled(name, line)

    async def _read_slots(self, child: Child, timeout: float) -> tuple[SlotsView | None, str]:
        """The child's /slots: (the reading, "answered"), (None, "unanswered") when no answer
        came in time, (None, "disabled") when it does not serve them (--no-slots)."""
        limit = max(0.5, min(2.0, timeout / 4))
        try:
            async with self.session().get(
                    f"{child.base_url}/slots",
                    headers={"Authorization": f"Bearer {child.api_key}"},
                    timeout=aiohttp.ClientTimeout(total=limit)) as r:
                if r.status in (404, 501):
                    return None, "disabled"
                payload: Any = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None, "unanswered"
        view = read_slots(payload)
        return view, "answered" if view is not None else "unanswered"

