"""The pieces of an upgrade in place (issue 40) on their own: the control socket (mode 0600, one
JSON line each way, its own user only), the handover's description in SPILLWAY_HANDOVER, the
state file's records, and a child's identity (issue 47): the kernel's, checked again right
before a signal."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import eventually

from supervisor.service import handover
from supervisor.upstreams import adopted
from supervisor.upstreams.owned import OWNER_ENV, ChildRecord, State, StateFile, state_id


@pytest.mark.asyncio
async def test_the_control_socket_answers_one_json_line_to_its_own_user(tmp_path: Path) -> None:
    asked: list[dict[str, Any]] = []

    async def handler(request: dict[str, Any]) -> dict[str, Any]:
        asked.append(request)
        return {"ok": True, "echo": request.get("op")}

    path = tmp_path / "run" / "abc.sock"
    control = handover.Control(path, handler)
    assert await control.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        answer = await asyncio.to_thread(handover.ask, path, {"op": "ping"}, 5)
        assert answer == {"ok": True, "echo": "ping"} and asked == [{"op": "ping"}]

        def raw(line: bytes) -> dict[str, Any]:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(path))
                s.sendall(line)
                return dict(json.loads(s.makefile("rb").readline()))

        bad = await asyncio.to_thread(raw, b"not json\n")
        assert bad["ok"] is False and "one JSON line" in bad["error"]
        assert len(asked) == 1  # the handler never saw it
    finally:
        await control.close()
    assert not path.exists()
    with pytest.raises(OSError):
        handover.ask(path, {"op": "ping"}, 1)


def test_the_handover_description_goes_through_the_environment_once() -> None:
    h = handover.Handover(123, ((5, "127.0.0.1:8080"), (6, "[::1]:8080")), 7, 30.0, 1.5)
    env = {handover.HANDOVER_ENV: h.to_env(), "OTHER": "x"}
    assert handover.Handover.from_env(env) == h
    assert env == {"OTHER": "x"}  # unset: nothing started later inherits it
    assert handover.Handover.from_env(env) is None
    assert handover.Handover.from_env({handover.HANDOVER_ENV: "{nonsense"}) is None


def test_the_state_file_is_private_and_keeps_each_record_whole(tmp_path: Path) -> None:
    config = tmp_path / "spillway.toml"
    config.write_text("")
    file = StateFile(str(config), folder=tmp_path / "run")
    assert file.id == state_id(str(tmp_path / "." / "spillway.toml"))  # the real path's
    record = ChildRecord(name="gpu", pid=os.getpid(), start_ticks=1, boot_id="b",
                         argv=("llama-server", "--port", "1"), port=1, api_key="k",
                         owner="id:gpu:n", media_marker="<m>", fingerprint="f", started=2.0,
                         daemon_pid=3)
    file.write(State(3, "<m>", (record,)))
    assert stat.S_IMODE(file.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(file.folder.stat().st_mode) == 0o700
    assert file.read() == State(3, "<m>", (record,))
    file.write(State(3, "<m>", ()))  # no child left: no file
    assert not file.path.exists() and file.read() is None
    file.path.write_text('{"version": 99, "children": []}')
    assert file.read() is None  # not understood: nothing acted on


@pytest.fixture
def wrapped_sleep(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], ChildRecord]]:
    """A process started as Spillway starts a child (its own session, an owner mark), through a
    wrapper script that execs another program with another command line (`sleep 300 1`, not
    the recorded `llama-server 300`), and its record as the daemon writes it."""
    wrapper = tmp_path / "llama-server"
    wrapper.write_text('#!/bin/sh\nexec sleep "$@" 1\n')
    wrapper.chmod(0o755)
    proc = subprocess.Popen([str(wrapper), "300"], start_new_session=True,
                            env={"PATH": os.environ["PATH"], OWNER_ENV: "abc:gpu:1"})
    try:
        ticks = adopted.start_ticks(proc.pid)
        assert ticks is not None
        assert eventually(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(
            b"sleep\0"), timeout=10)  # exec'd
        yield proc, ChildRecord(
            name="gpu", pid=proc.pid, start_ticks=ticks, boot_id=adopted.boot_id(),
            argv=(str(wrapper), "300"), port=1, api_key="k", owner="abc:gpu:1",
            media_marker="", fingerprint="", started=time.time(), daemon_pid=1)
    finally:
        proc.kill()
        proc.wait()


def test_identity_is_the_kernels_pid_start_time_boot_and_owner_mark_not_the_command_line(
        wrapped_sleep: tuple[subprocess.Popen[bytes], ChildRecord]) -> None:
    proc, record = wrapped_sleep
    assert adopted.identify(record).ours  # an exec'd wrapper is the same process
    for change, why in [({"start_ticks": record.start_ticks + 1}, "started at another time"),
                        ({"owner": "abc:gpu:2"}, "does not carry"),
                        ({"boot_id": "another"}, "before the machine restarted")]:
        found = adopted.identify(dataclasses.replace(record, **change))
        assert not found.ours and why in found.why, found
    proc.kill()
    proc.wait()
    found = adopted.identify(record)
    assert not found.ours and found.gone


@pytest.mark.asyncio
async def test_a_pid_whose_start_time_changed_is_not_signalled(
        wrapped_sleep: tuple[subprocess.Popen[bytes], ChildRecord]) -> None:
    """An end queued at an upgrade's start is carried out after the old daemon's drain: the
    identity is checked again then, and a process that is not the recorded one (here: the
    record's start time is not the process's, as when its pid went to another process) is
    not signalled."""
    proc, record = wrapped_sleep
    another = dataclasses.replace(record, start_ticks=record.start_ticks + 1)
    assert await adopted.end(another, 1.0, "no child takes it") is False
    assert proc.poll() is None  # not signalled
    with pytest.raises(adopted.NotTheRecorded, match="started at another time"):
        await adopted.take(another)  # nor adopted
    # The recorded one is ended: SIGTERM to its group, through the pidfd held.
    assert await adopted.end(record, 5.0, "no child takes it") is True
    assert proc.wait(5) == -signal.SIGTERM
