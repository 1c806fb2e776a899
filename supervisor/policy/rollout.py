"""A reload's new commands, one child at a time: in which order, and when one is settled. Pure.

A reload that changes several children's command (`model.args`, `model.llama_server`) must not
drain and restart them together: while both load, nothing serves. As a rolling update with no
replica unavailable does, the children take their new commands in turn, each only once the one
before is READY on its new command, the others serving meanwhile. The fallbacks go first (the
config's order reversed: the CPU child, then the small child, then the GPU child), so that the
GPU child, which serves most, goes last and finds the CPU child ready on its new command to
take its requests while it reloads; and a new command that cannot start is found out on a
child that serves little, before the GPU child is touched.

A new command that fails its first start is rolled back by the child (the last good command
runs again) and ends the rollout: the children after it keep their command, since the same
change would most likely fail the same way there.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence

from .lifecycle import ChildState


class Outcome(enum.StrEnum):
    """How a child's new command settled."""

    READY = "ready"  # a process of it is READY
    ROLLED_BACK = "rolled back"  # its first start failed: the last good command runs again
    STOPPED = "stopped"  # the child is stopped: it starts with it next time
    FAILED = "failed"  # FATAL on it, with no good command to go back to
    SUPERSEDED = "superseded"  # another reload asked for yet another command meanwhile


def order(children: Sequence[str], changed: Collection[str]) -> list[str]:
    """The children whose command changed, in the order they take it: fallbacks first."""
    return [name for name in reversed(children) if name in changed]


def settled(state: ChildState, *, rejected: bool, runs_it: bool, asked: bool) -> Outcome | None:
    """Whether a child that was given a new command is settled on it, and how; None while it
    drains, stops, loads or backs off. `rejected`: the new command was rolled back; `runs_it`:
    its current process was started with it; `asked`: it is still the command asked for."""
    if rejected:
        return Outcome.ROLLED_BACK
    if not asked:
        return Outcome.SUPERSEDED
    if state is ChildState.READY and runs_it:
        return Outcome.READY
    if state is ChildState.STOPPED:
        return Outcome.STOPPED
    if state is ChildState.FATAL:
        return Outcome.FAILED
    return None


def goes_on(outcome: Outcome) -> bool:
    """Whether the next child takes its new command after this outcome."""
    return outcome in (Outcome.READY, Outcome.STOPPED)
