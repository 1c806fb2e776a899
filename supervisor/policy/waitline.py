"""The waiting line: bounded, first in first out, with positions and an estimated wait.

Pure and synchronous: the pool keeps one of these and decides, each time capacity frees,
whether the request at the head can go. Only the head is ever served, so no request waits while
a later one takes the capacity it needs (no starvation); positions only fall.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Until requests have been timed, and with none running, a request is assumed to take this long.
DEFAULT_SERVICE_S = 5.0
# The least a request is assumed to take while the first ones run and none has been timed.
MIN_SERVICE_S = 0.1


@dataclass(frozen=True)
class Ticket:
    id: int
    joined: float  # monotonic seconds, given by the caller


class WaitLine:
    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._line: OrderedDict[int, Ticket] = OrderedDict()
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._line)

    def __contains__(self, ticket: Ticket) -> bool:
        return ticket.id in self._line

    @property
    def full(self) -> bool:
        return len(self._line) >= self.max_waiting

    def join(self, now: float) -> Ticket | None:
        """A place at the back, or None when the line is full."""
        if self.full:
            return None
        ticket = Ticket(self._next_id, now)
        self._next_id += 1
        self._line[ticket.id] = ticket
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """Out of the line (served, gave up, or the client went away); a no-op if not in it."""
        self._line.pop(ticket.id, None)

    def head(self) -> Ticket | None:
        return next(iter(self._line.values()), None)

    def position(self, ticket: Ticket) -> int:
        """1 for the head; 0 when not in line."""
        for i, tid in enumerate(self._line, start=1):
            if tid == ticket.id:
                return i
        return 0

    def tickets(self) -> list[Ticket]:
        return list(self._line.values())


def service_estimate(measured_s: float | None,
                     running_s: float | None) -> tuple[float, str]:
    """Seconds one request takes, and the basis of that figure:
    - "measured": the moving average of requests that finished;
    - "running": none has finished yet, but the first one has been running `running_s`: a
      request takes at least that long (so a burst at start-up is not told a made-up wait:
      a fixed guess was 50 times too long for a small model, seen in the chaos run);
    - "default": nothing measured and nothing running (nobody waits then anyway)."""
    if measured_s is not None and measured_s > 0:
        return measured_s, "measured"
    if running_s is not None:
        return max(MIN_SERVICE_S, running_s), "running"
    return DEFAULT_SERVICE_S, "default"


def estimated_wait(position: int, service_s: float | None, servers: int,
                   returning: Sequence[tuple[float, int]] = ()) -> float:
    """Seconds until the request at `position` (1 = next) is served, when `servers` requests
    run at once and each takes about `service_s`, and each (in_s, cap) of `returning` adds
    `cap` more from `in_s` seconds on (a child whose restart is under way: counting only the
    ready ones told waits more than twice too long while the GPU child restarted, in the chaos
    run)."""
    if position <= 0:
        return 0.0
    per = service_s if service_s and service_s > 0 else DEFAULT_SERVICE_S
    left = float(position)
    now = 0.0
    for at, cap in sorted((max(0.0, at), cap) for at, cap in returning if cap > 0):
        if servers > 0:
            served = (at - now) * servers / per  # requests served before this one returns
            if left <= served:
                return now + left * per / servers
            left -= served
        now = max(now, at)
        servers += cap
    return now + left * per / max(1, servers)
