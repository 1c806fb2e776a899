"""A debug switch for finding what grows in a long run: `SPILLWAY_DEBUG_MEMORY=1` in the
daemon's environment adds `GET /spillway/debug/memory`, which answers the live objects the
garbage collector tracks, by type (the most numerous), and their change since the route was
first asked (`?collect=1`: after a full collection, so that cyclic garbage waiting for the
oldest generation's turn is not counted). `SPILLWAY_DEBUG_MEMORY=tracemalloc` also traces
allocations from the start (a slower daemon) and adds the source lines whose allocated bytes
grew most since the first ask.

Off by default: counting every object takes tens of milliseconds, tracing slows every
allocation. bench/soak.py turns the counts on and reads them once a minute.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections import Counter
from typing import Any

from aiohttp import web

from ..proxy.app import OwnRoute, json_response

ENV = "SPILLWAY_DEBUG_MEMORY"
PATH = "/spillway/debug/memory"
TOP = 25


def type_counts() -> Counter[str]:
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def grown(now: Counter[str], first: Counter[str], top: int = TOP) -> dict[str, int]:
    """The types whose counts grew most since `first`, largest growth first."""
    diff = Counter({k: v - first.get(k, 0) for k, v in now.items()})
    return {k: v for k, v in diff.most_common(top) if v > 0}


class MemoryDebug:
    def __init__(self, trace: bool) -> None:
        self.trace = trace
        self._first: Counter[str] | None = None
        self._first_snapshot: tracemalloc.Snapshot | None = None
        if trace and not tracemalloc.is_tracing():
            tracemalloc.start(4)

    def report(self, collect: bool = False) -> dict[str, Any]:
        """`collect`: a full garbage collection first (what it freed is in `collected`), so
        that cyclic garbage not yet collected is not taken for growth."""
        collected = gc.collect() if collect else None
        counts = type_counts()
        if self._first is None:
            self._first = counts
        out: dict[str, Any] = {"gc_objects": sum(counts.values()), "collected": collected,
                               "gc_counts": list(gc.get_count()),
                               "top_types": dict(counts.most_common(TOP)),
                               "grown_types": grown(counts, self._first)}
        if self.trace:
            snap = tracemalloc.take_snapshot().filter_traces(
                (tracemalloc.Filter(False, tracemalloc.__file__),))
            if self._first_snapshot is None:
                self._first_snapshot = snap
            out["traced_bytes"] = tracemalloc.get_traced_memory()[0]
            out["grown_lines"] = [
                {"where": str(s.traceback), "size_diff": s.size_diff, "count_diff": s.count_diff}
                for s in snap.compare_to(self._first_snapshot, "lineno")[:TOP]
                if s.size_diff > 0]
        return out

    async def route(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.report(collect=request.query.get("collect") == "1"))


def routes_from_env() -> dict[tuple[str, str], OwnRoute]:
    """The debug route, when the environment turns it on; else none."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "no", "off"):
        return {}
    return {("GET", PATH): MemoryDebug(trace=value == "tracemalloc").route}
