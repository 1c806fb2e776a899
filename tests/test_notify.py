"""systemd's notify socket when PID 1 does not read it (issue 10): a send never blocks the event
loop. WATCHDOG and STATUS are dropped when the socket's queue is full (logged once); READY,
RELOADING, STOPPING and EXTEND_TIMEOUT are retried from the loop for up to a second; a daemon
whose notify socket nobody reads still answers and stops on SIGTERM in under 2 s."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import Spillway, fake_config

from supervisor.service.systemd import Notifier


class Unread:
    """A notify socket bound where NOTIFY_SOCKET points, read only when the test says so."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setblocking(False)
        self.address = address

    def fill(self) -> int:
        """Fill its queue from another sender, as other services' messages would: the count."""
        n = 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
            other.setblocking(False)
            while True:
                try:
                    other.sendto(b"X_FILLER=1", self.address)
                except BlockingIOError:
                    return n
                n += 1
                assert n < 100_000

    def drain(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(65536).decode())
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Unread]:
    path = str(tmp_path / "notify.sock")
    u = Unread(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    yield u
    u.close()  # also frees a sender left blocked (before the fix)


def finishes(work: Callable[[], None], timeout: float = 5.0) -> None:
    """Run `work` in a thread: it must finish (a send blocked on the full queue never would)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still blocked after {timeout} s: a notify send blocked"
    if errors:
        raise errors[0]


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "spillway.systemd" and text in r.getMessage()]


def test_watchdog_and_status_on_a_full_queue_are_dropped_without_blocking_logged_once(
        unread: Unread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spillway.systemd")
    n = Notifier()
    assert unread.fill() > 0

    def many() -> None:
        for i in range(50):
            n.send("WATCHDOG=1")
            n.status(f"gpu READY; {i} waiting")

    began = time.monotonic()
    finishes(many)
    assert time.monotonic() - began < 2.0
    assert len(messages(caplog, "are dropped until it reads again")) == 1
    assert n.dropped == 100
    # systemd reads again: the next ones go through, and a dropped STATUS is sent again even
    # though it did not change.
    assert all(m == "X_FILLER=1" for m in unread.drain())
    finishes(lambda: n.status("gpu READY; 49 waiting"))
    finishes(lambda: n.send("WATCHDOG=1"))
    assert unread.drain() == ["STATUS=gpu READY; 49 waiting", "WATCHDOG=1"]
    assert len(messages(caplog, "reads its notify socket again")) == 1
    # An unchanged status that systemd has is not sent again.
    finishes(lambda: n.status("gpu READY; 49 waiting"))
    assert unread.drain() == []
    # A new episode is logged again, once.
    unread.fill()

    def pings() -> None:
        for _ in range(20):
            n.send("WATCHDOG=1")

    finishes(pings)
    assert len(messages(caplog, "are dropped until it reads again")) == 2


def test_important_messages_wait_in_order_for_a_reader_that_resumes_within_a_second(
        unread: Unread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spillway.systemd")
    n = Notifier()
    got: list[str] = []

    async def scenario() -> None:
        unread.fill()
        began = time.monotonic()
        n.reloading()
        n.ready("gpu LOADING")
        n.status("gpu READY")  # dropped, but it supersedes the STATUS that waits with READY
        n.send("WATCHDOG=1")  # dropped
        assert time.monotonic() - began < 0.2  # none of them waited for the reader
        await asyncio.sleep(0.4)  # PID 1 busy
        got.extend(unread.drain())
        await asyncio.sleep(0.6)  # within the second: both are sent from the loop
        got.extend(unread.drain())

    finishes(lambda: asyncio.run(scenario()))
    sent = [m for m in got if m != "X_FILLER=1"]
    assert len(sent) == 2, got
    assert sent[0].startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert sent[1] == "READY=1\nSTATUS=gpu READY"
    assert not messages(caplog, "did not read")


def test_an_important_message_is_given_up_after_a_second_and_nothing_waits_for_it(
        unread: Unread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spillway.systemd")
    n = Notifier()

    async def scenario() -> None:
        unread.fill()
        n.stopping()
        await asyncio.sleep(1.4)

    finishes(lambda: asyncio.run(scenario()))
    assert messages(caplog, "did not read STOPPING=1 within 1 s")
    assert all(m == "X_FILLER=1" for m in unread.drain())

    # A loop that ends with a retry pending (shutdown) does not wait for it.
    async def shutdown() -> None:
        unread.fill()
        n.stopping()

    began = time.monotonic()
    finishes(lambda: asyncio.run(shutdown()))
    assert time.monotonic() - began < 0.8  # not the second the retry had left


def test_with_no_loop_running_an_important_message_goes_out_with_the_next_send(
        unread: Unread) -> None:
    n = Notifier()
    unread.fill()
    finishes(lambda: n.ready())  # no running loop here
    unread.drain()
    finishes(lambda: n.send("WATCHDOG=1"))
    assert unread.drain() == ["READY=1", "WATCHDOG=1"]


def test_an_abstract_notify_address(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"spillway-test-{os.getpid()}-{uuid.uuid4().hex}"
    u = Unread("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        n = Notifier()
        n.ready("up")
        assert u.drain() == ["READY=1\nSTATUS=up"]
    finally:
        u.close()


def test_a_daemon_whose_notify_socket_nobody_reads_answers_and_stops_on_sigterm_in_2_s(
        tmp_path: Path, fake_server: Path, tiny_model: Path) -> None:
    path = tmp_path / "notify.sock"
    unread = Unread(str(path))
    unread.fill()  # full before the daemon's first message, and never read
    s = Spillway(tmp_path / "spillway", fake_config(fake_server, tiny_model),
                 env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "100000"})  # a ping / 50 ms
    try:
        s.start(wait_ready=True, timeout=20)  # a blocked loop would never answer
        for _ in range(5):
            code, body = s.post("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 4}, timeout=5)
            assert code == 200, body
            assert s.get("/spillway/health", timeout=5)[0] == 200
            time.sleep(0.2)
        log = s.log_text()
        assert log.count("are dropped until it reads again") == 1, log
        assert s.proc is not None
        began = time.monotonic()
        s.signal(signal.SIGTERM)
        code = s.proc.wait(10)
        took = time.monotonic() - began
        assert code == 0, s.log_tail()
        assert took < 2.0, f"SIGTERM took {took:.1f} s\n{s.log_tail()}"
        assert all(m == "X_FILLER=1" for m in unread.drain())
    finally:
        s.stop()
        unread.close()
