"""systemd's notify protocol (sd_notify), through sdnotify.

- READY=1 once listening with a child ready (or the CPU child startable on demand while the GPU
  child cannot load); READY=1 again after a reload;
- STATUS=<one line>: each child's state, waiting requests, the last incident;
- WATCHDOG=1 from the event loop at half of WATCHDOG_USEC, so a blocked loop misses its pings
  and systemd restarts the service;
- RELOADING=1 with MONOTONIC_USEC while a reload is applied; STOPPING=1 on shutdown;
- EXTEND_TIMEOUT_USEC while a model takes longer to load than systemd's start timeout.

Without NOTIFY_SOCKET (not run by systemd, or Type= not notify) every call does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import sdnotify

log = logging.getLogger("spillway.systemd")

# Variables that are for this process only: a child must not answer systemd in our place.
OWN_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                 "LISTEN_FDNAMES")


def _monotonic_usec() -> int:
    return int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1_000_000)


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = sdnotify.SystemdNotifier() if self.enabled else None
        self.watchdog_s = self._watchdog_interval()
        self.last_status = ""
        self.ready_sent = False

    @staticmethod
    def _watchdog_interval() -> float | None:
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
            return None
        return int(usec) / 1_000_000 / 2  # ping at half the interval, as sd_watchdog_enabled says

    def send(self, *lines: str) -> None:
        if self._sd is not None:
            self._sd.notify("\n".join(lines))

    def ready(self, status: str | None = None) -> None:
        lines = ["READY=1"]
        if status:
            lines.append(f"STATUS={status}")
            self.last_status = status
        self.send(*lines)
        if not self.ready_sent:
            log.info("ready")
        self.ready_sent = True

    def status(self, text: str) -> None:
        """One line; sent only when it changed."""
        text = text.replace("\n", " ")
        if text != self.last_status:
            self.last_status = text
            self.send(f"STATUS={text}")

    def reloading(self) -> None:
        self.send("RELOADING=1", f"MONOTONIC_USEC={_monotonic_usec()}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def extend_timeout(self, seconds: float) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    async def watchdog(self, alive: Callable[[], bool] | None = None) -> None:
        """Ping from the event loop: if the loop blocks, the pings stop."""
        if self.watchdog_s is None:
            return
        log.info("watchdog: pinging every %.1f s", self.watchdog_s)
        while True:
            if alive is None or alive():
                self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s)
