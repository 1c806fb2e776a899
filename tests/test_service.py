"""Spillway as a system service: the unit file (real systemd-analyze), the notify protocol
(a datagram socket the test binds as NOTIFY_SOCKET), journald-friendly logs, shutdown."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from harness import REPO, eventually, eventually_async, fake_config, wait_gone

from conftest import SpillwayFactory

UNIT = REPO / "systemd" / "spillway.service"
SOCKET = REPO / "systemd" / "spillway.socket"


def test_the_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is part of the test setup (Debian's systemd)"
    spillway = shutil.which("spillway") or str(Path(sys.executable).parent / "spillway")
    assert os.access(spillway, os.X_OK), "the spillway command must be installed"
    copy = tmp_path / "spillway.service"
    copy.write_text(UNIT.read_text().replace("/usr/local/bin/spillway", spillway))
    socket_unit = tmp_path / "spillway.socket"
    socket_unit.write_text(SOCKET.read_text())
    # The two together: the service Requires= the socket, found beside it.
    result = subprocess.run([analyze, "verify", str(socket_unit), str(copy)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stderr
    # verify can fail: a typo in a key is reported, in either file.
    broken = tmp_path / "broken" / "spillway.service"
    broken.parent.mkdir()
    broken.write_text(copy.read_text().replace("NotifyAccess=all", "NotifyAcess=all"))
    (broken.parent / "spillway.socket").write_text(
        SOCKET.read_text().replace("ListenStream=", "ListenStrem="))
    bad = subprocess.run([analyze, "verify", str(broken.parent / "spillway.socket"),
                          str(broken)], capture_output=True, text=True, cwd=broken.parent)
    assert "Unknown key 'NotifyAcess'" in bad.stderr, bad.stderr
    assert "Unknown key 'ListenStrem'" in bad.stderr, bad.stderr


def test_the_unit_has_what_a_managed_gpu_service_needs() -> None:
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            keys.setdefault(k.strip(), []).append(v.strip())
    # `all`: the new daemon of an upgrade tells systemd MAINPID; `process`: the children
    # outlive a crash of Spillway, to be adopted (or ended) by the next start.
    assert keys["Type"] == ["notify"] and keys["NotifyAccess"] == ["all"]
    assert keys["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert keys["Restart"] == ["on-failure"] and keys["KillMode"] == ["process"]
    assert keys["Requires"] == ["spillway.socket"] and "spillway.socket" in keys["After"][0]
    assert int(keys["WatchdogSec"][0]) > 0
    assert int(keys["TimeoutStopSec"][0]) > 30 + 10  # the drain plus a child's grace
    assert keys["User"] == ["spillway"] and keys["StateDirectory"] == ["spillway"]
    assert keys["ProtectSystem"] == ["strict"] and keys["PrivateTmp"] == ["yes"]
    assert keys["NoNewPrivileges"] == ["yes"] and keys["DevicePolicy"] == ["closed"]
    allowed = " ".join(keys["DeviceAllow"])
    for node in ("char-nvidiactl", "char-nvidia-frontend", "char-nvidia-uvm",
                 "char-nvidia-caps"):
        assert node in allowed


def test_the_socket_unit_listens_where_the_example_config_does() -> None:
    keys: dict[str, list[str]] = {}
    for line in SOCKET.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            keys.setdefault(k.strip(), []).append(v.strip())
    example = (REPO / "examples" / "spillway.toml").read_text()
    assert keys["ListenStream"] == ["127.0.0.1:8080"]
    assert 'listen = "127.0.0.1:8080"' in example
    assert keys["Service"] == ["spillway.service"] and keys["FileDescriptorName"]


class NotifySocket:
    """What systemd would receive: a datagram socket bound where NOTIFY_SOCKET points."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def fields(self, name: str) -> list[tuple[float, str]]:
        out = []
        for t, message in list(self.messages):
            for line in message.splitlines():
                if line.startswith(name + "="):
                    out.append((t, line.split("=", 1)[1]))
        return out

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    n = NotifySocket(tmp_path / "notify.sock")
    yield n
    n.close()


def notify_env(n: NotifySocket, watchdog_usec: int = 1_000_000) -> dict[str, str]:
    return {"NOTIFY_SOCKET": str(n.path), "WATCHDOG_USEC": str(watchdog_usec)}


def test_ready_status_and_stopping_reach_systemd(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        notify: NotifySocket) -> None:
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_SLOW_START_S": "1"}},
                      cpu={"env": {"FAKE_SLOW_START_S": "1"}})
    s = spillway(cfg, env=notify_env(notify))
    ready = eventually(lambda: notify.fields("READY"))
    assert ready and ready[0][1] == "1"
    # Before READY, while the children loaded, Spillway asked for more time.
    extend = notify.fields("EXTEND_TIMEOUT_USEC")
    assert extend and extend[0][0] <= ready[0][0] and int(extend[0][1]) > 0
    # READY=1 goes as soon as one child serves; the status follows the other one's start (it
    # may come a moment after READY=1: the CPU child can be up first).
    def statuses() -> list[str]:
        return [text for _, text in notify.fields("STATUS")]

    assert eventually(lambda: any(t.startswith("gpu READY, cpu READY; 0 waiting")
                                  for t in statuses())), statuses()
    assert all("\n" not in t for t in statuses())
    s.stop()
    assert notify.fields("STOPPING") == [(notify.fields("STOPPING")[0][0], "1")]


def test_watchdog_pings_come_from_the_event_loop_at_half_the_interval(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        notify: NotifySocket) -> None:
    s = spillway(fake_config(fake_server, tiny_model), env=notify_env(notify, 1_000_000))
    assert eventually(lambda: len(notify.fields("WATCHDOG")) >= 4)
    pings = [t for t, _ in notify.fields("WATCHDOG")]
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert max(gaps) < 0.8  # every 0.5 s: within the 1 s systemd allows
    # A process that stops running (here: stopped outright, for 1.5 s) misses its pings.
    assert s.proc is not None
    s.proc.send_signal(signal.SIGSTOP)
    time.sleep(1.5)  # the stall itself, not a wait for something
    resumed = time.monotonic()
    s.proc.send_signal(signal.SIGCONT)
    assert eventually(lambda: any(t > resumed for t, _ in notify.fields("WATCHDOG")))
    pings = [t for t, _ in notify.fields("WATCHDOG")]
    assert max(b - a for a, b in zip(pings, pings[1:])) > 1.0


def test_a_reload_is_announced_with_a_monotonic_time_then_ready_again(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        notify: NotifySocket) -> None:
    s = spillway(fake_config(fake_server, tiny_model), env=notify_env(notify))
    eventually(lambda: notify.fields("READY"))
    before = time.clock_gettime(time.CLOCK_MONOTONIC)
    s.config_path.write_text(s.config_path.read_text().replace('log_level = "info"', "") +
                             '\n[queue]\nmax_waiting = 7\n')
    s.signal(signal.SIGHUP)
    assert eventually(lambda: notify.fields("RELOADING"))
    (t_reloading, _), = notify.fields("RELOADING")[:1]
    usec = int(notify.fields("MONOTONIC_USEC")[0][1])
    assert before * 1e6 <= usec <= time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6
    assert eventually(lambda: [t for t, _ in notify.fields("READY") if t >= t_reloading])
    assert s.status()["queue"]["max_waiting"] == 7


def test_logs_carry_journald_priorities_when_stderr_is_the_journal(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model), start=False)
    log = s.log_path
    log.touch()
    st = os.stat(log)
    s.env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    s.start()
    s.get("/props")

    def wanted() -> list[str] | None:
        lines = s.log_text().splitlines()
        found = (any(line.startswith("<6>spillway.proxy: rid=") for line in lines)
                 and any(line.startswith("<6>spillway.child: [gpu] fake llama-server")
                         for line in lines)
                 and any(line.startswith("<4>") for line in lines))  # "no GPU device"
        return lines if found else None

    lines = eventually(wanted)
    assert lines, s.log_text()
    assert all(line[:3] in ("<3>", "<4>", "<6>", "<7>", "<2>") for line in lines)


@pytest.mark.asyncio
async def test_sigterm_lets_in_flight_requests_finish_then_stops_the_children(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_TOKEN_DELAY_S": "0.25"}})
    s = spillway(cfg)
    pids = {s.child(n)["pid"] for n in ("gpu", "cpu")}
    async with aiohttp.ClientSession() as http:
        async def long_request() -> tuple[int, bytes]:
            async with http.post(f"{s.url}/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 8, "stream": True}) as r:
                return r.status, await r.read()

        running = asyncio.create_task(long_request())
        assert await eventually_async(lambda: s.child("gpu")["busy"] == 1)  # in flight
        s.signal(signal.SIGTERM)
        status, body = await running
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    assert s.proc is not None and s.proc.wait(30) == 0
    assert wait_gone(pids, 5) == set()
    log = s.log_text()
    assert "waiting for 1 in-flight request(s)" in log


@pytest.mark.asyncio
async def test_a_second_sigterm_cuts_the_drain_short(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_TOKEN_DELAY_S": "2"}},
                      server={"drain_timeout_s": 60})
    s = spillway(cfg)
    async with aiohttp.ClientSession() as http:
        running = asyncio.create_task(http.post(
            f"{s.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}))
        assert await eventually_async(lambda: s.child("gpu")["busy"] == 1)  # in flight
        began = time.monotonic()
        s.signal(signal.SIGTERM)
        # The drain begun (the first SIGTERM taken), then the second.
        assert await eventually_async(lambda: "in-flight request(s)" in s.log_text())
        s.signal(signal.SIGTERM)
        assert s.proc is not None
        code = await asyncio.to_thread(s.proc.wait, 30)
        running.cancel()
    assert code == 0
    assert time.monotonic() - began < 10  # not the 16 s the request needed, nor the 60 s drain
    assert "SIGTERM again: stopping now" in s.log_text()

