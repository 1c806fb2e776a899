"""Resumable streams across a GPU death, with real llama-server children (the embedded
SmolLM2-135M-Instruct) and the real OpenAI client: a client that left mid-answer comes back
after the GPU child died and reads the whole answer, continued on the CPU child, from
Spillway's replay buffer. The death is injected by tests/gpu_fault_injector.py after K events
of the stream reached Spillway."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from harness import Spillway, eventually
import strict_sse
from test_continuation_integration import STORY, dying_gpu, read_stream, smollm2, text_of

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]
__all__ = ["smollm2"]  # the model fixture, shared with the continuation tests


def events_text(raw: bytes) -> tuple[str, list[dict[str, Any]]]:
    events = [json.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]
    text = "".join(c.get("delta", {}).get("content") or ""
                   for e in events for c in e.get("choices", []))
    return text, events


def lookup(s: Spillway, conversation: str) -> dict[str, Any] | None:
    status, found = s.post("/v1/streams/lookup", {"conversation_ids": [conversation]})
    assert status == 200 and isinstance(found, list)
    return found[0] if found else None


def wait_done(s: Spillway, conversation: str, timeout: float = 120.0) -> dict[str, Any]:
    found = eventually(lambda: (f := lookup(s, conversation)) is not None and f["is_done"] and f,
                       timeout=timeout)
    assert found, f"the stream of {conversation} did not end in {timeout} s"
    return dict(found)


def test_a_client_that_left_reads_the_whole_continued_answer_after_the_gpu_died(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, injector: Path,
        tmp_path: Path) -> None:
    s = spillway(dying_gpu(llama_server, smollm2, injector, tmp_path / "fired", events=25))
    oa = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)
    whole, _ = read_stream(oa)  # the uninterrupted greedy answer, from the GPU child
    # The same question with a conversation id; the client reads 5 chunks and leaves (a page
    # reload). The GPU child dies 25 events in, with nobody reading.
    stream = oa.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": STORY}], max_tokens=120,
        temperature=0, seed=1, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Conversation-Id": "conv-robot"})
    seen = [chunk for _, chunk in zip(range(5), stream)]
    stream.close()
    found = wait_done(s, "conv-robot")
    assert (tmp_path / "fired").exists()
    status, raw = s.get("/v1/stream?conv_id=conv-robot&from=0")
    assert status == 200
    data = raw.encode()
    assert len(data) == found["total_bytes"]
    text, events = events_text(data)
    assert text == text_of(whole) and len(text) > 200
    assert text.startswith(text_of(seen))
    strict_sse.both(data)  # the continuation is said in the final event, not in a line
    assert any("spillway_continuation" in e for e in events)
    assert data.endswith(b"data: [DONE]\n\n")
    assert len({e["id"] for e in events}) == 1
    assert sum(1 for e in events for c in e.get("choices", [])
               if c.get("finish_reason")) == 1
    [record] = s.wait_incidents(1)
    assert record["decision"] == "continued" and record["client_connected"] is False
    # The original client was gone; the answer went on (the access line follows the incident).
    assert eventually(lambda: "-> cpu 499" in s.log_text()), s.log_tail()


@pytest.mark.asyncio
async def test_a_reader_that_reattached_reads_through_the_gpu_death_what_the_client_got(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, injector: Path,
        tmp_path: Path) -> None:
    """A second reader attached to the live stream (an EventSource reattaching) and the client
    that stayed read the same bytes across the death: one stream, continued."""
    s = spillway(dying_gpu(llama_server, smollm2, injector, tmp_path / "fired", events=20,
                           nth=1))
    body = {"model": "smollm2", "messages": [{"role": "user", "content": STORY}],
            "max_tokens": 80, "temperature": 0, "seed": 1, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", json=body,
                             headers={"X-Conversation-Id": "conv-live"}) as r:
            assert r.status == 200
            got = await r.content.readuntil(b"\n\n")

            async def reattach() -> bytes:
                async with http.get(f"{s.url}/v1/stream?conv_id=conv-live&from=0") as g:
                    assert g.status == 200
                    return await g.read()

            reader = asyncio.create_task(reattach())
            got += await r.read()
        again = await asyncio.wait_for(reader, 120)
    assert (tmp_path / "fired").exists()
    assert again == got
    text, _ = events_text(got)
    assert b'"spillway_continuation":{' in got and len(text) > 100
    strict_sse.both(got)
    assert got.endswith(b"data: [DONE]\n\n")
    [record] = s.wait_incidents(1)
    assert record["decision"] == "continued" and record["client_connected"] is True
