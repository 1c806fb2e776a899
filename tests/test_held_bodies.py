"""serving/held.py: the large bodies held at once across requests, bounded."""

from __future__ import annotations

from supervisor.gpu import MIB
from supervisor.serving.held import HeldBodies


def test_bodies_are_held_up_to_the_bound_then_refused() -> None:
    held = HeldBodies(limit=10 * MIB)
    assert held.take(4 * MIB) and held.take(4 * MIB)
    assert not held.take(4 * MIB)  # 12 MiB would pass 10
    assert (held.held, held.holders, held.refused) == (8 * MIB, 2, 1)
    held.give_back(4 * MIB)
    assert held.take(4 * MIB)
    assert held.to_json() == {"held_bytes": 8 * MIB, "holders": 2, "max_bytes": 10 * MIB,
                              "refused": 1}


def test_one_body_larger_than_the_bound_is_taken_when_nothing_else_is_held() -> None:
    held = HeldBodies(limit=1 * MIB)
    assert held.take(3 * MIB)  # alone: served (it is under server.max_body_mib)
    assert not held.take(1)


def test_a_place_taken_by_content_length_is_made_right_for_the_body_read() -> None:
    held = HeldBodies(limit=10 * MIB)
    assert held.take(2 * MIB) and held.take(6 * MIB)
    assert held.grow(2 * MIB, 3 * MIB)  # decompressed a little larger: still fits
    assert held.held == 9 * MIB and held.holders == 2
    assert not held.grow(3 * MIB, 5 * MIB)  # 11 MiB: refused, the place stays as it was
    assert held.held == 9 * MIB
    assert held.grow(0, 1 * MIB) and held.holders == 3  # no place yet: taken now


def test_no_bound() -> None:
    held = HeldBodies(limit=0)
    assert all(held.take(100 * MIB) for _ in range(10))
