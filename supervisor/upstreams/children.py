"""The supervised llama-server processes: the only code that spawns, signals and watches them.

Each child's lifecycle has one owner (engine.py: one task, one inbox, the only writer of its
state), which asks policy/lifecycle.step what each event comes to; this module is a child's
effects: a launch is a process, supervised by a task of its own that probes /health (posting
Ready, or Unresponsive after the start or hang timeout) and, once the process is reaped,
posts its Ended with the exit record; a stop is SIGTERM, grace, SIGKILL. Others ask for
changes through `start`, `stop`, `restart` and `drain` (events posted to the owner), and read
the state, pid, port and evidence.

Every child:
- listens on a loopback port Spillway picks, with a random API key only Spillway knows (given in
  the `LLAMA_API_KEY` environment variable, the same setting as `--api-key`, because a command
  line is readable by every local user in /proc and an environment is not);
- runs in its own session and process group, and outlives the daemon by design: an upgrade in
  place hands it to the next daemon, and after a crash the next start adopts it or ends it
  (owned.py keeps the record of each process, adopted.py recognises one; `adopt` takes one
  over); a stop of the daemon stops it;
- is ready when `/health` answers 200 (503 `Loading model` means still starting);
- has each stdout/stderr line logged with a `[name]` prefix, the last 200 kept as evidence;
- is stopped with SIGTERM to its group, a grace period, then SIGKILL (llama-server does not exit
  while a client is connected).

The effects go through two seams, so that a child's lifecycle is unit tested without processes
or sleeping (tests/test_child_lifecycle.py): the launcher (launcher.py: spawning, signalling,
reading output, the health probe) and the clock (clock.py: the lifecycle's waits, i.e. health
and liveness polls, back-off, drain, grace, and the times that decide the start timeout, the
hang timeout and quick failures). Only the callers' own timeouts (`wait_state`, `exit_of`)
take real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import random
import secrets
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .clock import Clock, MonotonicClock
from ..config.schema import ChildConfig, RestartConfig, command_changed, with_command_of
from .engine import Engine, LifeReader, exit_within
from .launcher import LINE_LIMIT, Launcher, Process, SubprocessLauncher, reserve_port
from .launcher import pick_port as pick_port  # the drill's import
from . import adopted as _adopted
from .owned import MEDIA_MARKER_ENV, OWNER_ENV, ChildRecord, fingerprint
from .hostcpu import HostCpu, host_cpu
from ..policy import lifecycle, rollout, signatures
from ..policy import release as release_rule  # (Child.release lets a process go)
from ..policy.refusal import Refusal, read_refusal
from ..records.caches import figures, text_bytes
from ..records.timefmt import rfc3339
from ..vocabulary import Load, StateListener
from ..policy.evidence import EXIT_UNKNOWN, FailureKind, VramSample, classify_exit, \
    describe_exit, exit_signal
from ..policy.lifecycle import ChildState

log = logging.getLogger("spillway.child")

STDERR_TAIL_LINES = 200
MARKER_LINES = 20
HEALTH_POLL_S = 0.1  # while starting
LIVENESS_POLL_S = 2.0  # while ready
LIVENESS_TIMEOUT_S = 10.0
HUNG_GRACE_S = 1.0  # SIGTERM to SIGKILL for a child that stopped answering /health

# systemd's variables, which are for the daemon alone (a child must not answer systemd's notify
# socket in its place).
SYSTEMD_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                     "LISTEN_FDNAMES")
# Environment variables llama-server reads as settings that Spillway owns, and systemd's; and
# Vertex AI's contract, which Spillway takes itself (policy/vertex.py): under it every child
# would leave its port for AIP_HTTP_PORT.
_OWNED_ENV = ("LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE",
              "LLAMA_ARG_MODEL", *SYSTEMD_VARIABLES, OWNER_ENV, "SPILLWAY_HANDOVER",
              "AIP_MODE", "AIP_HTTP_PORT", "AIP_PREDICT_ROUTE", "AIP_HEALTH_ROUTE")


@dataclass(frozen=True)
class ExitRecord:
    """How one process of a child ended, and what the evidence says it was."""

    generation: int
    pid: int
    returncode: int
    kind: FailureKind
    evidence: str
    wall: float
    monotonic: float
    run_s: float
    planned: bool  # Spillway stopped it
    served: bool = False  # it had started work on at least one request
    diagnosis: signatures.Diagnosis | None = None  # a known crash signature, if one matched
    refusal: Refusal | None = None  # llama-server refused its command (a flag, a file)

    @property
    def known_crash(self) -> str:
        return self.diagnosis.summary() if self.diagnosis is not None else ""

    @property
    def signature(self) -> str | None:
        """The known crash signature's name, if one matched."""
        return self.diagnosis.name if self.diagnosis is not None else None

    @property
    def signal_name(self) -> str | None:
        sig = exit_signal(self.returncode)
        if sig is None:
            return None
        try:
            return signal.Signals(sig).name
        except ValueError:
            return f"SIG{sig}"

    def to_json(self) -> dict[str, Any]:
        return {
            "code": None if self.returncode == EXIT_UNKNOWN else self.returncode,
            "signal": self.signal_name,
            "kind": self.kind,
            "evidence": self.evidence,
            "time": rfc3339(self.wall),
            "run_s": round(self.run_s, 3),
            "planned": self.planned,
            "diagnosis": self.diagnosis.to_json() if self.diagnosis else None,
            "refusal": self.refusal.to_json() if self.refusal else None,
        }


@dataclass(frozen=True)
class RejectedCommand:
    """A new command (a reload's) whose first start failed, and was rolled back."""

    cfg: ChildConfig
    argv: tuple[str, ...]  # as it was started, less the key
    exit: ExitRecord
    wall: float

    @property
    def why(self) -> str:
        """What failed, in a sentence: llama-server's refusal, else the exit's evidence."""
        if self.exit.refusal is not None:
            return self.exit.refusal.summary()
        return f"{self.exit.kind}: {self.exit.evidence}"

    def to_json(self) -> dict[str, Any]:
        refusal = self.exit.refusal
        return {
            "command": list(self.argv),
            "argument": refusal.argument if refusal else None,
            "said": list(refusal.said) if refusal else [],
            "why": self.why,
            "time": rfc3339(self.wall),
        }


VramProbe = Callable[[float], VramSample | None]


class ReleaseProbe(Protocol):
    """The cards' figures the release rule reads (policy/release.py): the GPU monitor's."""

    interval_s: float  # how often the cards are sampled: how soon to look again

    async def cards_now(self) -> list[release_rule.Card] | None:
        """The child's cards from a sample taken now; None without figures."""
        ...

    def listed_on(self, pid: int) -> frozenset[str]:
        """The cards whose list of every process showed `pid` while it lived."""
        ...


class Child(LifeReader):
    def __init__(
        self,
        cfg: ChildConfig,
        restart: RestartConfig,
        *,
        drain_timeout_s: float = lifecycle.DRAIN_TIMEOUT_S,
        hang_timeout_s: float = 120.0,
        vram_probe: VramProbe | None = None,
        vram_short_mib: float = 512.0,
        release_probe: ReleaseProbe | None = None,
        release_slack_mib: float = 256.0,
        extra_env: dict[str, str] | None = None,
        cpu: HostCpu | None = None,
        rng: Callable[[], float] = random.random,
        clock: Clock | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.name = cfg.name
        self.serves_model: str | None = None  # its requests go as sent
        self.cfg = cfg
        self.restart_cfg = restart
        self.drain_timeout_s = drain_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.vram_probe = vram_probe
        self.vram_short_mib = vram_short_mib
        # A GPU child's: after its process's unplanned end, the next spawn waits for the card
        # to have that process's memory back (policy/release.py, restart.release_wait_s).
        self.release_probe = release_probe
        self.release_slack_mib = release_slack_mib
        self.extra_env = dict(extra_env or {})
        self.cpu = cpu or host_cpu()  # the crash signatures' facts (AMX, ...)
        self._clock: Clock = clock or MonotonicClock()  # every timed wait
        # The processes and the health probe; a launcher made here is closed by `close`.
        self._own_launcher: SubprocessLauncher | None = None
        if launcher is None:
            launcher = self._own_launcher = SubprocessLauncher()
        self._launcher: Launcher = launcher
        # Its requests in flight: counted by the pool (the one writer), read here.
        self.load = Load()
        # The lifecycle's one owner (engine.py): the state, the crash loop and the next try
        # are its Life's, read through the properties below.
        self.engine = Engine(self.name, self, lifecycle.CHILD, policy=self.backoff_policy,
                             drain_timeout_s=lambda: self.drain_timeout_s,
                             idle=self.load.idle, clock=self._clock, rng=rng)

        self.state_since = time.monotonic()
        self.pid: int | None = None
        self.host = "127.0.0.1"  # every child listens on loopback only
        self.port: int | None = None
        self.api_key: str = ""
        self.last_exit: ExitRecord | None = None
        # The config its current (or last) process was started with, and the one whose process
        # last got READY. A new command is on trial until a process of it is READY: one whose
        # first start fails is rolled back to the good one (`rejected` says what failed).
        self._running: ChildConfig | None = None
        self._argv: tuple[str, ...] = ()  # the current process's, less the key
        self._good: ChildConfig | None = None
        self.rejected: RejectedCommand | None = None
        self.started_at: float | None = None  # monotonic, of the current process
        self.ready_at: float | None = None
        self.tasks_started = 0  # `launch_slot_` lines: executions, counted by the child itself
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        # Lines a crash signature names (an "AMX model buffer" line at load), kept past the
        # tail's bound for this process's whole life.
        self.marker_lines: deque[str] = deque(maxlen=MARKER_LINES)
        self.listeners: list[StateListener] = []
        # Each output line, as read (router mode: the router's own lines tell of its models).
        self.line_listeners: list[Callable[[str], None]] = []
        self.armed_signal: int | None = None  # the drill's: sent when the next task launches
        # Why a start that is due must wait (asked as the back-off ends), or None: set once by
        # the fleet, the one owner of the children (service/fleet.py), which keeps the holds
        # (the on-demand small child on the card, an upgrade's handover).
        self.hold: Callable[[], str | None] | None = None
        # The release rule's facts: each card just before the current process started, and
        # what the last process that ended unplanned may still hold (until the next spawn
        # has waited for it). `_releasing` is set while a launch waits for the card, before
        # its spawn: a stop then ends it there. `waiting_for_memory` says why, for status.
        self._before: tuple[release_rule.Card, ...] = ()
        self._footprint: release_rule.Footprint | None = None
        self._releasing: asyncio.Event | None = None
        self.waiting_for_memory: str | None = None
        # Its processes, as the state file records them (owned.py): `owner_id` (the config's
        # state id) begins each process's SPILLWAY_OWNER; told after each spawn and exit.
        self.owner_id = ""
        self.process_listeners: list[Callable[[Child], None]] = []
        self._record: ChildRecord | None = None  # the current process's
        # A process another Spillway started, to be taken over at the next launch (`adopt`),
        # and the one taken over, while it runs.
        self._adoption: tuple[ChildRecord, bool] | None = None
        self.adopted: ChildRecord | None = None
        self._released = False  # let go of at an upgrade: its process runs on, unwatched

        # The running process, its supervision (spawn, probes, exit) and how Spillway is
        # ending it, if it is: (planned, a note for an unplanned end's record).
        self._process: Process | None = None
        self._waiter: asyncio.Task[int] | None = None
        self._run: asyncio.Task[None] | None = None
        self._ending: tuple[bool, str, str | None] | None = None
        self._probe_wake = asyncio.Event()  # the probes stop: it left STARTING|READY
        self._unkillable = asyncio.Event()  # SIGKILL did not end it: reaped as it is
        self._exits: dict[int, asyncio.Future[ExitRecord]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # --- reading ----------------------------------------------------------------------------------

    def cache_figures(self) -> dict[str, Any]:
        """For the status's caches: its output lines kept (the tail, and the lines a crash
        signature names), each at most LINE_LIMIT bytes."""
        lines = len(self.stderr_tail) + len(self.marker_lines)
        cap = STDERR_TAIL_LINES + MARKER_LINES
        return figures(lines, max_entries=cap, max_bytes=cap * LINE_LIMIT,
                       size=text_bytes(self.stderr_tail) + text_bytes(self.marker_lines))

    @property
    def state(self) -> ChildState:
        return self.engine.life.state

    @property
    def restarts(self) -> int:
        """Starts after the first (each start is a new generation)."""
        return max(self.generation - 1, 0)

    @property
    def start_timeout_s(self) -> float:
        return self.cfg.start_timeout_s

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def is_ready(self) -> bool:
        return self.state is ChildState.READY

    def to_json(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "state": str(self.state),
            "reason": self.reason,
            "state_for_s": round(now - self.state_since, 3),
            "pid": self.pid,
            "port": self.port,
            "restarts": self.restarts,
            "quick_failures": self.quick_failures,
            "next_try_in_s": self.next_try_in_s(),
            "last_exit": self.last_exit.to_json() if self.last_exit else None,
            "diagnosis": self.diagnosis_json(),
            "uptime_s": round(now - self.started_at, 3) if self.started_at is not None else None,
            "last_start_s": round(self.last_start_s, 3) if self.last_start_s is not None else None,
            "in_flight": self.load.in_flight,
            "tasks_started": self.tasks_started,
            "command": self.cfg.command(self.port or 0, "")[:-2],
            "rejected_command": self.rejected.to_json() if self.rejected else None,
            "waiting_for_memory": self.waiting_for_memory,
            "adopted": {"from_daemon_pid": self.adopted.daemon_pid,
                        "process_started": rfc3339(self.adopted.started)}
            if self.adopted is not None else None,
        }

    @property
    def ever_ready(self) -> bool:
        """A process of it got READY since Spillway started: it has a good command."""
        return self._good is not None

    def diagnosis_json(self) -> dict[str, str] | None:
        """The known crash of the last exit, while it is the latest word on this child."""
        last = self.last_exit
        if last is None or last.diagnosis is None or self.state is ChildState.READY:
            return None
        return last.diagnosis.to_json()

    def next_try_in_s(self) -> float | None:
        """Seconds to the next start, in BACKOFF or FATAL; None in other states."""
        return self.own_next_try_in_s()

    def backoff_policy(self) -> lifecycle.BackoffPolicy:
        r = self.restart_cfg  # read each time: a reload may replace it
        return lifecycle.BackoffPolicy(
            initial_s=r.backoff_initial_s, max_s=r.backoff_max_s,
            quick_failure_s=r.quick_failure_s, max_quick_failures=r.max_quick_failures,
            fatal_retry_max_s=r.fatal_retry_max_s)

    # --- asking for changes: each is an event for the owner ---------------------------------------

    def configure(self, cfg: ChildConfig, restart: RestartConfig, drain_timeout_s: float) -> bool:
        """A reload: new timeouts and settings at once. A new command is taken at once by a
        STOPPED child (at its next start); a running one keeps its command and True is
        returned: it takes the new one with `take_command`, when the reload's rollout says
        (service/rollout.py: one child at a time)."""
        self.restart_cfg = restart
        self.hang_timeout_s = restart.hang_timeout_s
        self.drain_timeout_s = drain_timeout_s
        if command_changed(self.cfg, cfg) and self.state is not ChildState.STOPPED:
            self.cfg = with_command_of(cfg, self.cfg)
            return True
        self.cfg = cfg
        self.rejected = None  # a command asked for anew: what failed before is old news
        return False

    async def take_command(self, cfg: ChildConfig) -> rollout.Outcome:
        """A reload's new command: a READY child drains (its requests finish) and restarts
        with it; a starting, backing-off or FATAL one restarts at once; a stopped one takes it
        at its next start. Back once that is settled (policy/rollout.py's outcomes)."""
        self.cfg = cfg
        self.rejected = None
        await self.engine.ask(lifecycle.CommandChanged("config reload: its command changed"))
        settled: list[rollout.Outcome] = []

        def is_settled(life: lifecycle.Life) -> bool:
            outcome = rollout.settled(
                life.state, rejected=self.rejected is not None and self.rejected.cfg is cfg,
                runs_it=self._running is cfg, asked=self.cfg is cfg)
            if outcome is not None:
                settled.append(outcome)
            return outcome is not None

        await self.engine.until(is_settled)
        return settled[0]

    def start(self) -> None:
        """Begin supervising: start the process and keep it running; from FATAL, at once."""
        first = self.engine.life.generation == 0
        self.engine.post(lifecycle.Start("starting" if first else "start asked for",
                                         keep=True))

    def adopt(self, record: ChildRecord, changed: bool, why: str) -> None:
        """Take over a running process another Spillway started (its identity checked:
        adopted.identify), as this child's next process: STARTING, then READY at its first
        /health (no load: its model and cache are in it). `changed`: its config asks another
        command now (it runs the old one until a rollout restarts it)."""
        self._adoption = (record, changed)
        self.engine.post(lifecycle.Start(why, keep=True))

    def process_record(self) -> ChildRecord | None:
        """The current process, as the state file records it; None when none runs."""
        return self._record if self.pid is not None else None

    def restart(self, reason: str) -> None:
        """Stop the process now (SIGTERM, grace, SIGKILL) and start it again; from BACKOFF or
        FATAL, start at once."""
        self.engine.post(lifecycle.Restart(reason))

    def drain(self, reason: str, then_stop: bool = False) -> None:
        """No new work; in-flight work finishes (up to the drain timeout); then restart, or
        with `then_stop` stay stopped."""
        self.engine.post(lifecycle.Drain(reason, stop=then_stop))

    def end_stalled(self, evidence: str) -> None:
        """Stalled with work in flight (serving/watchdog.py): end the current process now
        (SIGTERM, then SIGKILL: a stopped process takes only that), recorded as a hang with
        the evidence; its requests fail over as after any death, and it restarts."""
        self.engine.post(lifecycle.Unresponsive(self.engine.life.generation, evidence,
                                                HUNG_GRACE_S, kind=FailureKind.HANG))

    async def stop(self, reason: str = "stop asked for", grace_s: float | None = None) -> None:
        """Stop the process and wait until it is gone; the child stays STOPPED (unless it is
        started again meanwhile)."""
        await self.engine.ask(lifecycle.Stop(reason, grace_s))
        if not self.engine.closed:
            await self.engine.until(lambda life: life.state is ChildState.STOPPED or
                                    life.wanted)

    async def close(self, grace_s: float | None = None) -> None:
        """Stop for good (daemon shutdown)."""
        await self.stop("daemon shutting down", grace_s)
        await self.engine.close()
        await self._end_tasks()

    async def release(self) -> None:
        """Let go of the process without a signal (an upgrade's handover: the next daemon has
        adopted it). The owner and the process's tasks end; the process runs on."""
        self._released = True
        await self.engine.close()
        proc = self._process
        release = getattr(proc, "release", None)  # a real process's (launcher.WatchedProcess)
        if release is not None:
            release()
        await self._end_tasks()

    async def _end_tasks(self) -> None:
        """The owner gone: the process's own tasks end, its exit futures too."""
        for task in [*self._tasks, *([self._run] if self._run is not None else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for fut in self._exits.values():
            if not fut.done():
                fut.cancel()
        if self._own_launcher is not None:
            await self._own_launcher.close()

    async def wait_state(self, *states: ChildState, timeout: float | None = None) -> bool:
        """Wait until the child is in one of `states`; False on timeout."""
        return await self.engine.wait_state(*states, timeout=timeout)

    async def exit_of(self, generation: int, timeout: float) -> ExitRecord | None:
        """The exit record of process `generation`, waiting up to `timeout` for it to end."""
        return await exit_within(self._exits.get(generation), timeout)

    def running(self, generation: int) -> bool:
        """Process `generation` is this child's current one and has not exited (as far as the
        event loop has heard)."""
        fut = self._exits.get(generation)
        return generation == self.generation and fut is not None and not fut.done() \
            and self.pid is not None

    def arm(self, sig: int | None) -> None:
        """The drill without a GPU: send `sig` to the process group as soon as the next task
        launches (during its prompt processing), standing in for a GPU that runs out of
        memory. None disarms."""
        self.armed_signal = sig

    def signal_now(self, sig: int) -> bool:
        """The drill's failure in the middle of an answer: `sig` to the process group now,
        standing in for a GPU that runs out of memory while a stream is generated (the KV
        cache grows with the answer). False when no process runs."""
        proc = self._process
        if proc is None:
            return False
        log.warning("[%s] drill: sending %s now", self.name, signal.Signals(sig).name)
        proc.signal_group(sig)
        return True

    def _fire_armed(self, proc: Process) -> None:
        sig = self.armed_signal
        self.armed_signal = None
        if sig is None:
            return
        log.warning("[%s] drill: sending %s as a task launches", self.name,
                    signal.Signals(sig).name)
        proc.signal_group(sig)

    # --- the effects: what the owner carries out (engine.Effects) ---------------------------------

    def entered(self, old: ChildState, new: ChildState, reason: str) -> None:
        self.state_since = time.monotonic()
        if new is ChildState.READY:
            self._good = self._running  # its command is good: a later trial goes back to it
        log.info("[%s] %s -> %s: %s", self.name, old, new, reason)
        if new not in _PROBED:
            self._probe_wake.set()
        for listener in list(self.listeners):
            try:
                listener(self, old, new, reason)
            except Exception:  # noqa: BLE001 - a listener must not break the owner task
                log.exception("state listener failed")

    def launch(self, generation: int, reason: str) -> None:
        loop = asyncio.get_running_loop()
        self._exits = {g: f for g, f in self._exits.items() if g >= generation - 4}
        self._exits[generation] = loop.create_future()
        self._ending = None
        self._probe_wake = asyncio.Event()
        self._unkillable = asyncio.Event()
        # Set here, not in the task: a stop that comes before the task runs ends it too.
        self._releasing = asyncio.Event() if self.release_probe is not None else None
        self._run = asyncio.create_task(self._run_process(generation),
                                        name=f"child-{self.name}-{generation}")

    def terminate(self, action: lifecycle.Terminate) -> None:
        if self._releasing is not None and self._ending is None:
            # Still waiting for the card's memory before its spawn: it ends there.
            self._ending = (action.planned, action.note, action.kind)
            self._releasing.set()
            return
        proc, waiter = self._process, self._waiter
        if proc is None or waiter is None or waiter.done() or proc.returncode is not None \
                or self._ending is not None:
            return  # gone already (its end is on its way), or being ended
        self._ending = (action.planned, action.note, action.kind)
        self._probe_wake.set()
        grace = self.cfg.stop_grace_s if action.grace_s is None else action.grace_s
        self._spawn(self._terminate(proc, waiter, grace))

    def recorded(self, end: lifecycle.Ended) -> None:
        record = end.record
        assert isinstance(record, ExitRecord)
        fut = self._exits.get(record.generation)
        if fut is not None and not fut.done():
            fut.set_result(record)
        if not end.planned:
            self.last_exit = record

    def opened(self, generation: int, since: int) -> None:
        pass  # a child's process begins with its launch

    def orphaned(self, generation: int) -> None:
        pass  # a child has no host

    def why_not_now(self) -> str | None:
        # A child is always tried (the GPU's freed memory restarts it early), unless the fleet
        # holds it back (`hold`: the on-demand small child, drained first; a handover).
        return self.hold() if self.hold is not None else None

    # --- one process, from spawn to exit ----------------------------------------------------------

    def _environment(self, api_key: str, owner: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _OWNED_ENV}
        # A quick abort (no backtrace through gdb) gets the crash evidence out faster.
        env.setdefault("GGML_NO_BACKTRACE", "1")
        env.update(self.extra_env)
        env.update(self.cfg.env)
        env["LLAMA_API_KEY"] = api_key
        env[OWNER_ENV] = owner
        return env

    async def _spawn_process(self) -> Process:
        adoption, self._adoption = self._adoption, None
        self.adopted = None
        if adoption is not None:
            return await self._take_over(*adoption)
        # Never the last process's port: connections pooled to it must not reach the new one.
        self.port = pick_port(avoid=self.port)
        self.api_key = secrets.token_urlsafe(24)
        self._running = self.cfg
        argv = self.cfg.command(self.port, self.api_key)
        argv = argv[:-2]  # the key travels in the environment, not on the command line
        self._argv = tuple(argv)
        owner = f"{self.owner_id}:{self.name}:{secrets.token_hex(8)}"
        log.info("[%s] starting: %s", self.name, " ".join(argv))
        proc = await self._launcher.spawn(argv, self._environment(self.api_key, owner))
        self._record = ChildRecord(
            name=self.name, pid=proc.pid, start_ticks=adoption_ticks(proc.pid),
            boot_id=_adopted.boot_id(), argv=self._argv, port=self.port, api_key=self.api_key,
            owner=owner, media_marker=self.extra_env.get(MEDIA_MARKER_ENV, ""),
            fingerprint=fingerprint(self.cfg), started=time.time(), daemon_pid=os.getpid())
        return proc

    async def _take_over(self, record: ChildRecord, changed: bool) -> Process:
        """The adopted process as this child's: its port, key and command; OSError when it
        ended meanwhile or is not the recorded one now (its identity is checked again as its
        pidfd is opened: a failed start, the child starts a process of its own)."""
        proc = await _adopted.take(record)
        self.port, self.api_key, self._argv = record.port, record.api_key, record.argv
        reserve_port(record.port)
        # A changed command runs the old one: a copy of the config stands for it, so that the
        # rollout sees that the new one does not run yet.
        self._running = dataclasses.replace(self.cfg) if changed else self.cfg
        self._record = record
        self.adopted = record
        log.info("[%s] adopting pid %d (started by spillway pid %d at %s, port %d)%s",
                 self.name, record.pid, record.daemon_pid, rfc3339(record.started),
                 record.port, ": its config asks another command now, which it takes once "
                 "adopted (as a reload)" if changed else "")
        return proc

    async def _memory_back(self, generation: int) -> bool:
        """Before a spawn: after a GPU process's unplanned end, wait until its cards have its
        memory back, at most restart.release_wait_s (policy/release.py), the clock through
        its seam; and keep the cards' figures this process starts from. False when a stop
        came meanwhile: the end of a process that never started is posted."""
        probe, woke = self.release_probe, self._releasing
        if probe is None or woke is None:
            return True
        footprint, self._footprint = self._footprint, None
        cards: list[release_rule.Card] | None = None
        try:
            while self._ending is None:
                cards = await probe.cards_now()
                if footprint is None or self._ending is not None:
                    break
                bound = self.restart_cfg.release_wait_s  # read each time: a reload may change it
                judged = release_rule.judge(footprint, cards, self._clock.now(), bound,
                                       int(self.release_slack_mib * release_rule.MIB),
                                       probe.interval_s)
                if judged.go:
                    if judged.forced:
                        log.warning("[%s] %s", self.name, judged.why)
                    elif self.waiting_for_memory is not None:
                        log.info("[%s] %s: starting", self.name, judged.why)
                    break
                if self.waiting_for_memory is None:
                    log.warning("[%s] waiting for the card to release the memory of the process "
                                "that ended (at most %.0f s) before starting: %s", self.name,
                                bound, judged.why)
                self.waiting_for_memory = judged.why
                await self._clock.wait(woke, judged.again_s)
        finally:
            self._releasing = None
            self.waiting_for_memory = None
        if self._ending is None:
            self._before = tuple(cards or ())
            return True
        # Stopped (or restarted) before its spawn: the next start still waits for the card.
        self._footprint = footprint
        planned, note, _ = self._ending
        what = "stopped before it started (it waited for the card's memory)"
        record = ExitRecord(generation, 0, 0, FailureKind.NONE, note or what, time.time(),
                            time.monotonic(), 0.0, planned=planned)
        self.engine.post(lifecycle.Ended(generation, planned, what=what, record=record))
        return False

    def _footprint_of(self, pid: int) -> release_rule.Footprint | None:
        """What a GPU process that just ended unplanned may still hold, for the next spawn."""
        if self.release_probe is None:
            return None
        return release_rule.Footprint(pid, self._clock.now(), self._before,
                                 self.release_probe.listed_on(pid))

    async def _run_process(self, generation: int) -> None:
        """Process `generation` from spawn to exit: its probes post Ready or Unresponsive,
        its end posts Ended."""
        if not await self._memory_back(generation):
            return
        spawned_at = time.monotonic()
        spawned = self._clock.now()
        self.ready_at = None
        try:
            proc = await self._spawn_process()
        except OSError as e:
            said = f"cannot start {self.cfg.llama_server!r}: {e}"
            # A binary that is missing or cannot be run is a command that cannot start at all;
            # a fork that failed for want of resources (EAGAIN, ENOMEM) may work next time.
            unrunnable = e.errno in (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR)
            record = ExitRecord(generation, 0, 127, FailureKind.CRASH, said, time.time(),
                                time.monotonic(), 0.0, planned=False,
                                refusal=Refusal(self.cfg.llama_server, (said,), unstarted=True)
                                if unrunnable else None)
            self.engine.post(_ended(record, self._roll_back(record)))
            return
        self.pid = proc.pid
        self._process = proc
        self.started_at = spawned_at
        if self.adopted is not None:  # its uptime goes on from its own start
            self.started_at = spawned_at - max(0.0, time.time() - self.adopted.started)
        self._tell_process()
        self.stderr_tail.clear()
        self.marker_lines.clear()
        reader = asyncio.create_task(self._read_output(proc), name=f"child-{self.name}-output")
        waiter = self._waiter = asyncio.create_task(proc.wait(), name=f"child-{self.name}-wait")
        tasks_before = self.tasks_started
        given_up = asyncio.ensure_future(self._unkillable.wait())
        try:
            await self._probe(generation, waiter, spawned)
            await asyncio.wait({waiter, given_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            given_up.cancel()
            await self._reap(proc, waiter, reader)
        if self._released:
            return  # the next daemon has it
        planned, note, kind = self._ending or (False, "", None)
        record = self._exit_record(generation, proc, spawned, planned, note, kind,
                                   served=self.tasks_started > tasks_before)
        self.pid = None
        self._process = None
        self.started_at = None
        self._record = None
        self.adopted = None
        self._tell_process()
        if not planned:
            self._footprint = self._footprint_of(proc.pid)
            log.warning("[%s] exited: %s (%s)", self.name, record.kind, record.evidence)
            if record.diagnosis is not None:
                log.warning("[%s] %s", self.name, record.diagnosis.summary())
            if record.refusal is not None:
                log.error("[%s] %s", self.name, record.refusal.summary())
        self.engine.post(_ended(record, self._roll_back(record)))

    def _roll_back(self, record: ExitRecord) -> str | None:
        """A new command's first start failed (it ended before READY, of its own or at the
        start timeout): the child goes back to its last good command, and says why. Not when
        another reload has asked for yet another command meanwhile (that one is tried)."""
        trial, good = self._running, self._good
        if record.planned or self.ready_at is not None or trial is None or good is None or \
                not command_changed(good, trial) or self.cfg is not trial:
            return None
        self.rejected = RejectedCommand(trial, self._argv, record, time.time())
        self.cfg = with_command_of(trial, good)
        log.error("[%s] its new command failed its first start (%s): back to its last good "
                  "command", self.name, self.rejected.why)
        return f"its new command failed its first start ({self.rejected.why}); back to its " \
               "last good command"

    def _probing(self, waiter: asyncio.Task[int]) -> bool:
        return not waiter.done() and self._ending is None and \
            self.engine.life.state in _PROBED

    async def _probe(self, generation: int, waiter: asyncio.Task[int], spawned: float) -> None:
        """/health until it answers (the start timeout), then every LIVENESS_POLL_S while it
        serves (the hang timeout); over when it leaves STARTING|READY or is being ended."""
        deadline = self._clock.now() + self.cfg.start_timeout_s
        while True:
            if not self._probing(waiter):
                return
            if self._clock.now() > deadline:
                self.engine.post(lifecycle.Unresponsive(
                    generation, f"not ready after {self.cfg.start_timeout_s:.0f} s "
                                "(start timeout)"))
                return
            if await self._health_ok(timeout=2.0):
                break
            await self._sleep_or_exit(waiter, HEALTH_POLL_S)
        self.ready_at = time.monotonic()
        self.engine.post(lifecycle.Ready(generation))
        last_ok = self._clock.now()
        while True:
            woke = await self._sleep_or_exit(waiter, LIVENESS_POLL_S)
            if not self._probing(waiter):
                return
            if woke:
                continue
            limit = min(LIVENESS_TIMEOUT_S, self.hang_timeout_s or LIVENESS_TIMEOUT_S)
            if await self._health_ok(timeout=limit):
                last_ok = self._clock.now()
            elif self.hang_timeout_s > 0 and self._clock.now() - last_ok > self.hang_timeout_s:
                self.engine.post(lifecycle.Unresponsive(
                    generation, f"/health unanswered for {self.hang_timeout_s:.0f} s",
                    HUNG_GRACE_S, kind=FailureKind.HANG))
                return

    async def _reap(self, proc: Process, waiter: asyncio.Task[int],
                    reader: asyncio.Task[None]) -> None:
        """The process gone (SIGKILL if cancelled while it runs) and its last lines read."""
        if not waiter.done() and not self._released:  # cancelled, or SIGKILL did not end it
            proc.signal_group(signal.SIGKILL)
            with contextlib.suppress(Exception):
                await self._clock.wait_any({waiter}, 5)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(reader, 2.0)  # the last lines are the evidence
        reader.cancel()

    def _exit_record(self, generation: int, proc: Process, spawned: float, planned: bool,
                     note: str, noted_kind: str | None, served: bool) -> ExitRecord:
        returncode = proc.returncode if proc.returncode is not None else -9
        died = time.monotonic()
        vram = self.vram_probe(died) if self.vram_probe is not None else None
        verdict = classify_exit(returncode, list(self.stderr_tail), vram,
                                vram_short_mib=self.vram_short_mib)
        evidence = f"{note} ({describe_exit(returncode)})" if note else verdict.evidence
        kind = (FailureKind(noted_kind) if noted_kind else FailureKind.CRASH) if note \
            else verdict.kind
        if planned and not note:  # a stop asked for: whatever it was still answering was cut
            kind = FailureKind.STOPPED
            evidence = f"stopped as asked ({describe_exit(returncode)})"
        diagnosis = refusal = None
        if not planned and not note:  # a death of its own, not one Spillway dealt
            diagnosis = signatures.diagnose(signatures.CrashFacts(
                returncode=returncode, lines=[*self.marker_lines, *self.stderr_tail],
                before_ready=self.ready_at is None, cpu_model=self.cpu.describe(),
                cpu_flags=self.cpu.flags))
            if self.ready_at is None:  # llama-server refuses a command before it serves
                refusal = read_refusal(returncode, list(self.stderr_tail), self._argv)
        return ExitRecord(generation, proc.pid, returncode, kind, evidence, time.time(), died,
                          self._clock.now() - spawned, planned=planned, served=served,
                          diagnosis=diagnosis, refusal=refusal)

    async def _sleep_or_exit(self, waiter: asyncio.Task[int], seconds: float) -> bool:
        """Sleep, cut short by the process exiting or the probes' end. True if the probes'
        end came."""
        wake = asyncio.create_task(self._probe_wake.wait())
        try:
            done = await self._clock.wait_any({waiter, wake}, seconds)
        finally:
            wake.cancel()
        return wake in done

    async def _health_ok(self, timeout: float) -> bool:
        if self.port is None:
            return False
        return await self._launcher.health(self.port, timeout)

    async def _terminate(self, proc: Process, waiter: asyncio.Task[int], grace: float) -> None:
        """SIGTERM to the group, a grace period, then SIGKILL."""
        proc.signal_group(signal.SIGTERM)
        if not await self._clock.wait_any({waiter}, grace):
            log.warning("[%s] still running %.0f s after SIGTERM; sending SIGKILL",
                        self.name, grace)
            proc.signal_group(signal.SIGKILL)
            if not await self._clock.wait_any({waiter}, 10):
                self._unkillable.set()  # (uninterruptible sleep): its end is recorded as is

    def _tell_process(self) -> None:
        for listener in list(self.process_listeners):
            try:
                listener(self)
            except Exception:  # noqa: BLE001 - a listener must not break the process task
                log.exception("process listener failed")

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_output(self, proc: Process) -> None:
        while True:
            raw = await proc.readline()
            if not raw:
                return
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.stderr_tail.append(line)
            if signatures.is_marker(line):
                self.marker_lines.append(line)
            log.info("[%s] %s", self.name, line)
            for listener in self.line_listeners:
                try:
                    listener(line)
                except Exception:  # noqa: BLE001 - a listener must not stop the reading
                    log.exception("output line listener failed")
            if "launch_slot_" in line:
                self.tasks_started += 1
                if self.armed_signal is not None:
                    self._fire_armed(proc)


def adoption_ticks(pid: int) -> int:
    """A process's start time as the state file records it (0 when it is gone already)."""
    return _adopted.start_ticks(pid) or 0


# The states in which a process is probed (/health): starting, and serving.
_PROBED = frozenset({ChildState.STARTING, ChildState.READY})


def _ended(record: ExitRecord, rollback: str | None = None) -> lifecycle.Ended:
    """A process's end, as the lifecycle hears it (`rollback`: why it goes back to its last
    good command)."""
    return lifecycle.Ended(
        record.generation, record.planned,
        what=f"stopped ({describe_exit(record.returncode)})" if record.planned
        else f"{record.kind}: {record.evidence}",
        run_s=record.run_s, served=record.served,
        signature=record.signature,
        known_crash=record.known_crash or None, record=record,
        unfit=record.kind is FailureKind.NO_OFFLOAD and not record.planned,
        refused=record.refusal.summary() if record.refusal is not None else None,
        rollback=rollback)
