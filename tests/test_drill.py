"""`spillway drill` in CI: simulated (no GPU here), against real llama-server children; its
report rendered in headless Chromium and read back from the DOM."""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, Spillway, real_config

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]


def drill(s: Spillway, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", "drill", "--url", s.url,
                           "--out", str(out), *extra], capture_output=True, text=True,
                          cwd=REPO, timeout=600)


class Dom(HTMLParser):
    """The elements the test reads from Chromium's rendered DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.bars: list[dict[str, str]] = []
        self.lanes: list[str] = []
        self.states: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "rect" and "request-bar" in classes:
            self.bars.append(a)
        elif tag == "g" and "lane" in classes:
            self.lanes.append(a["data-child"])
        elif tag == "rect" and "state" in classes:
            self.states.append(a["data-state"])


def rendered_dom(chromium: Path, page: Path, tmp: Path) -> str:
    result = subprocess.run(
        [str(chromium), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp / 'chromium-profile'}", "--dump-dom",
         page.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_drill_passes_simulated_and_its_report_renders(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path,
        chromium: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    result = drill(s, tmp_path / "report")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every result below is labelled SIMULATED" in result.stderr
    assert "PASSED (simulated: no GPU here)" in result.stdout
    [json_path] = (tmp_path / "report").glob("drill-*.json")
    [html_path] = (tmp_path / "report").glob("drill-*.html")
    report: dict[str, Any] = json.loads(json_path.read_text())
    assert report["simulated"] is True and report["passed"] is True
    assert [sc["number"] for sc in report["scenarios"]] == [1, 2, 3, 4, 5]
    incidents = {r["request_id"]: r for r in s.incidents()}
    for sc in report["scenarios"]:
        assert sc["simulated"] and sc["passed"], sc["verdict"]
        caught = [r for r in sc["requests"] if r["incident"]]
        assert caught, sc["name"]
        for r in caught:  # every figure matched to the daemon's own record by request id
            assert r["incident"] == incidents[r["request_id"]]
    one, two, three, four, five = report["scenarios"]
    assert one["requests"][0]["outcome"] == "replayed"
    assert one["requests"][0]["incident"]["evidence"] == "killed by SIGABRT"
    assert two["requests"][0]["stream"] and two["requests"][0]["complete"]
    assert three["requests"][0]["incident"]["client_connected"] is False
    assert len(four["requests"]) == 6
    assert five["tool_effects"] == {"0": 1, "1": 1, "2": 1, "3": 1}
    # The page, as a browser renders it.
    dom = Dom()
    dom.feed(rendered_dom(chromium, html_path, tmp_path))
    sent = [r for sc in report["scenarios"] for r in sc["requests"]]
    assert len(dom.bars) == len(sent)  # one bar per request
    colours = {"completed": "#2e7d32", "replayed": "#1565c0", "controlled_error": "#ef6c00",
               "cancelled": "#757575", "failed": "#c62828"}
    for bar, r in zip(dom.bars, sent):
        assert bar["data-request-id"] == r["request_id"]
        assert bar["data-outcome"] == r["outcome"]
        assert bar["fill"] == colours[r["outcome"]]
    assert dom.lanes == ["gpu", "cpu"]
    assert {"READY", "BACKOFF", "STARTING"} <= set(dom.states)


def test_a_scenario_short_of_its_bar_makes_the_drill_fail(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    # Replay turned off: the request over the GPU's profile gets a controlled error instead of
    # completing on the CPU child, which is below the bar of scenario 1.
    s = spillway(real_config(llama_server, tiny_model, failover={"replay": False}))
    result = drill(s, tmp_path / "report", "--only", "1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout
    report = json.loads(next((tmp_path / "report").glob("drill-*.json")).read_text())
    assert report["passed"] is False
    assert report["scenarios"][0]["requests"][0]["outcome"] == "controlled_error"


def test_profiles_compare_three_ways_to_run_the_model(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    result = subprocess.run([sys.executable, "-m", "supervisor", "drill", "--config",
                             str(s.config_path), "--out", str(tmp_path), "--only", "1",
                             "--profiles"], capture_output=True, text=True, cwd=REPO,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(next(tmp_path.glob("drill-*.json")).read_text())
    profiles = report["profiles"]
    assert "no GPU here" in profiles["note"]
    names = [p["profile"] for p in profiles["results"]]
    assert names[0].startswith("GPU-resident") and names[1].startswith("planned CPU/GPU split")
    assert names[2] == "independent CPU child"
    for p in profiles["results"]:
        assert p["error"] is None
        assert p["ttft_p50_s"] > 0 and p["gen_tps"] > 0 and p["prompt_tps"] > 0
        assert p["latency_p95_s"] >= p["latency_p50_s"] > 0
        assert p["peak_rss_mib"] > 0
    assert "-ngl" in profiles["results"][1]["args"]
    assert "profiles (no GPU here" in result.stdout
    assert "Profiles" in next(tmp_path.glob("drill-*.html")).read_text()
