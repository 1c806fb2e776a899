"""A pooled keep-alive connection that the child closed just as Spillway reused it.

llama-server (cpp-httplib) closes an idle keep-alive connection after 5 s and after 100
requests; on a busy machine the proxy can hand out a pooled connection whose close it has not
processed yet. The fake child's FAKE_DROP_REUSED switch closes every reused connection with no
answer, so the race happens on every second request. Such a request is sent once more to the
same child on a new connection: not a replay, not a child failure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import fake_config
from prometheus_client.parser import text_string_to_metric_families

from conftest import SpillwayFactory

pytestmark = pytest.mark.asyncio

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def seen(state_file: Path, path: str) -> list[dict[str, Any]]:
    lines = state_file.read_text().splitlines() if state_file.exists() else []
    return [r for r in map(json.loads, lines) if r["path"] == path]


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels}")


@pytest.fixture
def dropping(spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
             tmp_path: Path) -> Any:
    state = tmp_path / "gpu-requests.jsonl"
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": {
        "FAKE_DROP_REUSED": "1", "FAKE_STATE_FILE": str(state)}}))
    return s, state


async def test_a_reused_connection_closed_under_a_request_is_resent_on_a_new_one(
        dropping: Any) -> None:
    s, state = dropping
    async with aiohttp.ClientSession() as http:
        # The fake drops every request that comes on a reused connection: each request after
        # a non-streamed one reuses its connection and is dropped, and the new connection it
        # is sent again on is pooled in turn. (A stream asks for its connection to be closed
        # after it: the request after a stream opens a new one.)
        for stream in (False, True, False, False, False, True):
            async with http.post(f"{s.url}/v1/chat/completions",
                                 json={**CHAT, "stream": stream}) as r:
                body = await r.read()
                assert r.status == 200, body
                # Not a replay: the same child, one attempt, no failover header.
                assert r.headers["X-Spillway-Child"] == "gpu"
                assert r.headers["X-Spillway-Attempts"] == "1"
                assert "X-Spillway-Failover" not in r.headers
                if stream:
                    assert body.rstrip().endswith(b"data: [DONE]")
        # A GET changes nothing (RFC 9110, 9.2.1): it is sent again too.
        for _ in range(2):
            async with http.get(f"{s.url}/slots") as r:
                assert r.status == 200
                assert r.headers["X-Spillway-Child"] == "gpu"
    assert "dropping a request on a reused connection" in s.log_text()  # the race happened
    assert "before a response on a reused connection (request 2 on it" in s.log_text()
    # Not a child failure: no incident, no failover, no restart; the child never left READY.
    assert s.incidents() == []
    gpu = s.child("gpu")
    assert gpu["state"] == "READY" and gpu["restarts"] == 0
    code, text = s.get("/spillway/metrics")
    assert code == 200
    resends = metric(text, "spillway_upstream_stale_connection_resends_total", child="gpu")
    assert resends == 4 + 1  # chats 2, 4, 5 and 6; the second GET
    assert "spillway_failovers_total" not in {
        smp.name for f in text_string_to_metric_families(text) for smp in f.samples}
    # The child saw each dropped request and its resend: six chats, four of them twice.
    assert len(seen(state, "/v1/chat/completions")) == 6 + 4


async def test_a_post_outside_the_generation_routes_is_never_sent_twice(
        dropping: Any) -> None:
    s, state = dropping
    async with aiohttp.ClientSession() as http:
        statuses = []
        for i in range(2):
            async with http.post(f"{s.url}/tools", json={"tool": "x", "i": i}) as r:
                statuses.append(r.status)
    # The second arrived on a reused connection and was dropped with no answer: the child may
    # have acted on it, so it is not sent again (and the failure is the child's evidence).
    assert statuses == [200, 502]
    assert len(seen(state, "/tools")) == 2
    assert "taken as evidence about the child" in s.log_text()


async def test_a_stream_asks_for_its_connection_to_close_since_llama_server_closes_it(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    # The real llama-server closes the connection after every streamed answer while saying
    # `Keep-Alive: timeout=5, max=100`; the next request that took it from the pool failed.
    state = tmp_path / "gpu-requests.jsonl"
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": {
        "FAKE_CLOSE_AFTER_STREAM": "1", "FAKE_STATE_FILE": str(state)}}))
    async with aiohttp.ClientSession() as http:
        for stream in (True, False, True, False):
            async with http.post(f"{s.url}/v1/chat/completions",
                                 json={**CHAT, "stream": stream}) as r:
                assert r.status == 200
                await r.read()
    sent = [{k.lower(): v for k, v in r["headers"].items()}
            for r in seen(state, "/v1/chat/completions")]
    assert [h.get("connection") for h in sent] == ["close", None, "close", None]
