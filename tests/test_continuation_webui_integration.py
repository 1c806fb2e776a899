"""Issue 42: llama.cpp's own web UI's chat streams survive a GPU death.

The UI sends, with every chat, its built-in client tools, `return_progress` (its first events
are prompt progress events), a ping every second, reasoning parsed, and an X-Conversation-Id.
Real llama-server children (SmolLM2, and a tiny random model with a reasoning template, whose
every token is reasoning); the GPU child's death is injected by tests/gpu_fault_injector.py
after its first progress event (prefill) or after generated tokens. Each stream ends in tokens
and [DONE] with no error event; what the children were sent is recorded by the injector (the
CPU child behind it too, with no fault)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import Spillway, real_config
from tinymodel import write_tiny_model

from conftest import SpillwayFactory
from supervisor.commands import bootstrap

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

# tools/ui/src/lib/constants/get-datetime.ts and browser-info.ts in the pinned llama.cpp.
UI_TOOLS = [
    {"function": {"description": "Returns the current local date and time in ISO 8601 "
                                 "format, with the IANA time zone name",
                  "name": "get_datetime",
                  "parameters": {"properties": {}, "required": [], "type": "object"}},
     "type": "function"},
    {"function": {"description": "Get runtime info (OS name), may call when user asks about "
                                 "local files or shell commands",
                  "name": "get_info",
                  "parameters": {"properties": {}, "required": [], "type": "object"}},
     "type": "function"},
]
STORY = ("Tell me a short story about a robot who learns to paint. Make it about a page long, "
         "with a beginning, a middle and an end, and give the robot a name.")


def ui_body(**extra: Any) -> dict[str, Any]:
    """The body chat.service.ts builds (its key order; `undefined` keys left out), with the
    settings a user may have set (a token limit, timings per token, backend sampling)."""
    return {
        "messages": [{"content": "You are a helpful assistant.", "role": "system"},
                     {"content": STORY, "role": "user"}],
        "return_progress": True, "sse_ping_interval": 1, "stream": True, "tools": UI_TOOLS,
        "reasoning_format": "auto", "reasoning_control": True, "max_tokens": 40,
        "backend_sampling": False, "timings_per_token": True, **extra}


# What Spillway may pass on as it likes; everything else must reach the children as it was.
PASSED_ON = ("return_progress", "sse_ping_interval", "tools", "reasoning_format",
             "reasoning_control", "backend_sampling", "timings_per_token",
             "chat_template_kwargs")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return bootstrap.ensure_model()


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("thinking") / "thinking.gguf",
                            reasoning=True)


def children(llama_server: Path, model: Path, injector: Path, folder: Path,
             when: str, ctx: int = 2048) -> dict[str, Any]:
    """The GPU child dies on its first generation request at `when`; both children's
    requests are recorded. `-b 16 -ub 16`: the prompt is processed 16 tokens at a time, one
    progress event each."""
    cfg = real_config(llama_server, model, model={"args": [
        "-c", str(ctx), "-np", "2", "-t", "1", "-tb", "1", "-b", "16", "-ub", "16"]})
    cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector),
                  "env": {"REAL_LLAMA_SERVER": str(llama_server), "FAULT_NTH": "1",
                          "FAULT_WHEN": when, "FAULT_LINES": "terse",
                          "FAULT_BODIES_FILE": str(folder / "gpu-bodies.jsonl")}}
    cfg["cpu"] = {**cfg["cpu"], "llama_server": str(injector),
                  "env": {"REAL_LLAMA_SERVER": str(llama_server),
                          "FAULT_BODIES_FILE": str(folder / "cpu-bodies.jsonl")}}
    return cfg


def sent(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
        else []


async def stream(s: Spillway, route: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        async with http.post(f"{s.url}{route}", json=body,
                             headers={"X-Conversation-Id": "conv-42"}) as r:
            assert r.status == 200, await r.text()
            return await r.read()


def data_events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.split(b"\n\n"):
        data = b"\n".join(line[5:].strip() for line in block.split(b"\n")
                          if line.startswith(b"data:"))
        if data:
            out.append(json.loads(data) if data.startswith(b"{") else data.decode())
    return out


def deltas(events: list[Any]) -> list[dict[str, Any]]:
    return [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e.get("choices")]


def check_one_whole_stream(raw: bytes) -> tuple[list[Any], list[Any]]:
    """Tokens and [DONE], no error event, one id; the events before and after the switch."""
    assert b'"error"' not in raw, raw[-600:]
    # Events, and the pings the UI asks for (`:`, as llama-server writes them): no line of
    # Spillway's own says the switch.
    assert all(line in (b"", b":") or line.startswith(b"data: ")
               for line in raw.split(b"\n")), raw[:600]
    every = data_events(raw)
    assert every[-1] == "[DONE]"
    # The switch: the continuation's first prompt progress event, which comes without the
    # role (the first child's each carry it).
    switch = next(i for i, e in enumerate(every) if isinstance(e, dict) and
                  "prompt_progress" in e and "role" not in e["choices"][0]["delta"])
    first, then = every[:switch], every[switch:]
    events = [e for e in every if isinstance(e, dict)]
    assert len({e["id"] for e in events}) == 1
    finishes = [e for e in events
                if e.get("choices") and e["choices"][0].get("finish_reason")]
    assert len(finishes) == 1 and finishes[0]["spillway_continuation"]["child"] == "cpu"
    # The client's first events were prompt progress events, with the role (measured: each
    # is a role delta with `prompt_progress`); the continuation's come without it.
    assert "prompt_progress" in first[0] and first[0]["choices"][0]["delta"]["role"]
    assert all("role" not in d for d in deltas(then))
    return first, then


def generated(delta_list: list[dict[str, Any]]) -> str:
    return "".join((d.get("reasoning_content") or "") + (d.get("content") or "")
                   for d in delta_list)


def check_passed_on(folder: Path, body: dict[str, Any]) -> tuple[dict[str, Any],
                                                                 dict[str, Any]]:
    """The first attempt and the continuation were sent everything the UI sent."""
    [gpu] = sent(folder / "gpu-bodies.jsonl")
    [cpu] = sent(folder / "cpu-bodies.jsonl")
    for attempt in (gpu, cpu):
        for key in PASSED_ON:
            assert attempt["body"].get(key) == body.get(key), key
        # Spillway holds the conversation's stream itself (stream_sessions.py): the header
        # stops there, on the first attempt and on the continuation alike.
        assert "X-Conversation-Id" not in attempt["headers"]
    assert gpu["body"] == body
    return gpu["body"], cpu["body"]


@pytest.mark.parametrize("when", ["events:1", "tokens:1"])
async def test_the_web_uis_stream_continues_after_a_death_in_prefill_or_after_a_token(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, injector: Path,
        tmp_path: Path, when: str) -> None:
    """SmolLM2 (its template ignores the tools): (a) `events:1`, the death right after the
    first progress event, before any generated token: the same request goes to the CPU child
    and its stream, progress events included, follows; (b) `tokens:1`, after the first token:
    the continuation is asked for with the token as the final assistant message."""
    s = spillway(children(llama_server, smollm2, injector, tmp_path, when))
    body = ui_body()
    first, then = check_one_whole_stream(await stream(s, "/v1/chat/completions", body))
    text_before = generated(deltas(first))
    assert generated(deltas(then))  # tokens after the switch
    assert any("prompt_progress" in e for e in then if isinstance(e, dict))
    _, continuation = check_passed_on(tmp_path, body)
    [record] = s.wait_incidents(1)
    assert record["decision"] == "continued" and record["replay_child"] == "cpu"
    assert 0 < record["continued_after_s"] < 60  # the death to the CPU child's first token
    if when == "events:1":
        assert not text_before and record["tokens_before"] == 0
        assert continuation == body  # nothing generated: the same request once more
    else:
        assert text_before and record["tokens_before"] == 1
        assert continuation["messages"][-1] == {"role": "assistant", "content": text_before}
        assert continuation["continue_final_message"] is True
        assert continuation["add_generation_prompt"] is False
        assert continuation["max_tokens"] == body["max_tokens"] - 1


@pytest.mark.parametrize("when", ["events:1", "tokens:5"])
async def test_a_reasoning_stream_continues_as_reasoning(
        spillway: SpillwayFactory, llama_server: Path, thinking_model: Path, injector: Path,
        tmp_path: Path, when: str) -> None:
    """A tiny model with Qwen3.5's template, whose generation prompt opens a think block:
    every token is a `reasoning_content` delta. Cut after 5 of them, the relayed reasoning goes
    back as the final message's `reasoning_content`, and the CPU child goes on with reasoning
    deltas (its prompt ends with `<think>\\n` and the text: measured with /apply-template)."""
    s = spillway(children(llama_server, thinking_model, injector, tmp_path, when, ctx=8192))
    body = ui_body(chat_template_kwargs={"enable_thinking": True})
    first, then = check_one_whole_stream(await stream(s, "/v1/chat/completions", body))
    after = deltas(then)
    assert any(d.get("reasoning_content") for d in after)
    assert not any(d.get("content") for d in after)  # still reasoning: never closed
    _, continuation = check_passed_on(tmp_path, body)
    [record] = s.wait_incidents(1)
    assert record["decision"] == "continued"
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas(first))
    if when == "events:1":
        assert not reasoning and continuation == body
    else:
        assert reasoning and record["tokens_before"] >= 5
        assert continuation["messages"][-1] == {"role": "assistant", "content": "",
                                                "reasoning_content": reasoning}
        assert continuation["continue_final_message"] is True
        # No echo of the relayed reasoning in the continuation's first delta.
        assert not next(d["reasoning_content"] for d in after
                        if d.get("reasoning_content")).startswith(reasoning)


@pytest.mark.parametrize(("route", "body", "reasoning_event"), [
    ("/v1/responses", {"input": STORY, "stream": True, "max_output_tokens": 40, "tools": [
        {"type": "function", "name": "get_datetime", "parameters": {"type": "object"}}]},
     "response.reasoning_text.delta"),
    # (No `thinking` asked for: the pinned build sends a thinking block all the same.)
    ("/v1/messages", {"messages": [{"role": "user", "content": STORY}], "stream": True,
                      "max_tokens": 40, "tools": [{"name": "get_datetime",
                                                   "input_schema": {"type": "object"}}]},
     "content_block_delta"),
])
async def test_reasoning_a_continuation_cannot_carry_ends_with_the_error_event_at_once(
        spillway: SpillwayFactory, llama_server: Path, thinking_model: Path, injector: Path,
        tmp_path: Path, route: str, body: dict[str, Any], reasoning_event: str) -> None:
    """/v1/responses streams reasoning as a reasoning item, /v1/messages as a thinking block:
    a continuation cannot carry either, so the death ends the stream with the error event,
    straight away (tools offered are no reason: the incident names the reasoning)."""
    s = spillway(children(llama_server, thinking_model, injector, tmp_path, "events:5",
                          ctx=8192))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(f"{s.url}{route}", json=body) as r:
            raw = await r.read()
    events = data_events(raw)
    assert any(isinstance(e, dict) and e.get("type") == reasoning_event for e in events)
    assert "not continued" in events[-1]["error"]["message"]
    [record] = s.wait_incidents(1)
    assert record["decision"] == "passed_on" and "reasoning" in record["reason"]
