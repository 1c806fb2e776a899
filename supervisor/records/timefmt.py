"""Times as the records show them."""

from __future__ import annotations

import time


def rfc3339(wall: float) -> str:
    """UTC, millisecond precision: 2026-11-30T23:24:28.123Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(wall % 1 * 1000):03d}Z"
