"""Reloading the configuration: SIGHUP and a file watcher share one path.

Read and validate (the file, then what the running daemon checks it against: the sockets it
serves); an invalid file keeps the running config (each problem is logged with its key path and
shown in status and metrics); a valid one is handed to the daemon as a diff to apply. The
watcher watches the file's folder, not the file, because editors replace files (write a new
one, rename it over the old) and a watch on the old inode would go quiet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from ..config import schema as config

log = logging.getLogger("spillway.reload")

DEBOUNCE_S = 0.3  # an editor's save is several events; act once they settle

Apply = Callable[[config.Config, list[str]], Awaitable[None]]
Check = Callable[[config.Config], list[config.Problem]]


class _Handler(FileSystemEventHandler):
    def __init__(self, name: str, fire: Callable[[], None]) -> None:
        self.name = name
        self.fire = fire

    def on_any_event(self, event: FileSystemEvent) -> None:
        paths = [event.src_path, getattr(event, "dest_path", "")]
        if event.event_type in ("created", "moved", "closed") and any(
                Path(str(p)).name == self.name for p in paths if p):
            self.fire()


class Reloader:
    def __init__(self, path: str, current: Callable[[], config.Config], apply: Apply,
                 on_result: Callable[[str, list[config.Problem]], None],
                 on_start: Callable[[], None] | None = None,
                 check: Check | None = None) -> None:
        self.path = path
        self.current = current
        self.apply = apply
        self.on_result = on_result  # (result, problems): applied | invalid | unchanged
        self.on_start = on_start
        self.check = check  # the problems of a valid file that the running daemon cannot take
        self._lock = asyncio.Lock()
        self._observer: Observer | None = None  # type: ignore[valid-type]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: asyncio.TimerHandle | None = None

    async def reload(self, trigger: str) -> str:
        """Read, validate and apply; returns the result."""
        async with self._lock:
            log.info("reloading %s (%s)", self.path, trigger)
            if self.on_start is not None:
                self.on_start()
            try:
                new = await asyncio.to_thread(config.load, self.path)
                problems = self.check(new) if self.check is not None else []
                if problems:
                    raise config.ConfigError(self.path, problems)
            except config.ConfigError as e:
                for p in e.problems:
                    log.error("reload refused, keeping the running config: %s", p)
                self.on_result("invalid", e.problems)
                return "invalid"
            changes = config.diff(self.current(), new)
            if not changes:
                log.info("reload: nothing changed")
                self.on_result("unchanged", [])
                return "unchanged"
            log.info("reload: applying %s", ", ".join(changes))
            await self.apply(new, changes)
            self.on_result("applied", [])
            return "applied"

    # --- the file watcher -----------------------------------------------------------------------

    def watch(self) -> None:
        self._loop = asyncio.get_running_loop()
        folder = str(Path(self.path).resolve().parent)
        observer = Observer()
        # Only what a save looks like (a file closed after writing, or renamed into place): the
        # kernel then stays quiet about files merely appended to in the same folder (a log).
        observer.schedule(_Handler(Path(self.path).name, self._from_thread), folder,
                          recursive=False,
                          event_filter=[FileClosedEvent, FileMovedEvent, FileCreatedEvent])
        observer.daemon = True
        observer.start()
        self._observer = observer
        log.info("watching %s for changes", self.path)

    def _from_thread(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._debounce)

    def _debounce(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        assert self._loop is not None
        self._pending = self._loop.call_later(
            DEBOUNCE_S, lambda: asyncio.ensure_future(self.reload("the file changed")))

    def stop(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
