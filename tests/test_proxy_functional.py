"""The proxy against fake children (a test double with fault switches) on loopback."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from harness import eventually_async, fake_config

from conftest import SpillwayFactory

pytestmark = pytest.mark.asyncio


def seen(state_file: Path) -> list[dict[str, Any]]:
    if not state_file.exists():
        return []
    return [json.loads(line) for line in state_file.read_text().splitlines()]


def generation_requests(state_file: Path) -> list[dict[str, Any]]:
    """What clients sent the child through Spillway (not Spillway's own health and /props)."""
    return [r for r in seen(state_file) if r["path"] not in ("/health", "/v1/health", "/props")]


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "fake-requests.jsonl"


async def test_passthrough_keeps_method_path_query_body_and_end_to_end_headers(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    async with aiohttp.ClientSession() as http:
        async with http.put(
            f"{s.url}/lora-adapters/x?scale=0.5&b=2", data=b"raw \x00 body",
            headers={"X-Custom": "kept", "Connection": "keep-alive, X-Drop-Me",
                     "X-Drop-Me": "gone", "Authorization": "Bearer client-secret",
                     "X-Spillway-Deadline": "30", "Accept-Encoding": "gzip"},
        ) as r:
            assert r.status == 200
            echo = await r.json()
            assert r.headers["X-Spillway-Child"] == "gpu"
            assert r.headers["X-Spillway-Attempts"] == "1"
            rid = r.headers["X-Request-Id"]
    assert echo["method"] == "PUT"
    assert echo["path"] == "/lora-adapters/x"
    assert echo["query"] == "scale=0.5&b=2"
    assert echo["body"] == "raw \x00 body"
    h = {k.lower(): v for k, v in echo["headers"].items()}
    assert h["x-custom"] == "kept"
    assert "x-drop-me" not in h  # named in Connection: hop-by-hop
    assert "x-spillway-deadline" not in h  # Spillway's own request headers stop here
    assert h["accept-encoding"] == "identity"
    assert h["x-request-id"] == rid
    # The client's credentials never reach a child; the child's private key does.
    assert h["authorization"] != "Bearer client-secret"
    assert h["authorization"].startswith("Bearer ")


async def test_request_id_is_kept_sent_upstream_and_returned(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}]},
                             headers={"X-Request-Id": "req-42"}) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "req-42"
            assert (await r.json())["fake"]["request_id"] == "req-42"
        # An unusable id (spaces, too long) is replaced, never echoed.
        async with http.get(f"{s.url}/props", headers={"X-Request-Id": "bad id " * 40}) as r:
            assert r.status == 200
            assert len(r.headers["X-Request-Id"]) == 32
    assert "rid=req-42 POST /v1/chat/completions -> gpu 200" in s.log_text()


async def test_oversized_body_gets_413_before_any_child_sees_it(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, state_file: Path) -> None:
    cfg = fake_config(fake_server, tiny_model, server={"max_body_mib": 0.01},
                      gpu={"env": {"FAKE_STATE_FILE": str(state_file)}})
    s = spillway(cfg)
    before = len(generation_requests(state_file))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", data=b"x" * 20000,
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413
            assert r.content_type == "application/json"
            err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error"
    assert err["src"] == "spillway"
    assert "server.max_body_mib" in err["message"]
    assert len(generation_requests(state_file)) == before


@pytest.mark.parametrize("payload,words", [
    (b'{"messages": [', "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"\xff\xfe{}", "UTF-8"),
    (b"", "empty"),
])
async def test_malformed_generation_body_gets_400_and_never_reaches_a_child(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, state_file: Path,
        payload: bytes, words: str) -> None:
    s = spillway(fake_config(fake_server, tiny_model,
                             gpu={"env": {"FAKE_STATE_FILE": str(state_file)}}))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", data=payload,
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
    assert words in err["message"]
    assert err["request_id"] == r.headers["X-Request-Id"]
    assert generation_requests(state_file) == []


async def test_stream_passes_through_event_by_event(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_TOKEN_DELAY_S": "0.3", "FAKE_TOKENS": "4"}})
    s = spillway(cfg)
    arrivals = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}],
                                   "stream": True}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            loop_time = __import__("time").time
            async for line in r.content:
                if line.startswith(b"data: {"):
                    arrivals.append((loop_time(), json.loads(line[6:])))
                elif line.startswith(b"data: [DONE]"):
                    break
    tokens = [(t, e["fake"]) for t, e in arrivals if "fake" in e]
    assert len(tokens) == 4
    # Each token reached the client before the child had produced the next one.
    for (arrived, _), (_, later) in zip(tokens, tokens[1:]):
        assert arrived < later["t"]


async def test_a_client_that_closes_at_done_got_its_whole_answer_not_a_499(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    # The OpenAI client closes its connection at [DONE]; the child ends its response a moment
    # later. The client has every event, so the access line says 200, as llama-server's would,
    # not that the client left early (the stream's end then fails to reach a closed socket).
    cfg = fake_config(fake_server, tiny_model, server={"access_log": True},
                      gpu={"env": {"FAKE_LINGER_AFTER_DONE_S": "1", "FAKE_TOKENS": "3"}})
    s = spillway(cfg)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}],
                                   "stream": True}) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    break
            r.close()  # at once, as the OpenAI client's stream does at [DONE]
    assert await eventually_async(
        lambda: "POST /v1/chat/completions -> gpu " in s.log_text()), s.log_tail()
    assert "POST /v1/chat/completions -> gpu 200" in s.log_text(), s.log_tail()


async def test_no_ready_child_gives_a_controlled_503(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_HANG_START": "1"}},
                      cpu={"env": {"FAKE_HANG_START": "1"}}, queue={"max_waiting": 0})
    s = spillway(cfg, wait_ready=False)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 503
            assert r.content_type == "application/json"
            assert 1 <= int(r.headers["Retry-After"]) <= 60
            assert r.headers["x-should-retry"] == "true"
            assert "X-Spillway-Child" not in r.headers
            err = (await r.json())["error"]
        async with http.get(f"{s.url}/spillway/ready") as ready:
            assert ready.status == 503
    assert err["type"] == "unavailable_error"
    assert err["code"] == 503
    assert err["src"] == "spillway"
    assert err["queue_position"] == 1
    assert err["retry_after_s"] == int(r.headers["Retry-After"])
    # While the children load, llama-server's own words, and Spillway's reason beside them.
    assert err["message"] == "Loading model"
    assert "waiting line is full" in err["reason"] and "gpu is STARTING" in err["reason"]


async def test_routes_to_the_cpu_child_while_the_gpu_child_is_not_ready(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_HANG_START": "1"}})
    s = spillway(cfg, wait_ready=False)
    s.wait_state(("cpu",), ("READY",))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
            assert r.headers["X-Spillway-Child"] == "cpu"
        # Routes outside the caps can be pinned to a child.
        async with http.get(f"{s.url}/props", headers={"X-Spillway-Child": "gpu"}) as r:
            assert r.status == 503
        async with http.get(f"{s.url}/props", headers={"X-Spillway-Child": "cpu"}) as r:
            assert r.status == 200


KEY = "test-key-123"


async def test_a_key_guards_every_route_like_llama_server(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, state_file: Path) -> None:
    cfg = fake_config(fake_server, tiny_model, server={"api_key": KEY},
                      gpu={"env": {"FAKE_STATE_FILE": str(state_file)}})
    s = spillway(cfg, start=False)
    s.start(wait_ready=False)
    s.wait_state(("gpu", "cpu"), ("READY",), headers={"Authorization": f"Bearer {KEY}"})
    before = len(generation_requests(state_file))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        duplicated = CIMultiDict([("Authorization", f"Bearer {KEY}"),
                                  ("Authorization", "Bearer other")])
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"},
                        {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY[:-1]},
                        duplicated):
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/props"),
                                 ("GET", "/v1/models"), ("GET", "/spillway/status")):
                async with http.request(method, s.url + path, json=chat,
                                        headers=headers) as r:
                    assert r.status == 401, (headers, path)
                    err = (await r.json())["error"]
                    assert err["type"] == "authentication_error"
                    assert err["code"] == 401
        assert len(generation_requests(state_file)) == before  # nothing reached a child
        # The open routes stay open.
        for path in ("/health", "/v1/health", "/spillway/health"):
            async with http.get(s.url + path) as r:
                assert r.status == 200, path
        async with http.options(f"{s.url}/v1/chat/completions") as r:
            assert r.status != 401
        # Both of llama-server's ways of presenting the key work.
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"X-Api-Key": KEY}):
            async with http.post(f"{s.url}/v1/chat/completions", json=chat,
                                 headers=headers) as r:
                assert r.status == 200
    posts = [r for r in generation_requests(state_file) if r["method"] == "POST"]
    assert len(posts) == 2


async def test_status_reports_children_as_the_contract_says(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    status = s.status()
    assert set(status) >= {"children", "gpu", "waiting", "config"}
    assert status["waiting"] == 0
    assert status["config"]["path"] == str(s.config_path)
    assert status["config"]["error"] is None
    for name in ("gpu", "cpu"):
        child = status["children"][name]
        assert child["state"] == "READY"
        assert isinstance(child["pid"], int) and isinstance(child["port"], int)
        assert child["port"] != s.port
        assert child["restarts"] == 0
        assert child["last_exit"] is None
        assert child["uptime_s"] >= 0
        # The private key is nowhere in status or on the command line.
        assert "--api-key" not in child["command"]
    assert status["gpu"] is None  # no driver on this machine
    assert "NVML" in status["gpu_note"]



async def test_a_compressed_body_is_forwarded_decompressed_without_its_content_encoding(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, state_file: Path) -> None:
    """What admission parsed and a replay would send again is what the child gets: the body
    decompressed, and no Content-Encoding (the pinned llama-server, built without zlib, answers
    415 to a compressed body). It used to get the decompressed body with the client's
    `Content-Encoding: gzip`, which it could not read."""
    s = spillway(fake_config(fake_server, tiny_model,
                             gpu={"env": {"FAKE_STATE_FILE": str(state_file)}}))
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.post(f"{s.url}/v1/chat/completions", data=gzip.compress(chat),
                             headers={"Content-Encoding": "gzip",
                                      "Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"]
        # A route outside generation, whose body Spillway does not parse: the same.
        async with http.post(f"{s.url}/tokenize", data=zlib.compress(b'{"content": "hi"}'),
                             headers={"Content-Encoding": "Deflate"}) as r:
            assert r.status == 200
            echo = await r.json()
    assert echo["body"] == '{"content": "hi"}'
    forwarded = [{k.lower() for k in r["headers"]} for r in generation_requests(state_file)]
    assert len(forwarded) == 2 and all("content-encoding" not in h for h in forwarded)


async def test_spillways_own_headers_follow_one_rule(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, state_file: Path) -> None:
    """A value Spillway does not know, in any of its request headers, is a 400 naming the
    header, before any child sees the request (X-Spillway-Child, -Replay and -Deadline used to
    be ignored); the OpenAI SDKs' X-Stainless-Timeout never is."""
    s = spillway(fake_config(fake_server, tiny_model,
                             gpu={"env": {"FAKE_STATE_FILE": str(state_file)}}))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/props")):
            for name, value in (("X-Spillway-Child", "tpu"), ("X-Spillway-Replay", "nevr"),
                                ("X-Spillway-Deadline", "30s"), ("X-Spillway-Deadline", "0"),
                                ("X-Spillway-Fallback", "bigger")):
                async with http.request(method, s.url + path, json=chat,
                                        headers={name: value}) as r:
                    assert r.status == 400, (path, name, value)
                    err = (await r.json())["error"]
                    assert (err["type"], err["param"], err["src"]) == (
                        "invalid_request_error", name, "spillway"), err
                    assert name in err["message"] and err["request_id"] == \
                        r.headers["X-Request-Id"]
        assert generation_requests(state_file) == []
        for headers in ({"X-Stainless-Timeout": "0"}, {"X-Stainless-Timeout": "soon"},
                        {"X-Spillway-Replay": "NEVER", "X-Spillway-Deadline": "30",
                         "X-Spillway-Child": "cpu", "X-Spillway-Fallback": "none"}):
            async with http.post(f"{s.url}/v1/chat/completions", json=chat,
                                 headers=headers) as r:
                assert r.status == 200, headers
        async with http.get(f"{s.url}/props", headers={"X-Spillway-Child": " CPU "}) as r:
            assert r.status == 200 and r.headers["X-Spillway-Child"] == "cpu"
