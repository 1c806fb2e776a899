"""Issue 42 with fake children: a stream that offers tools is continued, unless a tool call
was relayed, which ends it with the error event at once (a random model will not call a tool
when asked to; the fake child does, as llama-server streams one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import fake_config

from conftest import SpillwayFactory

pytestmark = pytest.mark.asyncio
TOOLS = [{"type": "function", "function": {
    "name": "get_datetime", "description": "The date and time",
    "parameters": {"type": "object", "properties": {}, "required": []}}}]


async def chat(url: str) -> list[Any]:
    body = {"messages": [{"role": "user", "content": "What time is it?"}], "stream": True,
            "max_tokens": 8, "tools": TOOLS}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            raw = await r.read()
    return [json.loads(b[6:]) if b.startswith(b"data: {") else b[6:].decode()
            for b in raw.split(b"\n\n") if b.startswith(b"data: ")]


@pytest.mark.parametrize(("gpu_env", "continued"), [
    ({"FAKE_ABORT_AFTER_EVENTS": "3"}, True),  # tools offered, text relayed
    ({"FAKE_TOOL_CALL_AT": "2", "FAKE_ABORT_AFTER_EVENTS": "3"}, False),  # a call relayed
])
async def test_a_stream_with_tools_is_continued_unless_a_tool_call_was_relayed(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        gpu_env: dict[str, str], continued: bool) -> None:
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": {
        **gpu_env, "FAKE_CRASH_LINES": "terse"}}))
    events = await chat(s.url)
    [record] = s.wait_incidents(1)
    if continued:
        assert events[-1] == "[DONE]" and not any("error" in e for e in events
                                                   if isinstance(e, dict))
        assert record["decision"] == "continued" and record["tokens_before"] == 3
        return
    # Three events (the third a tool call), then the error event at once: no [DONE].
    assert [bool(e["choices"][0]["delta"].get("tool_calls")) for e in events[:3]] == \
        [False, False, True]
    assert len(events) == 4 and "[DONE]" not in events
    assert "a tool call had begun" in events[-1]["error"]["message"]
    assert record["decision"] == "passed_on" and "a tool call had begun" in record["reason"]
