"""The GPU's memory over the last minutes, for the status page's chart.

A ring of points, bounded twice: by age (`span_s`, ten minutes by default) and by count
(`max_points`). Samples may come far more often than a chart needs (`monitor.sample_interval_s`
can be 0.1 s), so the points are thinned as they come: the stored points are at least
`span_s / max_points` apart, except the newest, which is always the latest sample (it is
replaced until the next step is due). Age is measured on the monotonic clock (a wall clock step
must not empty or freeze the chart); `since` filtering is on wall time, the time the page shows
and asks with. Pure: the caller passes each point with its times (tests pass their own).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SPAN_S = 600.0
DEFAULT_MAX_POINTS = 600


@dataclass(frozen=True)
class MemoryPoint:
    monotonic: float
    wall: float
    total_bytes: int
    free_bytes: int
    used_bytes: int
    # child name -> its processes' bytes on the card; None while it has no process.
    children: Mapping[str, int | None] = field(default_factory=dict)
    # every card's memory in use, by PCI address: a line per card on the chart
    devices: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"time": round(self.wall, 3), "total_bytes": self.total_bytes,
                "free_bytes": self.free_bytes, "used_bytes": self.used_bytes,
                "children": dict(self.children), "devices": dict(self.devices)}


class GpuHistory:
    def __init__(self, span_s: float = DEFAULT_SPAN_S,
                 max_points: int = DEFAULT_MAX_POINTS) -> None:
        if span_s <= 0 or max_points < 2:
            raise ValueError("span_s > 0 and max_points >= 2")
        self.span_s = span_s
        self.step_s = span_s / max_points
        # One more than max_points: the newest, not yet a step after the one before it.
        self._points: deque[MemoryPoint] = deque(maxlen=max_points + 1)

    def __len__(self) -> int:
        return len(self._points)

    @property
    def max_points(self) -> int:
        """At most this many points (the newest, not yet a step on, included)."""
        return self._points.maxlen or 0

    def add(self, point: MemoryPoint) -> None:
        points = self._points
        if len(points) >= 2 and points[-1].monotonic - points[-2].monotonic < self.step_s:
            points[-1] = point  # thinned: the newest was not yet a step on; this one replaces it
        else:
            points.append(point)
        while points and points[0].monotonic < point.monotonic - self.span_s:
            points.popleft()

    def since(self, wall: float, now: float | None = None) -> list[MemoryPoint]:
        """The points taken after `wall` (wall-clock seconds), oldest first; with `now`
        (monotonic), only those within `span_s` of it (sampling may have stopped)."""
        oldest = now - self.span_s if now is not None else float("-inf")
        return [p for p in self._points if p.wall > wall and p.monotonic >= oldest]
