"""The small child against real llama-server children: SmolLM2-135M as the large model (the GPU
and CPU children), the tiny random model as the smaller one, the real OpenAI client.

The GPU child's failure is injected by tests/gpu_fault_injector.py (captured CUDA lines, then
SIGABRT, as a real OOM) or is a SIGKILL of its process; a request that accepts a smaller model
(X-Spillway-Fallback: smaller) is answered by the small child while the GPU child cannot take
it, every other request as before, by the CPU child.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from harness import PATIENCE_S, Spillway, eventually, real_config, router_config
import strict_sse
from prometheus_client.parser import text_string_to_metric_families

from conftest import SpillwayFactory
from supervisor.commands import bootstrap

pytestmark = [pytest.mark.integration]
MARKER = "OOM-ME"
SMALLER = {"X-Spillway-Fallback": "smaller"}
ALL = ("gpu", "small", "cpu")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return bootstrap.ensure_model()


def small_config(llama_server: Path, large: Path, small_model: Path,
                 injector: Path | None = None, fault: dict[str, str] | None = None,
                 **sections: Any) -> dict[str, Any]:
    cfg = real_config(llama_server, large, **sections)
    cfg["model"]["args"] = ["-c", "1024", "-np", "2", "-t", "1", "-tb", "1"]
    cfg["small"] = {"path": str(small_model), **sections.get("small", {})}
    if injector is not None:
        cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector),
                      "env": {"REAL_LLAMA_SERVER": str(llama_server), **(fault or {})}}
    return cfg


def client(s: Spillway, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0,
                         default_headers=headers or {}, timeout=60)


def ask(c: openai.OpenAI, text: str, model: str = "whatever", max_tokens: int = 8,
        **extra: Any) -> tuple[Any, Any]:
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        temperature=0, **extra)
    return raw.parse(), raw.headers


def states(s: Spillway) -> dict[str, str]:
    return {n: c["state"] for n, c in s.status()["children"].items()}


def test_an_opted_in_request_the_gpu_child_lost_is_answered_by_the_small_model(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, tiny_model: Path,
        injector: Path) -> None:
    """An OOM before any byte: the request that accepts a smaller model is rerouted to the
    small child (its own model's name in the answer, labelled, recorded as rerouted); the
    one that does not is replayed on the CPU child, as always."""
    s = spillway(small_config(llama_server, smollm2, tiny_model, injector,
                              {"FAULT_MARKER": MARKER}))
    s.wait_ready(children=ALL)
    small = s.status()["children"]["small"]
    assert (small["smaller_model"], small["mode"], small["requests"]) == (
        tiny_model.name, "resident", "opt-in")
    answer, headers = ask(client(s, SMALLER), f"say {MARKER} now")
    assert headers["X-Spillway-Child"] == "small"
    assert headers["X-Spillway-Attempts"] == "2"
    assert headers["X-Spillway-Failover"] == "runtime_oom"
    assert answer.model.endswith(tiny_model.name), answer.model  # the small model says so
    [record] = s.wait_incidents(1)
    assert record["decision"] == "rerouted" and record["replay_child"] == "small"
    assert "rerouted to the smaller model" in record["reason"]
    assert record["status"] == 200

    s.wait_ready(children=ALL)
    answer, headers = ask(client(s), f"say {MARKER} again")
    assert headers["X-Spillway-Child"] == "cpu"
    assert answer.model.endswith(smollm2.name)  # the large model, as asked
    record = s.wait_incidents(2)[-1]
    assert record["decision"] == "replayed" and record["replay_child"] == "cpu"


def test_while_the_gpu_child_is_down_opted_in_traffic_goes_to_the_small_child(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path,
        tiny_model: Path) -> None:
    """The GPU child killed under traffic: opt-in requests are answered by the small child,
    the others by the CPU child, none by the wrong model, none lost; a started stream is
    continued on the CPU child, never on the small one."""
    s = spillway(small_config(llama_server, smollm2, tiny_model,
                              restart={"backoff_initial_s": 4.0, "backoff_max_s": 8.0}))
    s.wait_ready(children=ALL)
    results: list[tuple[bool, int, str, str]] = []
    stop = threading.Event()

    def traffic(opted: bool) -> None:
        c = client(s, SMALLER if opted else {})
        while not stop.is_set():
            try:
                answer, headers = ask(c, "Name a colour.")
                results.append((opted, 200, headers["X-Spillway-Child"], answer.model))
            except openai.APIStatusError as e:
                results.append((opted, e.status_code, "", ""))

    workers = [threading.Thread(target=traffic, args=(opted,)) for opted in (True, False, True)]
    for w in workers:
        w.start()
    eventually(lambda: len(results) >= 6)
    os.kill(s.status()["children"]["gpu"]["pid"], signal.SIGKILL)
    eventually(lambda: states(s)["gpu"] != "READY", timeout=10)
    down_from = len(results)
    eventually(lambda: sum(1 for r in results[down_from:] if r[0] and r[2] == "small") >= 3)
    s.wait_ready(children=ALL)
    stop.set()
    for w in workers:
        w.join(60)
    assert all(status == 200 for _, status, _, _ in results), results  # nothing lost
    by_small = [r for r in results if r[2] == "small"]
    assert by_small and all(opted for opted, *_ in by_small)  # only those that accepted it
    assert all(model.endswith(tiny_model.name) for *_, model in by_small)
    assert all(model.endswith(smollm2.name) for _, _, child, model in results
               if child in ("gpu", "cpu"))
    # The child label on the metrics: the small child's answers are counted as its own.
    status, text = s.get("/spillway/metrics")
    assert status == 200
    served = {sample.labels["child"]: sample.value
              for family in text_string_to_metric_families(text)
              if family.name == "spillway_requests"
              for sample in family.samples if sample.name == "spillway_requests_total"
              and sample.labels["outcome"] == "success"}
    assert served.get("small", 0) >= len(by_small)


def test_a_started_stream_is_continued_on_the_cpu_child_not_the_small_one(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, tiny_model: Path,
        injector: Path) -> None:
    s = spillway(small_config(llama_server, smollm2, tiny_model, injector,
                              {"FAULT_MARKER": MARKER, "FAULT_WHEN": "events:3"}))
    s.wait_ready(children=ALL)
    body = {"messages": [{"role": "user", "content": f"Tell a story {MARKER}"}],
            "max_tokens": 24, "stream": True, "temperature": 0}
    request = urllib.request.Request(f"{s.url}/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={**SMALLER, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
        raw = r.read()
    events = strict_sse.both(raw)  # no line a strict client refuses: said in the last event
    assert events[-1]["spillway_continuation"]["child"] == "cpu"
    models = {json.loads(line[6:])["model"] for line in raw.decode().splitlines()
              if line.startswith("data: {")}
    assert all(m.endswith(smollm2.name) for m in models), models  # one model throughout
    [record] = s.wait_incidents(1)
    assert record["decision"] == "continued" and record["replay_child"] == "cpu"


def test_an_on_demand_small_child_serves_while_the_gpu_child_is_down_then_makes_way(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path,
        tiny_model: Path) -> None:
    """On demand: stopped while the GPU child serves; started into the VRAM its death freed;
    drained and stopped before the GPU child starts again."""
    s = spillway(small_config(llama_server, smollm2, tiny_model, small={"mode": "on-demand"},
                              restart={"backoff_initial_s": 4.0, "backoff_max_s": 8.0}))
    s.wait_ready()
    assert states(s)["small"] == "STOPPED"
    answer, headers = ask(client(s, SMALLER), "Name a colour.")
    assert headers["X-Spillway-Child"] == "gpu"  # the GPU child first, while it can
    os.kill(s.status()["children"]["gpu"]["pid"], signal.SIGKILL)
    s.wait_state(("small",), ("READY",))
    assert states(s)["gpu"] in ("EXITED", "BACKOFF")
    answer, headers = ask(client(s, SMALLER), "Name a colour.")
    assert headers["X-Spillway-Child"] == "small"
    assert answer.model.endswith(tiny_model.name)
    _, headers = ask(client(s), "Name a colour.")
    assert headers["X-Spillway-Child"] == "cpu"
    # The back-off over, the small child makes way, then the GPU child loads.
    s.wait_ready()
    assert states(s)["small"] == "STOPPED"
    log = s.log_text()
    assert log.index("[small] stopped: the GPU child starts again") < log.rindex(
        "[gpu] starting")
    answer, headers = ask(client(s, SMALLER), "Name a colour.")
    assert headers["X-Spillway-Child"] == "gpu"


def test_a_bad_fallback_header_is_a_clear_400(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path,
        tiny_model: Path) -> None:
    s = spillway(small_config(llama_server, smollm2, tiny_model))
    status, body = s.post("/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                          headers={"X-Spillway-Fallback": "bigger"})
    assert status == 400
    assert "X-Spillway-Fallback" in body["error"]["message"]


def test_router_mode_sends_an_opted_in_request_to_its_models_smaller_model(
        spillway: SpillwayFactory, llama_server: Path, slow_models_dir: Path) -> None:
    """Router mode: no third process; small.models maps alpha to beta, both on the GPU router,
    which keeps beta loaded. alpha's instance there dies (SIGABRT as its task launches): the
    opted-in request is rerouted to beta on the GPU router (the request rewritten to name it,
    the answer naming it), the plain one replayed on the CPU router for alpha."""
    # alpha the slow model: the arm acts on its instance's launch line as the router relays it,
    # a moment behind; the tiny model's answer could be whole by then on a busy machine.
    s = spillway(router_config(llama_server, slow_models_dir,
                               small={"models": {"alpha": "beta"}}))
    # beta is loaded on the GPU router without any request for it: resident.
    eventually(lambda: s.child("gpu")["models"]["beta"]["state"] == "READY")
    assert s.status()["smaller_models"] == {"alpha": "beta"}
    # alpha not loaded on the GPU router yet: beta answers, while alpha loads for what follows.
    answer, headers = ask(client(s, SMALLER), "hello", model="alpha")
    assert headers["X-Spillway-Child"] == "small" and answer.model == "beta"
    eventually(lambda: s.child("gpu")["models"]["alpha"]["state"] == "READY")
    answer, headers = ask(client(s, SMALLER), "hello", model="alpha")
    assert headers["X-Spillway-Child"] == "gpu" and answer.model == "alpha"
    for opted, rid in ((True, "router-small-1"), (False, "router-small-2")):
        eventually(lambda: s.child("gpu")["models"]["alpha"]["state"] == "READY")
        code, armed = s.arm({"model": "alpha"})
        assert code == 200, armed
        answer, headers = ask(client(s, {**(SMALLER if opted else {}), "X-Request-Id": rid}),
                              "a prompt for the doomed instance", model="alpha",
                              # long enough for the abort to land before it is answered
                              max_tokens=160, extra_body={"ignore_eos": True})
        assert headers["X-Spillway-Attempts"] == "2"
        if opted:
            assert headers["X-Spillway-Child"] == "small"
            assert headers["X-Spillway-Model"] == "beta" and answer.model == "beta"
        else:
            assert headers["X-Spillway-Child"] == "cpu"
            assert headers["X-Spillway-Model"] == "alpha" and answer.model == "alpha"
    first, second = s.wait_incidents(2)
    assert (first["decision"], first["replay_child"], first["model"]) == (
        "rerouted", "small", "alpha")
    assert (second["decision"], second["replay_child"]) == ("replayed", "cpu")
    # While alpha is down on the GPU router, opted-in requests for it go to beta there.
    assert s.child("gpu")["models"]["beta"]["failures"] == 0


def test_router_mode_config_refuses_what_has_no_meaning_there(tmp_path: Path) -> None:
    from supervisor.config import schema as config  # noqa: PLC0415 - a unit check here
    with pytest.raises(config.ConfigError) as e:
        config.build({"model": {"args": ["--models-dir", str(tmp_path)]},
                      "small": {"models": {"a": "b", "b": "c"}, "mode": "on-demand"}},
                     check_paths=False)
    text = str(e.value)
    assert "small.mode" in text and "one step only" in text


def test_on_demand_with_a_short_back_off_nothing_is_lost_and_the_small_child_stays_away(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, tiny_model: Path,
        injector: Path, tmp_path: Path) -> None:
    """The GPU child's back-off shorter than the small child's start: the opted-in requests it
    lost are rerouted to the small child as it starts, which is stopped before it is ready to
    give the GPU child the card; they are answered all the same (by the CPU child, or by the
    GPU child back), and the small child stays stopped beside the GPU child afterwards (found
    by bench/small_child.py: the replay waited out the line's whole wait for a child that was
    never going to be ready, and the small child was started again beside the GPU child)."""
    # Both requests lost in one death: the second one's launch brings the GPU child down while
    # the first (a longer answer) still runs there; once only (the child back must serve). Sent
    # at once, the first was sometimes answered, or the GPU child already dead, before the
    # second arrived on a busy machine: one incident, not two.
    s = spillway(small_config(llama_server, smollm2, tiny_model, injector,
                              {"FAULT_NTH": "2", "FAULT_ONCE_FILE": str(tmp_path / "fired")},
                              small={"mode": "on-demand"},
                              restart={"backoff_initial_s": 0.05, "backoff_max_s": 0.1},
                              queue={"max_wait_s": 20}))
    s.wait_ready()
    results: list[tuple[int, str]] = []

    def lost(max_tokens: int) -> None:
        try:
            _, headers = ask(client(s, SMALLER), f"say {MARKER}", max_tokens=max_tokens,
                             extra_body={"ignore_eos": True})
            results.append((200, headers["X-Spillway-Child"]))
        except openai.APIStatusError as e:
            results.append((e.status_code, ""))

    before = s.child("gpu")["tasks_started"]
    workers = [threading.Thread(target=lost, args=(128,)), threading.Thread(target=lost, args=(8,))]
    workers[0].start()
    assert eventually(lambda: s.child("gpu")["tasks_started"] == before + 1)
    workers[1].start()
    for w in workers:
        w.join(PATIENCE_S)
    assert [status for status, _ in results] == [200, 200], (results, s.log_tail(30))
    s.wait_ready()
    for _ in range(3):  # the GPU child back: opted-in requests are its own again
        _, headers = ask(client(s, SMALLER), "Name a colour.")
        assert headers["X-Spillway-Child"] == "gpu"
    assert states(s)["small"] == "STOPPED"
    assert s.wait_incidents(2)
