"""The children outlive Spillway (issue 40): a SIGKILL of the daemon leaves them running,
recorded in its state file, and the next start adopts them (the same pids, served at once, no
model load); a child whose command changed meanwhile is restarted with it, as a reload would;
one the config has no place for is ended; a process that is not Spillway's child is never
signalled, whatever the state file says."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from harness import Spillway, eventually, pid_alive, real_config, wait_gone

from conftest import SpillwayFactory
from supervisor.upstreams import adopted
from supervisor.upstreams.owned import StateFile

pytestmark = pytest.mark.integration

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def state_file(s: Spillway) -> StateFile:
    return StateFile(str(s.config_path), folder=s.folder / "state" / "run")


def pids(s: Spillway) -> dict[str, int]:
    return {name: s.child(name)["pid"] for name in ("gpu", "cpu")}


def kill_daemon(s: Spillway) -> None:
    assert s.proc is not None
    s.proc.kill()  # SIGKILL: no shutdown of its own
    s.proc.wait(10)
    s._log.close()


def test_a_sigkilled_spillways_children_are_adopted_by_the_next_start(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    before = pids(s)
    path = state_file(s).path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the children's keys
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    recorded = {c["name"]: c for c in json.loads(path.read_text())["children"]}
    assert {n: c["pid"] for n, c in recorded.items()} == before
    assert s.post("/v1/chat/completions", HI)[0] == 200
    old_daemon = s.proc.pid if s.proc else 0

    kill_daemon(s)
    time.sleep(0.5)  # the children go on without it (no PR_SET_PDEATHSIG any more)
    assert all(pid_alive(p) for p in before.values())

    s.start(wait_ready=True)
    status = s.status()
    assert pids(s) == before  # adopted: the same processes, their models still loaded
    assert status["daemon"]["adopted"] == before
    assert status["daemon"]["adopted_from_pid"] == old_daemon
    assert status["daemon"]["pid"] == s.proc.pid if s.proc else False
    for name in ("gpu", "cpu"):
        child = status["children"][name]
        assert child["adopted"]["from_daemon_pid"] == old_daemon
        assert child["last_start_s"] < 5  # READY at its first /health: no model load
        assert child["restarts"] == 0
    code, body = s.post("/v1/chat/completions", HI)
    assert code == 200, body
    log = s.log_text()
    assert f"adopting pid {before['gpu']}" in log and f"adopting pid {before['cpu']}" in log
    records = [r for r in s.incidents() if r["decision"] == "adopted"]
    assert {r["child"] for r in records} == {"gpu", "cpu"}
    assert all(f"spillway pid {old_daemon} ended without stopping its children" in r["reason"]
               for r in records)
    # An adopted child's output is read again: its `launch_slot_` line for that request was
    # read by the new daemon (from the pipe, opened again through /proc).
    assert eventually(lambda: s.tasks_started() >= 1, timeout=30)

    # A stop stops adopted children as any other, and the state file goes with them.
    assert s.stop() == 0
    assert wait_gone(set(before.values())) == set()
    assert not path.exists()


def _fake_record(proc: subprocess.Popen[bytes], like: dict[str, Any]) -> dict[str, Any]:
    """A record naming a process that is not Spillway's (its start time is right: only the
    missing owner mark tells)."""
    ticks = adopted.start_ticks(proc.pid)
    assert ticks is not None
    return {**like, "name": "small", "pid": proc.pid, "start_ticks": ticks,
            "argv": ["sleep", "300"]}


def test_a_changed_command_is_restarted_an_unplaced_child_ended_and_a_stranger_untouched(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    before = pids(s)
    path = state_file(s).path
    kill_daemon(s)

    # While no Spillway runs: the GPU child's command changes in the config; the state file is
    # made to say that the CPU child's process is the small child's (which this config has
    # not: it is ended), and to name a process that is not Spillway's at all.
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        doc = json.loads(path.read_text())
        cpu = next(c for c in doc["children"] if c["name"] == "cpu")
        cpu["name"] = "small"
        doc["children"].append(_fake_record(stranger, cpu))
        path.write_text(json.dumps(doc))
        s.config_path.write_text(s.config_path.read_text().replace(
            '[gpu]\n', '[gpu]\nenv = {"SPILLWAY_TEST_CHANGED" = "1"}\n'))

        s.start(wait_ready=True)
        status = s.status()
        daemon = status["daemon"]
        assert daemon["adopted"] == {"gpu": before["gpu"]}
        assert daemon["adopted_changed_command"] == ["gpu"]
        assert [(e["child"], e["pid"]) for e in daemon["ended"]] == [("small", before["cpu"])]
        assert [(e["child"], e["pid"]) for e in daemon["left_alone"]] == [
            ("small", stranger.pid)]
        assert wait_gone({before["cpu"]}) == set()  # ended (SIGTERM), before the CPU child
        # The GPU child takes its new command as a reload would: drained and restarted.
        assert eventually(lambda: s.child("gpu")["pid"] not in (None, before["gpu"]) and
                          s.child("gpu")["state"] == "READY")
        assert wait_gone({before["gpu"]}) == set()
        assert s.post("/v1/chat/completions", HI)[0] == 200
        # The stranger was never signalled.
        assert stranger.poll() is None and pid_alive(stranger.pid)
        assert "which is not this Spillway's child" in s.log_text()
        ended = [r for r in s.incidents() if r["decision"] == "ended"]
        assert [r["child"] for r in ended] == ["small"]
    finally:
        stranger.send_signal(signal.SIGKILL)
        stranger.wait()
