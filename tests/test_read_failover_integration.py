"""A read of the routes clients poll (`GET /health`, `GET /v1/models`) caught in a GPU death
(issue 43, 3): answered by the CPU child, or, when no child can answer it, a controlled 503
with Retry-After, never a bare 502. Real llama-server children (the embedded
SmolLM2-135M-Instruct); the death is injected by tests/gpu_fault_injector.py on a client's
request for the path (FAULT_CLIENTS_ONLY: not on Spillway's own /health probes)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from harness import real_config
from test_continuation_integration import smollm2

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]
__all__ = ["smollm2"]  # the model fixture, shared with the continuation tests


def dying_on(role: str, cfg: dict[str, Any], llama_server: Path, injector: Path, path: str,
             once: Path) -> None:
    cfg[role] = {**cfg[role], "llama_server": str(injector),
                 "env": {"REAL_LLAMA_SERVER": str(llama_server), "FAULT_ON_PATH": path,
                         "FAULT_CLIENTS_ONLY": "1", "FAULT_ONCE_FILE": str(once),
                         "FAULT_LINES": "terse"}}


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_a_read_caught_in_a_gpu_death_comes_from_the_cpu_child(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, injector: Path,
        tmp_path: Path, path: str) -> None:
    cfg = real_config(llama_server, smollm2)
    dying_on("gpu", cfg, llama_server, injector, path, tmp_path / "fired")
    s = spillway(cfg)
    status, headers, body = get(s.url + path)
    assert (tmp_path / "fired").exists()  # the GPU child did die on it
    assert status == 200, body
    assert headers["X-Spillway-Child"] == "cpu" and headers["X-Spillway-Attempts"] == "2"
    [incident] = s.wait_incidents(1)
    assert incident["decision"] == "replayed" and incident["route"] == path


def test_a_health_read_that_no_child_can_answer_is_a_503_with_retry_after(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, injector: Path,
        tmp_path: Path) -> None:
    """Both children die on it: no child can answer now, which a health check must hear as
    unavailable (503, with when to come back), not as a bad gateway."""
    cfg = real_config(llama_server, smollm2)
    dying_on("gpu", cfg, llama_server, injector, "/health", tmp_path / "gpu-fired")
    dying_on("cpu", cfg, llama_server, injector, "/health", tmp_path / "cpu-fired")
    s = spillway(cfg)
    status, headers, body = get(s.url + "/health")
    assert (tmp_path / "gpu-fired").exists() and (tmp_path / "cpu-fired").exists()
    assert status == 503, body
    assert float(headers["Retry-After"]) > 0 and b"unavailable_error" in body
    assert headers.get("x-should-retry") == "true"
    records = s.wait_incidents(2)
    assert [r["decision"] for r in records] == ["replayed", "rejected"]
