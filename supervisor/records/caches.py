"""What Spillway keeps in memory beyond a request's own life, and the bound of each, for the
status's `caches` object (`GET /spillway/status`): name -> {entries, bytes (where measurable),
max_entries, max_bytes, max_age_s}. A bound of None is no bound of that kind; every cache has
at least one of entries or bytes, and the list with its bounds is in docs/performance.md.
"""

from __future__ import annotations

from typing import Any


def figures(entries: int, *, max_entries: int | None = None, size: int | None = None,
            max_bytes: int | None = None, max_age_s: float | None = None) -> dict[str, Any]:
    """One cache's line in the status: its size now and its bounds."""
    return {"entries": entries, "bytes": size, "max_entries": max_entries,
            "max_bytes": max_bytes, "max_age_s": max_age_s}


def text_bytes(lines: Any) -> int:
    """The characters of some lines of text (their size, near enough: the output is ASCII)."""
    return sum(len(line) for line in lines)
