"""The collector's settings for a long-running proxy, applied once the daemon serves.

CPython's cyclic collector runs its youngest generation every 700 net allocations and, every
hundred of those, a full pass over every tracked object. On the hot path a request allocates
thousands of objects that its refcounts free at once, so the young passes find almost nothing,
while each full pass walked the 60,000 objects startup made (modules, the configuration, the
aiohttp application): some 20 us of every request at concurrency 64, 5% of its CPU
(bench: `python -m bench --only hotpath`).

So, at READY: what startup made is frozen (`gc.freeze`: moved to a generation the collector
never walks; it lives as long as the daemon anyway), and the youngest generation is collected
every 10,000 net allocations. Cycles (an exception's traceback, an aborted stream's task) are
still collected, in larger batches: a request's garbage is bounded, and the soak benchmark's
resident memory is the check."""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # net allocations between collections of the youngest generation


def settle() -> None:
    """Freeze what startup made and space out the young collections (idempotent: a second
    call freezes what was made since)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
