"""Reads replayed on the other child are an allowlist of llama-server's routes that change
nothing (policy/routes.read_only): a GET caught in the GPU child's death is asked again of the
CPU child only when asking twice does nothing twice. Fake children; the GPU child dies
(SIGABRT after the CUDA lines) on a request for the path (FAKE_CRASH_ON_PATH)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from harness import fake_config

from conftest import SpillwayFactory


def seen(state: Path) -> list[tuple[str, str]]:
    if not state.exists():
        return []
    return [(r["method"], r["path"]) for r in map(json.loads, state.read_text().splitlines())]


@pytest.mark.parametrize(("path_qs", "replayed"), [
    ("/lora-adapters", True),  # a read: the CPU child answers it
    ("/cors-proxy?url=http%3A%2F%2F192.0.2.1%2Fhook", False),  # fetches an outside URL
    ("/v1/models?autoload=true", False),  # on a router, loads the model it names
])
def test_a_get_caught_in_a_gpu_death_is_asked_of_the_cpu_child_only_when_it_only_reads(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path,
        path_qs: str, replayed: bool) -> None:
    path = path_qs.partition("?")[0]
    gpu_saw, cpu_saw = tmp_path / "gpu-saw.jsonl", tmp_path / "cpu-saw.jsonl"
    s = spillway(fake_config(
        fake_server, tiny_model,
        gpu={"env": {"FAKE_CRASH_ON_PATH": path, "FAKE_STATE_FILE": str(gpu_saw)}},
        cpu={"env": {"FAKE_STATE_FILE": str(cpu_saw)}}))
    try:
        with urllib.request.urlopen(s.url + path_qs, timeout=60) as r:
            status, headers, body = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, headers, body = e.code, e.headers, e.read()
    assert ("GET", path) in seen(gpu_saw)  # the GPU child had it, and died of it
    [incident] = s.wait_incidents(1)
    assert incident["route"] == path
    if replayed:
        assert status == 200 and headers["X-Spillway-Child"] == "cpu"
        assert headers["X-Spillway-Attempts"] == "2"
        assert incident["decision"] == "replayed"
        assert ("GET", path) in seen(cpu_saw)
    else:
        assert status == 502, body  # the controlled error: the child broke, nothing replayed
        assert json.loads(body)["error"]["type"] == "upstream_error"
        assert incident["decision"] == "rejected"
        assert incident["reason"] == "route never replays"
        assert ("GET", path) not in seen(cpu_saw)  # never sent to the other child
