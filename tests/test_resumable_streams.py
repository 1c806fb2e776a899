"""Resumable streams (X-Conversation-Id, GET/DELETE /v1/stream, POST /v1/streams/lookup),
answered from Spillway's own replay buffers, against fake children (a test double; the real
server and a real GPU death are in test_resumable_integration.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import PATIENCE_S, Spillway, eventually_async, fake_config
from prometheus_client.parser import text_string_to_metric_families

from conftest import SpillwayFactory
from supervisor.commands.cli import format_status

pytestmark = pytest.mark.asyncio
CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def data_events(raw: bytes) -> list[bytes]:
    return [b for b in raw.split(b"\n\n") if b.startswith(b"data: ")]


def text_of(raw: bytes) -> str:
    out = ""
    for block in data_events(raw):
        if block.startswith(b"data: {"):
            for choice in json.loads(block[6:]).get("choices", []):
                out += choice.get("delta", {}).get("content") or ""
    return out


async def post_stream(http: aiohttp.ClientSession, url: str, conversation: str,
                      keep: int | None = None, **body: Any) -> tuple[int, bytes]:
    """POST a stream with the conversation id; read it whole, or only `keep` events and then
    leave (the connection closed under the answer)."""
    async with http.post(f"{url}/v1/chat/completions", json={**CHAT, **body},
                         headers={"X-Conversation-Id": conversation}) as r:
        if keep is None:
            return r.status, await r.read()
        got = b""
        while len(data_events(got)) < keep:
            chunk = await r.content.readany()
            assert chunk, "the stream ended before the client meant to leave"
            got += chunk
        r.close()
        return r.status, got


def long_answers(spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
                 tmp_path: Path) -> tuple[Spillway, Path]:
    """A GPU child whose answers take 400 tokens at 50 ms each, and the file where it records
    each stream its reader left (cut off) before the end."""
    cuts = tmp_path / "cuts.jsonl"
    env = {"FAKE_TOKENS": "400", "FAKE_TOKEN_DELAY_S": "0.05", "FAKE_CUT_FILE": str(cuts)}
    return spillway(fake_config(fake_server, tiny_model, gpu={"env": env})), cuts


async def metric(http: aiohttp.ClientSession, url: str, name: str,
                 **labels: str) -> float | None:
    async with http.get(f"{url}/spillway/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


async def test_a_stream_is_read_again_byte_for_byte_and_the_child_never_sees_the_id(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    state = tmp_path / "requests.jsonl"
    s = spillway(fake_config(fake_server, tiny_model,
                             gpu={"env": {"FAKE_STATE_FILE": str(state)}}))
    async with aiohttp.ClientSession() as http:
        status, sent = await post_stream(http, s.url, "conv-1")
        assert status == 200 and sent.endswith(b"data: [DONE]\n\n")
        async with http.get(f"{s.url}/v1/stream", params={"conv_id": "conv-1",
                                                          "from": "0"}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            assert await r.read() == sent
        # From an offset: the rest, as an EventSource that reattaches reads it.
        cut = len(sent) // 2
        async with http.get(f"{s.url}/v1/stream?conv_id=conv-1&from={cut}") as r:
            assert r.status == 200 and await r.read() == sent[cut:]
        async with http.post(f"{s.url}/v1/streams/lookup",
                             json={"conversation_ids": ["conv-1", "unknown"]}) as r:
            assert r.status == 200
            [found] = await r.json()
        assert found["conversation_id"] == "conv-1" and found["is_done"] is True
        assert found["total_bytes"] == len(sent)
        assert found["completed_at"] >= found["started_at"] > 0
        assert await metric(http, s.url, "spillway_stream_resumes_total",
                            result="served") == 2.0
        assert await metric(http, s.url, "spillway_stream_sessions", state="finished") == 1.0
    posted = [r for r in lines(state) if r["path"] == "/v1/chat/completions"]
    assert posted and all("x-conversation-id" not in {k.lower() for k in r["headers"]}
                          for r in posted)
    # The status says what is held, and so does `spillway status`.
    status = s.status()
    assert status["streams"]["live"] == 0 and status["streams"]["finished"] == 1
    assert status["streams"]["held_bytes"] == len(sent)
    assert "resumable streams: 0 live, 1 finished" in format_status(status)


async def test_a_client_that_leaves_does_not_stop_the_answer_and_reads_it_later(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    cuts = tmp_path / "cuts.jsonl"
    env = {"FAKE_TOKENS": "40", "FAKE_TOKEN_DELAY_S": "0.05", "FAKE_CUT_FILE": str(cuts)}
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": env}))
    async with aiohttp.ClientSession() as http:
        status, first = await post_stream(http, s.url, "conv-left", keep=3)
        assert status == 200 and b"[DONE]" not in first
        # Reattached at once: what was held, then the live rest, to the end.
        async with http.get(f"{s.url}/v1/stream?conv_id=conv-left&from={len(first)}") as r:
            rest = await r.read()
    whole = first + rest
    assert whole.endswith(b"data: [DONE]\n\n")
    assert text_of(whole) == "".join(f"tok{i} " for i in range(40))
    assert lines(cuts) == []  # the child was never cut off: it answered to the end
    # The POST's access line is written when its handler ends, which may come after the GET
    # read the held [DONE]: the two requests race to their last line.
    assert await eventually_async(
        lambda: "POST /v1/chat/completions -> gpu 499" in s.log_text()), s.log_tail()


async def test_a_stop_ends_the_answer_on_the_child_and_forgets_it(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    s, cuts = long_answers(spillway, fake_server, tiny_model, tmp_path)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", json=CHAT,
                             headers={"X-Conversation-Id": "conv-stop"}) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
            async with http.delete(f"{s.url}/v1/stream?conv_id=conv-stop") as d:
                assert d.status == 204
            rest = await r.read()  # the client's stream ends, without [DONE]
        assert b"[DONE]" not in rest
        cut = await eventually_async(lambda: lines(cuts))
        assert cut[0]["cut_after"] < 400  # the child stopped generating
        async with http.get(f"{s.url}/v1/stream?conv_id=conv-stop") as r:
            assert r.status == 404
            err = (await r.json())["error"]
            assert err["type"] == "not_found_error"
            assert err["message"] == "Stream not found or expired"
        async with http.delete(f"{s.url}/v1/stream?conv_id=conv-stop") as d:
            assert d.status == 204  # idempotent
        # The server still serves (the stopped request released its slot and lease).
        status, again = await post_stream(http, s.url, "conv-next", max_tokens=3)
        assert status == 200 and again.endswith(b"data: [DONE]\n\n")


async def test_a_new_stream_of_the_conversation_stops_the_old_one(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    s, cuts = long_answers(spillway, fake_server, tiny_model, tmp_path)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", json=CHAT,
                             headers={"X-Conversation-Id": "conv"}) as old:
            await old.content.readuntil(b"\n\n")
            status, new = await post_stream(http, s.url, "conv", max_tokens=5)
            assert status == 200 and new.endswith(b"data: [DONE]\n\n")
            old_rest = await old.read()
        assert b"[DONE]" not in old_rest
        assert await eventually_async(lambda: lines(cuts))
        async with http.get(f"{s.url}/v1/stream?conv_id=conv&from=0") as r:
            assert await r.read() == new


async def test_the_streams_routes_refuse_bad_input_as_llama_server_does(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model, server={"body_timeout_s": 1},
                             streams={"buffer_mib": 0.0002}))  # 209 bytes
    # A lookup whose Content-Length no body follows: server.body_timeout_s holds here too (it
    # used to be held open for as long as the client kept the connection).
    reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
    writer.write(b"POST /v1/streams/lookup HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Length: 50\r\n\r\n")  # the host as curl names it (loopback's rule)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), PATIENCE_S)
    answer = json.loads(await reader.readexactly(
        int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])))
    writer.close()
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head
    assert "server.body_timeout_s" in answer["error"]["message"]
    async with aiohttp.ClientSession() as http:
        for method, path, status, message in (
                ("GET", "/v1/stream", 400, "Missing conversation id in path"),
                ("DELETE", "/v1/stream", 400, "Missing conversation id in path"),
                ("GET", "/v1/stream?conv_id=nobody", 404, "Stream not found or expired")):
            async with http.request(method, s.url + path) as r:
                assert r.status == status
                assert (await r.json())["error"]["message"] == message
        async with http.post(f"{s.url}/v1/streams/lookup", data=b"{not json") as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"].startswith("invalid body")
        async with http.post(f"{s.url}/v1/streams/lookup", json={"other": 1}) as r:
            assert r.status == 200 and await r.json() == []
        async with http.post(f"{s.url}/v1/chat/completions", json=CHAT,
                             headers={"X-Conversation-Id": "x" * 513}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "X-Conversation-Id"
        # The buffer keeps the last 209 bytes: an offset before them is lost.
        status, sent = await post_stream(http, s.url, "small")
        assert status == 200 and len(sent) > 209
        async with http.get(f"{s.url}/v1/stream?conv_id=small&from=0") as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"] == "Stream offset lost, please restart"
        async with http.get(f"{s.url}/v1/stream?conv_id=small&from={len(sent) - 209}") as r:
            assert r.status == 200 and await r.read() == sent[-209:]
        async with http.get(f"{s.url}/v1/stream?conv_id=small&from=abc") as r:
            assert r.status == 400
        # A request that never started a stream (the child refused it) leaves nothing.
        async with http.post(f"{s.url}/v1/chat/completions",
                             json={"messages": "not a list", "stream": True},
                             headers={"X-Conversation-Id": "refused"}) as r:
            assert r.status == 400
        async with http.get(f"{s.url}/v1/stream?conv_id=refused") as r:
            assert r.status == 404
        assert await metric(http, s.url, "spillway_stream_resumes_total",
                            result="offset_lost") == 1.0


async def test_a_stream_replayed_on_the_cpu_child_is_read_again_from_spillway(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """The GPU child dies before the first event: the stream is replayed on the CPU child, and
    the conversation's stream is the CPU child's answer, read from Spillway's buffer (the GPU
    child's own buffer, were it the holder, died with it)."""
    s = spillway(fake_config(fake_server, tiny_model,
                             gpu={"env": {"FAKE_CRASH_AFTER": "1", "FAKE_CRASH_LINES": "terse"}}))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", json=CHAT,
                             headers={"X-Conversation-Id": "conv-cpu"}) as r:
            assert r.status == 200 and r.headers["X-Spillway-Child"] == "cpu"
            sent = await r.read()
        async with http.get(f"{s.url}/v1/stream?conv_id=conv-cpu&from=0") as r:
            assert r.headers["X-Request-Id"]
            assert await r.read() == sent
    [record] = s.wait_incidents(1)
    assert record["decision"] == "replayed"


async def test_the_stream_routes_need_the_key(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    key = "k-123"
    s = spillway(fake_config(fake_server, tiny_model, server={"api_key": key}), start=False)
    s.start(wait_ready=False)
    s.wait_state(("gpu", "cpu"), ("READY",), headers={"Authorization": f"Bearer {key}"})
    async with aiohttp.ClientSession() as http:
        for method, path in (("GET", "/v1/stream?conv_id=a"), ("DELETE", "/v1/stream?conv_id=a"),
                             ("POST", "/v1/streams/lookup")):
            async with http.request(method, s.url + path, json={}) as r:
                assert r.status == 401
            async with http.request(method, s.url + path, json={"conversation_ids": []},
                                    headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status in (200, 204, 404)


async def test_a_reader_waiting_on_a_live_stream_ends_when_spillway_stops(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    env = {"FAKE_TOKENS": "1000", "FAKE_TOKEN_DELAY_S": "0.05"}
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": env},
                             server={"drain_timeout_s": 1}))
    async with aiohttp.ClientSession() as http:
        await post_stream(http, s.url, "conv-long", keep=1)
        async with http.get(f"{s.url}/v1/stream?conv_id=conv-long&from=0") as r:
            await r.content.readuntil(b"\n\n")
            stopping = asyncio.get_running_loop().run_in_executor(None, s.stop)
            rest = await asyncio.wait_for(r.read(), 30)
            assert b"[DONE]" not in rest
            assert await stopping == 0


async def test_a_stop_while_the_stream_waits_in_line_answers_as_llama_server_does(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    """Both children busy: the resumable stream waits in line; a Stop takes it out of the
    line, and its client gets llama-server's 400 "request cancelled by a stop"."""
    env = {"FAKE_TOKENS": "400", "FAKE_TOKEN_DELAY_S": "0.05", "FAKE_SLOTS": "1"}
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": env}, cpu={"env": env}))
    async with aiohttp.ClientSession() as http:
        busy = [await http.post(f"{s.url}/v1/chat/completions", json=CHAT) for _ in range(2)]
        for r in busy:
            await r.content.readuntil(b"\n\n")
        waiting = asyncio.create_task(http.post(
            f"{s.url}/v1/chat/completions", json=CHAT,
            headers={"X-Conversation-Id": "conv-queued"}))

        assert await eventually_async(lambda: s.status().get("waiting")), \
            "it never waited in line"
        async with http.delete(f"{s.url}/v1/stream?conv_id=conv-queued") as d:
            assert d.status == 204
        r = await asyncio.wait_for(waiting, 10)
        assert r.status == 400
        assert "request cancelled by a stop" in (await r.json())["error"]["message"]
        for b in busy:
            b.close()
        async with http.get(f"{s.url}/v1/stream?conv_id=conv-queued") as g:
            assert g.status == 404
