"""The listening sockets: passed in, else bound here.

A socket is passed in two ways, and both are used as they are (never closed and bound again,
so that a connection made meanwhile waits in the socket's backlog instead of being refused):

- systemd's socket activation (`spillway.socket`): `LISTEN_FDS` sockets from fd 3 on, for the
  process `LISTEN_PID` names (sd_listen_fds(3)); read once, and the variables unset, so that
  nothing started later takes them for its own;
- an upgrade in place (handover.py): the old daemon's sockets, named in `SPILLWAY_HANDOVER`.

Each `server.listen` address takes the passed socket bound to it (by `getsockname()`); an
address with none is bound here, as before socket activation, and the log says which is which.
A passed socket that matches no listen address is served too (it was passed to be served), with
a warning: `server.listen` should name it, for the Host checks and the commands that find the
daemon by its config.

The key rule holds for what is served, not only for what `server.listen` says: a socket passed
on an address beyond loopback, with no key in the config, is refused (`unguarded`): the daemon
does not start (at an upgrade the old one serves on), and a reload that would drop the key
while such an address is served is refused.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

from ..config.schema import KEY_NEEDED, ListenAddress, Problem, ServerConfig

log = logging.getLogger("spillway")

SD_LISTEN_FDS_START = 3
LISTEN_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# The backlog asked of every listening socket: connections made while no daemon accepts (an
# upgrade's handover, a restart under socket activation) wait there. The kernel caps it at
# net.core.somaxconn.
BACKLOG = socket.SOMAXCONN


class ListenError(Exception):
    """An address that cannot be listened on."""


@dataclass
class Listener:
    sock: socket.socket
    address: str  # as it is shown: 127.0.0.1:8080, [::1]:8080
    how: str  # "systemd", "handover" (the old daemon's, at an upgrade) or "bound"


def from_systemd(environ: MutableMapping[str, str] | None = None) -> list[socket.socket]:
    """systemd's sockets (LISTEN_FDS from fd 3, when LISTEN_PID is this process); the
    variables are unset either way. Only stream sockets that listen are taken."""
    env = os.environ if environ is None else environ
    pid, count = env.get("LISTEN_PID", ""), env.get("LISTEN_FDS", "")
    for name in LISTEN_VARIABLES:
        env.pop(name, None)
    if not pid.isdigit() or int(pid) != os.getpid() or not count.isdigit():
        return []
    return from_fds(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)), "systemd")


def from_fds(fds: Sequence[int], source: str) -> list[socket.socket]:
    """The listening stream sockets among `fds` (close-on-exec from now on: a child must not
    hold them); anything else passed is left alone, with a warning."""
    out = []
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            log.warning("fd %d passed by %s is not a socket (%s): not used", fd, source, e)
            continue
        if sock.type != socket.SOCK_STREAM or \
                not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            log.warning("fd %d passed by %s is not a listening stream socket: not used", fd,
                        source)
            sock.detach()
            continue
        sock.set_inheritable(False)
        out.append(sock)
    return out


def address_of(sock: socket.socket) -> str:
    """Where a socket listens, as server.listen writes it."""
    name = sock.getsockname()
    if sock.family == socket.AF_INET6:
        return f"[{name[0]}]:{name[1]}"
    if sock.family == socket.AF_INET:
        return f"{name[0]}:{name[1]}"
    return str(name)


def listen_address(sock: socket.socket) -> ListenAddress | None:
    """Where an IP socket listens, as server.listen would say it; None for a Unix socket
    (reached through the file system, on this machine only)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    host, port = sock.getsockname()[:2]
    return ListenAddress(str(host).split("%", 1)[0], int(port))


def unguarded(server: ServerConfig, listeners: Sequence[Listener]) -> Problem | None:
    """The key rule (config/schema.py's `unguarded`) on the addresses served: a socket on an
    address beyond loopback that `server`'s key does not guard, said with where it came from."""
    for listener in listeners:
        addr = listen_address(listener.sock)
        if addr is None or server.unguarded([addr]) is None:
            continue
        came = (f"the socket {listener.how} passed" if listener.how != "bound" else
                "bound at start: server.listen changes when spillway restarts")
        return Problem("server.api_key", f"no key, and Spillway serves {listener.address} "
                                         f"({came}), not a loopback address: {KEY_NEEDED}")
    return None


def _hosts(host: str) -> set[str]:
    if host == "localhost":
        return {"127.0.0.1", "::1"}
    try:
        return {str(ipaddress.ip_address(host.split("%", 1)[0]))}
    except ValueError:
        return {host}


def matches(addr: ListenAddress, sock: socket.socket) -> bool:
    """Whether `sock` is bound where `addr` says (the same port, the same address)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    host, port = sock.getsockname()[:2]
    if port != addr.port:
        return False
    bound = str(ipaddress.ip_address(host.split("%", 1)[0]))
    return bound in _hosts(addr.host)


def bind(addr: ListenAddress) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr.host else socket.AF_INET
    try:
        return socket.create_server((addr.host, addr.port), family=family, backlog=BACKLOG)
    except (OSError, OverflowError) as e:
        raise ListenError(f"cannot listen on {addr}: {e}") from e


def open_all(addresses: Sequence[ListenAddress], passed: Sequence[socket.socket],
             source: str) -> list[Listener]:
    """A listener for every address: its passed socket, else one bound now; then the passed
    sockets no address asked for. ListenError (with the sockets bound here closed) when one
    cannot be bound."""
    left = list(passed)
    out: list[Listener] = []
    try:
        for addr in addresses:
            found = next((s for s in left if matches(addr, s)), None)
            if found is not None:
                left.remove(found)
                out.append(Listener(found, address_of(found), source))
            else:
                if passed:
                    log.info("%s passed no socket for %s: bound here", source, addr)
                out.append(Listener(bind(addr), str(addr), "bound"))
    except ListenError:
        for listener in out:
            if listener.how == "bound":
                listener.sock.close()
        raise
    for sock in left:
        log.warning("%s passed a socket on %s, which server.listen does not name: served "
                    "as passed (name it in server.listen, for the Host checks and the "
                    "commands that find Spillway by its config)", source, address_of(sock))
        out.append(Listener(sock, address_of(sock), source))
    return out
