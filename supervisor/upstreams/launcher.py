"""The process seam: what a child's owner task asks of the operating system, behind a small
interface, so that the lifecycle (children.py) runs unchanged on a fake (tests/fake_launcher.py).

A `Launcher` starts a process (`spawn`) and asks a child's port whether it is healthy
(`health`); a `Process` is one started process: its pid and exit status, waiting for its exit,
signalling its process group, reading its output a line at a time. `SubprocessLauncher` is the
real one, and `WatchedProcess` its process (and an adopted one's: adopted.py):

- its end is seen through a pidfd the event loop watches, and the daemon reaps it itself
  (asyncio's subprocess transport would kill a child still running when it is closed, and a
  child must outlive a daemon that lets go of it: `release`, at an upgrade's handover);

- each process runs in its own session and process group, and is not told to die with the
  daemon: it outlives a crash or an upgrade of the daemon by design, to be adopted (or ended) by
  the next one (owned.py, adopted.py). It inherits SIGPIPE ignored (as llama-server sets it
  itself), so that a line written while no daemon reads its output is lost, not its life;
- stdout and stderr are one pipe, read a line at a time (a line over 1 MiB is cut there);
- a signal goes through the pidfd held since the start (or the adoption), so that it never
  reaches a process that took the pid later: to the whole group once while the process still
  leads it (`PIDFD_SIGNAL_PROCESS_GROUP`, Linux 6.9; before, `killpg` right after the pidfd
  says it lives), else to the process alone;
- healthy means `GET /health` on the loopback port answers 200 (503 `Loading model` is "still
  starting"; a refused connection or a timeout is "not healthy").
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import subprocess
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp

from ..policy.evidence import EXIT_UNKNOWN
from ..records.caches import figures

LINE_LIMIT = 1 << 20  # the longest output line read as one; a longer one is cut
PIDFD_SIGNAL_PROCESS_GROUP = 1 << 2  # linux/pidfd.h (6.9): the pidfd's process group


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


class WatchedProcess:
    """A real process, watched through a pidfd: its end is seen by the event loop (the pidfd
    turns readable), its signals go through it while it lives, its output is read from a pipe.

    With `popen`, the daemon started it (`SubprocessLauncher`) and reaps it for its exit status;
    without, it is adopted (adopted.py: another Spillway started it): its status cannot be
    had, and its end reads as EXIT_UNKNOWN. `release` lets go of it without a signal (an
    upgrade's handover: the next daemon adopts it)."""

    def __init__(self, pid: int, pidfd: int, output: asyncio.StreamReader | None,
                 transport: asyncio.BaseTransport | None,
                 popen: subprocess.Popen[bytes] | None = None) -> None:
        self._pid = pid
        self._pidfd: int | None = pidfd
        self._output = output
        self._transport = transport
        self._popen = popen  # kept, so that subprocess's own clean-up never reaps it first
        self._returncode: int | None = None
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        loop.add_reader(pidfd, self._on_exit)

    @classmethod
    async def watch(cls, pid: int, output_fd: int | None,
                    popen: subprocess.Popen[bytes] | None = None,
                    pidfd: int | None = None) -> WatchedProcess:
        """Watch `pid` (OSError when it is gone), reading its output from `output_fd` (a pipe's
        read end, taken over; None: not read), through `pidfd` (taken over) when one was
        opened already."""
        if pidfd is None:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                if output_fd is not None:
                    os.close(output_fd)
                raise
        reader: asyncio.StreamReader | None = None
        transport: asyncio.BaseTransport | None = None
        if output_fd is not None:
            loop = asyncio.get_running_loop()
            got = reader = asyncio.StreamReader(limit=LINE_LIMIT, loop=loop)
            pipe = os.fdopen(output_fd, "rb", buffering=0)
            try:
                transport, _ = await loop.connect_read_pipe(
                    lambda: asyncio.StreamReaderProtocol(got, loop=loop), pipe)
            except (OSError, ValueError):  # not a pipe (a file, a terminal): not read
                pipe.close()
                reader = None
        return cls(pid, pidfd, reader, transport, popen)

    def _on_exit(self) -> None:
        fd = self._pidfd
        if fd is None:
            return
        asyncio.get_running_loop().remove_reader(fd)
        code = EXIT_UNKNOWN
        if self._popen is not None:
            try:
                info = os.waitid(os.P_PIDFD, fd, os.WEXITED)
            except ChildProcessError:
                info = None
            if info is not None:
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            self._popen.returncode = code
        os.close(fd)
        self._pidfd = None
        self._returncode = code
        if not self._exited.done():
            self._exited.set_result(code)

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def signal_group(self, sig: int) -> None:
        # Once: llama-server reads a second SIGTERM as "terminate immediately". Only through
        # the pidfd: once the process is gone, its pid may be another process's (an adopted
        # process is reaped by init at once), and so may its group's id.
        fd = self._pidfd
        if fd is None:
            return
        try:
            signal.pidfd_send_signal(fd, 0)
            # Its group is the one it was started in only while it leads it (a process that
            # made a group of its own elsewhere is signalled alone). Read by pid after the
            # pidfd said it lives: a pid reused since fails the group signal below (ESRCH).
            leads = os.getpgid(self._pid) == self._pid
        except ProcessLookupError:
            return
        with contextlib.suppress(ProcessLookupError):
            if leads and self._signal_group_by_pidfd(fd, sig):
                return
            signal.pidfd_send_signal(fd, sig)

    def _signal_group_by_pidfd(self, fd: int, sig: int) -> bool:
        """`sig` to the pidfd's process group; False when only the process itself can be
        signalled (a member of another user's; ProcessLookupError when it is gone)."""
        try:
            signal.pidfd_send_signal(fd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
            return True
        except PermissionError:
            return False
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: a kernel before 6.9, without the flag
                raise
        try:  # the pidfd said just now that it lives (a child of ours is not reaped yet)
            os.killpg(self._pid, sig)
            return True
        except PermissionError:
            return False

    async def readline(self) -> bytes:
        if self._output is None:
            await self.wait()
            return b""
        try:
            return await self._output.readline()
        except ValueError:  # a line over the limit: take what is there
            return await self._output.read(LINE_LIMIT)

    def release(self) -> None:
        """Stop watching it and leave it running: no signal; its output no longer read."""
        fd = self._pidfd
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
            self._pidfd = None
        if self._transport is not None:
            self._transport.close()
        if self._popen is not None:
            self._popen.returncode = EXIT_UNKNOWN  # never waited for by subprocess either
        if self._output is not None:
            self._output.feed_eof()
        if not self._exited.done():
            self._exited.cancel()


class SubprocessLauncher:
    """Real processes, and `/health` over HTTP. `close` ends the probe's HTTP session."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> WatchedProcess:
        read_end, write_end = os.pipe()
        try:
            # In the loop, as asyncio's own create_subprocess_exec does: fork and exec are quick.
            popen = subprocess.Popen(  # noqa: ASYNC220
                list(argv), stdin=subprocess.DEVNULL, stdout=write_end, stderr=write_end,
                env=dict(env), start_new_session=True,
                # Python's SIGPIPE (and SIGXFSZ) stay ignored in the child: the module's doc.
                restore_signals=False, close_fds=True)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return await WatchedProcess.watch(popen.pid, read_end, popen)

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
