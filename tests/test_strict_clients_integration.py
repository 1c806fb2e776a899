"""Issue 47: streams through Spillway have no line a strict client refuses.

Home Assistant's home-llm `json.loads` every line, Jan's llama.cpp extension throws on any line
that is neither `data: ` nor `error: ` (tests/strict_sse.py parses as each does). Real
llama-server children: a plain stream; a stream continued on the CPU child after the GPU
child's death (tests/gpu_fault_injector.py); a stream held past `failover.stream_hold_s`
through a long prefill on the CPU child (the slow model, a prompt over the GPU child's context,
so admission sends it to the CPU child); and a client that asked for pings, which gets
llama-server's own (`:`) through the same hold. What Spillway did is said in the final event,
the incident, the access log and the metrics."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import strict_sse
from harness import Spillway, eventually, real_config
from prometheus_client.parser import text_string_to_metric_families

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
CHAT = "/v1/chat/completions"


def metric(s: Spillway, name: str) -> dict[str, float]:
    status, text = s.get("/spillway/metrics")
    assert status == 200
    return {next(iter(sample.labels.values()), ""): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name}


async def read(s: Spillway, body: dict[str, Any]) -> tuple[aiohttp.ClientResponse, bytes,
                                                          list[tuple[float, bytes]]]:
    """The response, its body, and each line with when it arrived (from the headers)."""
    lines: list[tuple[float, bytes]] = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}{CHAT}", json=body) as r:
            headers_at = time.monotonic()
            async for line in r.content:
                lines.append((time.monotonic() - headers_at, line))
    return r, b"".join(line for _, line in lines), lines


async def test_a_plain_stream_has_no_line_a_strict_client_refuses(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    r, raw, _ = await read(s, {"messages": [{"role": "user", "content": "Hello"}],
                               "max_tokens": 16, "stream": True,
                               "stream_options": {"include_usage": True}})
    assert r.status == 200
    events = strict_sse.both(raw)
    assert events[-1]["usage"]["completion_tokens"] == 16


async def test_a_stream_continued_after_a_gpu_death_is_said_in_its_last_event_not_a_line(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path,
        tmp_path: Path) -> None:
    cfg = real_config(llama_server, tiny_model)
    cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector),
                  "env": {"REAL_LLAMA_SERVER": str(llama_server), "FAULT_NTH": "1",
                          "FAULT_WHEN": "events:10", "FAULT_LINES": "terse",
                          "FAULT_ONCE_FILE": str(tmp_path / "fired")}}
    s = spillway(cfg)
    r, raw, _ = await read(s, {"messages": [{"role": "user", "content": "Tell a story"}],
                               "max_tokens": 60, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}})
    assert (tmp_path / "fired").exists() and r.headers["X-Spillway-Child"] == "gpu"
    events = strict_sse.both(raw)
    assert raw.endswith(b"data: [DONE]\n\n") and not any("error" in e for e in events)
    # The finish and the usage chunk after it (the stream's last event) both say so.
    finish = next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])
    for said in (finish, events[-1]):
        note = said["spillway_continuation"]
        assert (note["from_child"], note["child"]) == ("gpu", "cpu")
    [record] = s.wait_incidents(1)
    assert record["decision"] == "continued" and record["replay_child"] == "cpu"
    tokens_before = record["tokens_before"]
    assert note["tokens_before"] == tokens_before > 0
    assert eventually(lambda: metric(s, "spillway_stream_continuations_total")
                      .get("completed") == 1.0)
    assert eventually(lambda: f"continued_from=gpu tokens_before={tokens_before}"
                      in s.log_text()), s.log_tail()


def held_config(llama_server: Path, slow_model: Path) -> dict[str, Any]:
    """The GPU child holds 256 tokens a slot, the CPU child 2048: a longer prompt is the CPU
    child's, whose prefill of it (one thread, 16 tokens a batch, the slow model) takes
    seconds; the hold lasts one."""
    return real_config(
        llama_server, slow_model,
        model={"args": ["-c", "4096", "-np", "2", "-t", "1", "-tb", "1", "-b", "16",
                        "-ub", "16"]},
        gpu={"args": ["-ngl", "99", "-c", "512"]},
        failover={"stream_hold_s": 1.0})


async def long_prompt(s: Spillway, tokens: int, word: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/tokenize", json={"content": f"{word} " * 100}) as r:
            per_word = len((await r.json())["tokens"]) / 100
    return f"{word} " * int(tokens / per_word)


async def test_a_stream_held_past_the_hold_limit_sends_its_headers_alone_then_its_events(
        spillway: SpillwayFactory, llama_server: Path, slow_model: Path) -> None:
    s = spillway(held_config(llama_server, slow_model))
    prompt = await long_prompt(s, 900, "harbour")
    r, raw, lines = await read(s, {"messages": [{"role": "user", "content": prompt}],
                                   "max_tokens": 4, "stream": True})
    assert r.status == 200 and r.headers["X-Spillway-Child"] == "cpu"
    # Nothing but llama-server's own lines: its events, no comment of Spillway's while the
    # CPU child worked through its prompt, though the status and headers had gone out.
    events = strict_sse.both(raw)
    assert events and raw.endswith(b"data: [DONE]\n\n")
    first_event_s = lines[0][0]
    assert lines[0][1].startswith(b"data: ") and first_event_s > 0.25, lines[:3]
    # Said where an operator reads it: the metric and the access log.
    assert eventually(lambda: metric(s, "spillway_stream_holds_expired_total")
                      .get("cpu") == 1.0)
    assert eventually(lambda: "hold_expired=cpu" in s.log_text()), s.log_tail()
    print(f"headers to first event: {first_event_s:.1f} s; {len(lines)} lines")

    # A client that asked for pings (llama.cpp's web UI asks for one a second) gets them,
    # as llama-server writes them (`:`), through the same hold: no other kind of line. Twice
    # the prompt: its prefill must outlast the hold by more than the ping interval (900 tokens
    # took 1.9 s on an unloaded CI machine, and no ping came after the hold).
    prompt = await long_prompt(s, 1900, "lighthouse")
    r, raw, lines = await read(s, {"messages": [{"role": "user", "content": prompt}],
                                   "max_tokens": 4, "stream": True, "sse_ping_interval": 1})
    assert r.status == 200 and r.headers["X-Spillway-Child"] == "cpu"
    strict_sse.jan(raw.replace(b":\n\n", b""))  # the rest is as before
    said = [line.rstrip(b"\n") for _, line in lines if not line.startswith(b"data: ")]
    assert set(said) == {b":", b""} and said.count(b":") >= 1, said
    pinged = [round(t, 1) for t, line in lines if line == b":\n"]
    first_event_s = next(t for t, line in lines if line.startswith(b"data: "))
    print(f"pings at {pinged} s from the headers; the first event at {first_event_s:.1f} s")
    with pytest.raises(strict_sse.Refused):  # (which is why home-llm never asks)
        strict_sse.home_llm(raw)
