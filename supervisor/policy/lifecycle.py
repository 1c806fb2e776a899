"""The lifecycle of an upstream: a child process, or a model's instance on a router child.

Its states, the transitions allowed between them, the restart back-off, and `step`: what one
event comes to, as a new state and the actions to carry out. Pure (of Spillway it imports only
the crash signatures' table, which counts a known crash's repeats). One owner task per upstream
(engine.py) is the only writer of its state; it takes events from its inbox, asks `step`, and
carries the actions out through the upstream's effects (children.py: processes;
router/upstream.py: the router's load and unload).

    STOPPED -> STARTING -> READY -> DRAINING -> STOPPING -> STOPPED
    STARTING|READY|DRAINING|STOPPING -> EXITED -> BACKOFF -> STARTING
    BACKOFF -> FATAL (too many quick failures) -> STARTING (the crash-loop back-off's next
    try, an operator, or memory freed)

FATAL means "stop hammering", not "never again": a home server is unattended. From FATAL the
child is tried again after a capped, growing interval (Kubernetes' crash-loop back-off): first
after min(backoff_max_s, fatal_retry_max_s), doubling up to fatal_retry_max_s.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import signatures


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
    # STOPPING -> EXITED: it died of its own before the stop reached it (a crash as the stop
    # came): a death, with its evidence, not a stop
    S.STOPPING: frozenset({S.STOPPED, S.EXITED}),
    # EXITED -> BACKOFF: every unplanned exit waits before the next start (a new command that
    # failed its first start waits for nothing: its last good command starts at once)
    # EXITED -> STOPPED: the exit came while a stop was wanted anyway
    S.EXITED: frozenset({S.BACKOFF, S.STOPPED}),
    # BACKOFF -> STARTING: the delay passed (or an operator restart cut it short, or a new
    # command was rolled back)
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
# After a death, before it starts again: EXITED (the death told), then BACKOFF or FATAL (its
# wait for the next try). Its memory is free meanwhile.
DEAD = frozenset({S.EXITED, S.BACKOFF, S.FATAL})


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


def fatal_try(loop: CrashLoop, policy: BackoffPolicy) -> CrashLoop:
    """The crash-loop back-off's next try from FATAL: counted, and one more quick failure is
    FATAL again (with a longer wait)."""
    return CrashLoop(quick_failures_after_fatal_try(policy), loop.fatal_tries + 1)


# --- one step for children and model instances ------------------------------------------------
#
# An upstream's whole state is a `Life`; what happens to it is an event; `step` says what the
# event comes to: the new Life, and the actions (transitions to tell, a launch, a stop, a wait)
# that its owner carries out. The two kinds differ only in what a `Manner` says.


@dataclass(frozen=True)
class Manner:
    """What differs between a child and a model's instance, for the lifecycle."""

    launch_opens: bool  # a launch is the process (a child); else the router says when an
    # instance begins (a model: `Began`)
    ready: str  # the READY reason's word: "ready in 1.20 s", "loaded in 1.20 s"
    again: str  # the next try, as the BACKOFF reason says it
    after_drain: str | None  # a child starts again after a drain, with this reason; a model
    # is unloaded and loaded again on demand (None)
    drained: str | None  # a model's STOPPING reason when its drain is over (a child's keeps
    # the drain's own)


CHILD = Manner(launch_opens=True, ready="ready", again="restart",
               after_drain="restart after stop", drained=None)
MODEL = Manner(launch_opens=False, ready="loaded", again="loaded again", after_drain=None,
               drained="drained: unloading it")


@dataclass(frozen=True)
class Life:
    """Everything the lifecycle knows of one upstream."""

    state: ChildState = S.STOPPED
    reason: str = "not started"
    since: float = 0.0  # clock time the state was entered
    wanted: bool = False  # kept running: started and not stopped (a model's instance always
    # is, while its router is up: a death is followed by a load)
    then: str | None = None  # once the current process has stopped, start again (the reason)
    generation: int = 0  # processes (a child) or instances (a model) so far
    running: bool = False  # the current generation has not ended
    host_up: bool = True  # a model's router is READY (a child has no host)
    loop: CrashLoop = field(default_factory=CrashLoop)
    next_try_at: float | None = None  # clock time of the next try, in BACKOFF and FATAL
    signatures: tuple[str | None, ...] = ()  # the known crash signature of each of the
    # last unplanned ends (None: none matched), newest last
    last_start_s: float | None = None  # STARTING to READY, the last time


# The signatures kept: enough for any repeat count the crash table asks for.
SIGNATURES_KEPT = 8


@dataclass(frozen=True)
class Context:
    """What a step may read besides the Life and the event. `jitter` is asked once for each
    death that backs off, `why_not_now` (a model's capacity guard) once for each try that is
    due: the owner supplies both, tests supply numbers."""

    now: float  # the clock
    policy: BackoffPolicy
    manner: Manner
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    jitter: Callable[[], float] = lambda: 0.5
    why_not_now: Callable[[], str | None] = lambda: None


# --- events: what the owner's inbox takes ---


@dataclass(frozen=True)
class Start:
    """Start it if it is stopped. `keep` (a child's start): keep it running, so from FATAL
    at once, and once a stop in progress is over; without it (a model's load on demand), now
    or not at all: a model in FATAL waits for its crash-loop back-off."""

    reason: str
    keep: bool = False


@dataclass(frozen=True)
class Restart:
    """Stop the process (if any) and start again; from BACKOFF or FATAL, at once."""

    reason: str


@dataclass(frozen=True)
class Drain:
    """READY only: no new work; when its requests are done (or the drain timeout), stop it;
    then start it again, unless `stop` (it stays stopped: the small child, making way for the
    GPU child)."""

    reason: str
    stop: bool = False


@dataclass(frozen=True)
class Stop:
    """Stop it and keep it stopped."""

    reason: str
    grace_s: float | None = None  # SIGTERM to SIGKILL, when not the configured one


@dataclass(frozen=True)
class CommandChanged:
    """A reload changed its command: a READY one drains (its requests finish, then it starts
    with the new one); a starting, backing-off or FATAL one restarts."""

    reason: str


@dataclass(frozen=True)
class Unload:
    """A model's idle instance, unloaded to make room for another."""

    reason: str


@dataclass(frozen=True)
class Forgive:
    """An operator's restart of a model: the crash loop forgotten; from BACKOFF or FATAL it
    is loaded again on demand."""

    reason: str


@dataclass(frozen=True)
class Began:
    """A model's instance began (the router spawned it, or lists it loading or loaded)."""

    reason: str
    since: int = 0  # where its output begins in the upstream's count of lines heard


@dataclass(frozen=True)
class Ready:
    """It answers: a child's /health said 200, the router said a model is loaded."""

    generation: int | None = None  # None: the current one


@dataclass(frozen=True)
class Unresponsive:
    """A child that did not get ready in time, stopped answering /health, stalled with work in
    flight, or turned out unfit (no layers on the GPU): end it, its record saying `kind`
    (None: `crash`)."""

    generation: int
    note: str
    grace_s: float | None = None
    kind: str | None = None  # a FailureKind's value


@dataclass(frozen=True)
class Ended:
    """Its process or instance ended, and what the evidence says."""

    generation: int
    planned: bool  # Spillway (or the router, evicting it) ended it
    what: str  # "kind: evidence", or how a planned end went ("stopped (exited with code 0)")
    run_s: float = 0.0
    served: bool = False  # it had started work on a request
    signature: str | None = None  # a known crash signature (signatures.py): a deterministic
    # one twice in a row is FATAL
    known_crash: str | None = None  # its verdict and remedy, in a sentence
    record: object = None  # the upstream's own record of the end (exit_of's answer)
    # Ended by Spillway for an unfit start (no layers on the GPU under gpu.require_offload):
    # a quick failure however long it loaded or served, so that it reaches FATAL and stops
    # reloading a model that will not fit the GPU.
    unfit: bool = False
    # llama-server refused its command (refusal.py: a bad flag or value, a file it cannot
    # open), said in a sentence: the same command fails the same way, so FATAL at once.
    refused: str | None = None
    # A new command (a reload's) that failed its first start: the upstream went back to its
    # last good command, and starts it at once (why, in a sentence). Not a quick failure: the
    # good command did not fail.
    rollback: str | None = None


@dataclass(frozen=True)
class Idle:
    """A drain's wait is over: its requests are done, or the drain timed out."""


@dataclass(frozen=True)
class Due:
    """The clock reached a back-off's end (`at`)."""

    at: float


@dataclass(frozen=True)
class LoadRefused:
    """The router did not take a load (its --models-max, a model it no longer lists)."""

    problem: str


@dataclass(frozen=True)
class UnloadRefused:
    """The router did not take an unload: nothing of the model was loaded."""


@dataclass(frozen=True)
class HostChanged:
    """A model's router changed state: `ready` (requests pass), `serving` (its instances
    live: READY or DRAINING)."""

    ready: bool
    serving: bool
    reason: str


Event = (Start | Restart | Drain | Stop | CommandChanged | Unload | Forgive | Began | Ready
         | Unresponsive | Ended | Idle | Due | LoadRefused | UnloadRefused | HostChanged)


# --- actions: what the owner carries out ---


@dataclass(frozen=True)
class Enter:
    """A transition, to tell (the log, the listeners); `life` is the Life as it entered, for
    whoever reads the upstream while it is told."""

    old: ChildState
    new: ChildState
    reason: str
    life: Life = field(compare=False, repr=False, default_factory=Life)


@dataclass(frozen=True)
class Launch:
    """Start it: a child spawns process `generation`; a model asks its router to load it."""

    generation: int
    reason: str


@dataclass(frozen=True)
class Opened:
    """A model's instance `generation` began, its output from line `since` on."""

    generation: int
    since: int


@dataclass(frozen=True)
class Terminate:
    """End the running process or instance: a child's SIGTERM, grace, SIGKILL; a model's
    unload. Planned, or (a child not ready in time, or hung) with a note for its record."""

    planned: bool
    grace_s: float | None = None
    note: str = ""
    kind: str | None = None  # what an unplanned end with a note is recorded as (a FailureKind)


@dataclass(frozen=True)
class Record:
    """An end, as the lifecycle took it: exit_of's answer, the last exit, the counters."""

    end: Ended


@dataclass(frozen=True)
class Orphaned:
    """A model's instance `generation` ended with its router (the router's exit is the
    evidence; it is no failure of the model)."""

    generation: int


@dataclass(frozen=True)
class WakeAt:
    """Post `Due(at)` when the clock reaches `at` (`after_s` from now)."""

    at: float
    after_s: float


@dataclass(frozen=True)
class WaitIdle:
    """Post `Idle()` when its requests are done, or after `timeout_s`."""

    timeout_s: float


Action = Enter | Launch | Opened | Terminate | Record | Orphaned | WakeAt | WaitIdle

# The states in which a process or instance may be running (a stop ends it).
_LIVE = frozenset({S.STARTING, S.READY, S.DRAINING})


class _Turn:
    """One step's work: the Life as it changes, and the actions in order."""

    def __init__(self, life: Life, ctx: Context) -> None:
        self.life = life
        self.ctx = ctx
        self.actions: list[Action] = []

    def set(self, **changes: object) -> None:
        self.life = replace(self.life, **changes)  # type: ignore[arg-type]

    def enter(self, new: ChildState, reason: str) -> None:
        old = self.life.state
        check_transition(old, new)
        # A start or a stop ends the wait for the next try.
        ends_wait = new in (S.STARTING, S.STOPPED)
        self.set(state=new, reason=reason, since=self.ctx.now,
                 next_try_at=None if ends_wait else self.life.next_try_at)
        self.actions.append(Enter(old, new, reason, self.life))

    def launch(self, reason: str) -> None:
        self.enter(S.STARTING, reason)
        if self.ctx.manner.launch_opens:
            self.set(generation=self.life.generation + 1, running=True)
        self.actions.append(Launch(self.life.generation, reason))

    def stop_it(self, reason: str, grace_s: float | None = None) -> None:
        self.enter(S.STOPPING, reason)
        self.actions.append(Terminate(planned=True, grace_s=grace_s))

    def wait(self, seconds: float) -> None:
        at = self.ctx.now + seconds
        self.set(next_try_at=at)
        self.actions.append(WakeAt(at, seconds))

    def restart_now(self, reason: str) -> None:
        """From STOPPED, BACKOFF or FATAL: start at once. From FATAL the crash loop is
        forgotten: an operator, a reload or freed memory deserves its own tries."""
        if self.life.state is S.FATAL:
            self.set(loop=CrashLoop(), signatures=())
        self.launch(reason)

    def start_after_stop(self) -> None:
        """STOPPED: a start asked for while it stopped comes now."""
        then = self.life.then
        self.set(then=None)
        if then is not None:
            self.launch(then)

    def walk_to_stopped(self, reason: str) -> None:
        """Legal steps from wherever it is to STOPPED; BACKOFF and FATAL stay."""
        steps = {S.READY: S.STOPPING, S.STARTING: S.STOPPING, S.DRAINING: S.STOPPING,
                 S.STOPPING: S.STOPPED, S.EXITED: S.STOPPED}
        while (next_state := steps.get(self.life.state)) is not None:
            self.enter(next_state, reason)


def step(life: Life, event: Event, ctx: Context) -> tuple[Life, list[Action]]:
    """What `event` comes to for an upstream in `life`: its new Life, and the actions to
    carry out, in order. An event that does not apply in the current state changes nothing."""
    turn = _Turn(life, ctx)
    _HANDLERS[type(event)](turn, event)
    return turn.life, turn.actions


def _start(t: _Turn, e: Start) -> None:
    t.set(wanted=True)
    state = t.life.state
    if state is S.STOPPED and t.life.host_up:
        t.launch(e.reason)
    elif state is S.FATAL and e.keep:
        t.restart_now(e.reason)
    elif state is S.STOPPING and e.keep and t.life.then is None:
        t.set(then="restart after stop")


def _restart(t: _Turn, e: Restart) -> None:
    t.set(wanted=True)
    state = t.life.state
    if state in _LIVE:
        t.set(then="restart after stop")
        t.stop_it(e.reason)
    elif state is S.STOPPING:
        t.set(then=e.reason)
    elif state in (S.STOPPED, S.BACKOFF, S.FATAL) and t.life.host_up:
        t.restart_now(e.reason)


def _drain(t: _Turn, e: Drain) -> None:
    if t.life.state is S.READY:
        t.enter(S.DRAINING, e.reason)
        if e.stop:
            t.set(wanted=False, then=None)
        else:
            t.set(then=t.ctx.manner.after_drain)
        t.actions.append(WaitIdle(t.ctx.drain_timeout_s))


def _stop(t: _Turn, e: Stop) -> None:
    t.set(wanted=False, then=None)
    state = t.life.state
    if state in _LIVE:
        t.stop_it(e.reason, e.grace_s)
    elif state in (S.BACKOFF, S.FATAL):
        t.enter(S.STOPPED, "stop asked for")


def _command_changed(t: _Turn, e: CommandChanged) -> None:
    if t.life.state is S.READY:
        _drain(t, Drain(e.reason))
    elif t.life.state in (S.STARTING, S.BACKOFF, S.FATAL):
        _restart(t, Restart(e.reason))


def _unload(t: _Turn, e: Unload) -> None:
    if t.life.state is S.READY:
        t.stop_it(e.reason)


def _forgive(t: _Turn, e: Forgive) -> None:
    t.set(loop=CrashLoop(), next_try_at=None)
    if t.life.state in (S.BACKOFF, S.FATAL):
        t.enter(S.STOPPED, e.reason)


def _began(t: _Turn, e: Began) -> None:
    if not t.life.running:
        t.set(generation=t.life.generation + 1, running=True)
        t.actions.append(Opened(t.life.generation, e.since))
    if t.life.state in (S.STOPPED, S.BACKOFF, S.FATAL):
        t.enter(S.STARTING, e.reason)


def _ready(t: _Turn, e: Ready) -> None:
    current = e.generation is None or e.generation == t.life.generation
    if current and t.life.running and t.life.state is S.STARTING:
        took = t.ctx.now - t.life.since
        t.set(last_start_s=took)
        t.enter(S.READY, f"{t.ctx.manner.ready} in {took:.2f} s")


def _unresponsive(t: _Turn, e: Unresponsive) -> None:
    if e.generation == t.life.generation and t.life.running and \
            t.life.state in (S.STARTING, S.READY):
        t.actions.append(Terminate(planned=False, grace_s=e.grace_s, note=e.note,
                                   kind=e.kind))


def _ended(t: _Turn, e: Ended) -> None:
    if e.generation != t.life.generation or not t.life.running:
        return  # already told (a router says an instance's end twice), or an older one's
    t.set(running=False)
    t.actions.append(Record(e))
    if e.planned:
        t.walk_to_stopped(e.what)
        t.start_after_stop()
        return
    if e.rollback is not None and t.life.wanted:
        t.set(then=None)
        t.enter(S.EXITED, e.what)
        t.enter(S.BACKOFF, e.rollback)
        t.launch(e.rollback)  # BACKOFF -> STARTING: its last good command, at once
        return
    then, stopping = t.life.then, t.life.state is S.STOPPING
    t.set(then=None, signatures=(*t.life.signatures, e.signature)[-SIGNATURES_KEPT:])
    repeats = signatures.repeats(t.life.signatures)
    decision = after_exit(t.ctx.policy, t.life.loop.quick_failures,
                          0.0 if e.unfit else e.run_s, t.ctx.jitter(),
                          served=e.served and not e.unfit, known_crash_repeats=repeats)
    # A good run (or a death while serving) ends the crash loop: its FATAL tries too.
    if e.refused is not None:  # restarting cannot mend it: FATAL at once
        decision = replace(decision, fatal=True)
    count = decision.quick_failures
    t.set(loop=CrashLoop(count, t.life.loop.fatal_tries if count else 0))
    # The wait is said as the death is told (the status of BACKOFF and FATAL gives it).
    wait_s = fatal_retry_s(t.ctx.policy, t.life.loop.fatal_tries) if decision.fatal \
        else decision.delay_s
    t.set(next_try_at=t.ctx.now + wait_s)
    t.enter(S.EXITED, e.what)
    if not t.life.wanted:
        t.enter(S.STOPPED, "exited while stopping")
        return
    if decision.fatal:
        if e.refused is not None:
            why = f"{e.refused}; the same command fails the same way: mend it and reload"
        elif repeats >= KNOWN_CRASH_LIMIT and e.known_crash is not None:
            # Restarting cannot mend it: say what it is and what to change.
            why = f"the same crash {repeats} times in a row; {e.known_crash}"
        else:
            why = f"{count} quick failures in a row; last: {e.what}"
        t.enter(S.BACKOFF, e.what)
        t.enter(S.FATAL, f"{why}; next try in {wait_s:.0f} s")
    else:
        t.enter(S.BACKOFF, f"{t.ctx.manner.again} in {wait_s:.1f} s after {e.what}")
    if then is not None and stopping:  # a restart asked for as it died: the back-off is
        t.restart_now(then)  # cut short (a drain's restart is not asked for: it backs off)
    else:
        t.wait(wait_s)


def _idle(t: _Turn, e: Idle) -> None:
    if t.life.state is S.DRAINING:
        t.stop_it(t.ctx.manner.drained or t.life.reason)


def _due(t: _Turn, e: Due) -> None:
    if t.life.state in (S.BACKOFF, S.FATAL) and e.at == t.life.next_try_at and t.life.host_up:
        _try(t)


def _try(t: _Turn) -> None:
    """The back-off's wait is over: start again, if it would fit now."""
    fatal = t.life.state is S.FATAL
    why_not = t.ctx.why_not_now()
    if why_not is not None:
        if not fatal:
            t.enter(S.STOPPED, f"backoff over; not {t.ctx.manner.again} yet: {why_not}")
            return
        # Stays FATAL; looked at again after the next interval.
        t.set(reason=f"{t.life.reason.split('; not loaded:')[0]}; not loaded: {why_not}")
        t.wait(fatal_retry_s(t.ctx.policy, t.life.loop.fatal_tries))
        return
    if fatal:
        t.set(loop=fatal_try(t.life.loop, t.ctx.policy))
        t.launch(f"try {t.life.loop.fatal_tries} from FATAL (crash-loop back-off)")
    else:
        t.launch("backoff over")


def _load_refused(t: _Turn, e: LoadRefused) -> None:
    # Not a failure of the model: it is loaded again on demand.
    if t.life.state is S.STARTING and not t.life.running:
        t.enter(S.STOPPING, f"the router did not load it: {e.problem}")
        t.enter(S.STOPPED, f"the router did not load it: {e.problem}")


def _unload_refused(t: _Turn, e: UnloadRefused) -> None:
    if t.life.state is S.STOPPING and not t.life.running:
        t.enter(S.STOPPED, "unloaded")
        t.start_after_stop()


def _host_changed(t: _Turn, e: HostChanged) -> None:
    t.set(host_up=e.ready)
    if not e.serving:
        # The router's instances end with it; BACKOFF and FATAL keep their timers.
        if t.life.running:
            t.set(running=False)
            t.actions.append(Orphaned(t.life.generation))
        t.set(then=None)
        t.walk_to_stopped(e.reason)
    elif e.ready and t.life.state in (S.BACKOFF, S.FATAL) and \
            t.life.next_try_at is not None and t.ctx.now >= t.life.next_try_at:
        _try(t)  # its wait ran out while the router was away


_HANDLERS: dict[type, Callable[[_Turn, Any], None]] = {
    Start: _start, Restart: _restart, Drain: _drain, Stop: _stop,
    CommandChanged: _command_changed, Unload: _unload, Forgive: _forgive, Began: _began,
    Ready: _ready, Unresponsive: _unresponsive, Ended: _ended, Idle: _idle, Due: _due,
    LoadRefused: _load_refused, UnloadRefused: _unload_refused, HostChanged: _host_changed,
}
