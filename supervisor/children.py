"""The supervised llama-server processes: the only code that spawns, signals and watches them.

One task owns each child and is the only writer of its state (policy/lifecycle.py says which
transitions are legal and how long to back off). Others ask for changes through `start`,
`stop`, `restart` and `drain`, and read the state, pid, port and evidence.

Every child:
- listens on a loopback port Spillway picks, with a random API key only Spillway knows (given in
  the `LLAMA_API_KEY` environment variable, the same setting as `--api-key`, because a command
  line is readable by every local user in /proc and an environment is not);
- runs in its own session and process group, with the kernel told to kill it when the daemon
  dies (PR_SET_PDEATHSIG), so none outlives the daemon even when the daemon gets SIGKILL;
- is ready when `/health` answers 200 (503 `Loading model` means still starting);
- has each stdout/stderr line logged with a `[name]` prefix, the last 200 kept as evidence;
- is stopped with SIGTERM to its group, a grace period, then SIGKILL (llama-server does not exit
  while a client is connected).

The effects go through two seams, so that this state machine is unit tested without processes
or sleeping (tests/test_child_lifecycle.py): the launcher (launcher.py: spawning, signalling,
reading output, the health probe) and the clock (clock.py: the lifecycle's waits, i.e. health
and liveness polls, back-off, drain, grace, and the times that decide the start timeout, the
hang timeout and quick failures). Only the callers' own timeouts (`wait_state`, `exit_of`) and
the last-resort reaping after a cancellation take real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .clock import Clock, MonotonicClock
from .config import ChildConfig, RestartConfig, command_changed
from .launcher import Launcher, Process, SubprocessLauncher
from .load import Load
from .launcher import pick_port as pick_port  # the drill's import
from .hostcpu import HostCpu, host_cpu
from .policy import lifecycle, signatures
from .systemd import OWN_VARIABLES
from .timefmt import rfc3339
from .vocabulary import StateListener
from .policy.evidence import (
    FailureKind,
    VramSample,
    classify_exit,
    describe_exit,
    exit_signal,
)
from .policy.lifecycle import ChildState

log = logging.getLogger("spillway.child")

STDERR_TAIL_LINES = 200
MARKER_LINES = 20
HEALTH_POLL_S = 0.1  # while starting
LIVENESS_POLL_S = 2.0  # while ready
LIVENESS_TIMEOUT_S = 10.0
HUNG_GRACE_S = 1.0  # SIGTERM to SIGKILL for a child that stopped answering /health

# Environment variables llama-server reads as settings that Spillway owns, and systemd's, which
# are for the daemon alone (a child must not answer systemd's notify socket in its place).
_OWNED_ENV = ("LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE",
              "LLAMA_ARG_MODEL", *OWN_VARIABLES)


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
            "code": self.returncode,
            "signal": self.signal_name,
            "kind": self.kind,
            "evidence": self.evidence,
            "time": rfc3339(self.wall),
            "run_s": round(self.run_s, 3),
            "planned": self.planned,
            "diagnosis": self.diagnosis.to_json() if self.diagnosis else None,
        }


VramProbe = Callable[[float], VramSample | None]


class Child(lifecycle.CrashLoopCounters):
    def __init__(
        self,
        cfg: ChildConfig,
        restart: RestartConfig,
        *,
        drain_timeout_s: float = lifecycle.DRAIN_TIMEOUT_S,
        hang_timeout_s: float = 120.0,
        vram_probe: VramProbe | None = None,
        vram_short_mib: float = 512.0,
        extra_env: dict[str, str] | None = None,
        cpu: HostCpu | None = None,
        rng: Callable[[], float] = random.random,
        clock: Clock | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.name = cfg.name
        self.cfg = cfg
        self.restart_cfg = restart
        self.drain_timeout_s = drain_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.vram_probe = vram_probe
        self.vram_short_mib = vram_short_mib
        self.extra_env = dict(extra_env or {})
        self.cpu = cpu or host_cpu()  # the crash signatures' facts (AMX, ...)
        self._rng = rng
        self._clock: Clock = clock or MonotonicClock()  # every timed wait
        # The processes and the health probe; a launcher made here is closed by `close`.
        self._own_launcher: SubprocessLauncher | None = None
        if launcher is None:
            launcher = self._own_launcher = SubprocessLauncher()
        self._launcher: Launcher = launcher

        self.state = ChildState.STOPPED
        self.state_since = time.monotonic()
        self.reason = "not started"  # why it is in its state, for status
        self.pid: int | None = None
        self.host = "127.0.0.1"  # every child listens on loopback only
        self.port: int | None = None
        self.api_key: str = ""
        self.generation = 0
        self.restarts = 0
        # Quick failures in a row, tries from FATAL since the last good run (lifecycle.py).
        self.crash_loop = lifecycle.CrashLoop()
        self.next_try_at: float | None = None  # clock time of the next start, in BACKOFF|FATAL
        self.last_exit: ExitRecord | None = None
        self.started_at: float | None = None  # monotonic, of the current process
        self.ready_at: float | None = None
        self.last_start_s: float | None = None  # spawn -> ready, of the last start
        self.tasks_started = 0  # `launch_slot_` lines: executions, counted by the child itself
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        # Lines a crash signature names (an "AMX model buffer" line at load), kept past the
        # tail's bound for this process's whole life.
        self.marker_lines: deque[str] = deque(maxlen=MARKER_LINES)
        # The signature of each of the last unplanned exits (None: none matched), newest last.
        self.recent_signatures: deque[str | None] = deque(maxlen=8)
        # Its requests in flight: counted by the pool (the one writer), read here.
        self.load = Load()
        self.listeners: list[StateListener] = []
        # Each output line, as read (router mode: the router's own lines tell of its models).
        self.line_listeners: list[Callable[[str], None]] = []
        self.armed_signal: int | None = None  # the drill's: sent when the next task launches
        self._process: Process | None = None  # the running process (for the drill's signal)

        self._want_running = False
        self._command: str | None = None  # "restart" | "drain" | "stop"
        self._command_reason = ""
        self._wake = asyncio.Event()
        self._state_changed = asyncio.Event()
        self._exits: dict[int, asyncio.Future[ExitRecord]] = {}
        self._owner: asyncio.Task[None] | None = None
        self._closed = False
        self._grace_override: float | None = None

    # --- reading ----------------------------------------------------------------------------------

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
        }

    def diagnosis_json(self) -> dict[str, str] | None:
        """The known crash of the last exit, while it is the latest word on this child."""
        last = self.last_exit
        if last is None or last.diagnosis is None or self.state is ChildState.READY:
            return None
        return last.diagnosis.to_json()

    def next_try_in_s(self) -> float | None:
        """Seconds to the next start, in BACKOFF or FATAL; None in other states."""
        if self.next_try_at is None or self.state not in (ChildState.BACKOFF,
                                                          ChildState.FATAL):
            return None
        return round(max(0.0, self.next_try_at - self._clock.now()), 1)

    def backoff_policy(self) -> lifecycle.BackoffPolicy:
        r = self.restart_cfg  # read each time: a reload may replace it
        return lifecycle.BackoffPolicy(
            initial_s=r.backoff_initial_s, max_s=r.backoff_max_s,
            quick_failure_s=r.quick_failure_s, max_quick_failures=r.max_quick_failures,
            fatal_retry_max_s=r.fatal_retry_max_s)

    # --- asking for changes -----------------------------------------------------------------------

    def configure(self, cfg: ChildConfig, restart: RestartConfig, drain_timeout_s: float) -> None:
        """A reload: new timeouts at once; a new command drains a READY child (its requests
        finish, then it restarts with it) and restarts a starting, backing-off or FATAL one.
        STOPPED, DRAINING and STOPPING children take it at their next start."""
        self.restart_cfg = restart
        self.hang_timeout_s = restart.hang_timeout_s
        self.drain_timeout_s = drain_timeout_s
        changed = command_changed(self.cfg, cfg)
        self.cfg = cfg
        if not changed:
            return
        if self.state is ChildState.READY:
            self.drain("config reload: its command changed")
        elif self.state in (ChildState.STARTING, ChildState.BACKOFF, ChildState.FATAL):
            self.restart("config reload: its command changed")

    def start(self) -> None:
        """Begin supervising: start the process and keep it running."""
        self._want_running = True
        if self.state is ChildState.FATAL:
            self._command, self._command_reason = "restart", "start asked for"
        if self._owner is None:
            self._owner = asyncio.create_task(self._own(), name=f"child-{self.name}")
        self._wake.set()

    def restart(self, reason: str) -> None:
        """Stop the process now (SIGTERM, grace, SIGKILL) and start it again; from BACKOFF or
        FATAL, start at once."""
        self._want_running = True
        self._command, self._command_reason = "restart", reason
        if self._owner is None:
            self._owner = asyncio.create_task(self._own(), name=f"child-{self.name}")
        self._wake.set()

    def drain(self, reason: str) -> None:
        """No new work; in-flight work finishes (up to the drain timeout); then restart."""
        if self.state is ChildState.READY:
            self._command, self._command_reason = "drain", reason
            self._wake.set()

    async def stop(self, reason: str = "stop asked for", grace_s: float | None = None) -> None:
        """Stop the process and wait until it is gone; the child stays STOPPED."""
        self._grace_override = grace_s
        self._want_running = False
        self._command, self._command_reason = "stop", reason
        self._wake.set()
        while self.state not in (ChildState.STOPPED,) and self._owner is not None:
            if self._owner.done():
                break
            await self._wait_state_change()

    async def close(self, grace_s: float | None = None) -> None:
        """Stop for good (daemon shutdown)."""
        await self.stop("daemon shutting down", grace_s)
        self._closed = True
        self._wake.set()
        if self._owner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._owner
        if self._own_launcher is not None:
            await self._own_launcher.close()

    async def wait_state(self, *states: ChildState, timeout: float | None = None) -> bool:
        """Wait until the child is in one of `states`; False on timeout."""
        async def waiter() -> None:
            while self.state not in states:
                await self._wait_state_change()
        try:
            await asyncio.wait_for(waiter(), timeout)
            return True
        except TimeoutError:
            return False

    async def exit_of(self, generation: int, timeout: float) -> ExitRecord | None:
        """The exit record of process `generation`, waiting up to `timeout` for it to end."""
        fut = self._exits.get(generation)
        if fut is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            return None

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

    # --- the owner task ---------------------------------------------------------------------------

    def _to(self, new: ChildState, reason: str) -> None:
        old = self.state
        lifecycle.check_transition(old, new)
        self.state = new
        self.state_since = time.monotonic()
        self.reason = reason
        log.info("[%s] %s -> %s: %s", self.name, old, new, reason)
        for listener in list(self.listeners):
            try:
                listener(self, old, new, reason)
            except Exception:  # noqa: BLE001 - a listener must not break the owner task
                log.exception("state listener failed")
        self._state_changed.set()
        self._state_changed = asyncio.Event()

    async def _wait_state_change(self) -> None:
        await self._state_changed.wait()

    def _take_command(self) -> tuple[str | None, str]:
        cmd, reason = self._command, self._command_reason
        self._command, self._command_reason = None, ""
        return cmd, reason

    async def _wait_wake(self, timeout: float | None = None) -> bool:
        """Wait for a command; True if one came, False on timeout."""
        if not await self._clock.wait(self._wake, timeout):
            return False
        self._wake.clear()
        return True

    async def _own(self) -> None:
        start_reason = "starting"
        try:
            while not self._closed:
                if not self._want_running:
                    await self._while_stopped()
                    start_reason = "start asked for"
                    continue
                if self.state is ChildState.FATAL:
                    fatal_reason = await self._from_fatal()
                    if fatal_reason is None:
                        continue
                    start_reason = fatal_reason
                else:
                    cmd, reason = self._take_command()  # a restart before the start is moot
                    if cmd == "restart":
                        start_reason = reason
                if self.generation > 0:
                    self.restarts += 1
                # STOPPED|BACKOFF|FATAL -> STARTING
                self.next_try_at = None
                self._to(ChildState.STARTING, start_reason)
                record = await self._run_process()
                start_reason = "restart after stop"
                if record is not None and not record.planned:
                    start_reason = await self._after_exit(record)
        finally:
            self._fail_pending_exits()

    async def _while_stopped(self) -> None:
        """Not wanted running: BACKOFF|FATAL|EXITED -> STOPPED, then wait for a command."""
        self._take_command()
        if self.state in (ChildState.BACKOFF, ChildState.FATAL, ChildState.EXITED):
            self._to(ChildState.STOPPED, "stop asked for")
        await self._wait_wake()

    async def _from_fatal(self) -> str | None:
        """In FATAL: the reason for the next start, or None after waiting (look again)."""
        cmd, reason = self._take_command()
        if cmd == "restart":  # an operator, a reload, or the card's memory freed
            self.crash_loop = lifecycle.CrashLoop()
            self.recent_signatures.clear()  # a changed config deserves its own two tries
            return reason
        left = (self.next_try_at or 0.0) - self._clock.now()
        if left > 0:
            await self._wait_wake(left)
            return None
        # The crash-loop back-off's next try: one more quick failure is FATAL again, with a
        # longer wait.
        self.crash_loop = lifecycle.fatal_try(self.crash_loop, self.backoff_policy())
        return f"try {self.fatal_tries} from FATAL (crash-loop back-off)"

    async def _after_exit(self, record: ExitRecord) -> str:
        """After an unplanned exit: EXITED -> STOPPED | BACKOFF (and its wait) | BACKOFF ->
        FATAL, as lifecycle.after_death says. The reason for the next start."""
        self.last_exit = record
        self.recent_signatures.append(record.signature)
        after = lifecycle.after_death(
            self.state, self.crash_loop, self.backoff_policy(),
            what=f"{record.kind}: {record.evidence}", run_s=record.run_s, jitter=self._rng(),
            served=record.served, wanted=self._want_running,
            known_crash=record.known_crash or None,
            known_crash_repeats=signatures.repeats(self.recent_signatures))
        self.crash_loop = after.loop
        if after.fatal:  # the wait is said as it goes FATAL
            self.next_try_at = self._clock.now() + (after.wait_s or 0.0)
        for state, reason in after.path:
            self._to(state, reason)
        if after.wait_s is None or after.fatal:
            return "restart after stop"
        # BACKOFF; then BACKOFF -> STARTING at the top of the loop
        return await self._back_off(after.wait_s)

    async def _back_off(self, delay_s: float) -> str:
        """Wait out the back-off (cut short by a stop or a restart); the reason for the next
        start."""
        until = self.next_try_at = self._clock.now() + delay_s
        while (left := until - self._clock.now()) > 0 and self._want_running:
            if await self._wait_wake(left) and self._command == "restart":
                return self._command_reason or "restart asked for"
        return "backoff over"

    def _fail_pending_exits(self) -> None:
        for fut in self._exits.values():
            if not fut.done():
                fut.cancel()

    def _environment(self, api_key: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _OWNED_ENV}
        # A quick abort (no backtrace through gdb) gets the crash evidence out faster.
        env.setdefault("GGML_NO_BACKTRACE", "1")
        env.update(self.extra_env)
        env.update(self.cfg.env)
        env["LLAMA_API_KEY"] = api_key
        return env

    async def _spawn(self) -> Process:
        # Never the last process's port: connections pooled to it must not reach the new one.
        self.port = pick_port(avoid=self.port)
        self.api_key = secrets.token_urlsafe(24)
        argv = self.cfg.command(self.port, self.api_key)
        argv = argv[:-2]  # the key travels in the environment, not on the command line
        log.info("[%s] starting: %s", self.name, " ".join(argv))
        return await self._launcher.spawn(argv, self._environment(self.api_key))

    async def _run_process(self) -> ExitRecord | None:
        """One process from spawn to exit. Returns its exit record (planned or not)."""
        self.generation += 1
        generation = self.generation
        loop = asyncio.get_running_loop()
        exit_future: asyncio.Future[ExitRecord] = loop.create_future()
        self._exits = {g: f for g, f in self._exits.items() if g >= generation - 4}
        self._exits[generation] = exit_future
        spawned_at = time.monotonic()
        spawned = self._clock.now()
        try:
            proc = await self._spawn()
        except OSError as e:
            record = ExitRecord(generation, 0, 127, FailureKind.CRASH, f"cannot start "
                                f"{self.cfg.llama_server!r}: {e}", time.time(),
                                time.monotonic(), 0.0, planned=False)
            exit_future.set_result(record)
            self._to(ChildState.EXITED, record.evidence)
            return record
        self.pid = proc.pid
        self._process = proc
        self.started_at = spawned_at
        self.ready_at = None
        self.stderr_tail.clear()
        self.marker_lines.clear()
        reader = asyncio.create_task(self._read_output(proc), name=f"child-{self.name}-output")
        waiter = asyncio.create_task(proc.wait(), name=f"child-{self.name}-wait")
        tasks_before = self.tasks_started
        try:
            planned, note = await self._supervise(proc, waiter, spawned)
        finally:
            await self._reap(proc, waiter, reader)
        record = self._exit_record(generation, proc, spawned, planned, note,
                                   served=self.tasks_started > tasks_before)
        exit_future.set_result(record)
        self.pid = None
        self._process = None
        self.started_at = None
        if planned:
            self._to(ChildState.STOPPED, f"stopped ({describe_exit(record.returncode)})")
        else:
            log.warning("[%s] exited: %s (%s)", self.name, record.kind, record.evidence)
            if record.diagnosis is not None:
                log.warning("[%s] %s", self.name, record.diagnosis.summary())
            self._to(ChildState.EXITED, f"{record.kind}: {record.evidence}")
        return record

    async def _supervise(self, proc: Process, waiter: asyncio.Task[int],
                         spawned: float) -> tuple[bool, str]:
        """STARTING, READY, DRAINING and STOPPING of one process, until it is gone (or stopping
        it is over): (planned, a note on why Spillway ended it unplanned)."""
        outcome = await self._until_ready(waiter)
        if outcome == "ready":
            self.ready_at = time.monotonic()
            self.last_start_s = self._clock.now() - spawned
            self._to(ChildState.READY, f"ready in {self.last_start_s:.2f} s")
            outcome = await self._while_ready(waiter)
        if outcome == "command":
            return await self._on_command(proc, waiter), ""
        if outcome == "timeout":
            await self._terminate(proc, waiter)
            return False, f"not ready after {self.cfg.start_timeout_s:.0f} s (start timeout)"
        if outcome == "hung":
            await self._terminate(proc, waiter, grace_s=HUNG_GRACE_S)
            return False, f"/health unanswered for {self.hang_timeout_s:.0f} s"
        return False, ""

    async def _on_command(self, proc: Process, waiter: asyncio.Task[int]) -> bool:
        """A command while starting or ready: drain first if asked to, then STOPPING. True if
        Spillway stopped the process, False if it exited first."""
        cmd, reason = self._take_command()
        outcome = "command"
        if cmd == "drain" and self.state is ChildState.READY:
            self._to(ChildState.DRAINING, reason)
            outcome = await self._while_draining(waiter)
            if outcome == "command":
                _, reason2 = self._take_command()
                reason = reason2 or reason
        if outcome == "exited":
            return False
        self._to(ChildState.STOPPING, reason)
        await self._terminate(proc, waiter)
        return True

    async def _reap(self, proc: Process, waiter: asyncio.Task[int],
                    reader: asyncio.Task[None]) -> None:
        """The process gone (SIGKILL if cancelled while it runs) and its last lines read."""
        if not waiter.done():  # cancelled: never leave a process behind
            proc.signal_group(signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(waiter), 5)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(reader, 2.0)  # the last lines are the evidence
        reader.cancel()

    def _exit_record(self, generation: int, proc: Process, spawned: float, planned: bool,
                     note: str, served: bool) -> ExitRecord:
        returncode = proc.returncode if proc.returncode is not None else -9
        died = time.monotonic()
        vram = self.vram_probe(died) if self.vram_probe is not None else None
        verdict = classify_exit(returncode, list(self.stderr_tail), vram,
                                vram_short_mib=self.vram_short_mib)
        evidence = f"{note} ({describe_exit(returncode)})" if note else verdict.evidence
        kind = FailureKind.CRASH if note else verdict.kind
        diagnosis = None
        if not planned and not note:  # a death of its own, not one Spillway dealt
            diagnosis = signatures.diagnose(signatures.CrashFacts(
                returncode=returncode, lines=[*self.marker_lines, *self.stderr_tail],
                before_ready=self.ready_at is None, cpu_model=self.cpu.describe(),
                cpu_flags=self.cpu.flags))
        return ExitRecord(generation, proc.pid, returncode, kind, evidence, time.time(), died,
                          self._clock.now() - spawned, planned=planned, served=served,
                          diagnosis=diagnosis)

    async def _until_ready(self, waiter: asyncio.Task[int]) -> str:
        """'ready' | 'exited' | 'timeout' | 'command'."""
        deadline = self._clock.now() + self.cfg.start_timeout_s
        while True:
            if waiter.done():
                return "exited"
            if self._command in ("stop", "restart"):
                return "command"
            if self._clock.now() > deadline:
                return "timeout"
            if await self._health_ok(timeout=2.0):
                return "ready"
            await self._sleep_or_exit(waiter, HEALTH_POLL_S)

    async def _while_ready(self, waiter: asyncio.Task[int]) -> str:
        """'exited' | 'command' | 'hung'."""
        last_ok = self._clock.now()
        while True:
            if waiter.done():
                return "exited"
            if self._command is not None:
                return "command"
            woke = await self._sleep_or_exit(waiter, LIVENESS_POLL_S)
            if woke or waiter.done():
                continue
            limit = min(LIVENESS_TIMEOUT_S, self.hang_timeout_s or LIVENESS_TIMEOUT_S)
            if await self._health_ok(timeout=limit):
                last_ok = self._clock.now()
            elif self.hang_timeout_s > 0 and self._clock.now() - last_ok > self.hang_timeout_s:
                return "hung"

    async def _while_draining(self, waiter: asyncio.Task[int]) -> str:
        """'exited' | 'command' (stop/restart) | 'drained' (idle or drain timeout)."""
        idle = asyncio.create_task(self.load.idle.wait())
        wake = asyncio.create_task(self._wake.wait())
        try:
            done = await self._clock.wait_any({waiter, idle, wake}, self.drain_timeout_s)
        finally:
            idle.cancel()
            wake.cancel()
        if waiter in done:
            return "exited"
        if wake in done:
            self._wake.clear()
            if self._command in ("stop", "restart"):
                return "command"
        return "drained"

    async def _sleep_or_exit(self, waiter: asyncio.Task[int], seconds: float) -> bool:
        """Sleep, cut short by the process exiting or a command. True if a command came."""
        wake = asyncio.create_task(self._wake.wait())
        try:
            done = await self._clock.wait_any({waiter, wake}, seconds)
        finally:
            wake.cancel()
        if wake in done:
            self._wake.clear()
            return True
        return False

    async def _health_ok(self, timeout: float) -> bool:
        if self.port is None:
            return False
        return await self._launcher.health(self.port, timeout)

    async def _terminate(self, proc: Process, waiter: asyncio.Task[int],
                         grace_s: float | None = None) -> None:
        """SIGTERM to the group, a grace period, then SIGKILL."""
        if grace_s is None:
            grace_s = self._grace_override
        grace = self.cfg.stop_grace_s if grace_s is None else grace_s
        proc.signal_group(signal.SIGTERM)
        if not await self._clock.wait_any({waiter}, grace):
            log.warning("[%s] still running %.0f s after SIGTERM; sending SIGKILL",
                        self.name, grace)
            proc.signal_group(signal.SIGKILL)
            await self._clock.wait_any({waiter}, 10)

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
