"""Whether a drill runs: the window in which `POST /spillway/drill/arm` answers.

Arming sends SIGABRT to the GPU child, so it is refused outside a drill. `spillway drill` opens
the window (`POST /spillway/drill/start`), is given a token it shows on every arm
(`X-Spillway-Drill`), and closes it at its end; one drill at a time. A drill that dies without
closing it (killed, its machine gone) leaves a window that closes by itself after `idle_s`
without an arm, and whatever it armed is disarmed then (the daemon's tick asks `expired`).

For the same reason only a well-formed arm arms (`read_arm`): a body that is not a JSON object,
a field the arm does not take (`disarn`), or a value of the wrong type (`"disarm": "true"`) is a
400 that arms nothing, never read as the plain arm it would otherwise fall back to.
"""

from __future__ import annotations

import hmac
import json
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


# When an armed model's instance on the GPU router is sent SIGABRT: as its next task launches,
# or as another model's instance is spawned there (router mode).
WHENS = ("task", "neighbour_load")
_ARM_FIELDS = ("model", "now", "disarm", "when")


@dataclass(frozen=True)
class Arm:
    """What an arm asks: SIGABRT to the GPU child (in router mode, to `model`'s instance on
    the GPU router) at its next task (`when`), at once (`now`), or nothing armed (`disarm`)."""

    model: str | None = None
    now: bool = False
    disarm: bool = False
    when: str = "task"


def read_arm(body: object) -> Arm | str:
    """The arm a request's JSON body asks for, or what is wrong with it (for a 400)."""
    if not isinstance(body, dict):
        return f"the body must be a JSON object ({', '.join(_ARM_FIELDS)}), not a JSON " \
               f"{type(body).__name__}"
    unknown = [k for k in body if k not in _ARM_FIELDS]
    if unknown:
        return f"the arm takes {', '.join(_ARM_FIELDS)}; not {unknown[0]!r}"
    flags: dict[str, bool] = {}
    for name in ("now", "disarm"):
        value = body.get(name, False)
        if not isinstance(value, bool):
            return f"{name} must be true or false, not {_as_written(value)}"
        flags[name] = value
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        return f"model must be a model's name, not {_as_written(model)}"
    when = body.get("when", "task")
    if when not in WHENS:
        return "when must be 'task' (its next task launches) or 'neighbour_load' (another " \
               "model loads)"
    if "when" in body and (model is None or flags["now"]):
        return "when goes with model (router mode), and not with now"
    if flags["now"] and flags["disarm"]:
        return "now and disarm together ask for two things; send one"
    return Arm(model=model, now=flags["now"], disarm=flags["disarm"], when=when)


def _as_written(value: object) -> str:
    """A value as the client wrote it, for an error message: `"true"` (a string), `1`."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
