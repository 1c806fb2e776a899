"""`spillway drill` in CI: simulated (no GPU here), against real llama-server children (and
routers, in router mode, with its sixth scenario); its report rendered in headless Chromium and
read back from the DOM. Scenario 6's judge is also held to made-up results, to see it fail."""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, Spillway, real_config, router_config

from conftest import SpillwayFactory
from supervisor.commands.drill.client import Sent
from supervisor.commands.drill.scenarios import ScenarioResult, judge

integration = pytest.mark.integration


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
        self.model_lanes: list[tuple[str, str]] = []
        self.states: list[str] = []
        self.skipped: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "rect" and "request-bar" in classes:
            self.bars.append(a)
        elif tag == "g" and "lane" in classes and "data-model" in a:
            self.model_lanes.append((a["data-child"], a["data-model"]))
        elif tag == "g" and "lane" in classes:
            self.lanes.append(a["data-child"])
        elif tag == "tr" and "skipped" in classes:
            self.skipped.append(a["data-scenario"])
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


@integration
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
    assert [sc["number"] for sc in report["scenarios"]] == [1, 2, 3, 4, 5, 7]
    # Scenario 6 is router mode's: skipped here, with the reason, and not a failure.
    assert report["router"] is False
    [skipped] = report["skipped"]
    assert skipped["number"] == 6 and "router mode only" in skipped["why"], skipped
    assert "[6] SKIPPED: router mode only" in result.stderr
    assert "skipped (router mode only" in result.stdout
    incidents = {r["request_id"]: r for r in s.incidents()}
    for sc in report["scenarios"]:
        assert sc["simulated"] and sc["passed"], sc["verdict"]
        caught = [r for r in sc["requests"] if r["incident"]]
        assert caught, sc["name"]
        for r in caught:  # every figure matched to the daemon's own record by request id
            assert r["incident"] == incidents[r["request_id"]]
    one, two, three, four, five, seven = report["scenarios"]
    assert one["requests"][0]["outcome"] == "replayed"
    assert one["requests"][0]["incident"]["evidence"] == "killed by SIGABRT"
    assert two["requests"][0]["stream"] and two["requests"][0]["complete"]
    assert three["requests"][0]["incident"]["client_connected"] is False
    assert len(four["requests"]) == 6
    assert five["tool_effects"] == {"0": 1, "1": 1, "2": 1, "3": 1}
    [cut] = seven["requests"]
    assert cut["outcome"] == "continued" and cut["cut_at"] == 8 and cut["continued"]
    assert cut["incident"]["decision"] == "continued"
    assert cut["incident"]["replay_child"] == "cpu" and cut["incident"]["tokens_before"] >= 8
    # The page, as a browser renders it.
    dom = Dom()
    dom.feed(rendered_dom(chromium, html_path, tmp_path))
    sent = [r for sc in report["scenarios"] for r in sc["requests"]]
    assert len(dom.bars) == len(sent)  # one bar per request
    colours = {"completed": "#2e7d32", "replayed": "#1565c0", "controlled_error": "#ef6c00",
               "cancelled": "#757575", "failed": "#c62828", "continued": "#6a1b9a"}
    for bar, r in zip(dom.bars, sent):
        assert bar["data-request-id"] == r["request_id"]
        assert bar["data-outcome"] == r["outcome"]
        assert bar["fill"] == colours[r["outcome"]]
    assert dom.lanes == ["gpu", "cpu"] and dom.model_lanes == []
    assert {"READY", "BACKOFF", "STARTING"} <= set(dom.states)
    assert dom.skipped == ["6"]


@integration
def test_the_drill_passes_in_router_mode_with_a_second_model_loading(
        spillway: SpillwayFactory, llama_server: Path, models_dir: Path, tmp_path: Path,
        chromium: Path) -> None:
    s = spillway(router_config(llama_server, models_dir))
    result = drill(s, tmp_path / "report")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "router mode: every request is for model alpha; the second model is beta" in \
        result.stderr
    assert "PASSED (simulated: no GPU here)" in result.stdout
    report: dict[str, Any] = json.loads(next((tmp_path / "report").glob("drill-*.json"))
                                        .read_text())
    assert report["router"] is True and report["passed"] is True and report["skipped"] == []
    assert (report["model"], report["second_model"]) == ("alpha", "beta")
    assert [sc["number"] for sc in report["scenarios"]] == [1, 2, 3, 4, 5, 6, 7]
    incidents = {r["request_id"]: r for r in s.incidents()}
    for sc in report["scenarios"]:
        assert sc["simulated"] and sc["passed"], (sc["number"], sc["verdict"])
        for r in sc["requests"]:
            assert r["model"] == "alpha"  # every request named A, and was served for A
            if r["incident"]:
                assert r["incident"] == incidents[r["request_id"]]
                assert r["incident"]["model"] == "alpha"
    six = report["scenarios"][5]
    assert six["name"] == "a second model takes the last VRAM"
    assert len(six["requests"]) == 6 and {r["stream"] for r in six["requests"]} == {True, False}
    assert six["models"]["load_status"] == 200 and six["models"]["in_flight_on_gpu"] >= 1
    assert six["models"]["gpu_states_after"]["beta"] == "READY"
    replayed = [r for r in six["requests"] if not r["stream"] and r["incident"]]
    assert replayed, six["requests"]
    for r in replayed:  # A's work, caught on the GPU router as B loaded, done on the CPU one
        assert r["complete"] and r["child"] == "cpu" and r["attempts"] == 2
        assert r["incident"]["decision"] == "replayed"
        assert r["incident"]["replay_child"] == "cpu"
    # The daemon agrees: B loaded on the GPU router, A's instance died once and came back.
    models = s.child("gpu")["models"]
    assert models["beta"]["state"] == "READY" and models["alpha"]["state"] == "READY"
    assert models["beta"]["failures"] == 0
    assert "on the GPU router at the end: beta READY, alpha READY" in result.stdout
    dom = Dom()
    dom.feed(rendered_dom(chromium, next((tmp_path / "report").glob("drill-*.html")),
                          tmp_path))
    assert dom.lanes == ["gpu", "cpu"]
    assert dom.model_lanes == [("gpu", "alpha"), ("cpu", "alpha"), ("gpu", "beta"),
                               ("cpu", "beta")]
    assert {bar["data-scenario"] for bar in dom.bars} == {"1", "2", "3", "4", "5", "6", "7"}
    assert report["scenarios"][6]["requests"][0]["outcome"] == "continued"


@integration
def test_router_mode_scenario_6_fails_when_the_work_is_not_replayed(
        spillway: SpillwayFactory, llama_server: Path, models_dir: Path,
        tmp_path: Path) -> None:
    # Replay turned off: A's non-streaming requests caught when B loads get a controlled
    # error instead of completing on the CPU router: A's work is lost, below the bar.
    s = spillway(router_config(llama_server, models_dir, failover={"replay": False}))
    result = drill(s, tmp_path / "report", "--only", "6", "--model", "beta",
                   "--second-model", "alpha")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(next((tmp_path / "report").glob("drill-*.json")).read_text())
    [six] = report["scenarios"]
    assert six["number"] == 6 and six["passed"] is False
    assert "beta's work lost" in six["verdict"], six["verdict"]


@integration
def test_router_mode_with_one_model_skips_scenario_6(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "alpha.gguf").symlink_to(tiny_model)
    s = spillway(router_config(llama_server, folder))
    result = drill(s, tmp_path / "report", "--only", "6")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(next((tmp_path / "report").glob("drill-*.json")).read_text())
    assert report["router"] is True and report["second_model"] is None
    assert report["scenarios"] == []
    [skipped] = report["skipped"]
    assert skipped["number"] == 6 and "fewer than two models" in skipped["why"], skipped


def _sent(rid: str, stream: bool, *, complete: bool = True, child: str = "cpu",
          attempts: int = 2, incident: dict[str, Any] | None = None) -> Sent:
    s = Sent(6, rid, stream, 1.0, ended=2.0, status=200, attempts=attempts, child=child,
             model="alpha", complete=complete, request_id_kept=True)
    s.incident = incident
    return s


def _scenario_6(*requests: Sent, beta: str = "READY") -> ScenarioResult:
    r = ScenarioResult(6, "a second model takes the last VRAM", "bar", True)
    r.requests.extend(requests)
    r.models = {"model": "alpha", "second_model": "beta", "load_status": 200,
                "gpu_states_after": {"beta": beta, "alpha": "READY"}}
    return r


def test_scenario_6_judge_fails_when_a_request_for_a_was_lost() -> None:
    replayed = {"request_id": "whole", "decision": "replayed", "replay_child": "cpu",
                "model": "alpha"}
    good = _scenario_6(_sent("whole", False, incident=replayed),
                       _sent("stream", True, attempts=1, child="gpu"),
                       _sent("spilled", False, attempts=1))
    judge(good)
    assert good.passed, good.verdict
    # A non-streaming request for A that never completed: its work is lost.
    lost = _sent("lost", False, complete=False)
    lost.status, lost.note = None, "connection: ServerDisconnectedError"
    bad = _scenario_6(_sent("whole", False, incident=replayed), lost)
    judge(bad)
    assert not bad.passed and "alpha's work lost: lost never completed" in bad.verdict
    # Caught, but passed on rather than replayed on the CPU router.
    passed_on = _scenario_6(_sent("whole", False, incident={
        **replayed, "decision": "passed_on", "replay_child": None}))
    judge(passed_on)
    assert not passed_on.passed and "not replayed on the CPU router" in passed_on.verdict
    # Nothing caught at all: B's load did not hit A's work.
    missed = _scenario_6(_sent("whole", False, attempts=1))
    judge(missed)
    assert not missed.passed and "was caught" in missed.verdict
    # B did not end READY on the GPU router.
    no_beta = _scenario_6(_sent("whole", False, incident=replayed), beta="BACKOFF")
    judge(no_beta)
    assert not no_beta.passed and "beta is BACKOFF" in no_beta.verdict


def test_scenario_7_judge_fails_unless_the_cut_stream_was_continued() -> None:
    def cut(**kw: Any) -> ScenarioResult:
        s = Sent(7, "cut", True, 1.0, ended=2.0, status=200, attempts=1, child="gpu",
                 request_id_kept=True, **{"complete": True, "cut_at": 8, "continued": True,
                                           **kw})
        s.incident = {"request_id": "cut", "decision": "continued", "replay_child": "cpu"}
        r = ScenarioResult(7, "a stream cut in the middle of its answer", "bar", True)
        r.requests.append(s)
        return r

    good = cut()
    judge(good)
    assert good.passed, good.verdict
    for broken, said in (({"continued": False}, "does not say it was continued"),
                         ({"complete": False, "error_event": True}, "not one whole stream"),
                         ({"cut_at": None}, "ended before the GPU child was stopped")):
        bad = cut(**broken)
        judge(bad)
        assert not bad.passed and said in bad.verdict, (broken, bad.verdict)
    passed_on = cut()
    passed_on.requests[0].incident = {"request_id": "cut", "decision": "passed_on"}
    judge(passed_on)
    assert not passed_on.passed and "not continued on the CPU child" in passed_on.verdict


@integration
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


@integration
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
