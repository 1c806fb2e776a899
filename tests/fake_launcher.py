"""A fake of supervisor/upstreams/launcher.py's seam: processes that live in the test's event
loop and on its fake clock (tests/fake_clock.py, with fake_processes=True), with fault switches.

Each spawn takes the next `Script` given to the launcher (then its default): what the process
prints, after how many health probes it is ready (or never), when it exits by itself and how
(code, signal, last words), when its /health stops answering (each probe then takes its whole
timeout), whether it ignores SIGTERM. A test can also act on a running process at any moment:
`say` a line, `crash`, `hang`.

Every process keeps what was done to it: its argv and environment, the signals it got (with
the clock's time), its health probes.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fake_clock import FakeClock


@dataclass(frozen=True)
class Script:
    """What one fake process does."""

    lines: Sequence[str] = ()  # printed as it starts
    ready_after: int | None = 1  # /health answers 200 from this probe on; None: never
    exit_after_s: float | None = None  # exits by itself this long after its spawn
    exit_code: int = 1  # ... with this status (-N: killed by signal N)
    last_words: Sequence[str] = ()  # ... printed just before
    hang_after_s: float | None = None  # /health stops answering this long after its spawn
    ignores_sigterm: bool = False  # only SIGKILL ends it
    unkillable: bool = False  # nothing ends it (a process in uninterruptible sleep)
    sigterm_exit_s: float = 0.0  # how long it takes to exit after SIGTERM
    sigterm_code: int = 0  # its exit status after SIGTERM
    spawn_error: OSError | None = None  # cannot be started at all


@dataclass
class FakeProcess:
    clock: FakeClock
    script: Script
    argv: list[str]
    env: dict[str, str]
    pid: int
    spawned_at: float
    signals: list[tuple[float, int]] = field(default_factory=list)  # (clock time, signal)
    probes: int = 0  # health probes it got
    exited_at: float | None = None
    hung: bool = False
    _returncode: int | None = None
    _lines: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)
    _exit: asyncio.Future[int] | None = None

    def __post_init__(self) -> None:
        self._exit = asyncio.get_running_loop().create_future()
        for line in self.script.lines:
            self.say(line)
        s = self.script
        if s.exit_after_s is not None:
            self.clock.call_later(s.exit_after_s, lambda: self.crash(s.exit_code, *s.last_words))
        if s.hang_after_s is not None:
            self.clock.call_later(s.hang_after_s, self.hang)

    @property
    def port(self) -> int:
        return int(self.argv[self.argv.index("--port") + 1])

    @property
    def alive(self) -> bool:
        return self._returncode is None

    @property
    def signal_numbers(self) -> list[int]:
        return [sig for _, sig in self.signals]

    # --- the Process protocol ---------------------------------------------------------------

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def wait(self) -> int:
        # Awaited directly (no shield): the exit wakes a waiter in the same turn of the loop
        # as an event set at the same moment wakes its own.
        assert self._exit is not None
        return await self._exit

    def signal_group(self, sig: int) -> None:
        self.signals.append((self.clock.now(), sig))
        if not self.alive or self.script.unkillable:
            return
        if sig == signal.SIGTERM:
            if self.script.ignores_sigterm:
                return
            if self.script.sigterm_exit_s > 0:
                self.clock.call_later(self.script.sigterm_exit_s,
                                      lambda: self.crash(self.script.sigterm_code))
            else:
                self.crash(self.script.sigterm_code)
            return
        self.crash(-sig)  # SIGKILL, SIGABRT, ...: the default action, death

    async def readline(self) -> bytes:
        line = await self._lines.get()
        if not line:
            self._lines.put_nowait(b"")  # the end stays the end
        return line

    # --- what a test can make it do ---------------------------------------------------------

    def say(self, line: str) -> None:
        if self.alive:
            self._lines.put_nowait(line.encode() + b"\n")

    def crash(self, code: int, *last_words: str) -> None:
        """Exit now with `code` (-N: by signal N), printing `last_words` first."""
        if not self.alive:
            return
        for line in last_words:
            self.say(line)
        self._returncode = code
        self.exited_at = self.clock.now()
        self._lines.put_nowait(b"")
        assert self._exit is not None
        self._exit.set_result(code)

    def hang(self) -> None:
        """/health stops answering (the process stays up)."""
        self.hung = True

    def healthy(self) -> bool:
        ready_after = self.script.ready_after
        return ready_after is not None and self.probes >= ready_after


class FakeLauncher:
    """The launcher seam on fake processes: `scripts` are used in order, one per spawn, then
    `default`."""

    def __init__(self, clock: FakeClock, *scripts: Script,
                 default: Script | None = None) -> None:
        self.clock = clock
        self.scripts = list(scripts)
        self.default = default or Script()
        self.processes: list[FakeProcess] = []
        self.spawns: list[tuple[list[str], dict[str, str]]] = []  # every try, failed or not

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> FakeProcess:
        script = self.scripts.pop(0) if self.scripts else self.default
        self.spawns.append((list(argv), dict(env)))
        if script.spawn_error is not None:
            raise script.spawn_error
        proc = FakeProcess(self.clock, script, list(argv), dict(env), pid=4000 + len(self.spawns),
                           spawned_at=self.clock.now())
        self.processes.append(proc)
        return proc

    async def health(self, port: int, timeout: float) -> bool:
        live = [p for p in self.processes if p.alive and p.port == port]
        if not live:
            return False  # connection refused
        proc = live[-1]
        proc.probes += 1
        if proc.hung:
            await self.clock.sleep(timeout)  # no answer until the probe gives up
            return False
        return proc.healthy()

    @property
    def last(self) -> FakeProcess:
        return self.processes[-1]
