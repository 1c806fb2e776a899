"""Reloading the TOML: SIGHUP and the file watcher, one path; an invalid file keeps the running
config; a valid one applies as a diff; a child whose command changed is drained and restarted
without dropping a request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import Spillway, eventually, eventually_async, fake_config, real_config, toml_dumps
from prometheus_client.parser import text_string_to_metric_families
from test_children_functional import transitions

from conftest import SpillwayFactory

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def metric(s: Spillway, name: str, key: str | None = None, **labels: str) -> float | None:
    code, text = s.get("/spillway/metrics", {"Authorization": f"Bearer {key}"} if key else None)
    assert code == 200
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def edit(s: Spillway, **sections: dict[str, Any]) -> None:
    """Save a changed config the way editors do: a new file renamed over the old."""
    for name, values in sections.items():
        s.config[name] = {**s.config.get(name, {}), **values}
    tmp = s.config_path.with_suffix(".swp")
    tmp.write_text(toml_dumps(s.config))
    os.replace(tmp, s.config_path)


async def reload_under_traffic(s: Spillway, change: dict[str, Any],
                               done: Any) -> list[int]:
    """Four clients (two streaming) send requests while `change` is saved; each answer's
    status (negative: incomplete); back once `done()` holds and eight more were answered, each
    of them whole."""
    results: list[int] = []
    odd: list[Any] = []
    stop = asyncio.Event()

    async def client(http: aiohttp.ClientSession, stream: bool) -> None:
        while not stop.is_set():
            async with http.post(f"{s.url}/v1/chat/completions",
                                 json={**CHAT, "max_tokens": 24, "stream": stream}) as r:
                body = await r.read()
                complete = r.status == 200 and (
                    body.rstrip().endswith(b"data: [DONE]") if stream
                    else bool(json.loads(body)["choices"]))
                results.append(r.status if complete else -r.status)
                if not complete:
                    odd.append((r.status, stream, body[-300:]))

    async with aiohttp.ClientSession() as http:
        clients = [asyncio.create_task(client(http, i % 2 == 1)) for i in range(4)]
        await eventually_async(lambda: len(results) >= 8)
        edit(s, **change)
        assert await eventually_async(done), s.status()["config"]
        before = len(results)
        await eventually_async(lambda: len(results) >= before + 8)
        stop.set()
        await asyncio.gather(*clients)
    assert results and all(r == 200 for r in results), (results, odd)
    return results


def test_an_invalid_file_keeps_the_running_config_and_says_why(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    pids = {n: s.child(n)["pid"] for n in ("gpu", "cpu")}
    good = s.config_path.read_text()
    typo = {**s.config, "restart": {**s.config["restart"], "backoff_initial": 2}}
    s.config_path.write_text(toml_dumps(typo))
    s.signal(signal.SIGHUP)
    error = eventually(lambda: s.status()["config"]["error"])
    assert error and "restart.backoff_initial" in error and "backoff_initial_s" in error
    assert "reload refused, keeping the running config: restart.backoff_initial" in \
        s.log_text()
    assert (metric(s, "spillway_config_reloads_total", result="invalid") or 0) >= 1
    assert metric(s, "spillway_config_last_reload_valid") == 0
    # Still serving, with the same children.
    assert s.post("/v1/chat/completions", CHAT)[0] == 200
    assert {n: s.child(n)["pid"] for n in ("gpu", "cpu")} == pids
    # Fixed: the next reload clears the error.
    s.config_path.write_text(good)
    s.signal(signal.SIGHUP)
    assert eventually(lambda: s.status()["config"]["error"] is None)


def test_the_file_watcher_applies_an_editors_save_at_once(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    assert s.post("/v1/chat/completions", CHAT)[0] == 200
    edit(s, server={"api_key": "new-key"})
    assert eventually(lambda: s.post("/v1/chat/completions", CHAT)[0] == 401)
    status, _ = s.post("/v1/chat/completions", CHAT, {"Authorization": "Bearer new-key"})
    assert status == 200
    assert metric(s, "spillway_config_reloads_total", "new-key", result="applied") == 1


def test_a_listen_change_is_noted_for_the_next_restart(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    edit(s, server={"listen": "127.0.0.1:1"}, queue={"max_waiting": 3})
    notes = eventually(lambda: s.status()["config"]["restart_needed"])
    assert notes == ["server.listen changed: it takes effect when spillway restarts"]
    assert s.status()["queue"]["max_waiting"] == 3  # the rest applied


def test_a_small_child_given_by_a_reload_waits_for_the_next_restart(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """The children are wired at start: a [small] added by a reload is noted, not half made,
    and the rest of the change applies."""
    s = spillway(fake_config(fake_server, tiny_model))
    edit(s, small={"path": str(tiny_model)}, queue={"max_waiting": 5})
    notes = eventually(lambda: s.status()["config"]["restart_needed"])
    assert notes == ["small.path was given or removed, or small.models changed: that takes "
                     "effect when spillway restarts"]
    assert s.status()["queue"]["max_waiting"] == 5
    assert set(s.status()["children"]) == {"gpu", "cpu"}
    assert s.post("/v1/chat/completions", CHAT)[0] == 200


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_reload_that_changes_a_childs_args_under_traffic_drops_no_request(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    gpu_pid, cpu_pid = s.child("gpu")["pid"], s.child("cpu")["pid"]
    # The GPU child's command changes: it must be drained and restarted.
    await reload_under_traffic(s, {"gpu": {"args": ["-ngl", "99", "-b", "512"]}},
                               lambda: s.child("gpu")["pid"] not in (None, gpu_pid) and
                               s.child("gpu")["state"] == "READY")
    gpu = s.child("gpu")
    assert "-b" in gpu["command"] and s.child("cpu")["pid"] == cpu_pid
    assert transitions(s.log_text(), "gpu")[2:6] == [
        "READY -> DRAINING", "DRAINING -> STOPPING", "STOPPING -> STOPPED",
        "STOPPED -> STARTING"]
