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
from harness import (PATIENCE_S, Spillway, deep_merge, eventually, fake_config, free_port,
                     toml_dumps, wait_gone)

from supervisor.config import schema as config
from supervisor.config.schema import ListenAddress
from supervisor.service import listen_fds

KEY = "socket-activation-test-key"

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


@pytest.mark.parametrize(("host", "family", "key", "refused"), [
    ("0.0.0.0", socket.AF_INET, None, True),
    ("::", socket.AF_INET6, None, True),
    ("127.0.0.1", socket.AF_INET, None, False),
    ("::1", socket.AF_INET6, None, False),
    ("0.0.0.0", socket.AF_INET, KEY, False),
])
def test_the_key_rule_holds_for_each_socket_served(
        sockets: list[socket.socket], host: str, family: socket.AddressFamily, key: str | None,
        refused: bool) -> None:
    sock = socket.create_server((host, 0), family=family)
    sockets.append(sock)
    server = config.build({"server": {"listen": "127.0.0.1:8080"} | (
        {"api_key": key} if key else {})}, check_paths=False).server
    for how in ("systemd", "the old daemon"):  # socket activation; an upgrade's handover
        problem = listen_fds.unguarded(server, [listen_fds.Listener(
            sock, listen_fds.address_of(sock), how)])
        assert (problem is not None) is refused
        if problem is not None:
            assert problem.path == "server.api_key"
            assert f"serves {listen_fds.address_of(sock)} (the socket {how} passed)" in \
                problem.message


def test_a_unix_socket_needs_no_key(tmp_path: Path, sockets: list[socket.socket]) -> None:
    """Reached through the file system, on this machine only: like loopback."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sockets.append(sock)
    sock.bind(str(tmp_path / "s.sock"))
    sock.listen()
    server = config.build({}, check_paths=False).server
    assert listen_fds.unguarded(server, [listen_fds.Listener(sock, "s.sock", "systemd")]) is None


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


def test_a_passed_socket_beyond_loopback_is_not_served_without_a_key(
        tmp_path: Path, fake_server: Path, tiny_model: Path) -> None:
    """The key rule holds for every socket served: systemd's socket on 0.0.0.0, with a config
    that has no key (it listens on loopback, which needs none), is refused at start, as a
    server.listen of 0.0.0.0 without a key is. It was served keyless: a LAN client that said
    `Host: localhost` got a chat completion."""
    state = tmp_path / "child-saw.jsonl"
    s = Spillway(tmp_path / "spillway", fake_config(
        fake_server, tiny_model, gpu={"env": {"FAKE_STATE_FILE": str(state)}},
        cpu={"env": {"FAKE_STATE_FILE": str(state)}}))
    held = socket.create_server(("0.0.0.0", 0), backlog=64)
    port = held.getsockname()[1]
    try:
        start_activated(s, held)
        assert s.proc is not None
        try:
            code = s.proc.wait(PATIENCE_S)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 1, s.log_tail()
        assert (f"not started: server.api_key: no key, and Spillway serves 0.0.0.0:{port} "
                "(the socket systemd passed), not a loopback address: set server.api_key"
                in s.log_text()), s.log_tail()
        assert not state.exists()  # refused before any child started
    finally:
        s.stop()
        held.close()


def test_a_reload_that_drops_the_key_while_a_lan_address_is_served_is_refused(
        tmp_path: Path, fake_server: Path, tiny_model: Path) -> None:
    """With the key, systemd's 0.0.0.0 socket is served. A new file that listens on loopback
    (server.listen changes only at a restart) and has no key would leave 0.0.0.0 open: the
    reload is refused, the running config (and its key) kept."""
    held = socket.create_server(("0.0.0.0", 0), backlog=64)
    port = held.getsockname()[1]
    cfg = fake_config(fake_server, tiny_model, server={"listen": f"0.0.0.0:{port}", "api_key": KEY})
    s = Spillway(tmp_path / "spillway", cfg)
    s.port = port
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        start_activated(s, held)
        s.wait_ready(headers=auth)
        assert f"listening on 0.0.0.0:{port}: the socket systemd passed" in s.log_text()
        assert s.get("/v1/models")[0] == 401
        keyless = deep_merge(cfg, {})
        keyless["server"] = {"listen": f"127.0.0.1:{port}"}
        s.config_path.write_text(toml_dumps(keyless))
        s.signal(signal.SIGHUP)
        status = eventually(lambda: (st := s.status(auth))["config"]["error"] and st)
        assert status, s.log_tail()
        assert (f"server.api_key: no key, and Spillway serves 0.0.0.0:{port} (the socket "
                "systemd passed), not a loopback address") in status["config"]["error"]
        assert "reload refused, keeping the running config: server.api_key" in s.log_text()
        assert s.get("/v1/models")[0] == 401  # the key still guards it
        assert s.get("/v1/models", auth)[0] == 200
    finally:
        s.stop()
        held.close()


def test_an_upgrade_to_a_config_without_a_key_leaves_the_old_daemon_serving(
        tmp_path: Path, fake_server: Path, tiny_model: Path) -> None:
    """At an upgrade the new daemon is handed every socket the old one serves, systemd's on
    0.0.0.0 among them: a file that no longer has a key is refused by the new daemon, which
    tells the old one why (`spillway upgrade` says it); the old one serves on, with its key."""
    held = socket.create_server(("0.0.0.0", 0), backlog=64)  # systemd's, in the test
    lan = held.getsockname()[1]
    cfg = fake_config(fake_server, tiny_model, server={"api_key": KEY})
    s = Spillway(tmp_path / "spillway", cfg)  # and its own 127.0.0.1 address, bound
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        start_activated(s, held)
        s.wait_ready(headers=auth)
        keyless = deep_merge(cfg, {})
        del keyless["server"]["api_key"]
        s.config_path.write_text(toml_dumps(keyless))
        assert eventually(lambda: s.status(auth)["config"]["error"])  # its reload refused
        upgraded = subprocess.run(
            [sys.executable, "-m", "supervisor", "upgrade", "--config", str(s.config_path)],
            env=s.env, capture_output=True, text=True, timeout=PATIENCE_S)
        assert upgraded.returncode == 1, upgraded.stderr
        assert (f"did not take over: 'server.api_key: no key, and Spillway serves "
                f"0.0.0.0:{lan} (the socket the old daemon passed), not a loopback address"
                in upgraded.stderr), upgraded.stderr
        assert s.proc is not None and s.proc.poll() is None  # the old one serves on
        assert s.status(auth)["daemon"]["pid"] == s.proc.pid
        assert s.get("/v1/models")[0] == 401 and s.get("/v1/models", auth)[0] == 200
    finally:
        s.stop()
        held.close()
