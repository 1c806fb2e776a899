"""A sick child: alive, answering /health, and failing request after request with a 5xx that
the requests did not cause (an OOM during start-up can leave llama-server so,
llama.cpp#27309). Such a child is drained and restarted.

Where the line is drawn between a bad request and a sick child:
- llama-server types its errors: a request's own fault is a 4xx (`invalid_request_error`, an
  exceeded context), a route it does not serve is a 501; neither counts. A 503 while it loads
  is not an answer. A 500 is its `server_error`: an exception while serving, which a malformed
  field can still cause (a JSON type error), so one 500 is no verdict;
- a streak counts the 5xx answers to generation requests with no success in between, and must
  hold answers to at least two *different* requests (by their bodies): one client retrying the
  same bad request is not a sick child;
- `restart.sick_after_errors` answers in such a streak (3 by default; 0: off) make it sick.

Its kind comes from its own words: an out-of-memory line (`oom_survived`) or a lost device
(`gpu_fault`) in its bodies or its last stderr lines, else `sick`. Pure: the caller keeps the
streak and carries the drain out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .evidence import FailureKind, Verdict, gpu_line

DEFAULT_SICK_AFTER = 3
NOT_COUNTED = frozenset({501, 503})  # a route it does not serve; loading


@dataclass(frozen=True)
class Streak:
    count: int = 0
    bodies: frozenset[int] = field(default_factory=frozenset)  # the requests' body digests
    lines: tuple[str, ...] = ()  # each answer's first line, oldest first (a few)


def counts(status: int) -> bool:
    """A 5xx that may say the child is sick (see the module's note)."""
    return status >= 500 and status not in NOT_COUNTED


def after(streak: Streak, status: int, line: str, body_digest: int) -> Streak:
    """The streak after one more answer to a generation request from this child."""
    if not counts(status):
        return Streak()  # a success (or an answer that says nothing) ends it
    return Streak(streak.count + 1, streak.bodies | {body_digest}, (*streak.lines, line)[-5:])


def is_sick(streak: Streak, threshold: int) -> bool:
    return threshold > 0 and streak.count >= threshold and len(streak.bodies) >= 2


def verdict(streak: Streak, stderr_tail: Sequence[str]) -> Verdict:
    """What the sick child is: from its bodies and its stderr, else `sick`."""
    found = gpu_line([*stderr_tail, *streak.lines])
    how = f"{streak.count} different requests in a row answered with a 5xx"
    if found is not None:
        kind, line = found
        kind = FailureKind.OOM_SURVIVED if kind is FailureKind.RUNTIME_OOM else kind
        return Verdict(kind, f"{line} ({how})")
    return Verdict(FailureKind.SICK, f"{how}: {streak.lines[-1] if streak.lines else ''}")
