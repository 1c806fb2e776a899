"""A dead GPU process's memory: back on the card or not, and whether the next start waits.

A process reaped is not always a process whose VRAM is free again: the driver tears its
context down after it (amdgpu's KFD in a work queue, NVIDIA's behind a core dump or MPS), and a
start that comes first races the dying process for the memory and dies the same way, start
after start (llama.cpp#26981: the crash loop after an image killed llama-server mid-prefill,
until --no-mmproj-offload). So after a GPU child's unplanned end its next start waits, up to
`restart.release_wait_s`, until each card it used says the memory is back:

- the dead pid is still among the card's processes, with memory: not back;
- a source that lists every process of the card (NVML) listed the pid while it lived, and lists
  it no more: back, whatever the free memory says (another process may have taken it since);
- otherwise (the DRM fdinfo looks only at the living children's own files; NVML in a container
  lists no pid of ours), the card's free memory: back once it is within `slack` of what it was
  just before the process started (NVML's figure moves a little on its own);
- no figures at all: nothing to wait for.

Past the bound it starts anyway, and says so. Pure: the caller samples the cards, keeps the
clock and waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MIB = 1024 * 1024
DEFAULT_WAIT_S = 30.0


@dataclass(frozen=True)
class Card:
    """One card's figures at one moment, as the rule reads them."""

    pci_bus_id: str
    free_bytes: int
    processes: Mapping[int, int] = field(default_factory=dict)  # pid -> bytes on this card
    lists_every_process: bool = False  # NVML: every process on the card; DRM: only the asked


@dataclass(frozen=True)
class Footprint:
    """What a dead GPU process may still hold: its pid, when it ended (the clock's time), each
    card's figures just before it started, and the cards whose full process list showed it
    while it lived."""

    pid: int
    ended_at: float
    before: tuple[Card, ...] = ()
    listed_on: frozenset[str] = frozenset()

    def before_on(self, pci_bus_id: str) -> Card | None:
        return next((c for c in self.before if c.pci_bus_id == pci_bus_id), None)


@dataclass(frozen=True)
class Judgement:
    go: bool
    why: str  # what the cards say, for the log ("" when there was nothing to wait for)
    forced: bool = False  # it goes because the bound is reached, the memory still held
    again_s: float = 0.0  # when not go: look again after this long


def held(fp: Footprint, card: Card, slack_bytes: int) -> str | None:
    """What `card` still holds of the dead process, in words; None when it is back."""
    own = card.processes.get(fp.pid, 0)
    if own > 0:
        return f"pid {fp.pid} still holds {own / MIB:.0f} MiB on {card.pci_bus_id}"
    if card.lists_every_process and card.pci_bus_id in fp.listed_on:
        return None  # gone from the card's processes: its context is torn down
    before = fp.before_on(card.pci_bus_id)
    if before is None or card.free_bytes + slack_bytes >= before.free_bytes:
        return None
    return (f"{card.pci_bus_id} has {card.free_bytes / MIB:.0f} MiB free, "
            f"{before.free_bytes / MIB:.0f} MiB before pid {fp.pid} started")


def judge(fp: Footprint, cards: Sequence[Card] | None, now: float, bound_s: float,
          slack_bytes: int, poll_s: float) -> Judgement:
    """Whether the next start may go now, after `fp`'s process ended: `cards` are the cards'
    figures sampled now (None: no figures), `bound_s` the longest wait (0: none), `poll_s` how
    soon to look again."""
    waited_s = max(0.0, now - fp.ended_at)
    if not cards or bound_s <= 0:
        return Judgement(True, "")
    still = [what for card in cards if (what := held(fp, card, slack_bytes)) is not None]
    if not still:
        return Judgement(True, f"the card has pid {fp.pid}'s memory back {waited_s:.1f} s "
                               "after its end")
    said = "; ".join(still)
    if waited_s >= bound_s:
        return Judgement(True, f"{said}, {waited_s:.0f} s after its end: starting anyway "
                               f"(restart.release_wait_s = {bound_s:g})", forced=True)
    return Judgement(False, said, again_s=min(poll_s, bound_s - waited_s))
