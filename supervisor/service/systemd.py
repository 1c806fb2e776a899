"""systemd's notify protocol (sd_notify): sdnotify finds and connects the socket; the sends
themselves never block.

- READY=1 once listening with a child ready (or the CPU child startable on demand while the GPU
  child cannot load); READY=1 again after a reload;
- STATUS=<one line>: each child's state, waiting requests, the last incident;
- WATCHDOG=1 from the event loop at half of WATCHDOG_USEC, so a blocked loop misses its pings
  and systemd restarts the service;
- RELOADING=1 with MONOTONIC_USEC while a reload is applied; STOPPING=1 on shutdown;
- EXTEND_TIMEOUT_USEC while a model takes longer to load than systemd's start timeout;
- at an upgrade in place (handover.py), MAINPID=<its pid> with READY=1 from the new daemon, and
  nothing more from the old one.

systemd reads the socket from PID 1, which can pause for seconds when busy; its queue holds a
few datagrams (net.unix.max_dgram_qlen, 10 by default). A blocking send on a full queue would
stop the event loop: no request answered, no signal handled. So every send is non-blocking:
- WATCHDOG and STATUS find the queue full: dropped (the next one carries the same news; a
  dropped STATUS is sent again at the next status() even if unchanged), logged once until
  systemd reads again;
- READY, RELOADING, STOPPING and EXTEND_TIMEOUT_USEC are retried from the event loop, in order,
  for up to RETRY_FOR_S, then dropped with a warning. Nothing waits for them: shutdown does
  not (a pending retry dies with the loop). Called with no loop running, they are retried at
  the next send, within the same second.

Without NOTIFY_SOCKET (not run by systemd, or Type= not notify) every call does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import sdnotify

log = logging.getLogger("spillway.systemd")

# Messages that change the service's state in systemd: worth a retry when the queue is full.
IMPORTANT = ("READY=", "RELOADING=", "STOPPING=", "EXTEND_TIMEOUT_USEC=", "MAINPID=")
RETRY_FOR_S = 1.0
RETRY_EVERY_S = 0.05
MAX_PENDING = 32

Sent = Literal["sent", "full", "failed"]


def _monotonic_usec() -> int:
    return int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1_000_000)


@dataclass
class _Pending:
    lines: list[str]
    deadline: float  # time.monotonic() after which it is dropped


class Notifier:
    def __init__(self) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET") or None
        self.enabled = self.address is not None
        self._sock = self._connect() if self.enabled else None
        self.watchdog_s = self._watchdog_interval()
        self.last_status = ""  # the newest status asked for
        self._status_sent: str | None = None  # the last one systemd got
        self.ready_sent = False
        self.dropped = 0  # messages systemd never got (queue full)
        self._pending: deque[_Pending] = deque()
        self._retry: asyncio.TimerHandle | None = None
        self._retry_loop: asyncio.AbstractEventLoop | None = None
        self._full = False  # dropping since the queue filled: logged once per episode
        self._error: str | None = None  # the last other send error: logged once

    def _connect(self) -> socket.socket | None:
        """sdnotify's connected datagram socket ('@name' is an abstract address), made
        non-blocking."""
        try:
            sd = sdnotify.SystemdNotifier(debug=True)
        except Exception as e:  # a missing path, an address too long, a bad value
            log.warning("NOTIFY_SOCKET=%s: cannot connect (%s); systemd will not hear from "
                        "spillway", self.address, e)
            return None
        sock: socket.socket = sd.socket
        sock.setblocking(False)
        return sock

    @staticmethod
    def _watchdog_interval() -> float | None:
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
            return None
        return int(usec) / 1_000_000 / 2  # ping at half the interval, as sd_watchdog_enabled says

    # --- sending ----------------------------------------------------------------------------

    def send(self, *lines: str) -> None:
        """Never blocks: see the module's docstring for a full queue."""
        if not self.enabled:
            return
        important = any(line.startswith(IMPORTANT) for line in lines)
        if self._pending and not self._flush():
            result: Sent = "full"  # behind older messages that still wait: keep the order
        else:
            result = self._try(lines)
        if result != "full":
            return
        if important:
            self._queue(list(lines))
        else:
            self._drop(lines)

    def _try(self, lines: Sequence[str]) -> Sent:
        if self._sock is None:
            return "failed"
        try:
            self._sock.send("\n".join(lines).encode(), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return "full"
        except OSError as e:
            if self._error != str(e):
                self._error = str(e)
                log.warning("systemd notify socket %s: %s; message dropped", self.address, e)
            return "failed"
        self._error = None
        if self._full:
            self._full = False
            log.info("systemd reads its notify socket again (%d message(s) dropped so far)",
                     self.dropped)
        for line in lines:
            if line.startswith("STATUS="):
                self._status_sent = line[len("STATUS="):]
        return "sent"

    def _drop(self, lines: Sequence[str]) -> None:
        self.dropped += 1
        if any(line.startswith("STATUS=") for line in lines):
            self._status_sent = None  # the next status() sends it again
        if not self._full:
            self._full = True
            log.warning("systemd's notify socket is full (PID 1 busy?): WATCHDOG and STATUS "
                        "messages are dropped until it reads again; READY, RELOADING, STOPPING "
                        "and EXTEND_TIMEOUT are retried for %.0f s", RETRY_FOR_S)

    def cache_figures(self) -> dict[str, Any]:
        """For the status's caches: messages waiting for a full notify socket."""
        return {"entries": len(self._pending), "bytes": None, "max_entries": MAX_PENDING,
                "max_bytes": None, "max_age_s": RETRY_FOR_S}

    def _queue(self, lines: list[str]) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._expire(self._pending.popleft())
        self._pending.append(_Pending(lines, time.monotonic() + RETRY_FOR_S))
        self._schedule()

    def _expire(self, p: _Pending) -> None:
        self.dropped += 1
        if any(line.startswith("STATUS=") for line in p.lines):
            self._status_sent = None
        log.warning("systemd did not read %s within %.0f s (its notify socket is full): dropped",
                    p.lines[0], RETRY_FOR_S)

    def _flush(self) -> bool:
        """Send the messages that wait, oldest first; True when none is left."""
        while self._pending:
            p = self._pending[0]
            # The newest status supersedes the one the message was made with.
            lines = [f"STATUS={self.last_status}" if line.startswith("STATUS=") else line
                     for line in p.lines]
            if self._try(lines) == "full":
                if time.monotonic() < p.deadline:
                    return False
                self._expire(p)
            self._pending.popleft()
        return True

    def _schedule(self) -> None:
        """A retry from the running loop; with none, the next send retries."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._retry is not None and self._retry_loop is loop:
            return
        self._retry_loop = loop
        self._retry = loop.call_later(RETRY_EVERY_S, self._on_retry)

    def _on_retry(self) -> None:
        self._retry = None
        if not self._flush():
            self._schedule()

    # --- the messages -----------------------------------------------------------------------

    def ready(self, status: str | None = None) -> None:
        lines = ["READY=1"]
        if status:
            status = status.replace("\n", " ")
            lines.append(f"STATUS={status}")
            self.last_status = status
        self.send(*lines)
        if not self.ready_sent:
            log.info("ready")
        self.ready_sent = True

    def status(self, text: str) -> None:
        """One line; sent when it changed, or when systemd missed the last one."""
        text = text.replace("\n", " ")
        if text != self.last_status or text != self._status_sent:
            self.last_status = text
            self.send(f"STATUS={text}")

    def main_pid(self, status: str) -> None:
        """An upgrade's new daemon: systemd follows this process from now on (MAINPID=, which
        NotifyAccess=all lets a process other than the main one send), and it is ready."""
        status = status.replace("\n", " ")
        self.last_status = status
        self.send(f"MAINPID={os.getpid()}", "READY=1", f"STATUS={status}")
        self.ready_sent = True

    def silence(self) -> None:
        """An upgrade's old daemon, once the new one is the main process: nothing more to
        systemd (a STOPPING=1 from it would stop the service the new one runs)."""
        self.enabled = False
        self._pending.clear()

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
