"""Idempotency-Key through the proxy, and the stream hold limit, against the fake child."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import eventually, eventually_async, fake_config
import strict_sse

from conftest import SpillwayFactory

pytestmark = pytest.mark.asyncio
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def executions(state_file: Path) -> int:
    if not state_file.exists():
        return 0
    return sum(1 for line in state_file.read_text().splitlines()
               if json.loads(line)["path"] == "/v1/chat/completions")


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
               key: str | None, **headers: str) -> tuple[int, Any, bytes]:
    h = dict(headers)
    if key is not None:
        h["Idempotency-Key"] = key
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=h) as r:
        return r.status, r.headers, await r.read()


async def test_a_retry_of_a_completed_request_gets_the_stored_answer_without_running_again(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    state = tmp_path / "seen.jsonl"
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_STATE_FILE": str(state)}}))
    async with aiohttp.ClientSession() as http:
        status, headers, first = await post(http, s.url, CHAT, "k-1")
        assert status == 200 and "Idempotent-Replayed" not in headers
        status, headers, again = await post(http, s.url, CHAT, "k-1",
                                            **{"X-Request-Id": "retry-1"})
        assert status == 200
        assert headers["Idempotent-Replayed"] == "true"
        assert headers["X-Request-Id"] == "retry-1"
        assert headers["X-Spillway-Child"] == "gpu"
        assert again == first
        # Streams are stored whole and given back whole.
        stream = {**CHAT, "stream": True}
        _, _, streamed = await post(http, s.url, stream, "k-2")
        _, headers, restreamed = await post(http, s.url, stream, "k-2")
        assert headers["Idempotent-Replayed"] == "true"
        assert headers["Content-Type"].startswith("text/event-stream")
        assert restreamed == streamed and streamed.endswith(b"data: [DONE]\n\n")
    assert executions(state) == 2


async def test_a_retry_while_it_runs_gets_409_and_another_body_gets_422(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_TOKEN_DELAY_S": "0.2"}}))
    async with aiohttp.ClientSession() as http:
        running = asyncio.create_task(post(http, s.url, CHAT, "k-3"))
        # The first one running (1.6 s at the GPU child) before its retry is sent.
        assert await eventually_async(lambda: s.child("gpu")["busy"] == 1)
        status, headers, body = await post(http, s.url, CHAT, "k-3")
        assert status == 409
        assert json.loads(body)["error"]["param"] == "Idempotency-Key"
        assert (await running)[0] == 200
        status, _, body = await post(http, s.url, {**CHAT, "max_tokens": 5}, "k-3")
        assert status == 422
        assert "different request body" in json.loads(body)["error"]["message"]


async def test_a_controlled_error_is_not_stored_so_a_retry_runs_anew(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_SLOW_START_S": "1.5"}},
                      cpu={"env": {"FAKE_SLOW_START_S": "1.5"}}, queue={"max_waiting": 0})
    s = spillway(cfg, wait_ready=False)
    async with aiohttp.ClientSession() as http:
        status, _, _ = await post(http, s.url, CHAT, "k-4")
        assert status == 503
        s.wait_state(("gpu",), ("READY",))
        status, headers, _ = await post(http, s.url, CHAT, "k-4")
        assert status == 200 and "Idempotent-Replayed" not in headers


async def test_past_the_hold_limit_the_status_and_headers_alone_flow_and_replay_is_given_up(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_PROMPT_DELAY_S": "1.0", "FAKE_CRASH_AFTER": "1"}},
                      failover={"stream_hold_s": 0.3})
    s = spillway(cfg)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions",
                             json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            raw = await r.read()
    # No line of Spillway's own while it waited (llama-server sends none: the client did not
    # ask for pings); every line is one a strict client reads.
    events = strict_sse.both(raw)
    assert raw.endswith(b"data: [DONE]\n\n") and not any("error" in e for e in events)
    # The status and headers went out at the hold limit (0.3 s), before the child's crash (at
    # its first token, 1 s): bytes had reached the client, so no replay; the stream goes on
    # from the CPU child instead, with nothing relayed before: the whole answer.
    assert events[-1]["spillway_continuation"]["tokens_before"] == 0
    [record] = s.wait_incidents(1)
    assert record["decision"] == "continued" and record["tokens_before"] == 0
    status, text = s.get("/spillway/metrics")
    assert 'spillway_stream_holds_expired_total{child="gpu"} 1.0' in text
    assert eventually(lambda: "hold_expired=gpu continued_from=gpu tokens_before=0"
                      in s.log_text()), s.log_tail()


async def test_an_answer_larger_than_the_whole_store_budget_is_not_stored(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    state = tmp_path / "seen.jsonl"
    env = {"FAKE_STATE_FILE": str(state), "FAKE_TOKENS": "200"}
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": env},
                             idempotency={"max_total_mib": 4 / 1024}))  # 4 KiB in all
    long = {**CHAT, "stream": True, "max_tokens": 200}  # far more than 4 KiB of events
    async with aiohttp.ClientSession() as http:
        status, _, small = await post(http, s.url, CHAT, "small")
        assert status == 200 and len(small) < 1024
        status, _, streamed = await post(http, s.url, long, "long")
        assert status == 200 and len(streamed) > 4096
        status, headers, again = await post(http, s.url, long, "long")
        assert status == 200 and "Idempotent-Replayed" not in headers  # released: ran anew
        _, headers, _ = await post(http, s.url, CHAT, "small")
        assert headers["Idempotent-Replayed"] == "true"  # and it evicted nothing to try
    assert executions(state) == 3
