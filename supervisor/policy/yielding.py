"""The GPU child giving way to another program on its cards (gpu.yield_to_other_processes), and
coming back once that program is done: pure rules over the cards' figures.

Another program (an image generator, a game, a video encoder) is seen by the memory it holds
on the GPU child's cards: each card's used memory less what Spillway's own processes hold
there. That works with every source: NVML lists every process with its memory, so the grower
is also named; the DRM fdinfo (AMD, Intel) reads only the processes asked for, so the others
are known as a sum. The GPU child gives way when the others grew since the last sample in
which the tightest card kept its headroom, and the card is now under it: the GPU child's own
growth (its KV cache, a batch) never makes it give way, and neither does a program that was
there all along. It comes back once the card has room for it again (the resources' need, as
after a death) and the others have not moved for `quiet_s`, or the program it gave way to has
left the card.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from .lifecycle import ChildState

MIB = 1024 * 1024
# The others' memory moves by this much before it counts as grown (or changed): NVML's used
# figure moves a little on its own (contexts, the driver's own).
GROWTH_SLACK_BYTES = 64 * MIB
# The GPU child's answers in flight get this long to finish on it once it gives way; those
# still running are then cut, streams continued on the CPU child and the rest replayed there
# (the failover's own rules, as after a death).
DRAIN_S = 3.0
GRACE_S = 1.0  # SIGTERM to SIGKILL: llama-server does not exit while a client is connected
# How long a lent GPU child's memory is looked for on the card after its stop before the
# lending says the card still holds it (the driver tears a context down after the process).
RELEASE_CHECK_S = 10.0


@dataclass(frozen=True)
class CardUse:
    """One of the GPU child's cards, as these rules read it."""

    free_bytes: int
    used_bytes: int
    process_bytes: Mapping[int, int]  # pid -> bytes on the card
    lists_every_process: bool  # a pid missing from process_bytes holds nothing there


@dataclass(frozen=True)
class Others:
    """What other programs hold on the GPU child's cards, summed over them."""

    bytes: int  # each card's used memory less Spillway's own processes' there
    by_pid: Mapping[int, int] = field(default_factory=dict)  # those the driver lists
    listed: bool = False  # every card lists every process: a pid missing is gone


def others_on(cards: Sequence[CardUse], own: Collection[int]) -> Others:
    """The other programs' memory on `cards`, Spillway's processes (`own`) left out."""
    total = 0
    by_pid: dict[int, int] = {}
    for card in cards:
        mine = sum(card.process_bytes.get(pid, 0) for pid in own)
        total += max(0, card.used_bytes - mine)
        if card.lists_every_process:
            for pid, used in card.process_bytes.items():
                if pid not in own:
                    by_pid[pid] = by_pid.get(pid, 0) + used
    return Others(total, by_pid, bool(cards) and all(c.lists_every_process for c in cards))


def grower(now: Others, before: Others) -> int | None:
    """The listed process that grew most since `before` (a new one counts from nothing), or
    None when none is listed or none grew."""
    grown = {pid: used - before.by_pid.get(pid, 0) for pid, used in now.by_pid.items()}
    best = max(grown, key=lambda pid: grown[pid], default=None)
    return best if best is not None and grown[best] > 0 else None


@dataclass
class OthersWatch:
    """The others' memory over time, fed each new sample: what it was at the last sample with
    room (where a growth counts from), and since when it has not moved (quiet)."""

    at_room: Others | None = None  # None: counted afresh at the next sample
    settled_bytes: int | None = None  # the others' bytes at their last move
    moved_at: float = 0.0

    def see(self, others: Others, now: float, room: bool) -> None:
        if self.at_room is None or room:
            self.at_room = others
        if self.settled_bytes is None or \
                abs(others.bytes - self.settled_bytes) >= GROWTH_SLACK_BYTES:
            self.settled_bytes = others.bytes
            self.moved_at = now

    def grown_bytes(self, others: Others) -> int:
        """How much the others grew since the last sample with room."""
        return 0 if self.at_room is None else others.bytes - self.at_room.bytes

    def quiet_for(self, now: float) -> float:
        return now - self.moved_at

    def afresh(self) -> None:
        """The GPU child lent or back: growth counts from the next sample (the others may
        have grown into the memory it left, which is theirs to take)."""
        self.at_room = None


def gives_way(enabled: bool, gpu: ChildState, lent: bool, tightest_free_bytes: int,
              headroom_bytes: int, grown_bytes: int) -> bool:
    """The GPU child gives way: READY and not lent already, the tightest of its cards under its
    headroom, and other programs grew there since it last had room. Not while it loads: its
    own allocations are not listed yet, and a load into a full card fails on its own (and is
    tried again once the card has room, as a FATAL one is)."""
    return (enabled and gpu is ChildState.READY and not lent
            and tightest_free_bytes < headroom_bytes
            and grown_bytes >= GROWTH_SLACK_BYTES)


def comes_back(room: bool, quiet_for_s: float, quiet_s: float, gone: bool) -> bool:
    """The GPU child that gave way starts again: its cards have room for it (its need and the
    headroom), and the program it gave way to left, or the others held still for quiet_s."""
    return room and (gone or quiet_for_s >= quiet_s)
