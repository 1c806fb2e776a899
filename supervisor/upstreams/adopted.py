"""A child process another Spillway started: recognised, adopted, or ended.

A process is Spillway's by its identity as the kernel shows it, read from /proc (the same
user's processes only):

- the pid is alive (not a zombie), on the same boot, with the same start time (clock ticks
  after boot: a pid reused since has another);
- its environment holds `SPILLWAY_OWNER` with the recorded value: a random value per process,
  readable only by its own user, so no other program carries it by chance.

Its command line is no part of it: a `llama-server` that is a wrapper script (`exec
llama-server.real "$@"`, as distribution packages, Nix and scripts that set LD_LIBRARY_PATH
ship it) runs another command line in the same process, with the same pid, start time and
environment. What a command line would say (that the config still asks for this child) the
record's fingerprint of the config says (owned.py; ownership.py compares it).

A process that fails any check is not Spillway's: it is never signalled. One that passes is
adopted (`take`: the launcher's `WatchedProcess`, its end seen and its signals sent through a
pidfd, its output read from its stdout pipe, opened again through /proc/PID/fd/1), or ended
(`end`: SIGTERM, a grace period, SIGKILL) when the config no longer has a place for it. Both
check the identity again once the pidfd is open, however long ago it was checked first (an
upgrade's ends wait for the old daemon's drain): the pidfd then holds that very process, and a
signal through it cannot reach a process that took its pid later.

Not the daemon's child, its exit status cannot be had (only its parent may wait for it): an
adopted process's end is recorded as "exit status unknown" (policy/evidence.EXIT_UNKNOWN) and
its last output lines judge what it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from .launcher import WatchedProcess
from .owned import OWNER_ENV, ChildRecord

log = logging.getLogger("spillway.child")

PROC = Path("/proc")


@functools.cache
def boot_id() -> str:
    """This boot's id (it does not change while the machine runs)."""
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None when it is gone or a
    zombie."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    after = stat.rsplit(")", 1)[-1].split()
    if len(after) < 20 or after[0] in ("Z", "X"):
        return None
    return int(after[19])


def _carries(pid: int, owner: str) -> bool:
    wanted = f"{OWNER_ENV}={owner}".encode()
    return wanted in (PROC / str(pid) / "environ").read_bytes().split(b"\0")


@dataclass(frozen=True)
class Identity:
    """What the checks found: `ours` (all hold), else `gone` (no such process now) or
    neither (a process that is not this record's: never touched), with why."""

    ours: bool
    gone: bool
    why: str


def identify(record: ChildRecord) -> Identity:
    """Whether the process in `record` is the child it records (see the module's doc)."""
    pid = record.pid
    if pid <= 1:
        return Identity(False, False, f"pid {pid} is no child's")
    ticks = start_ticks(pid)
    if ticks is None:
        return Identity(False, True, f"pid {pid} is gone")
    if record.boot_id and record.boot_id != boot_id():
        return Identity(False, True, f"pid {pid} was recorded before the machine restarted")
    if ticks != record.start_ticks:
        return Identity(False, False, f"pid {pid} started at another time: another process "
                                      "has that pid now")
    try:
        carries = _carries(pid, record.owner)
    except PermissionError:
        return Identity(False, False, f"pid {pid} is another user's")
    except OSError as e:
        return Identity(False, True, f"pid {pid}: {e}")
    if not carries:
        return Identity(False, False, f"pid {pid} does not carry this Spillway's {OWNER_ENV}")
    return Identity(True, False, f"pid {pid} is the {record.name} child started by spillway "
                                 f"pid {record.daemon_pid}")


def _open_output(pid: int) -> int | None:
    """The child's stdout pipe (stdout and stderr are one), opened again for reading; None
    when it cannot be (its lines are then not read)."""
    try:
        return os.open(PROC / str(pid) / "fd" / "1", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        log.warning("pid %d: its output cannot be read (%s): its lines are not logged", pid, e)
        return None


def _lives(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    return True


class NotTheRecorded(OSError):
    """The process a record names is not there to take now: gone, or not Spillway's (its
    identity, with why)."""

    def __init__(self, found: Identity) -> None:
        super().__init__(found.why)
        self.found = found


async def take(record: ChildRecord) -> WatchedProcess:
    """The process `record` names, watched as the launcher's `Process`, once its identity holds
    again right now: its pidfd opened first, then every check (identify), so that the pidfd
    holds the very process checked and every later signal goes to it alone. NotTheRecorded
    when a check fails; OSError when it is gone meanwhile."""
    try:
        pidfd = os.pidfd_open(record.pid)
    except OSError:
        raise NotTheRecorded(Identity(False, True, f"pid {record.pid} is gone")) from None
    found = identify(record)
    output = None
    if found.ours:
        output = _open_output(record.pid)
        # Its stdout was opened by pid: the pidfd says whether that was still the process.
        if not _lives(pidfd):
            found = Identity(False, True, f"pid {record.pid} is gone")
    if not found.ours:
        for fd in (pidfd, output):
            if fd is not None:
                os.close(fd)
        raise NotTheRecorded(found)
    return await WatchedProcess.watch(record.pid, output, pidfd=pidfd)


async def end(record: ChildRecord, grace_s: float, why: str) -> bool:
    """End the process `record` names, which no child takes: SIGTERM to its group, `grace_s`,
    then SIGKILL, only once its identity holds again (`take`: checked long ago, at an
    upgrade's start, it may have ended and its pid gone to another process since). True once
    it is gone; False when it is not this Spillway's to end (left alone) or outlived SIGKILL."""
    try:
        proc = await take(record)
    except NotTheRecorded as e:
        if not e.found.gone:
            log.warning("[%s] pid %d is not ended: %s (left alone)", record.name, record.pid,
                        e.found.why)
        return e.found.gone
    except OSError:
        return True  # gone already
    log.warning("[%s] ending pid %d, left running by spillway pid %d: %s", record.name,
                record.pid, record.daemon_pid, why)
    proc.signal_group(signal.SIGTERM)
    reader = asyncio.create_task(_drain(proc))
    try:
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
            return True
        except TimeoutError:
            log.warning("[%s] pid %d still running %.0f s after SIGTERM; sending SIGKILL",
                        record.name, record.pid, grace_s)
            proc.signal_group(signal.SIGKILL)
            try:
                await asyncio.wait_for(proc.wait(), 10)
                return True
            except TimeoutError:
                return False
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _drain(proc: WatchedProcess) -> None:
    """Its last lines, logged (a pipe left unread would hold its writer)."""
    while line := await proc.readline():
        log.info("[ended pid %d] %s", proc.pid, line.decode(errors="replace").rstrip())
