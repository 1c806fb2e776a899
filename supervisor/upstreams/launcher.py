"""The process seam: what a child's owner task asks of the operating system, behind a small
interface, so that the lifecycle (children.py) runs unchanged on a fake (tests/fake_launcher.py).

A `Launcher` starts a process (`spawn`) and asks a child's port whether it is healthy
(`health`); a `Process` is one started process: its pid and exit status, waiting for its exit,
signalling its process group, reading its output a line at a time. `SubprocessLauncher` is the
real one:

- each process runs in its own session and process group, and is not told to die with the
  daemon: it outlives a crash or an upgrade of the daemon by design, to be adopted (or ended) by
  the next one (owned.py, adopted.py). It inherits SIGPIPE ignored (as llama-server sets it
  itself), so that a line written while no daemon reads its output is lost, not its life;
- stdout and stderr are one pipe, read a line at a time (a line over 1 MiB is cut there);
- a signal goes to the whole group once, falling back to the process itself;
- healthy means `GET /health` on the loopback port answers 200 (503 `Loading model` is "still
  starting"; a refused connection or a timeout is "not healthy").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp

from ..records.caches import figures

LINE_LIMIT = 1 << 20  # the longest output line read as one; a longer one is cut


class Process(Protocol):
    """One started process."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None:
        """None while it runs (as far as the event loop has heard); -N: killed by signal N."""
        ...

    async def wait(self) -> int:
        """Wait for the exit; the exit status."""
        ...

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the process group, once; nothing if the process is gone."""
        ...

    async def readline(self) -> bytes:
        """The next line of output (stdout and stderr together), b"" at the end."""
        ...


class Launcher(Protocol):
    async def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> Process:
        """Start `argv` with exactly `env`; OSError if it cannot be started."""
        ...

    async def health(self, port: int, timeout: float) -> bool:
        """Whether the child listening on the loopback `port` says it is ready, within
        `timeout` seconds."""
        ...


def free_port() -> int:
    """A loopback port the kernel says is free now (it may hand the same one out again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The ports handed out lately, newest last. Two children start at the same moment and each
# binds its port only once its process runs; the kernel can give the same free port to both
# asks in between. The one that then loses the bind exits, but meanwhile its /health probe is
# answered by the other child on the same port, and it would be taken for READY (seen once in
# CI: requests for the GPU child reached the CPU child with the wrong key, and got 401).
_RECENT_PORTS: deque[int] = deque(maxlen=32)


def recent_ports_figures() -> dict[str, Any]:
    """For the status's caches: the ports handed out lately (a fixed count)."""
    return figures(len(_RECENT_PORTS), max_entries=_RECENT_PORTS.maxlen)


def reserve_port(port: int) -> None:
    """A port taken otherwise (an adopted child's): not handed out while it is recent."""
    if port not in _RECENT_PORTS:
        _RECENT_PORTS.append(port)


def pick_port(avoid: int | None = None, probe: Callable[[], int] = free_port) -> int:
    """A free loopback port, never `avoid` and never one handed out lately. A process outside
    Spillway may still take it first: the child then exits and is restarted with another."""
    while True:
        port = probe()
        if port != avoid and port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
            return port


class SubprocessProcess:
    """A real process, started by `SubprocessLauncher`."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def signal_group(self, sig: int) -> None:
        # Once: llama-server reads a second SIGTERM as "terminate immediately".
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            if self._proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.send_signal(sig)

    async def readline(self) -> bytes:
        stream = self._proc.stdout
        assert stream is not None
        try:
            return await stream.readline()
        except ValueError:  # a line over the limit: take what is there
            return await stream.read(LINE_LIMIT)


class SubprocessLauncher:
    """Real processes, and `/health` over HTTP. `close` ends the probe's HTTP session."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> SubprocessProcess:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            # Python's SIGPIPE (and SIGXFSZ) stay ignored in the child: see the module's doc.
            restore_signals=False,
            limit=LINE_LIMIT,
        )
        return SubprocessProcess(proc)

    async def health(self, port: int, timeout: float) -> bool:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=4, force_close=True))
        try:
            async with self._session.get(
                f"http://127.0.0.1:{port}/health", timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
