"""Socket activation (issue 40): a listening socket passed in (systemd's LISTEN_FDS/LISTEN_PID,
fd 3 on) is served as it is, matched to server.listen by its address; an address with none is
bound; and a connection made while the daemon restarts waits in the socket's backlog and is
answered by the next daemon, never refused."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Spillway, fake_config, free_port, wait_gone

from supervisor.config.schema import ListenAddress
from supervisor.service import listen_fds


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def test_each_listen_address_takes_the_socket_passed_for_it_and_the_rest_is_bound(
        sockets: list[socket.socket]) -> None:
    passed = socket.create_server(("127.0.0.1", 0))
    extra = socket.create_server(("127.0.0.1", 0))
    port, unbound = passed.getsockname()[1], free_port()
    listeners = listen_fds.open_all(
        [ListenAddress("127.0.0.1", port), ListenAddress("127.0.0.1", unbound)],
        [extra, passed], "systemd")
    sockets.extend(listener.sock for listener in listeners)
    assert [(listener.address, listener.how) for listener in listeners] == [
        (f"127.0.0.1:{port}", "systemd"), (f"127.0.0.1:{unbound}", "bound"),
        (f"127.0.0.1:{extra.getsockname()[1]}", "systemd")]  # passed, not named: still served
    assert listeners[0].sock is passed and listeners[2].sock is extra
    # localhost matches a loopback socket; another port or address does not.
    assert listen_fds.matches(ListenAddress("localhost", port), passed)
    assert not listen_fds.matches(ListenAddress("127.0.0.2", port), passed)
    assert not listen_fds.matches(ListenAddress("127.0.0.1", unbound), passed)


def test_systemds_variables_for_another_process_are_ignored_and_always_unset() -> None:
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x",
           "OTHER": "kept"}
    assert listen_fds.from_systemd(env) == []
    assert env == {"OTHER": "kept"}


def test_a_passed_fd_that_is_not_a_listening_socket_is_left_alone() -> None:
    r, w = os.pipe()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        assert listen_fds.from_fds([r, udp.fileno()], "systemd") == []
        os.write(w, b"x")  # both still open: nothing closed them
        assert os.read(r, 1) == b"x" and udp.fileno() >= 0
    finally:
        os.close(r)
        os.close(w)
        udp.close()


# What systemd does between fork and exec: the socket to fd 3, LISTEN_FDS=1, and LISTEN_PID the
# process's own pid (exec keeps it).
_ACTIVATE = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="spillway")
os.execv(sys.executable, [sys.executable, "-m", "supervisor", "run", "--config", sys.argv[2]])
"""


def start_activated(s: Spillway, sock: socket.socket) -> None:
    """`spillway run` as systemd starts it for spillway.socket."""
    fd = sock.fileno()
    s._log = open(s.log_path, "ab")
    s.proc = subprocess.Popen([sys.executable, "-c", _ACTIVATE, str(fd), str(s.config_path)],
                              cwd=s.folder, env=s.env, stdout=s._log, stderr=subprocess.STDOUT,
                              pass_fds=(fd,))


def test_a_connection_made_while_the_daemon_restarts_waits_and_is_answered(
        tmp_path: Path, fake_server: Path, tiny_model: Path) -> None:
    s = Spillway(tmp_path / "spillway", fake_config(fake_server, tiny_model))
    held = socket.create_server(("127.0.0.1", s.port), backlog=64)  # systemd's, in the test
    try:
        start_activated(s, held)
        s.wait_ready()
        assert f"listening on 127.0.0.1:{s.port}: the socket systemd passed" in s.log_text()
        first = {s.child(n)["pid"] for n in ("gpu", "cpu")}
        # `systemctl restart`: the daemon stops (its children with it)...
        s.signal(signal.SIGTERM)
        assert s.proc is not None and s.proc.wait(30) == 0
        s._log.close()
        assert wait_gone(first) == set()
        # ... and while none runs, a client connects and sends its request: it is not
        # refused, it waits in the backlog.
        answer: dict[str, object] = {}

        def client() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
            conn.request("POST", "/v1/chat/completions", json.dumps(
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
                {"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer.update(status=resp.status, body=resp.read())
            conn.close()

        waiting = threading.Thread(target=client, daemon=True)
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not answer  # connected, waiting: no daemon yet
        # The next daemon takes the same socket and answers it.
        start_activated(s, held)
        waiting.join(120)
        assert answer.get("status") == 200, (answer, s.log_tail())
        s.wait_ready()
        assert {s.child(n)["pid"] for n in ("gpu", "cpu")}.isdisjoint(first)
    finally:
        s.stop()
        held.close()
