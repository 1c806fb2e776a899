"""Router mode against the real pinned llama-server: both children are routers over a models
folder with two real small models (`alpha`, the tiny test model, and `beta`, a second one with
other dimensions). A model's instance on the GPU router is killed with SIGABRT (the drill's arm:
as its next task launches, i.e. during prompt processing, before any token), and the request is
replayed on the CPU router for the same model while the other model keeps serving on the GPU
router. Free VRAM comes from a fake NVML (tests/fake_nvml) where the fit check is the subject."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from harness import (
    PATIENCE_S,
    Spillway,
    eventually,
    eventually_async,
    free_port,
    router_config,
    write_json,
)
import strict_sse

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]


def chat(model: str, content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, **extra}


def model_state(s: Spillway, child: str, model: str) -> str | None:
    found = s.child(child).get("models", {}).get(model)
    return None if found is None else str(found["state"])


async def post(http: aiohttp.ClientSession, s: Spillway,
               body: dict[str, Any]) -> tuple[int, Any, bytes]:
    async with http.post(f"{s.url}/v1/chat/completions", json=body,
                         headers={"X-Request-Id": body.get("rid", "")} if "rid" in body
                         else None) as r:
        return r.status, r.headers, await r.read()


def wait_model(s: Spillway, child: str, model: str, state: str = "READY",
               timeout: float = PATIENCE_S) -> None:
    assert eventually(lambda: model_state(s, child, model) == state, timeout), \
        (model_state(s, child, model), s.log_tail())


@pytest.mark.asyncio
async def test_router_mode_serves_each_model_and_lists_them_once(
        spillway: SpillwayFactory, llama_server: Path, models_dir: Path) -> None:
    s = spillway(router_config(llama_server, models_dir))
    status = s.status()
    assert status["router"] is True
    assert set(status["models"]) == {"alpha", "beta"}
    # The router's own pid stays the child's; each model has its own entry.
    assert status["children"]["gpu"]["pid"] is not None
    assert set(status["children"]["gpu"]["models"]) == {"alpha", "beta"}
    async with aiohttp.ClientSession() as http:
        for model in ("alpha", "beta"):
            code, headers, body = await post(http, s, chat(model))
            assert code == 200, body
            assert headers["X-Spillway-Child"] == "gpu"
            assert headers["X-Spillway-Model"] == model
            assert json.loads(body)["model"] == model
        for path in ("/v1/models", "/models"):
            async with http.get(f"{s.url}{path}") as r:
                listing = await r.json()
            ids = [m["id"] for m in listing["data"]]
            assert sorted(ids) == ["alpha", "beta"], listing  # one list, each model once
    # alpha's figures come from /props?model=alpha, asked for as it became READY.
    assert eventually(lambda: s.child("gpu")["models"]["alpha"]["ctx_per_slot"] is not None)
    gpu_models = s.child("gpu")["models"]
    assert gpu_models["alpha"]["state"] == "READY" and gpu_models["beta"]["state"] == "READY"
    assert gpu_models["alpha"]["ctx_per_slot"] == 1024  # /props?model=alpha: -c 2048 -np 2
    instance = gpu_models["alpha"]["pid"]
    assert instance is not None and instance != s.child("gpu")["pid"]
    # Loaded on demand on the GPU router only: the CPU router has loaded nothing yet.
    assert {m["state"] for m in s.child("cpu")["models"].values()} == {"STOPPED"}
    # Each model on each child in the metrics, as Prometheus's own parser reads them.
    code, text = s.get("/spillway/metrics")
    assert code == 200
    states = {(x.labels["child"], x.labels["model"], x.labels["state"]): x.value
              for f in text_string_to_metric_families(text) if f.name == "spillway_model_state"
              for x in f.samples}
    assert states[("gpu", "alpha", "READY")] == 1 and states[("gpu", "alpha", "STOPPED")] == 0
    assert states[("cpu", "beta", "STOPPED")] == 1
    # `spillway status` shows each model on each child.
    table = (await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "supervisor", "status", "--url", s.url],
        capture_output=True, text=True, timeout=60)).stdout
    rows = [line.split() for line in table.splitlines() if line.startswith(("alpha", "beta"))]
    assert ["alpha", "gpu", "READY", str(instance)] == rows[0][:4], table
    assert {(r[0], r[1], r[2]) for r in rows} >= {("beta", "gpu", "READY"),
                                                   ("alpha", "cpu", "STOPPED")}, table
    # A model nobody serves is the router's to answer, in its own words.
    async with aiohttp.ClientSession() as http:
        code, _, body = await post(http, s, chat("gamma"))
    assert code == 400 and b"not found" in body


@pytest.mark.asyncio
async def test_router_routes_pass_through_and_act_on_the_gpu_router(
        spillway: SpillwayFactory, llama_server: Path, models_dir: Path) -> None:
    s = spillway(router_config(llama_server, models_dir))
    async with aiohttp.ClientSession() as http:
        # /models/load and /models/unload (the web UI's) act on the GPU router.
        async with http.post(f"{s.url}/models/load", json={"model": "beta"}) as r:
            assert r.status == 200 and (await r.json())["success"] is True
        wait_model(s, "gpu", "beta")
        assert model_state(s, "cpu", "beta") == "STOPPED"
        # GET with ?model= reaches the child where that model is loaded.
        async with http.get(f"{s.url}/props", params={"model": "beta"}) as r:
            props = await r.json()
            assert r.status == 200 and r.headers["X-Spillway-Child"] == "gpu"
        assert props["model_alias"] == "beta" and props["default_generation_settings"]["n_ctx"]
        async with http.post(f"{s.url}/models/unload", json={"model": "beta"}) as r:
            assert r.status == 200
        wait_model(s, "gpu", "beta", "STOPPED")
        # An unload (even one the router reports as status 1) is no failure.
        assert s.child("gpu")["models"]["beta"]["failures"] == 0
        # The router's web UI (this build has none: its own 404), passed through as it is.
        async with http.get(f"http://127.0.0.1:{s.child('gpu')['port']}/") as r:
            direct = (r.status, r.headers.get("Content-Type"), await r.read())
        async with http.get(f"{s.url}/") as r:
            assert (r.status, r.headers.get("Content-Type"), await r.read()) == direct
            assert r.headers["X-Spillway-Child"] == "gpu"
        # CORS preflight is llama-server's own behaviour, passed through.
        async with http.options(f"{s.url}/v1/chat/completions",
                                headers={"Origin": "http://example.test",
                                         "Access-Control-Request-Method": "POST"}) as r:
            assert r.status == 200
            assert "access-control-allow-methods" in {h.lower() for h in r.headers}


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_an_instance_death_replays_on_the_cpu_router_for_the_same_model(
        spillway: SpillwayFactory, llama_server: Path, slow_models_dir: Path,
        stream: bool) -> None:
    # The arm acts on the instance's launch line as the router relays it, a moment behind the
    # instance: alpha is the slow model, and the prompt long (some 500 tokens), so that the
    # instance is still processing it then (with the tiny model and a short prompt, the answer
    # was whole, or 370 tokens of the stream out, before the SIGABRT on a busy machine).
    s = spillway(router_config(llama_server, slow_models_dir))
    async with aiohttp.ClientSession() as http:
        for model in ("alpha", "beta"):  # both loaded on the GPU router
            assert (await post(http, s, chat(model)))[0] == 200
        victim = s.child("gpu")["models"]["alpha"]["pid"]
        code, armed = s.arm({"model": "alpha"})
        assert code == 200 and armed["model"] == "alpha", armed
        rid = f"router-death-{'stream' if stream else 'whole'}"
        async with http.post(f"{s.url}/v1/chat/completions",
                             json=chat("alpha", "a prompt for the doomed instance " +
                                       " ".join(["hello world"] * 60), max_tokens=64,
                                       ignore_eos=True, stream=stream),
                             headers={"X-Request-Id": rid}) as r:
            body = await r.read()
            headers = r.headers
            code = r.status
        assert code == 200, body
        assert headers["X-Spillway-Attempts"] == "2"
        assert headers["X-Spillway-Child"] == "cpu"
        assert headers["X-Spillway-Model"] == "alpha"
        assert headers["X-Request-Id"] == rid
        if stream:
            text = body.decode()
            assert text.rstrip().endswith("data: [DONE]"), text
            assert '"error"' not in text
        else:
            assert json.loads(body)["choices"][0]["message"]["content"] is not None
        # The other model kept serving on the GPU router, unaffected.
        code, headers, _ = await post(http, s, chat("beta"))
        assert code == 200 and headers["X-Spillway-Child"] == "gpu"
    incidents = s.wait_incidents(1)
    assert incidents[0]["request_id"] == rid
    assert incidents[0]["model"] == "alpha"
    assert incidents[0]["child"] == "gpu" and incidents[0]["decision"] == "replayed"
    assert incidents[0]["replay_child"] == "cpu"
    assert "exited with status" in incidents[0]["evidence"] or \
        "instance" in incidents[0]["evidence"], incidents[0]
    gpu_alpha = s.child("gpu")["models"]["alpha"]
    assert gpu_alpha["failures"] == 1 and gpu_alpha["last_exit"]["kind"] == "crash"
    # Spillway loads alpha again on the GPU router after its back-off, by itself.
    wait_model(s, "gpu", "alpha")
    code, text = s.get("/spillway/metrics")
    reloads = {(x.labels["child"], x.labels["model"], x.labels["reason"]): x.value
               for f in text_string_to_metric_families(text) if f.name == "spillway_model_reloads"
               for x in f.samples if x.name.endswith("_total")}
    assert reloads == {("gpu", "alpha", "crash"): 1.0}, reloads
    assert s.child("gpu")["models"]["alpha"]["pid"] not in (None, victim)
    assert s.child("gpu")["models"]["beta"]["failures"] == 0
    async with aiohttp.ClientSession() as http:
        code, headers, _ = await post(http, s, chat("alpha"))
    assert code == 200 and headers["X-Spillway-Child"] == "gpu"


@pytest.mark.asyncio
async def test_a_model_that_would_not_fit_the_free_vram_goes_to_the_cpu_router(
        spillway: SpillwayFactory, llama_server: Path, models_dir: Path,
        tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, total_mib=24576, free_mib=20000)
    s = spillway(router_config(llama_server, models_dir, gpu={"vram_headroom_mib": 1024},
                               monitor={"sample_interval_s": 0.1}), fake_nvml=nvml)
    async with aiohttp.ClientSession() as http:
        code, headers, _ = await post(http, s, chat("alpha"))
        assert code == 200 and headers["X-Spillway-Child"] == "gpu"
        # NVML's per-process figure for alpha's instance (a grandchild: found by its port) is
        # what alpha is seen using, and what a later load of it must fit.
        instance = s.child("gpu")["models"]["alpha"]["pid"]
        write_json(nvml, total_mib=24576, free_mib=20000, processes={str(instance): 3000})
        assert await eventually_async(
            lambda: s.child("gpu")["models"]["alpha"]["vram_peak_bytes"] == 3000 * 1048576)
        assert s.child("gpu")["models"]["alpha"]["vram_needs_bytes_to_load"] >= \
            (3000 + 1024) * 1048576
        # Another process takes the card: beta's weights, KV cache and the headroom no longer
        # fit. Its requests go to the CPU router; the card is not asked to load it.
        write_json(nvml, total_mib=24576, free_mib=900)
        assert await eventually_async(lambda: s.status()["gpu"]["free_mib"] == 900)
        for _ in range(2):
            code, headers, _ = await post(http, s, chat("beta"))
            assert code == 200 and headers["X-Spillway-Child"] == "cpu"
        assert model_state(s, "gpu", "beta") == "STOPPED"
        # The card has room again: beta loads on the GPU router on demand.
        write_json(nvml, total_mib=24576, free_mib=20000)
        assert await eventually_async(lambda: s.status()["gpu"]["free_mib"] == 20000)
        deadline = time.monotonic() + 20
        child = ""
        while time.monotonic() < deadline and child != "gpu":
            code, headers, _ = await post(http, s, chat("beta"))
            assert code == 200
            child = headers["X-Spillway-Child"]
        assert child == "gpu"


@pytest.mark.asyncio
async def test_a_second_model_loading_kills_the_first_ones_instance_and_its_work_is_not_lost(
        spillway: SpillwayFactory, llama_server: Path, slow_models_dir: Path) -> None:
    # The article's scenario, simulated: while a request for alpha runs on the GPU router,
    # beta is loaded there and alpha's instance dies (SIGABRT as beta's instance is spawned,
    # standing in for the allocation that fails when beta takes the last VRAM). alpha is the
    # slow model: the tiny one's answer (a slot of 1,024 tokens) could be done before beta's
    # spawn line was read on a busy machine.
    s = spillway(router_config(llama_server, slow_models_dir))
    async with aiohttp.ClientSession() as http:
        assert (await post(http, s, chat("alpha")))[0] == 200
        code, armed = s.arm({"model": "alpha", "when": "neighbour_load"})
        assert code == 200 and armed["when"] == "neighbour_load", armed
        running = asyncio.create_task(post(http, s, chat(
            "alpha", "a long answer", max_tokens=6000, ignore_eos=True)))
        assert await eventually_async(
            lambda: s.child("gpu")["models"]["alpha"]["in_flight"] == 1)
        async with http.post(f"{s.url}/models/load", json={"model": "beta"}) as r:
            assert r.status == 200
        code, headers, body = await running
    assert code == 200, body
    assert headers["X-Spillway-Attempts"] == "2" and headers["X-Spillway-Child"] == "cpu"
    assert headers["X-Spillway-Model"] == "alpha"
    wait_model(s, "gpu", "beta")
    [incident] = s.wait_incidents(1)
    assert incident["model"] == "alpha" and incident["decision"] == "replayed"


@pytest.mark.asyncio
async def test_in_router_mode_the_agent_weighs_the_gpu_routers_loaded_models(
        spillway: SpillwayFactory, llama_server: Path, slow_models_dir: Path) -> None:
    # (alpha the slow model: its long answer still runs when the agent is asked.)
    s = spillway(router_config(llama_server, slow_models_dir,
                               balancer={"agent_listen": f"127.0.0.1:{free_port()}"}))
    assert s.agent_line() == "up ready 100%"  # the GPU router is up, nothing loaded yet
    async with aiohttp.ClientSession() as http:
        assert (await post(http, s, chat("alpha")))[0] == 200  # alpha: 2 slots on the GPU
        running = asyncio.create_task(post(http, s, chat(
            "alpha", "a long answer", max_tokens=6000, ignore_eos=True)))
        assert await eventually_async(
            lambda: s.child("gpu")["models"]["alpha"]["in_flight"] == 1)
        assert s.agent_line() == "up ready 50%"  # one of alpha's two GPU slots is busy
        code, _, _ = await running
    assert code == 200
    assert s.agent_line() == "up ready 100%"


@pytest.mark.asyncio
async def test_a_stream_whose_instance_dies_mid_answer_continues_on_the_cpu_router(
        spillway: SpillwayFactory, llama_server: Path, slow_models_dir: Path) -> None:
    """Router mode: alpha's instance on the GPU router is killed (SIGABRT) after the client
    has part of the stream; the same stream goes on from alpha on the CPU router. alpha is
    the slow model: the tiny one could write all 600 tokens before the kill on a busy
    machine."""
    import os
    import signal

    s = spillway(router_config(llama_server, slow_models_dir))
    async with aiohttp.ClientSession() as http:
        assert (await post(http, s, chat("alpha")))[0] == 200
        victim = s.child("gpu")["models"]["alpha"]["pid"]
        # (600 tokens: within the slot's context of 1024, on either router.)
        body = chat("alpha", "a long answer, please", max_tokens=600, stream=True,
                    ignore_eos=True)
        events: list[bytes] = []
        raw = b""
        async with http.post(f"{s.url}/v1/chat/completions", json=body,
                             headers={"X-Request-Id": "router-cut"}) as r:
            assert r.status == 200 and r.headers["X-Spillway-Child"] == "gpu"
            async for line in r.content:
                raw += line
                if line.startswith(b"data: {"):
                    events.append(line)
                    if len(events) == 5:
                        os.kill(victim, signal.SIGABRT)
    text = raw.decode()
    assert text.rstrip().endswith("data: [DONE]"), text[-500:]
    assert '"error"' not in text
    strict_sse.both(raw)  # no line a strict client refuses: the final event says it
    chunks = [json.loads(e[6:]) for e in events]
    assert sum(1 for c in chunks for ch in c["choices"] if ch["delta"].get("role")) == 1, \
        text[:3000]
    assert len({c["id"] for c in chunks}) == 1
    final = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(final) == 1 and final[0]["spillway_continuation"]["child"] == "cpu"
    assert final[0]["choices"][0]["finish_reason"] == "length"
    [record] = s.wait_incidents(1)
    # The limit kept across the two children: what the GPU router's instance generated (the
    # relayed text, counted by the CPU router's tokenizer) and what the CPU router's did.
    generated = record["tokens_before"] + final[0]["timings"]["predicted_n"]
    assert 595 <= generated <= 605, generated
    assert record["decision"] == "continued" and record["model"] == "alpha"
    assert record["request_id"] == "router-cut" and record["replay_child"] == "cpu"
    assert record["tokens_before"] >= 4
