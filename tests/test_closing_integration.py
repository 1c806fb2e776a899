"""The GPU child dies after a stream's last token and before its finish (issue 43): the client
has the whole answer, so the stream ends with the finish llama-server would have sent, and
[DONE] where the route has it, never an error event; a resumable stream's buffer ends the same
way; the incident says `finished`, and what counted. Only when llama-server's own count or one
event a token reached the limit (issue 47): a stream short of it is continued. Real
llama-server children (the embedded SmolLM2-135M-Instruct, or the tests' tiny model); the death
is injected by tests/gpu_fault_injector.py right after the Kth event of the stream reached
Spillway (K: the role delta and the 16 tokens of a limit of 16, so the next events would have
been the finish)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import fake_config
from test_continuation_integration import STORY, dying_gpu, smollm2
from test_finish_integration import contents, cut_after, finishes, greedy, stream
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
    assert "16 of 16 tokens, by its events (one a token)" in record["reason"]
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
    assert "16 of 16 tokens, by llama-server's own count (tokens_predicted)" in record["reason"]


@pytest.mark.asyncio
async def test_a_text_that_re_tokenizes_past_the_limit_is_continued_not_closed(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """The soak's "17 of 16" (issue 47): 15 events relayed of a limit of 16, and the other
    child's tokenizer would count 17 in the text. A recount says nothing of how many tokens
    were sampled, and neither llama-server's own count nor the events reached the limit: the
    stream is continued for the one token left, and ends with the other child's own finish
    (before, it was closed with a made-up `length`)."""
    s = spillway(fake_config(fake_server, tiny_model,
                             gpu={"env": {"FAKE_ABORT_AFTER_EVENTS": "15", "FAKE_TOKENS": "32",
                                          "FAKE_CRASH_LINES": "terse"}},
                             cpu={"env": {"FAKE_TOKENIZE_EXTRA": "2"}}))
    body = {"messages": [{"role": "user", "content": "Count."}], "stream": True,
            "max_tokens": 16}
    raw, _ = await post(f"{s.url}/v1/chat/completions", body)
    events = data_events(raw)
    assert not any("error" in e for e in events) and raw.endswith(b"data: [DONE]\n\n")
    text = [c["delta"]["content"] for e in events for c in e["choices"]
            if c["delta"].get("content")]
    # 15 from the GPU child, then the CPU child's one (the fake answers what it is asked for,
    # up to 8): the continuation asked for the one token left.
    assert len(text) == 16 and text[-1] == "tok0 "
    [final] = [e for e in events if e["choices"][0]["finish_reason"]]
    assert final["choices"][0]["finish_reason"] == "length" and "spillway_closed" not in final
    assert final["spillway_continuation"]["tokens_before"] == 15
    [record] = s.wait_incidents(1)
    assert record["decision"] == "continued" and record["tokens_before"] == 15
    assert "continued after 15 tokens, by its events (one a token)" in record["reason"]


@pytest.mark.parametrize("own_count", [True, False])
@pytest.mark.asyncio
async def test_the_limit_is_reached_by_llama_servers_own_count_where_events_fall_short(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path,
        tmp_path: Path, own_count: bool) -> None:
    """The tiny model's greedy answer to the story: its 80th text event carries tokens 80 and
    81 (a UTF-8 character in two byte tokens). With a limit of 81, cut right after that event:
    with `timings_per_token` llama-server's own count says 81 of 81, so the stream is closed
    at its limit; without it the events say 80, so it is continued for one token (the one
    left, as far as anything says) and ends with the other child's own finish."""
    s = spillway(cut_after(llama_server, tiny_model, injector, tmp_path / "fired", 80, nth=2))
    body = {**greedy(), "max_tokens": 81}
    _, uncut = await stream(s.url, {**body, "timings_per_token": True})
    said = [e["timings"]["predicted_n"] for e in contents(uncut)]
    assert len(said) == 80 and said[-1] == 81 and said[-2] == 79  # (the model's own text)
    raw, events = await stream(s.url, {**body, "timings_per_token": own_count})
    assert (tmp_path / "fired").exists()
    assert not any("error" in e for e in events) and raw.endswith(b"data: [DONE]\n\n")
    [final] = finishes(events)
    assert final["choices"][0]["finish_reason"] == "length"
    [record] = s.wait_incidents(1)
    if own_count:
        assert len(contents(events)) == 80 and final["spillway_closed"]["tokens"] == 81
        assert events[-1]["usage"]["completion_tokens"] == 81
        assert record["decision"] == "finished"
        assert "(81 of 81 tokens, by llama-server's own count (timings.predicted_n))" in \
            record["reason"]
        assert "after the last of 81 tokens, by llama-server's own count" in s.log_text()
    else:
        assert "spillway_closed" not in final
        assert final["spillway_continuation"]["tokens_before"] == 80
        own = events[-1]["timings"]["predicted_n"]
        assert own == 1 and events[-1]["usage"]["completion_tokens"] == 80 + own
        assert record["decision"] == "continued"
