"""Whether a drill runs: the window in which `POST /spillway/drill/arm` answers.

Arming sends SIGABRT to the GPU child, so it is refused outside a drill. `spillway drill` opens
the window (`POST /spillway/drill/start`), is given a token it shows on every arm
(`X-Spillway-Drill`), and closes it at its end; one drill at a time. A drill that dies without
closing it (killed, its machine gone) leaves a window that closes by itself after `idle_s`
without an arm, and whatever it armed is disarmed then (the daemon's tick asks `expired`).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IDLE_S = 1800.0  # a drill arms every few minutes at most; half an hour of silence is a dead one


@dataclass
class _Open:
    token: str
    opened: float
    touched: float


class DrillWindow:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 idle_s: float = IDLE_S) -> None:
        self._clock = clock
        self.idle_s = idle_s
        self._open: _Open | None = None

    @property
    def running(self) -> bool:
        return self._open is not None and not self._idle_past()

    def open(self) -> str | None:
        """A new drill's token; None while another drill runs."""
        if self.running:
            return None
        now = self._clock()
        self._open = _Open(secrets.token_urlsafe(24), now, now)
        return self._open.token

    def admits(self, token: str | None) -> bool:
        """Whether `token` is the running drill's; an admitted call keeps the window open."""
        if token is None or not self.running:
            return False
        assert self._open is not None
        if not hmac.compare_digest(token.encode(), self._open.token.encode()):
            return False
        self._open.touched = self._clock()
        return True

    def close(self) -> None:
        self._open = None

    def expired(self) -> bool:
        """True once, when a window left idle too long is closed by this call."""
        if self._open is not None and self._idle_past():
            self._open = None
            return True
        return False

    def to_json(self) -> dict[str, Any]:
        if not self.running:
            return {"running": False}
        assert self._open is not None
        now = self._clock()
        return {"running": True, "for_s": round(now - self._open.opened, 1),
                "closes_in_s": round(self._open.touched + self.idle_s - now, 1)}

    def _idle_past(self) -> bool:
        assert self._open is not None
        return self._clock() - self._open.touched >= self.idle_s
