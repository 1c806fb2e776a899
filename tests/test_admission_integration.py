"""Admission against real llama-server children: caps read back from the children's own
/slots, prompts over the GPU child's context, and VRAM headroom from (fake) NVML figures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import Spillway, eventually_async, real_config, write_json

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]


def tasks(s: Spillway) -> dict[str, int]:
    return {n: c["tasks_started"] for n, c in s.status()["children"].items()}


async def post(http: aiohttp.ClientSession, s: Spillway, body: dict[str, Any]) -> tuple[int, Any,
                                                                                        Any]:
    async with http.post(f"{s.url}/v1/chat/completions", json=body) as r:
        return r.status, r.headers, json.loads(await r.read())


@pytest.mark.asyncio
async def test_thirty_two_concurrent_requests_never_put_more_than_the_cap_on_a_child(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    # Four slots each, a cap of two: llama-server would take four at once; Spillway must not.
    cfg = real_config(llama_server, tiny_model,
                      model={"args": ["-c", "4096", "-np", "4", "-t", "1", "-tb", "1"]},
                      gpu={"max_concurrency": 2}, cpu={"max_concurrency": 2},
                      queue={"max_waiting": 64, "max_wait_s": 300})
    s = spillway(cfg)
    gpu = s.profiled("gpu", "slots")
    assert gpu["slots"] == 4 and gpu["cap"] == 2
    peak = {"gpu": 0, "cpu": 0}
    done = asyncio.Event()

    async def watch(http: aiohttp.ClientSession, child: str) -> None:
        # One watcher per child, sampling back to back: a loaded CI machine answered /slots so
        # slowly that a shared, sleeping watcher once never saw the GPU child's two at once.
        while not done.is_set():
            async with http.get(f"{s.url}/slots", headers={"X-Spillway-Child": child}) as r:
                busy = sum(1 for slot in await r.json() if slot["is_processing"])
            peak[child] = max(peak[child], busy)

    # Long enough answers that each pair of GPU requests overlaps for a good while.
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 160,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        watchers = [asyncio.create_task(watch(http, child)) for child in ("gpu", "cpu")]
        results = await asyncio.gather(*(post(http, s, body) for _ in range(32)))
        done.set()
        await asyncio.gather(*watchers)
    assert [r[0] for r in results] == [200] * 32
    assert all(r[2]["usage"]["completion_tokens"] == 160 for r in results)
    assert peak["gpu"] == 2  # it was full...
    assert peak["cpu"] <= 2  # ...and never past the cap
    served = {"gpu": 0, "cpu": 0}
    for _, headers, _ in results:
        served[headers["X-Spillway-Child"]] += 1
    assert served["gpu"] + served["cpu"] == 32 and served["cpu"] > 0


@pytest.mark.asyncio
async def test_a_prompt_over_the_gpu_childs_context_never_reaches_it(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    # The GPU child holds 512 tokens a slot, the CPU child 2048.
    cfg = real_config(llama_server, tiny_model,
                      model={"args": ["-c", "1024", "-np", "2", "-t", "1", "-tb", "1"]},
                      cpu={"args": ["--device", "none", "-ngl", "0", "-c", "4096"]})
    s = spillway(cfg)
    assert s.profiled("gpu")["ctx_per_slot"] == 512 and s.profiled("cpu")["ctx_per_slot"] == 2048
    before = tasks(s)
    async with aiohttp.ClientSession() as http:
        # About a thousand tokens, as this model's tokenizer counts them.
        async with http.post(f"{s.url}/tokenize", json={"content": "hello world " * 100}) as r:
            per_unit = len((await r.json())["tokens"]) / 100
        long_prompt = "hello world " * int(1000 / per_unit)
        status, headers, body = await post(http, s, {
            "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 4})
        assert status == 200, body
        assert headers["X-Spillway-Child"] == "cpu"
        assert 512 < body["usage"]["prompt_tokens"] <= 2048
        # Over every child's context: refused before any child works on it.
        too_long = {"messages": [{"role": "user", "content": long_prompt * 3}], "max_tokens": 4}
        status, headers, body = await post(http, s, too_long)
        # The child's own count of the templated prompt, asked of it directly.
        async with http.post(f"{s.url}/v1/chat/completions/input_tokens", json=too_long) as r:
            counted = (await r.json())["input_tokens"]
    assert status == 400
    error = body["error"]
    assert error["type"] == "exceed_context_size_error" and error["src"] == "spillway"
    assert error["n_ctx"] == 2048 and error["n_prompt_tokens"] == counted > 2048
    assert error["message"] == (f"request ({counted} tokens) exceeds the available context size "
                                "(2048 tokens), try increasing it")
    after = tasks(s)
    assert after["gpu"] == before["gpu"]
    assert after["cpu"] == before["cpu"] + 1


@pytest.mark.asyncio
async def test_low_free_vram_moves_new_work_off_the_gpu_child(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, total_mib=24576, free_mib=20000)
    cfg = real_config(llama_server, tiny_model, gpu={"vram_headroom_mib": 1024},
                      monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, fake_nvml=nvml)
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

    async def child_now() -> str:
        async with aiohttp.ClientSession() as http:
            _, headers, _ = await post(http, s, body)
            return str(headers["X-Spillway-Child"])

    assert await child_now() == "gpu"
    write_json(nvml, total_mib=24576, free_mib=600)  # a game took the card
    # Once the monitor has sampled it (admission reads the same sample as the status).
    assert await eventually_async(lambda: s.status()["gpu"]["free_mib"] == 600)
    assert [await child_now() for _ in range(3)] == ["cpu"] * 3
    write_json(nvml, total_mib=24576, free_mib=20000)
    assert await eventually_async(lambda: s.status()["gpu"]["free_mib"] == 20000)
    assert await child_now() == "gpu"
