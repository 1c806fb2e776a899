"""A reload that changes several children's command takes them one at a time (policy/rollout.py,
service/rollout.py): the second only once the first is READY on its new command, one child
READY at every moment, every request answered; a new command that fails its first start is
rolled back, the rollout stops there, and the status and `spillway status` say which argument
and what llama-server said; a command that cannot start at boot ends `spillway run` with
llama-server's own words."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import (
    PATIENCE_S, REPO, eventually, fake_config, real_config,
)
from test_reload import edit, reload_under_traffic

from conftest import SpillwayFactory
from supervisor.policy.rollout import Outcome, goes_on, order, settled
from supervisor.policy.lifecycle import ChildState

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


# --- the rule, pure ---------------------------------------------------------------------------


def test_the_fallbacks_take_their_new_command_first() -> None:
    assert order(["gpu", "cpu"], {"gpu", "cpu"}) == ["cpu", "gpu"]
    assert order(["gpu", "small", "cpu"], {"gpu", "cpu", "small"}) == ["cpu", "small", "gpu"]
    assert order(["gpu", "cpu"], {"gpu"}) == ["gpu"]


@pytest.mark.parametrize(("state", "flags", "outcome"), [
    (ChildState.DRAINING, {}, None),
    (ChildState.STARTING, {"runs_it": True}, None),
    (ChildState.READY, {}, None),  # still its old process
    (ChildState.READY, {"runs_it": True}, Outcome.READY),
    (ChildState.STARTING, {"rejected": True}, Outcome.ROLLED_BACK),
    (ChildState.READY, {"runs_it": True, "asked": False}, Outcome.SUPERSEDED),
    (ChildState.STOPPED, {}, Outcome.STOPPED),
    (ChildState.FATAL, {"runs_it": True}, Outcome.FAILED),
    (ChildState.BACKOFF, {"runs_it": True}, None),
])
def test_when_a_child_is_settled_on_its_new_command(
        state: ChildState, flags: dict[str, bool], outcome: Outcome | None) -> None:
    args = {"rejected": False, "runs_it": False, "asked": True, **flags}
    assert settled(state, **args) is outcome


def test_the_rollout_goes_on_only_after_a_child_took_its_command() -> None:
    assert [o for o in Outcome if goes_on(o)] == [Outcome.READY, Outcome.STOPPED]


# --- under traffic ----------------------------------------------------------------------------


def moments_with_none_ready(events: list[dict[str, Any]], since: float) -> list[dict[str, Any]]:
    """Replays the timeline from `since` (both children READY then): each event after which
    neither the GPU nor the CPU child was READY."""
    states = {"gpu": "READY", "cpu": "READY"}
    bad = []
    for e in sorted(events, key=lambda e: e["time"]):
        if e["time"] < since or e["child"] not in states or "model" in e:
            continue
        states[e["child"]] = e["state"]
        if "READY" not in states.values():
            bad.append(e)
    return bad


@pytest.mark.asyncio
async def test_a_reload_of_both_commands_restarts_one_child_at_a_time(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    # Loads that take 2 s, and a line that waits 1 s at most: restarting both children at
    # once answered 503 "Loading model" for as long as both loaded.
    s = spillway(fake_config(fake_server, tiny_model, queue={"max_wait_s": 1.0}))
    pids = {n: s.child(n)["pid"] for n in ("gpu", "cpu")}
    slow = {"FAKE_SLOW_START_S": "2"}

    def rolled() -> bool:
        rollout = s.status()["config"]["rollout"]
        return bool(rollout) and rollout["outcomes"] == {"cpu": "ready", "gpu": "ready"}

    await reload_under_traffic(
        s, {"model": {"args": ["-b", "512"]}, "gpu": {"env": slow}, "cpu": {"env": slow}},
        rolled)
    timeline = s.get("/spillway/timeline")[1]["events"]
    since = min(e["time"] for e in timeline if e["state"] == "DRAINING")
    assert moments_with_none_ready(timeline, since) == []
    # The CPU child first; the GPU child drained only once the CPU child was READY again.
    cpu_ready = [e["time"] for e in timeline if e["child"] == "cpu" and e["state"] == "READY"
                 and e["time"] >= since]
    gpu_drain = [e["time"] for e in timeline if e["child"] == "gpu" and e["state"] == "DRAINING"]
    assert cpu_ready and gpu_drain and cpu_ready[0] <= gpu_drain[0]
    for name in ("gpu", "cpu"):
        child = s.child(name)
        assert child["pid"] != pids[name] and "-b" in child["command"]
    assert s.status()["config"]["rollout"]["order"] == ["cpu", "gpu"]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_reload_of_the_binary_under_steady_traffic_answers_every_request(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    # The same binary behind a wrapper that takes 2 s to start it: both children's command
    # changes (model.llama_server), and each new process loads slowly, as a large model does.
    wrapper = tmp_path / "slow-llama-server"
    wrapper.write_text(f"#!/bin/sh\nsleep 2\nexec {llama_server} \"$@\"\n")
    wrapper.chmod(0o755)
    s = spillway(real_config(llama_server, tiny_model, queue={"max_wait_s": 1.0}))
    pids = {n: s.child(n)["pid"] for n in ("gpu", "cpu")}

    def rolled() -> bool:
        rollout = s.status()["config"]["rollout"]
        return bool(rollout) and rollout["outcomes"] == {"cpu": "ready", "gpu": "ready"}

    await reload_under_traffic(s, {"model": {"llama_server": str(wrapper)}}, rolled)
    timeline = s.get("/spillway/timeline")[1]["events"]
    since = min(e["time"] for e in timeline if e["state"] == "DRAINING")
    assert moments_with_none_ready(timeline, since) == []
    for name in ("gpu", "cpu"):
        child = s.child(name)
        assert child["pid"] != pids[name] and child["command"][0] == str(wrapper)


# --- a new command that cannot start ----------------------------------------------------------


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_new_command_that_fails_its_first_start_is_rolled_back(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    gpu_pid = s.child("gpu")["pid"]
    bad = "/nonexistent/template.jinja"  # passes check-config; llama-server refuses it
    args = [*s.config["model"]["args"], "--chat-template-file", bad]

    def stopped() -> bool:
        rollout = s.status()["config"]["rollout"]
        return bool(rollout) and not rollout["running"] and "cpu" in rollout["outcomes"]

    await reload_under_traffic(s, {"model": {"args": args}}, stopped)
    rollout = s.status()["config"]["rollout"]
    assert rollout["outcomes"] == {"cpu": "rolled back"} and rollout["kept"] == ["gpu"]
    cpu = s.wait_state(("cpu",), ("READY",))["children"]["cpu"]
    assert bad not in cpu["command"]  # its last good command, running again
    rejected = cpu["rejected_command"]
    assert rejected["argument"] == f"--chat-template-file {bad}"
    assert f"failed to open file '{bad}'" in rejected["said"][0]
    gpu = s.child("gpu")
    assert gpu["pid"] == gpu_pid and bad not in gpu["command"]  # never touched
    # The operator's view names it too.
    shown = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "supervisor", "status", "--config",
                         str(s.config_path)], capture_output=True, text=True, cwd=REPO,
        env=s.env, timeout=PATIENCE_S)
    assert f"--chat-template-file {bad}" in shown.stdout, shown.stdout
    assert "rolled back" in shown.stdout and "failed to open file" in shown.stdout


@pytest.mark.integration
def test_a_reload_to_a_value_llama_server_would_refuse_keeps_the_children_serving(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    pids = {n: s.child(n)["pid"] for n in ("gpu", "cpu")}
    args = [a if a != "2" else "abc" for a in s.config["model"]["args"]]  # -np abc
    assert "abc" in args
    edit(s, model={"args": args})
    error = eventually(lambda: s.status()["config"]["error"])
    assert error and "model.args[" in error and "-np takes a whole number, not 'abc'" in error
    assert s.post("/v1/chat/completions", CHAT)[0] == 200
    assert {n: s.child(n)["pid"] for n in ("gpu", "cpu")} == pids


# --- at boot ----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(("args", "said"), [
    (["--chat-template-file", "/nonexistent/template.jinja"],
     "failed to open file '/nonexistent/template.jinja'"),
    (["--mcp-servers-json", "{bad"], "MCP starting failed: failed to parse MCP config JSON"),
])
def test_a_command_that_cannot_start_at_boot_ends_spillway_with_its_words(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        args: list[str], said: str) -> None:
    s = spillway(real_config(llama_server, tiny_model, gpu={"args": ["-ngl", "99", *args]}),
                 start=False)
    result = subprocess.run([sys.executable, "-m", "supervisor", "run", "--config",
                             str(s.config_path)], capture_output=True, text=True,
                            cwd=s.folder, env=s.env, timeout=PATIENCE_S)
    assert result.returncode == 1, result.stderr[-2000:]
    assert said in result.stderr
    assert "the GPU child's command cannot start" in result.stderr
    assert args[0] in result.stderr and "no earlier command to go back to" in result.stderr
    assert "Traceback" not in result.stderr
