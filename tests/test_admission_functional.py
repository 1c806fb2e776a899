"""Admission through the daemon, against fake children: the waiting line, controlled 503s with
the real OpenAI client, deadlines, the CPU guard and the on-demand CPU child."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from harness import Spillway, eventually, eventually_async, fake_config

from conftest import SpillwayFactory

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
SLOW = {"FAKE_TOKEN_DELAY_S": "0.25"}  # 8 tokens: 2 s a request


def one_each(fake_server: Path, model: Path, **sections: Any) -> dict[str, Any]:
    """Each child takes one request at a time, slowly."""
    base: dict[str, Any] = {"gpu": {"env": SLOW, "max_concurrency": 1},
                            "cpu": {"env": SLOW, "max_concurrency": 1}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return fake_config(fake_server, model, **base)


async def post(http: aiohttp.ClientSession, s: Spillway, body: dict[str, Any] = CHAT,
               **headers: str) -> tuple[int, Any, Any]:
    async with http.post(f"{s.url}/v1/chat/completions", json=body, headers=headers) as r:
        data = await r.read()
        return r.status, r.headers, json.loads(data) if data[:1] == b"{" else data


async def fill_both(http: aiohttp.ClientSession, s: Spillway) -> list[asyncio.Task[Any]]:
    """Both children busy with a slow request each, on this loop; the tasks to await."""
    busy = [asyncio.create_task(post(http, s)) for _ in range(2)]
    await eventually_async(lambda: s.status()["children"]["cpu"]["busy"] == 1)
    return busy


def occupy_both(s: Spillway) -> threading.Thread:
    """Both children busy with a slow request each, from another thread (the test goes on)."""
    async def occupy() -> None:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(post(http, s), post(http, s))

    t = threading.Thread(target=asyncio.run, args=(occupy(),))
    t.start()
    eventually(lambda: sum(c["busy"] for c in s.status()["children"].values()) == 2)
    return t


@pytest.mark.asyncio
async def test_requests_wait_in_line_with_positions_and_are_served_in_turn(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(one_each(fake_server, tiny_model))
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(post(http, s)) for _ in range(4)]
        status = await eventually_async(lambda: (st := s.status())["waiting"] == 2 and st)
        assert [w["position"] for w in status["waiting_requests"]] == [1, 2]
        assert status["children"]["gpu"]["busy"] == 1 and status["children"]["cpu"]["busy"] == 1
        results = await asyncio.gather(*tasks)
    assert [r[0] for r in results] == [200] * 4
    assert s.status()["waiting"] == 0


@pytest.mark.asyncio
async def test_a_client_that_leaves_the_line_leaves_at_once(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(one_each(fake_server, tiny_model))
    async with aiohttp.ClientSession() as http:
        busy = await fill_both(http, s)
        waiting = asyncio.create_task(post(http, s))
        assert await eventually_async(lambda: s.status()["waiting"] == 1)
        waiting.cancel()
        assert await eventually_async(lambda: s.status()["waiting"] == 0)
        # At once: the line emptied while both requests ahead of it still ran (2 s each), not
        # when a child was free to take it.
        assert not any(t.done() for t in busy)
        await asyncio.gather(*busy)


def test_a_full_line_gives_the_controlled_503_through_the_openai_client(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(one_each(fake_server, tiny_model, queue={"max_waiting": 0}))
    oa = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
    t = occupy_both(s)
    with pytest.raises(openai.APIStatusError) as e:
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                   extra_headers={"X-Request-Id": "busy-1"})
    t.join()
    assert e.value.status_code == 503
    response = e.value.response
    assert response.headers["content-type"].startswith("application/json")
    retry_after = int(response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert response.headers["x-should-retry"] == "true"
    body = e.value.body
    assert isinstance(body, dict)
    error = body.get("error", body)  # the SDK may hand over the inner object
    assert error["type"] == "unavailable_error" and error["code"] == 503
    assert error["queue_position"] == 1 and error["retry_after_s"] == retry_after
    assert error["request_id"] == "busy-1" and error["src"] == "spillway"
    assert "waiting line is full" in error["message"]


def test_the_openai_clients_retry_honours_retry_after(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(one_each(fake_server, tiny_model, queue={"max_waiting": 0}))
    oa = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=2)  # the SDK's default
    t = occupy_both(s)
    began = time.monotonic()
    raw = oa.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    elapsed = time.monotonic() - began
    t.join()
    assert raw.http_response.status_code == 200
    refusals = [line for line in s.log_text().splitlines()
                if "POST /v1/chat/completions -> - 503" in line]
    # No request had finished yet, so the first estimate is a lower bound (how long the two
    # running have run): the client may come back once too soon, and is told more then.
    assert 1 <= len(refusals) <= 2
    # The SDK slept the Retry-After Spillway gave (whole seconds from the estimated wait).
    assert elapsed >= 1.0 * len(refusals)


@pytest.mark.asyncio
async def test_a_deadline_shorter_than_the_wait_is_refused_at_once(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(one_each(fake_server, tiny_model))
    async with aiohttp.ClientSession() as http:
        # One request timed first: before any finished, the wait is only known to be at least
        # as long as the first has been running, and a request may wait up to its deadline.
        assert (await post(http, s))[0] == 200
        busy = await fill_both(http, s)
        began = time.monotonic()
        status, headers, body = await post(http, s, **{"X-Spillway-Deadline": "0.5"})
        assert time.monotonic() - began < 0.5
        assert status == 503 and "longer than the client will wait" in body["error"]["message"]
        # The OpenAI SDKs send their own timeout: it counts as a deadline too.
        status, _, _ = await post(http, s, **{"X-Stainless-Timeout": "0.5"})
        assert status == 503
        await asyncio.gather(*busy)


@pytest.mark.asyncio
async def test_the_cpu_childs_expected_time_is_weighed_against_the_deadline(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = one_each(fake_server, tiny_model, cpu={"env": {"FAKE_TOKEN_DELAY_S": "0.05",
                                                         "FAKE_TOKENS": "200"}},
                   queue={"max_waiting": 0})
    s = spillway(cfg)
    async with aiohttp.ClientSession() as http:
        # Teach Spillway the CPU child's speed (20 tokens/s): the GPU child is busy.
        gpu_busy = asyncio.create_task(post(http, s, {**CHAT, "max_tokens": 8}))
        await eventually_async(lambda: s.status()["children"]["gpu"]["busy"] == 1)
        status, headers, _ = await post(http, s, {**CHAT, "max_tokens": 4})
        assert status == 200 and headers["X-Spillway-Child"] == "cpu"
        speed = s.status()["children"]["cpu"]["tokens_per_s"]["generation"]
        assert 10 < speed < 40
        # 150 tokens at 20 tokens/s will not fit a 3 s deadline: not sent to the CPU child.
        status, _, body = await post(http, s, {**CHAT, "max_tokens": 150},
                                     **{"X-Spillway-Deadline": "3"})
        assert status == 503
        assert "the CPU child would need about" in body["error"]["message"]
        await gpu_busy


@pytest.mark.asyncio
async def test_an_on_demand_cpu_child_starts_when_needed_and_stops_when_idle(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_HANG_START": "1"}},
                      cpu={"mode": "on-demand", "idle_stop_s": 1.0},
                      monitor={"sample_interval_s": 0.2})
    s = spillway(cfg, wait_ready=False)
    s.wait_listening()
    assert s.child("cpu")["state"] == "STOPPED"
    assert s.status()["serving"] is True  # startable on demand counts
    async with aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, s)
    assert status == 200 and headers["X-Spillway-Child"] == "cpu"
    cpu = s.child("cpu")
    assert cpu["last_start_s"] is not None and cpu["last_start_s"] > 0
    assert s.wait_state(("cpu",), ("STOPPED",))
    assert "on-demand: idle for" in s.log_text()


def test_the_cpu_guard_keeps_a_cold_start_off_a_machine_without_the_ram(
        spillway: SpillwayFactory, fake_server: Path, tmp_path: Path) -> None:
    huge = tmp_path / "huge.gguf"
    with open(huge, "wb") as f:  # sparse: as large as a model no machine here can hold
        f.truncate(1 << 40)
    cfg = fake_config(fake_server, huge, gpu={"env": {"FAKE_HANG_START": "1"}},
                      cpu={"mode": "on-demand"}, queue={"max_waiting": 0})
    s = spillway(cfg, wait_ready=False)
    s.wait_listening()
    needs = s.child("cpu")["ram"]["needs_bytes_to_start"]
    assert needs >= 1 << 40
    status, body = s.post("/v1/chat/completions", CHAT)
    assert status == 503
    # The GPU child still loads: llama-server's words, and why the CPU child did not start.
    assert body["error"]["message"] == "Loading model"
    assert "not enough free RAM for the CPU child" in body["error"]["reason"]
    assert s.child("cpu")["state"] == "STOPPED"
    os.unlink(huge)


@pytest.mark.asyncio
async def test_a_replay_onto_a_cold_cpu_child_records_its_start_time(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_CRASH_AFTER": "1"}},
                      cpu={"mode": "on-demand", "env": {"FAKE_SLOW_START_S": "0.5"}})
    s = spillway(cfg, wait_ready=False)
    s.wait_state(("gpu",), ("READY",))
    assert s.child("cpu")["state"] == "STOPPED"
    async with aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, s)
    assert status == 200 and headers["X-Spillway-Attempts"] == "2"
    [record] = s.wait_incidents(1)
    assert record["decision"] == "replayed"
    assert record["cpu_start_s"] >= 0.5  # the CPU child was started for it
