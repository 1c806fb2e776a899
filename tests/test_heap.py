"""service/heap.py: what startup made is frozen, and young collections spaced out."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from supervisor.service import heap


@pytest.fixture
def collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settle_freezes_what_exists_and_spaces_the_young_collections(collector: None) -> None:
    made: list[list[int]] = [[] for _ in range(1000)]  # tracked containers, as startup makes
    before, older = gc.get_freeze_count(), gc.get_threshold()[1:]
    heap.settle()
    assert gc.get_freeze_count() >= before + len(made)
    # The youngest generation's threshold alone changes: the older ratios are CPython's.
    assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, *older)


def test_a_cycle_made_after_settling_is_still_collected(collector: None) -> None:
    import weakref

    heap.settle()

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
