"""Failures that are not deaths, the sick child: alive, /health 200, and a 5xx for every request
(llama.cpp#27309). Several different requests in a row failing so drain and restart it; one
client repeating one bad request does not (fake llama-server children, sick on demand)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import eventually, fake_config

from conftest import SpillwayFactory

from supervisor.policy import sickness
from supervisor.policy.evidence import FailureKind


def test_the_streak_rule() -> None:
    s = sickness.Streak()
    for status, digest in ((500, 1), (500, 1), (500, 1)):  # one request, three times
        s = sickness.after(s, status, "HTTP 500: x", digest)
    assert s.count == 3 and not sickness.is_sick(s, 3)
    s = sickness.after(s, 500, "HTTP 500: y", 2)  # a second, different request
    assert sickness.is_sick(s, 3) and not sickness.is_sick(s, 0)
    assert sickness.after(s, 200, "", 3) == sickness.Streak()  # a success ends it
    assert sickness.after(sickness.Streak(), 501, "", 1).count == 0  # a route not served
    assert sickness.after(sickness.Streak(), 503, "", 1).count == 0  # loading
    plain = sickness.verdict(s, [])
    assert plain.kind is FailureKind.SICK and plain.evidence.startswith("4 different")
    oom = sickness.verdict(s, ["cudaMalloc failed: out of memory"])
    assert oom.kind is FailureKind.OOM_SURVIVED


@pytest.mark.parametrize("oom_line,kind", [("0", "sick"), ("1", "oom_survived")])
def test_a_child_failing_every_request_is_drained_and_restarted(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path,
        oom_line: str, kind: str) -> None:
    flag = tmp_path / "sick"
    flag.write_text("")
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_SICK_FILE": str(flag), "FAKE_SICK_OOM_LINE": oom_line}})
    s = spillway(cfg)
    body = {"messages": [{"role": "user", "content": "the same"}], "max_tokens": 4}
    for _ in range(3):  # one client's request, three times: not the child's sickness
        status, _ = s.post("/v1/chat/completions", body)
        assert status == 500
    assert s.child("gpu")["state"] == "READY" and s.child("gpu")["restarts"] == 0
    status, _ = s.post("/v1/chat/completions", {**body, "messages": [
        {"role": "user", "content": "another"}]})
    assert status == 500  # passed on: the answer was the child's
    flag.unlink()  # the restart heals it
    status, answer = s.post("/v1/chat/completions", body)
    assert status == 200
    assert eventually(lambda: s.child("gpu")["restarts"] >= 1)
    assert f"[gpu] sick ({kind})" in s.log_text()
    _, timeline = s.get("/spillway/timeline")
    drained = [t for t in timeline["events"] if t["child"] == "gpu" and t["state"] == "DRAINING"]
    assert drained and drained[0]["reason"].startswith(f"sick ({kind}): ")
