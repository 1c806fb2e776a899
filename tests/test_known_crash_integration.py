"""Crashes that are not OOM, against real llama-server children: a known signature ends the
quick retries with a verdict and a remedy in status, the log, the metrics and the incident; the
remedy, applied by a config edit, brings the children back. The CPU's fault is injected by
tests/cpu_fault_injector.py (AMX: the buffer line, then SIGSEGV at the warm-up; SIGILL: a real
undefined instruction at the first task)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import Spillway, eventually, real_config
from prometheus_client.parser import text_string_to_metric_families

from conftest import SpillwayFactory
from supervisor.commands.cli import format_status

pytestmark = [pytest.mark.integration]
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def cpu_injector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cpu-injector") / "cpu-fault-injector"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{TESTS / "cpu_fault_injector.py"}" '
                    '"$@"\n')
    path.chmod(0o755)
    return path


def known_crashes(s: Spillway) -> dict[tuple[str, str], float]:
    status, text = s.get("/spillway/metrics")
    assert status == 200
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "spillway_known_crashes_total":
                found[(sample.labels["child"], sample.labels["signature"])] = sample.value
    return found


def amx_config(llama_server: Path, model: Path, injector: Path) -> dict[str, Any]:
    cfg = real_config(llama_server, model)
    cfg["model"]["llama_server"] = str(injector)
    env = {"REAL_LLAMA_SERVER": str(llama_server), "CPU_FAULT": "amx"}
    cfg["gpu"] = {**cfg["gpu"], "env": env}
    cfg["cpu"] = {**cfg["cpu"], "env": env}
    return cfg


def test_amx_crash_loop_ends_with_its_remedy_and_the_remedy_brings_both_back(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        cpu_injector: Path) -> None:
    cfg = amx_config(llama_server, tiny_model, cpu_injector)
    s = spillway(cfg, wait_ready=False)
    status = s.wait_state(("gpu", "cpu"), ("FATAL",))
    for name in ("gpu", "cpu"):
        child = status["children"][name]
        # Two starts, not max_quick_failures (5): the same known crash twice is enough.
        assert child["quick_failures"] == 2, child
        assert child["last_exit"]["signal"] == "SIGSEGV"
        assert "the same crash 2 times in a row; known crash amx_matmul" in child["reason"]
        known = child["diagnosis"]
        assert known["signature"] == "amx_matmul"
        assert "AMX model buffer size" in known["evidence"]
        assert "--no-repack" in known["remedy"]
        assert known["upstream"] == "https://github.com/ggml-org/llama.cpp/issues/20824"
        assert child["last_exit"]["diagnosis"] == known
    # The operator's `spillway status` says what it is and what to change.
    text = format_status(status)
    assert "known crash amx_matmul: llama.cpp's AMX matrix multiply" in text
    assert 'fix: add "--no-repack" to model.args' in text
    # So does the log, at each crash, and the metrics count each.
    log = s.log_text()
    assert log.count("[cpu] known crash amx_matmul") == 2, s.log_tail()
    assert known_crashes(s) == {("gpu", "amx_matmul"): 2.0, ("cpu", "amx_matmul"): 2.0}

    # The remedy, as the verdict words it: --no-repack in model.args, by the config command.
    args = cfg["model"]["args"]
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "config", "set", "model.args",
         "[" + ", ".join(f'"{a}"' for a in [*args, "--no-repack"]) + "]",
         "--config", str(s.config_path)], capture_output=True, text=True, timeout=60,
        env=s.env)
    assert done.returncode == 0, done.stderr
    ready = s.wait_state(("gpu", "cpu"), ("READY",))
    for name in ("gpu", "cpu"):
        assert ready["children"][name]["diagnosis"] is None  # the past crash is not news now
    code, body = s.post("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert code == 200, body
    assert body["choices"][0]["message"]["content"] is not None


def test_sigill_at_a_request_is_replayed_and_the_incident_names_the_cause(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        cpu_injector: Path) -> None:
    """A GPU child built for another CPU dies by a real SIGILL at its first task: the request is
    replayed on the CPU child, and its incident carries the verdict and the remedy. The second
    time, the GPU child is FATAL at once (served or not, restarting cannot mend it)."""
    cfg = real_config(llama_server, tiny_model)
    cfg["gpu"] = {**cfg["gpu"], "llama_server": str(cpu_injector),
                  "env": {"REAL_LLAMA_SERVER": str(llama_server), "CPU_FAULT": "sigill"}}
    s = spillway(cfg)
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
            "ignore_eos": True}
    code, answer = s.post("/v1/chat/completions", body, headers={"X-Request-Id": "sigill-1"})
    assert code == 200, answer
    [record] = s.wait_incidents(1)
    assert record["request_id"] == "sigill-1" and record["decision"] == "replayed"
    assert record["kind"] == "crash" and "SIGILL" in record["evidence"]
    assert record["known_crash"].startswith("known crash illegal_instruction: the binary uses "
                                            "an instruction this CPU")
    assert "GGML_NATIVE=OFF" in record["known_crash"]
    # Back once (one crash proves nothing), then the same crash again: FATAL, with the remedy.
    s.wait_state(("gpu",), ("READY",))
    code, answer = s.post("/v1/chat/completions", body, headers={"X-Request-Id": "sigill-2"})
    assert code == 200, answer
    status = s.wait_state(("gpu",), ("FATAL",))
    gpu = status["children"]["gpu"]
    assert "known crash illegal_instruction" in gpu["reason"]
    assert gpu["diagnosis"]["signature"] == "illegal_instruction"
    assert eventually(lambda: known_crashes(s).get(("gpu", "illegal_instruction")) == 2.0)
    assert status["children"]["cpu"]["state"] == "READY"  # the safety net never fell


def test_the_injector_is_the_real_server_once_the_remedy_is_in_its_arguments(
        llama_server: Path, tiny_model: Path, cpu_injector: Path) -> None:
    """The AMX stand-in obeys --no-repack the way llama.cpp does (no AMX buffer, no crash): it
    execs the real server, so the test above proves the remedy, not a switch in the double."""
    done = subprocess.run([str(cpu_injector), "--version", "--no-repack"], capture_output=True,
                          text=True, timeout=60, env={"REAL_LLAMA_SERVER": str(llama_server),
                                                      "CPU_FAULT": "amx"})
    real = subprocess.run([str(llama_server), "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == real.returncode == 0
    assert done.stdout + done.stderr == real.stdout + real.stderr
