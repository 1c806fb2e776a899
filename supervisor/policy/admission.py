"""Admission: the decision taken before forwarding (forward, route elsewhere, wait, reject).

Pure. The design's order, numbered the same way in the code:

1. Spillway's own routes are answered directly (the app routes them before this module).
2. Bad input is rejected with a 4xx before any child sees it (the handler checks the body).
3. A prompt over the GPU child's context per slot goes to a child with room, else 400.
4. GPU child ready, under its concurrency cap, VRAM headroom kept: forward to it.
5. Replay-safe, CPU child ready or startable, expected CPU time within the deadline: CPU child.
6. Room in the waiting line and the wait fits the deadline: wait, in FIFO order.
7. Else 503 with Retry-After, x-should-retry, queue position and the estimated wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .routes import RouteClass

CHILD_ORDER = ("gpu", "cpu")


@dataclass(frozen=True)
class Route:
    child: str | None  # None: nobody can take it now
    reason: str
    retry_after_s: float = 0.0


def _retry_after(states: Mapping[str, str]) -> float:
    """How soon a child may be back, from the states alone."""
    values = set(states.values())
    if "STARTING" in values or "DRAINING" in values or "STOPPING" in values:
        return 2.0
    if "BACKOFF" in values or "EXITED" in values:
        return 5.0
    return 30.0


def _why_none(states: Mapping[str, str]) -> str:
    return "no child is ready (" + ", ".join(f"{n} is {s}" for n, s in states.items()) + ")"


def route_simple(states: Mapping[str, str], route: RouteClass, pin: str | None) -> Route:
    """4/5 without caps: the GPU child when ready, else the CPU child when ready, else 7.

    Routes outside the caps may be pinned to a child with `X-Spillway-Child`.
    """
    if pin in CHILD_ORDER and route is not RouteClass.GENERATION:
        if states.get(pin) == "READY":
            return Route(pin, "pinned by X-Spillway-Child")
        return Route(None, f"the {pin} child (pinned by X-Spillway-Child) is "
                           f"{states.get(pin)}", _retry_after(states))
    for name in CHILD_ORDER:
        if states.get(name) == "READY":
            return Route(name, f"{name} child ready")
    return Route(None, _why_none(states), _retry_after(states))
