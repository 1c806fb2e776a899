"""Every GPU backend's failure lines, verbatim from users' reports, through the three verdicts:
a child's exit (classify_exit), a router instance's death (classify_instance_exit) and a live
child's answer read with its stderr tail (classify). Each case names its source in
tests/fixtures/backend-lines/cases.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.policy.evidence import (
    CHILD_FAILED, Evidence, FailureKind, VramSample, classify, classify_exit,
)
from supervisor.policy.router import classify_instance_exit

CASES_FILE = Path(__file__).parent / "fixtures" / "backend-lines" / "cases.json"
CASES: list[dict[str, Any]] = json.loads(CASES_FILE.read_text())["cases"]
DEVICE = "0000:03:00.0 AMD Radeon RX 7900 XTX"
VRAM = {
    None: None,
    "low": VramSample(free_mib=61, total_mib=24560, age_s=0.4, device=DEVICE),
    "plenty": VramSample(free_mib=20100, total_mib=24560, age_s=0.4, device=DEVICE),
}
ROUTER_EXIT = 1  # the pinned router reports every instance death as status 1


def _runs() -> list[Any]:
    return [pytest.param(case, how, id=f"{case['id']}-{how}")
            for case in CASES for how in case["expect"]]


@pytest.mark.parametrize("case,how", _runs())
def test_backend_lines(case: dict[str, Any], how: str) -> None:
    kind, decider = case["expect"][how]
    lines: list[str] = case["lines"]
    vram = VRAM[case["vram"]]
    if how == "exit":
        verdict = classify_exit(case["exit_status"], lines, vram)
    elif how == "router":
        verdict = classify_instance_exit(ROUTER_EXIT, lines, loading=case["loading"], vram=vram)
    else:
        answer = case["response"]
        verdict = classify(Evidence(upstream_status=answer["status"],
                                    upstream_body=answer["body"], stderr_tail=lines, vram=vram))
    assert verdict.kind == FailureKind(kind)
    assert decider in verdict.evidence
    # The deciding line is one of the case's own lines, whole, unless a fact decided.
    assert verdict.child_failed == (verdict.kind in CHILD_FAILED)


def test_every_case_names_its_source_and_backend() -> None:
    backends = {case["backend"] for case in CASES}
    assert backends >= {"cuda", "rocm", "vulkan", "sycl", "metal"}
    for case in CASES:
        assert case["source"].startswith("https://github.com/")
        assert case["lines"] and case["expect"]
        for kind, decider in case["expect"].values():
            FailureKind(kind)
            # The decider is text the report holds (or the HTTP status of the answer).
            assert decider.startswith("HTTP ") or any(decider in line for line in case["lines"])


def test_gpu_fault_is_a_child_failure_like_an_oom() -> None:
    assert FailureKind.GPU_FAULT.value == "gpu_fault"
    assert FailureKind.GPU_FAULT in CHILD_FAILED
    assert FailureKind.RUNTIME_OOM in CHILD_FAILED
