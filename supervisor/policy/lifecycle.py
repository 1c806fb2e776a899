"""Child states, the transitions allowed between them, and the restart backoff.

Imports nothing: the owner task of each child (children.py) is the only writer of its state and
asks this module whether a transition is legal and how long to back off.

    STOPPED -> STARTING -> READY -> DRAINING -> STOPPING -> STOPPED
    STARTING|READY|DRAINING -> EXITED -> BACKOFF -> STARTING
    BACKOFF -> FATAL (too many quick failures) -> STARTING (the crash-loop back-off's next
    try, an operator, or memory freed)

FATAL means "stop hammering", not "never again": a home server is unattended. From FATAL the
child is tried again after a capped, growing interval (Kubernetes' crash-loop back-off): first
after min(backoff_max_s, fatal_retry_max_s), doubling up to fatal_retry_max_s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ChildState(enum.StrEnum):
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    READY = "READY"
    DRAINING = "DRAINING"
    STOPPING = "STOPPING"
    EXITED = "EXITED"
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"


S = ChildState

TRANSITIONS: dict[ChildState, frozenset[ChildState]] = {
    # STOPPED -> STARTING: started (daemon start, on-demand use, resume)
    S.STOPPED: frozenset({S.STARTING}),
    # STARTING -> READY: /health answered 200
    # STARTING -> EXITED: died while loading, or killed after the start timeout
    # STARTING -> STOPPING: stop asked for while loading
    S.STARTING: frozenset({S.READY, S.EXITED, S.STOPPING}),
    # READY -> DRAINING: no new work, in-flight work finishes (reload, OOM survived, operator)
    # READY -> STOPPING: stop or restart asked for
    # READY -> EXITED: died (OOM abort, crash, kill)
    S.READY: frozenset({S.DRAINING, S.STOPPING, S.EXITED}),
    # DRAINING -> STOPPING: in-flight work done, or the drain timed out
    # DRAINING -> READY: drain called off (operator resume)
    # DRAINING -> EXITED: died while draining
    S.DRAINING: frozenset({S.STOPPING, S.READY, S.EXITED}),
    # STOPPING -> STOPPED: the process is gone (SIGTERM, grace, SIGKILL)
    S.STOPPING: frozenset({S.STOPPED}),
    # EXITED -> BACKOFF: every unplanned exit waits before the next start
    # EXITED -> STOPPED: the exit came while a stop was wanted anyway
    S.EXITED: frozenset({S.BACKOFF, S.STOPPED}),
    # BACKOFF -> STARTING: the delay passed (or an operator restart cut it short)
    # BACKOFF -> FATAL: too many quick failures in a row
    # BACKOFF -> STOPPED: stop asked for while waiting
    S.BACKOFF: frozenset({S.STARTING, S.FATAL, S.STOPPED}),
    # FATAL -> STARTING: the crash-loop back-off's next try, operator restart, a reload, or
    # (GPU) the card's memory freed by another process
    # FATAL -> STOPPED: stop asked for
    S.FATAL: frozenset({S.STARTING, S.STOPPED}),
}

# How long a drain waits for in-flight work before it stops the upstream anyway
# (failover.drain_timeout_s's default; a child's and a model instance's alike).
DRAIN_TIMEOUT_S = 60.0

# States in which the child has a live process that may be serving requests.
SERVING = frozenset({S.READY, S.DRAINING})


class InvalidTransition(Exception):
    pass


def check_transition(current: ChildState, new: ChildState) -> None:
    if new not in TRANSITIONS[current]:
        raise InvalidTransition(f"{current} -> {new} is not a child transition")


@dataclass(frozen=True)
class BackoffPolicy:
    initial_s: float
    max_s: float
    quick_failure_s: float  # a run shorter than this counts as a quick failure
    max_quick_failures: int  # this many quick failures in a row -> FATAL
    fatal_retry_max_s: float  # the longest wait between two tries from FATAL


@dataclass(frozen=True)
class ExitDecision:
    fatal: bool
    delay_s: float
    quick_failures: int  # the new count of quick failures in a row


# A known, deterministic crash signature (signatures.py) seen this many times in a row ends the
# quick retries: the same crash at the same point again says that restarting cannot mend it.
KNOWN_CRASH_LIMIT = 2


def after_exit(policy: BackoffPolicy, quick_failures: int, run_s: float,
               jitter: float, served: bool = False,
               known_crash_repeats: int = 0) -> ExitDecision:
    """What to do after an unplanned exit.

    `run_s` is how long the process ran; `jitter` is a number in [0, 1) supplied by the caller so
    that this stays deterministic under test. A run longer than `quick_failure_s` clears the
    count: a child that served for hours and then died restarts after the initial delay. So does
    a death while working on requests (`served`): a request that runs the GPU out of memory is
    replayed elsewhere, not retried there, so it cannot loop; only a child that cannot start or
    stay up on its own is on its way to FATAL. `known_crash_repeats` (the same known crash
    signature, this many exits in a row) reaching KNOWN_CRASH_LIMIT is FATAL at once, served or
    not: llama.cpp's AMX matmul, say, kills every start at its first compute.
    """
    quick = run_s < policy.quick_failure_s and not served
    count = quick_failures + 1 if quick else 0
    if count >= policy.max_quick_failures or known_crash_repeats >= KNOWN_CRASH_LIMIT:
        return ExitDecision(fatal=True, delay_s=0.0, quick_failures=count)
    base = min(policy.max_s, policy.initial_s * (2 ** max(count - 1, 0)))
    # +-25% jitter, so two children (or two hosts) that failed together do not retry in lockstep.
    delay = base * (0.75 + 0.5 * jitter)
    return ExitDecision(fatal=False, delay_s=delay, quick_failures=count)


def fatal_retry_s(policy: BackoffPolicy, tries: int) -> float:
    """How long a FATAL child waits before its next try, after `tries` tries from FATAL that
    failed: min(backoff_max_s, fatal_retry_max_s), doubling up to fatal_retry_max_s. No
    jitter: the intervals are long, and the operator reads the next try in the status."""
    first = min(policy.max_s, policy.fatal_retry_max_s)
    return min(policy.fatal_retry_max_s, first * 2.0 ** min(tries, 64))


def quick_failures_after_fatal_try(policy: BackoffPolicy) -> int:
    """The quick-failure count a try from FATAL starts with: one more quick failure is FATAL
    again (with a longer wait), instead of another round of max_quick_failures fast starts."""
    return max(policy.max_quick_failures - 1, 0)


# --- the crash loop, one step for children and model instances alike --------------------------


@dataclass(frozen=True)
class CrashLoop:
    """What an upstream (a child, or a model's instance on a router) remembers of its failures:
    its quick failures in a row, and its tries from FATAL since the last good run."""

    quick_failures: int = 0
    fatal_tries: int = 0


class CrashLoopCounters:
    """The crash loop's figures, as status and the operator read them, for an object that
    keeps its `crash_loop` (a child, a model instance)."""

    crash_loop: CrashLoop

    @property
    def quick_failures(self) -> int:
        return self.crash_loop.quick_failures

    @property
    def fatal_tries(self) -> int:
        return self.crash_loop.fatal_tries


@dataclass(frozen=True)
class AfterDeath:
    """What an unplanned end comes to: the states to enter, in order, each with its reason;
    the wait before the next try (None: it stays STOPPED); the crash loop's new memory."""

    path: tuple[tuple[ChildState, str], ...]
    wait_s: float | None
    loop: CrashLoop

    @property
    def fatal(self) -> bool:
        return self.path[-1][0] is S.FATAL


def after_death(state: ChildState, loop: CrashLoop, policy: BackoffPolicy, *, what: str,
                run_s: float, jitter: float, served: bool, wanted: bool = True,
                again: str = "restart", known_crash: str | None = None,
                known_crash_repeats: int = 0) -> AfterDeath:
    """An unplanned end, seen in `state` (EXITED when the owner already said so). `what` is
    its kind and evidence; `again` names the next try in the BACKOFF reason ("restart", or
    "loaded again" for a model); `known_crash` is a known signature's summary, which a FATAL
    for repeats of it gives as its reason. Not `wanted` running: it stays STOPPED."""
    path: list[tuple[ChildState, str]] = [] if state is S.EXITED else [(S.EXITED, what)]
    decision = after_exit(policy, loop.quick_failures, run_s, jitter, served=served,
                          known_crash_repeats=known_crash_repeats)
    # A good run (or a death while serving) ends the crash loop: its FATAL tries too.
    new = CrashLoop(decision.quick_failures,
                    0 if decision.quick_failures == 0 else loop.fatal_tries)
    if not wanted:
        return AfterDeath((*path, (S.STOPPED, "exited while stopping")), None, new)
    if not decision.fatal:
        return AfterDeath((*path, (S.BACKOFF, f"{again} in {decision.delay_s:.1f} s after "
                                              f"{what}")), decision.delay_s, new)
    wait = fatal_retry_s(policy, new.fatal_tries)
    if known_crash_repeats >= KNOWN_CRASH_LIMIT and known_crash is not None:
        # Restarting cannot mend it: say what it is and what to change.
        why = f"the same crash {known_crash_repeats} times in a row; {known_crash}"
    else:
        why = f"{new.quick_failures} quick failures in a row; last: {what}"
    return AfterDeath((*path, (S.BACKOFF, what), (S.FATAL, f"{why}; next try in {wait:.0f} s")),
                      wait, new)


def fatal_try(loop: CrashLoop, policy: BackoffPolicy) -> CrashLoop:
    """The crash-loop back-off's next try from FATAL: counted, and one more quick failure is
    FATAL again (with a longer wait)."""
    return CrashLoop(quick_failures_after_fatal_try(policy), loop.fatal_tries + 1)
