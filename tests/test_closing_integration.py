"""The GPU child dies after a stream's last token and before its finish (issue 43): the client
has the whole answer, so the stream ends with the finish llama-server would have sent, and
[DONE] where the route has it, never an error event; a resumable stream's buffer ends the same
way; the incident says `finished`. Real llama-server children (the embedded
SmolLM2-135M-Instruct); the death is injected by tests/gpu_fault_injector.py right after the
Kth event of the stream reached Spillway (K: the role delta and the 16 tokens of a limit of
16, so the next events would have been the finish)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import fake_config
from test_continuation_integration import STORY, dying_gpu, smollm2
from test_resumable_integration import wait_done

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]
__all__ = ["smollm2"]  # the model fixture, shared with the continuation tests


def data_events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]


async def post(url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[bytes, dict[str, str]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers=headers or {}) as r:
            assert r.status == 200
            return await r.read(), dict(r.headers)


@pytest.mark.asyncio
async def test_a_chat_stream_at_its_limit_when_the_gpu_dies_ends_with_its_finish(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, injector: Path,
        tmp_path: Path) -> None:
    s = spillway(dying_gpu(llama_server, smollm2, injector, tmp_path / "fired", events=17))
    body = {"messages": [{"role": "user", "content": STORY}], "max_tokens": 16,
            "temperature": 0, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    url = f"{s.url}/v1/chat/completions"
    whole, _ = await post(url, body)  # uninterrupted, from the GPU child
    # The same question, resumable: the GPU child dies after the 16th token's event.
    raw, headers = await post(url, body, {"X-Conversation-Id": "conv-limit"})
    assert (tmp_path / "fired").exists()
    assert headers["X-Spillway-Child"] == "gpu"
    events = data_events(raw)
    assert not any("error" in e for e in events) and b"upstream_error" not in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == "".join(c["delta"].get("content") or ""
                           for e in data_events(whole) for c in e["choices"])
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    final = next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])
    assert final["spillway_closed"]["from_child"] == "gpu"
    assert final["spillway_closed"]["tokens"] == 16 and final["id"] == events[0]["id"]
    # The usage the client asked for: the tokens relayed (the prompt's were never told).
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 16
    [record] = s.wait_incidents(1)
    assert record["decision"] == "finished" and record["status"] == 200
    assert "token limit was reached before the child died" in record["reason"]
    assert "16 of 16 tokens" in record["reason"]
    # The resumable stream's buffer has the finish too: a resume sees the answer end.
    wait_done(s, "conv-limit")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{s.url}/v1/stream?conv_id=conv-limit&from=0") as r:
            assert r.status == 200
            buffered = await r.read()
    assert buffered == raw


@pytest.mark.asyncio
async def test_a_completion_stream_at_its_limit_when_the_gpu_dies_ends_with_its_stop(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, injector: Path,
        tmp_path: Path) -> None:
    """/completion: 16 token events, then the stop event llama-server sends at its limit."""
    s = spillway(dying_gpu(llama_server, smollm2, injector, tmp_path / "fired", events=16,
                           nth=1))
    body = {"prompt": "Once upon a time", "n_predict": 16, "temperature": 0, "stream": True}
    raw, _ = await post(f"{s.url}/completion", body)
    assert (tmp_path / "fired").exists()
    events = data_events(raw)
    assert not any("error" in e for e in events)
    assert [e["tokens_predicted"] for e in events] == [*range(1, 17), 16]
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == "limit"
    assert events[-1]["tokens_evaluated"] == 4 and events[-1]["content"] == ""
    assert sum(1 for e in events if e.get("stop")) == 1 and b"[DONE]" not in raw
    [record] = s.wait_incidents(1)
    assert record["decision"] == "finished" and record["route"] == "/completion"


@pytest.mark.asyncio
async def test_a_text_that_re_tokenizes_past_the_limit_is_closed_not_broken(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """The soak's "17 of 16": 15 events relayed of a limit of 16 (the events merge a few
    tokens), and the other child's tokenizer counts 17 in the text. llama-server stops at its
    limit, so the text was generated within 16: the count stops there, and the stream is
    closed with its finish instead of the error event."""
    s = spillway(fake_config(fake_server, tiny_model,
                             gpu={"env": {"FAKE_ABORT_AFTER_EVENTS": "15", "FAKE_TOKENS": "32",
                                          "FAKE_CRASH_LINES": "terse"}},
                             cpu={"env": {"FAKE_TOKENIZE_EXTRA": "2"}}))
    body = {"messages": [{"role": "user", "content": "Count."}], "stream": True,
            "max_tokens": 16}
    raw, _ = await post(f"{s.url}/v1/chat/completions", body)
    events = data_events(raw)
    assert not any("error" in e for e in events) and raw.endswith(b"data: [DONE]\n\n")
    assert len(events) == 16 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["spillway_closed"]["tokens"] == 16
    [record] = s.wait_incidents(1)
    assert record["decision"] == "finished"
    assert "16 of 16 tokens, as the cpu child counts the text" in record["reason"]
