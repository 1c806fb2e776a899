"""/spillway/metrics, read with prometheus-client's own parser."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from harness import fake_config, write_json
from prometheus_client.parser import text_string_to_metric_families

from conftest import SpillwayFactory

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.asyncio
async def test_metrics_parse_and_count_what_happened(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, total_mib=24576, free_mib=20000)
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_CRASH_AFTER": "3", "FAKE_TOKEN_DELAY_S": "0.05"},
                           "max_concurrency": 1},
                      cpu={"env": {"FAKE_TOKEN_DELAY_S": "0.05"}, "max_concurrency": 1},
                      server={"max_body_mib": 0.01}, monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, fake_nvml=nvml)
    async with aiohttp.ClientSession() as http:
        async def chat(stream: bool = False) -> int:
            async with http.post(f"{s.url}/v1/chat/completions",
                                 json={**CHAT, "stream": stream}) as r:
                await r.read()
                return r.status

        # Two served, then three at once: one waits in line; the GPU child's third request
        # kills it (replayed on the CPU child).
        assert await chat() == 200
        assert await chat(stream=True) == 200
        assert await asyncio.gather(chat(), chat(), chat()) == [200, 200, 200]
        async with http.post(f"{s.url}/v1/chat/completions", data=b"x" * 20000) as r:
            assert r.status == 413
        # /props goes to the GPU child only once it is READY again after its death (else to
        # the CPU child, by design): waited for, not assumed (on a busy machine its restart
        # can outlast the requests above).
        await asyncio.to_thread(s.wait_state, ("gpu",), ("READY",))
        async with http.get(f"{s.url}/props") as r:
            assert r.status == 200
    await asyncio.to_thread(s.wait_incidents, 1)
    code, text = s.get("/spillway/metrics")
    assert code == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name: str, **labels: str) -> float:
        family = families[name.removesuffix("_total").removesuffix("_count")
                          .removesuffix("_sum")]
        found = [smp.value for smp in family.samples if smp.name == name
                 and all(smp.labels.get(k) == v for k, v in labels.items())]
        assert found, (name, labels, [(smp.name, smp.labels) for smp in family.samples])
        return float(sum(found))

    for name in ("spillway_requests", "spillway_request_duration_seconds",
                 "spillway_stream_time_to_first_token_seconds", "spillway_failovers",
                 "spillway_replays", "spillway_rejections", "spillway_waiting_requests",
                 "spillway_wait_seconds", "spillway_child_state", "spillway_child_restarts",
                 "spillway_gpu_memory_free_bytes", "spillway_gpu_memory_used_bytes",
                 "spillway_config_reloads"):
        assert name in families, name
    chat_route = "/v1/chat/completions"
    assert value("spillway_requests_total", route=chat_route, outcome="success") == 5
    assert value("spillway_requests_total", route=chat_route, child="none",
                 outcome="rejected") == 1
    assert value("spillway_requests_total", route="/props", child="gpu") == 1
    assert value("spillway_request_duration_seconds_count", route=chat_route) == 5
    assert value("spillway_stream_time_to_first_token_seconds_count", route=chat_route) == 1
    assert value("spillway_failovers_total", child="gpu", kind="runtime_oom") == 1
    assert value("spillway_replays_total", result="completed") == 1
    assert value("spillway_rejections_total", reason="body_too_large") == 1
    assert value("spillway_wait_seconds_count") >= 1
    assert value("spillway_child_state", child="gpu", state="READY") == 1
    assert value("spillway_child_state", child="gpu", state="FATAL") == 0
    assert value("spillway_child_restarts_total", child="gpu", reason="runtime_oom") == 1
    assert value("spillway_gpu_memory_free_bytes") == 20000 * 1024 * 1024
    assert value("spillway_gpu_memory_used_bytes") == (24576 - 20000) * 1024 * 1024
    assert json.loads(json.dumps(s.status()))["queue"]["service_s"] is not None
