"""A reload's new commands, taken one child at a time (the order and the rule:
policy/rollout.py).

One task carries a rollout out: it hands each child its new command (children.Child
.take_command) and waits until that child is settled on it before it goes on to the next. A
reload during a rollout replaces it: the new rollout starts from what each child runs by then
(a child halfway through its restart goes on to the newest command). What the rollout is doing,
and where it stopped and why, is in the status (`reload.rollout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..config.schema import ChildConfig, Config
from ..policy import rollout
from ..records.timefmt import rfc3339
from ..upstreams.children import Child

log = logging.getLogger("spillway.reload")


class Rollout:
    def __init__(self, children: Mapping[str, Child],
                 take_command: Callable[[str, ChildConfig], Awaitable[rollout.Outcome]]
                 ) -> None:
        self.children = children
        self.take_command = take_command  # the fleet's (service/fleet.py)
        self._task: asyncio.Task[None] | None = None
        self.order: list[str] = []
        self.current: str | None = None  # the child taking its new command now
        self.outcomes: dict[str, str] = {}  # each child done, and how it settled
        self.kept: list[str] = []  # children left on their command when the rollout stopped
        self.started: float | None = None  # wall time
        self.ended: float | None = None

    def start(self, new: Config, changed: list[str]) -> None:
        """Roll the children in `changed` onto their commands in `new`, one at a time."""
        if self._task is not None and not self._task.done():
            log.info("reload: the rollout in progress (%s) gives way to this one",
                     self.current or "between children")
            self._task.cancel()
        self.order = rollout.order(new.order, changed)
        self.current, self.outcomes, self.kept = None, {}, []
        self.started, self.ended = time.time(), None
        log.info("reload: new commands for %s, one child at a time, in this order",
                 ", ".join(self.order))
        self._task = asyncio.create_task(self._run(new, list(self.order)), name="rollout")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self, new: Config, order: list[str]) -> None:
        for i, name in enumerate(order):
            self.current = name
            child = self.children[name]
            log.info("reload: the %s takes its new command", child.cfg.label)
            outcome = await self.take_command(name, new.child(name))
            self.outcomes[name] = str(outcome)
            self.current = None
            log.info("reload: the %s's new command: %s", child.cfg.label, outcome)
            if not rollout.goes_on(outcome):
                self.kept = order[i + 1:]
                why = child.rejected.why if child.rejected is not None else str(outcome)
                if self.kept:
                    log.error("reload: stopped at the %s (%s); %s keep their command",
                              child.cfg.label, why, ", ".join(self.kept))
                break
        self.ended = time.time()

    def to_json(self) -> dict[str, Any] | None:
        if self.started is None:
            return None
        return {
            "order": self.order,
            "current": self.current,
            "outcomes": self.outcomes,
            "kept": self.kept,
            "running": self.running,
            "started": rfc3339(self.started),
            "ended": rfc3339(self.ended) if self.ended is not None else None,
        }

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
