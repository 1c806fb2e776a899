"""An upgrade in place: the running daemon hands its listening sockets and its children to a new
daemon process, running the code installed now, with no model reload and no connection refused.

`spillway upgrade --config FILE` asks over the daemon's control socket (`Control`: a unix
socket in the state folder, beside the state file: `<state folder>/run/<id>.sock`, mode 0600,
and only a peer of the daemon's own user or root is answered). A unix socket rather than a
route under /spillway/: an upgrade starts processes as the daemon's user, a right that belongs
with the right to signal it (its user, root), not with the API key handed to every client; no
web page can reach a unix socket, so it adds nothing for the browser checks to guard; and it
answers whatever `server.listen` is and however full the waiting line.

Then (`start_successor`, in the old daemon):

1. the config file is read and checked: a file that is not valid is refused, the old daemon
   serving on as it was;
2. the new daemon is started as `python -m supervisor run --config FILE` with the same
   interpreter (the code installed now), in a session of its own, its output where the old
   one's goes (the journal under systemd), never the caller's pipes: the CLI only talks to the
   socket. It is given the listening sockets (`pass_fds`) and, in `SPILLWAY_HANDOVER`, which fd
   is which address, the old daemon's pid, and the write end of a pipe to say when it serves;
3. the new daemon listens on the sockets as they are (both daemons accept for a moment: no
   connection waits longer than that), adopts each child the state file records (ownership.py:
   the same identity checks as after a crash), and, once they answer, tells systemd
   MAINPID=<its pid> and READY=1 (NotifyAccess=all), then writes its answer to the pipe;
4. the old daemon answers the CLI, lets go of its children without a signal, stops accepting,
   lets its requests in flight finish (up to server.drain_timeout_s) and exits 0;
5. the new daemon, once the old one has exited (or after the drain timeout and a margin), owns
   everything: it writes the state file, starts the children it did not adopt, ends a process
   its config has no place for, restarts a child whose command changed (as a reload), and
   answers on the control socket.

Until step 5 the new daemon changes no process: it starts none and ends none (a child that
dies meanwhile is started at step 5). So when anything fails before step 4 (it exits, or does
not serve within the timeout), the old daemon kills it and serves on as if nothing happened,
and `spillway upgrade` exits non-zero with why.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.files import write_atomically
from ..records.idempotency import IdempotencyStore, StoredResponse
from ..upstreams.launcher import WatchedProcess
from ..upstreams.owned import run_folder
from .listen_fds import LISTEN_VARIABLES, Listener

log = logging.getLogger("spillway")

HANDOVER_ENV = "SPILLWAY_HANDOVER"
UPGRADE_TIMEOUT_S = 120.0  # for the new daemon to serve (its start, its children's answers)
COMMIT_MARGIN_S = 30.0  # past the old daemon's drain timeout, before the new one goes on alone
REQUEST_LIMIT = 64 * 1024


class UpgradeFailed(Exception):
    """The new daemon did not take over; the old one serves on."""


@dataclass(frozen=True)
class Handover:
    """What the new daemon is given (SPILLWAY_HANDOVER)."""

    from_pid: int
    listen: tuple[tuple[int, str], ...]  # (fd, address)
    ready_fd: int
    drain_timeout_s: float
    asked_at: float  # wall time

    def to_env(self) -> str:
        return json.dumps({"from_pid": self.from_pid,
                           "listen": [{"fd": fd, "address": a} for fd, a in self.listen],
                           "ready_fd": self.ready_fd, "drain_timeout_s": self.drain_timeout_s,
                           "asked_at": self.asked_at})

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Handover | None:
        """The handover this daemon was started for, if any (the variable is unset: nothing
        started later inherits it)."""
        env = os.environ if environ is None else environ
        raw = env.pop(HANDOVER_ENV, None)
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            return cls(int(doc["from_pid"]),
                       tuple((int(x["fd"]), str(x["address"])) for x in doc["listen"]),
                       int(doc["ready_fd"]), float(doc["drain_timeout_s"]),
                       float(doc["asked_at"]))
        except (ValueError, KeyError, TypeError) as e:
            log.error("%s is not a handover this spillway understands (%s): started as a "
                      "daemon of its own", HANDOVER_ENV, e)
            return None


def control_path(state_id: str, folder: Path | None = None) -> Path:
    return (folder or run_folder()) / f"{state_id}.sock"


# --- the control socket -------------------------------------------------------------------------

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _peer_uid(sock: socket.socket) -> int | None:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])


class Control:
    """The daemon's control socket: one JSON line in, one JSON line out."""

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> bool:
        """Listen (a stale socket file is replaced). False, with a warning, when it cannot
        be: `spillway upgrade` then cannot reach this daemon."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            old = os.umask(0o177)
            try:
                self._server = await asyncio.start_unix_server(
                    self._serve, path=str(self.path), limit=REQUEST_LIMIT)
            finally:
                os.umask(old)
        except (OSError, ValueError) as e:
            log.warning("cannot listen on the control socket %s (%s): `spillway upgrade` "
                        "cannot reach this daemon", self.path, e)
            return False
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            uid = _peer_uid(sock) if sock is not None else None
            if uid is None or uid not in (os.getuid(), 0):
                answer: dict[str, Any] = {"ok": False, "error": "not this daemon's user"}
            else:
                try:
                    line = await asyncio.wait_for(reader.readline(), 10)
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError("not a JSON object")
                except (ValueError, TimeoutError, asyncio.LimitOverrunError) as e:
                    answer = {"ok": False, "error": f"a request of one JSON line: {e}"}
                else:
                    answer = await self.handler(request)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def close(self, unlink: bool = True) -> None:
        """Stop answering; the socket file is removed unless the next daemon's is there now."""
        if self._server is not None:
            self._server.close()
            self._server = None
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()


def ask(path: Path, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The CLI's side: one request, its answer. OSError when no daemon answers there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data) if data.strip() else {"ok": False, "error": "no answer"}
    return answer if isinstance(answer, dict) else {"ok": False, "error": "not an answer"}


# --- what survives: the Idempotency-Key store's completed answers -------------------------------


def answers_path(state_id: str, phase: str, folder: Path | None = None) -> Path:
    """Where the old daemon writes its stored answers for the new one: at the handover
    (`handover`), and those completed during its drain (`drained`)."""
    return (folder or run_folder()) / f"{state_id}.answers-{phase}.json"


def _write_answers(path: Path, answers: list[tuple[str, str, str, float, StoredResponse]]
                   ) -> None:
    doc = [{"scope": scope, "key": key, "fingerprint": fp, "created": created,
            "status": r.status, "headers": [list(h) for h in r.headers],
            "body": base64.b64encode(r.body).decode()}
           for scope, key, fp, created, r in answers]
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomically(path, json.dumps(doc), mode=0o600)  # answers are the clients' own


def _read_answers(path: Path) -> list[tuple[str, str, str, float, StoredResponse]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return [(str(a["scope"]), str(a["key"]), str(a["fingerprint"]), float(a["created"]),
             StoredResponse(int(a["status"]), tuple((str(h), str(v)) for h, v in a["headers"]),
                            base64.b64decode(a["body"]))) for a in doc]


async def save_answers(path: Path, store: IdempotencyStore) -> int:
    """The store's completed answers to `path` (in a worker thread); how many."""
    answers = store.export()
    try:
        await asyncio.to_thread(_write_answers, path, answers)
    except OSError as e:
        log.error("upgrade: cannot write the stored answers to %s: %s (a retry with an "
                  "Idempotency-Key answered here runs again on the new daemon)", path, e)
        return 0
    return len(answers)


async def load_answers(path: Path, store: IdempotencyStore) -> int:
    """The answers the old daemon wrote to `path`, into the store (the file is removed); how
    many were kept."""
    try:
        answers = await asyncio.to_thread(_read_answers, path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.error("upgrade: cannot read the stored answers in %s: %s", path, e)
        return 0
    return store.absorb(answers, time.monotonic())


# --- the old daemon's side ----------------------------------------------------------------------


async def start_successor(config_path: str, listeners: Sequence[Listener],
                          drain_timeout_s: float, timeout_s: float) -> dict[str, Any]:
    """Start the new daemon and wait until it says it serves: its answer (pid, adopted). On
    UpgradeFailed it was killed (it had changed no process), and the old daemon serves on."""
    ready_r, ready_w = os.pipe()
    fds = [listener.sock.fileno() for listener in listeners]
    handover = Handover(os.getpid(), tuple((fd, listener.address)
                                           for fd, listener in zip(fds, listeners)),
                        ready_w, drain_timeout_s, time.time())
    env = dict(os.environ)
    # systemd's watchdog is the new main process's after MAINPID=; its LISTEN_* were this one's.
    for name in ("WATCHDOG_PID", *LISTEN_VARIABLES):
        env.pop(name, None)
    env[HANDOVER_ENV] = handover.to_env()
    argv = [sys.executable, "-m", "supervisor", "run", "--config", config_path]
    try:
        popen = subprocess.Popen(  # noqa: ASYNC220 - a quick fork and exec, as asyncio's own
            argv, stdin=subprocess.DEVNULL, pass_fds=(*fds, ready_w), env=env,
            start_new_session=True, close_fds=True)
    except OSError as e:
        os.close(ready_r)
        raise UpgradeFailed(f"cannot start {' '.join(argv)}: {e}") from e
    finally:
        os.close(ready_w)
    log.warning("upgrade: started the new daemon, pid %d (%s)", popen.pid, " ".join(argv))
    new = await WatchedProcess.watch(popen.pid, None, popen)
    try:
        answer = await _read_answer(ready_r, new, timeout_s)
    except UpgradeFailed:
        new.signal_group(9)  # SIGKILL: it changed no process; nothing of it must stay
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(new.wait(), 10)
        raise
    new.release()  # it outlives this daemon
    return answer


async def _read_answer(fd: int, new: WatchedProcess, timeout_s: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=REQUEST_LIMIT, loop=loop)
    pipe = os.fdopen(fd, "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except TimeoutError:
        raise UpgradeFailed(f"the new daemon (pid {new.pid}) did not serve within "
                            f"{timeout_s:.0f} s: killed; this one serves on") from None
    finally:
        transport.close()
    if not line:
        code: int | None = None
        with contextlib.suppress(asyncio.TimeoutError):
            code = await asyncio.wait_for(new.wait(), 10)
        raise UpgradeFailed(f"the new daemon (pid {new.pid}) exited before it served "
                            f"(exit status {code}): its lines are in this daemon's log or the "
                            "journal; this one serves on")
    try:
        answer = json.loads(line)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or not answer.get("serving"):
        said = answer.get("error") if isinstance(answer, dict) else line
        raise UpgradeFailed(f"the new daemon (pid {new.pid}) did not take over: {said!r}")
    return answer


# --- the new daemon's side ----------------------------------------------------------------------


def tell_old(handover: Handover, answer: dict[str, Any]) -> None:
    """The answer to the old daemon (it waits for one line); the pipe is closed."""
    try:
        os.write(handover.ready_fd, json.dumps(answer).encode() + b"\n")
    except OSError as e:
        log.error("upgrade: cannot answer spillway pid %d: %s", handover.from_pid, e)
    finally:
        with contextlib.suppress(OSError):
            os.close(handover.ready_fd)


async def wait_exit(pid: int, timeout_s: float) -> bool:
    """Until process `pid` has exited (True), or `timeout_s` (False)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return True  # gone already
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()

    def exited() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(fd, exited)
    try:
        await asyncio.wait_for(gone, timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)
