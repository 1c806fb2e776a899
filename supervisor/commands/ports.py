"""Is a listening address free, and if not, who holds it and what is free nearby.

The quickstart asks before it builds anything: finding port 8080 taken after a five-minute
build, with only aiohttp's "address already in use" to go on, is a poor first run. The holder is
named from the kernel's socket table (psutil; as root every process's, else one's own), and the
answer offers the next free port on the same host.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class PortTaken:
    host: str
    port: int
    holder: str  # "python3 (pid 4242: python3 -m http.server 8080)", or why it is unknown
    next_free: int | None  # the next port on the same host that binds, if one does soon


def can_bind(host: str, port: int) -> OSError | None:
    """None when `host:port` could be listened on now (as aiohttp listens: SO_REUSEADDR);
    else the error a bind gives."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            return e
    return None


def holder(port: int) -> str:
    """Which process listens on `port` (any address), in words."""
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid is None:
                break
            try:
                proc = psutil.Process(c.pid)
                cmdline = " ".join(proc.cmdline())[:120]
                return f"{proc.name()} (pid {c.pid}: {cmdline})"
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return f"pid {c.pid}"
    return (f"another program (which one is hidden from this user: `sudo ss -ltnp "
            f"'sport = :{port}'` names it)")


def next_free(host: str, port: int, tries: int = 100) -> int | None:
    for candidate in range(port + 1, min(port + 1 + tries, 65536)):
        if can_bind(host, candidate) is None:
            return candidate
    return None


def check(host: str, port: int) -> PortTaken | None:
    """None when the address is free; who holds it and the next free port when it is in use.
    Other bind errors (a host that is not this machine's, a port below 1024) raise."""
    err = can_bind(host, port)
    if err is None:
        return None
    if err.errno != errno.EADDRINUSE:
        raise err
    return PortTaken(host, port, holder(port), next_free(host, port))
