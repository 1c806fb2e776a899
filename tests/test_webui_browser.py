"""llama.cpp's own web UI, in headless Chromium, through Spillway (issue 42).

The real SvelteKit app (built from the pinned sdist's `tools/ui`) is served by the real
llama-server children (`--path <dist>`) through Spillway; the embedded SmolLM2 answers. The GPU
child runs behind tests/gpu_fault_injector.py where a test needs it to die: after K events of
the UI's stream reached Spillway (the captured CUDA line, then SIGABRT). What the UI does is its
own: it sends its built-in tools (`get_datetime`, `get_info`) and `X-Conversation-Id` with every
message, polls /props, /v1/models, /slots and /tools, Stops with `DELETE /v1/stream`, and on a
reload finds its stream again with `POST /v1/streams/lookup` and `GET /v1/stream`.

The page driver and the selectors it relies on are in tests/webui_page.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cdp import Browser
from harness import Spillway, eventually_async, real_config
from test_continuation_integration import smollm2
from webui_page import WebUi, plain

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]
__all__ = ["smollm2"]  # the model fixture, shared with the continuation tests

# Greedy, and short enough for two shared cores: an answer of the embedded SmolLM2 at 60-80
# tokens a second.
SETTINGS: dict[str, Any] = {"temperature": 0, "max_tokens": 80}
QUESTION = "Write two sentences about the sea."
# Long enough for several prompt_progress events with `-b 16 -ub 16` (about 10).
LONG_QUESTION = ("Here are some notes about rivers. Rivers carry water from the hills to the "
                 "sea. ") * 8 + "Summarize these notes in one sentence."


def ui_config(llama_server: Path, model: Path, web_ui: Path, *more: str,
              injector: Path | None = None, fired: Path | None = None,
              events: int = 0, ctx: int = 2048) -> dict[str, Any]:
    """Both children serve the UI (`--path`) and its server tools (`--tools get_info`: /tools
    answers 200, and the UI sends it with its own); two slots of `ctx / 2` tokens. With
    `injector`, the GPU child dies once, on the first generation request, after `events`
    events of its stream reached Spillway."""
    cfg = real_config(llama_server, model, model={"args": [
        "-c", str(ctx), "-np", "2", "-t", "1", "-tb", "1", "--path", str(web_ui),
        "--tools", "get_info", *more]})
    if injector is not None:
        assert fired is not None and events > 0
        cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector),
                      "env": {"REAL_LLAMA_SERVER": str(llama_server), "FAULT_NTH": "1",
                              "FAULT_WHEN": f"events:{events}", "FAULT_ONCE_FILE": str(fired),
                              "FAULT_LINES": "terse"}}
    return cfg


@pytest.fixture
async def browser(chromium: Path, tmp_path: Path) -> AsyncIterator[Any]:
    async with Browser.launch(chromium, tmp_path) as page:
        yield page


async def start(spillway: SpillwayFactory, cfg: dict[str, Any]) -> Spillway:
    return await asyncio.to_thread(spillway, cfg)


def lookup(s: Spillway, conversation: str) -> dict[str, Any] | None:
    """Spillway's stream buffer for the conversation, as the UI looks it up (`is_done`,
    `total_bytes`); None if there is none."""
    code, found = s.post("/v1/streams/lookup", {"conversation_ids": [conversation]})
    assert code == 200 and isinstance(found, list), (code, found)
    return dict(found[0]) if found else None


def buffered(s: Spillway, conversation: str) -> tuple[str, str]:
    """The ended stream's bytes in Spillway's buffer (GET /v1/stream from 0; on a live stream
    this would wait for its end): the text of its deltas, and the bytes."""
    code, raw = s.get(f"/v1/stream?conv_id={conversation}&from=0")
    assert code == 200, (code, raw)
    raw = raw if isinstance(raw, str) else json.dumps(raw)
    text = ""
    for block in raw.split("\n\n"):
        if block.startswith("data: {"):
            event = json.loads(block[6:])
            text += "".join(c.get("delta", {}).get("content") or ""
                            for c in event.get("choices", []))
    return text, raw


async def the_request(ui: WebUi, max_tokens: int = SETTINGS["max_tokens"]
                      ) -> tuple[str, dict[str, Any]]:
    """The UI's chat request in this document: its conversation id and body."""
    [sent] = await ui.chat_requests()
    conversation = sent["headers"].get("x-conversation-id")
    assert conversation, sent["headers"]
    body = json.loads(sent["body"])
    # What makes the UI's streams special: its own tools, always (get_datetime in the page).
    assert any(t["function"]["name"] == "get_datetime" for t in body.get("tools", [])), body
    assert body["stream"] is True and body["max_tokens"] == max_tokens
    return str(conversation), body


async def finished_and_whole(s: Spillway, ui: WebUi, conversation: str) -> str:
    """The answer ended on the page without the error dialog, and it is the whole answer:
    the text Spillway's buffer holds for the conversation, which ended with [DONE]."""
    shown = await ui.wait_answer_ended()
    error = await ui.error_dialog()
    assert error is None, f"the page shows an error: {error!r} (answer so far: {shown!r})"
    done = await eventually_async(lambda: (e := lookup(s, conversation)) and e["is_done"])
    assert done, f"the stream of {conversation} did not end: {lookup(s, conversation)}"
    text, raw = await asyncio.to_thread(buffered, s, conversation)
    last = raw.rstrip().rsplit("\n\n", 1)[-1]
    assert last == "data: [DONE]", f"the stream did not end with [DONE], but with {last[:400]}"
    assert plain(text) and plain(shown) == plain(text), (shown, text)
    return shown


async def chat_incidents(s: Spillway, count: int = 1) -> list[dict[str, Any]]:
    """Spillway's incidents (GET /spillway/incidents) for the UI's chat
    requests, once there are `count`. (The page may still be loading its static files, its
    splash images, when it sends: one caught by the death is an incident of its own.)"""
    def read() -> list[dict[str, Any]]:
        code, body = s.get("/spillway/incidents?limit=50")
        assert code == 200, (code, body)
        return [r for r in body["incidents"] if r["route"] == "/v1/chat/completions"]
    records = await eventually_async(lambda: len(r := read()) >= count and r)
    assert records, f"no {count} incidents of the chat route: {s.incidents()}"
    return list(records)


def said(record: dict[str, Any]) -> dict[str, Any]:
    """What an incident says, for a failed assertion."""
    return {k: record.get(k) for k in ("route", "decision", "reason", "kind", "tokens_before",
                                       "status")}


async def answered(s: Spillway, browser: Any, question: str = QUESTION,
                   fired: Path | None = None, least: int = 20) -> WebUi:
    """The page opened, `question` asked, and its whole answer shown; with `fired`, through
    the GPU child's death (the injector's file says it fired)."""
    ui = WebUi(browser, s.url)
    await ui.open(SETTINGS)
    await ui.ask(question)
    conversation, _ = await the_request(ui)
    if fired is not None:
        await ui.wait_answer_ended()
        assert await asyncio.to_thread(fired.exists), "the GPU child did not die"
    shown = await finished_and_whole(s, ui, conversation)
    assert len(plain(shown)) > least, shown
    return ui


async def test_a_question_sent_from_the_ui_is_answered_on_the_page(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, web_ui: Path,
        browser: Any) -> None:
    s = await start(spillway, ui_config(llama_server, smollm2, web_ui))
    await answered(s, browser)
    assert s.incidents() == []
    assert " 200 " in next(line for line in s.log_text().splitlines()
                           if "POST /v1/chat/completions -> gpu" in line)


async def test_a_gpu_death_mid_answer_the_answer_finishes_on_the_page(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, web_ui: Path,
        injector: Path, tmp_path: Path, browser: Any) -> None:
    """The GPU child dies 8 events into the answer (one prompt_progress event, then the
    role and a few tokens): the page shows the whole answer, continued on the CPU child."""
    s = await start(spillway, ui_config(llama_server, smollm2, web_ui, injector=injector,
                                        fired=tmp_path / "fired", events=8))
    await answered(s, browser, fired=tmp_path / "fired", least=0)
    [record] = await chat_incidents(s)
    assert record["decision"] == "continued" and record["tokens_before"] > 0, said(record)


async def test_a_gpu_death_during_a_long_prompts_prefill_the_answer_finishes_on_the_page(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, web_ui: Path,
        injector: Path, tmp_path: Path, browser: Any) -> None:
    """`-b 16 -ub 16`: the long message's prefill sends about ten prompt_progress events; the
    GPU child dies after the second, before any token of the answer."""
    s = await start(spillway, ui_config(llama_server, smollm2, web_ui, "-b", "16", "-ub", "16",
                                        injector=injector, fired=tmp_path / "fired", events=2))
    await answered(s, browser, LONG_QUESTION, fired=tmp_path / "fired", least=10)
    [record] = await chat_incidents(s)
    assert record["decision"] == "continued" and record["tokens_before"] == 0, said(record)


def slots(s: Spillway) -> list[dict[str, Any]]:
    code, body = s.get("/slots")
    assert code == 200 and isinstance(body, list), (code, body)
    return list(body)


async def test_stop_on_the_page_ends_the_answer_and_frees_the_slot(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, web_ui: Path,
        browser: Any) -> None:
    """A long answer (ignore_eos through the UI's custom JSON, 1800 tokens: over twenty seconds
    here); Stop pressed once its first words show: the page ends it, the UI's
    DELETE /v1/stream reaches Spillway, and the child's slot stops long before 1800 tokens."""
    s = await start(spillway, ui_config(llama_server, smollm2, web_ui, ctx=4096))
    ui = WebUi(browser, s.url)
    await ui.open({**SETTINGS, "max_tokens": 1800,
                   "customJson": json.dumps({"ignore_eos": True})})
    await ui.ask("Tell me a long story about a lighthouse keeper.")
    conversation, _ = await the_request(ui, max_tokens=1800)
    await ui.wait_answer_started(chars=20)
    assert any(slot["is_processing"] for slot in slots(s)), slots(s)
    entry = await asyncio.to_thread(lookup, s, conversation)
    assert entry is not None and not entry["is_done"], entry
    await ui.stop()
    shown = await ui.wait_answer_ended()  # the Stop button is gone, the text stays
    assert plain(shown), shown
    assert await ui.error_dialog() is None
    freed = await eventually_async(lambda: not any(slot["is_processing"] for slot in slots(s)))
    assert freed, f"a slot is still processing after Stop: {slots(s)}"
    # The UI's Stop is `DELETE /v1/stream`: Spillway answered it and forgot the buffer.
    assert await browser.wait_for(
        "(window.__sent || []).some(r => r.method === 'DELETE' && r.status === 204)")
    [delete] = [r for r in await ui.sent() if r["method"] == "DELETE"]
    assert delete["url"] == f"/v1/stream?conv_id={conversation}", delete
    assert await asyncio.to_thread(lookup, s, conversation) is None
    # The child cancelled the task (Spillway closed its connection) long before 1800 tokens.
    log = s.log_text()
    assert re.search(r"\[gpu\].*stop: cancel task", log), s.log_tail()
    released = [int(n) for n in re.findall(
        r"\[gpu\].*release: .*stop processing: n_tokens = (\d+)", log)]
    assert released and released[-1] < 1800, released
    assert plain(await ui.answer_text()), "the answer so far is no longer on the page"
    assert not await ui.generating()


async def test_a_reload_mid_answer_across_a_gpu_death_resumes_the_finished_answer(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, web_ui: Path,
        injector: Path, tmp_path: Path, browser: Any) -> None:
    """A 600-token answer (ignore_eos). The page is reloaded as soon as Spillway's buffer holds
    its first words (the page itself shows them later: on two busy cores Chromium renders the
    stream seconds behind it), and the GPU child dies 300 events in, after the reloaded page
    asked for its stream again (checked: a reload takes one or two seconds here, 300 tokens
    about four). The reloaded page finds the stream in Spillway's buffer (POST
    /v1/streams/lookup, GET /v1/stream) and shows the whole answer, continued on the CPU
    child."""
    s = await start(spillway, ui_config(llama_server, smollm2, web_ui, injector=injector,
                                        fired=tmp_path / "fired", events=300))
    gpu = (await asyncio.to_thread(s.child, "gpu"))["pid"]
    ui = WebUi(browser, s.url)
    settings = {**SETTINGS, "max_tokens": 600, "customJson": json.dumps({"ignore_eos": True})}
    await ui.open(settings)
    await ui.ask(QUESTION)
    conversation, _ = await the_request(ui, max_tokens=600)
    # Some ten events of the answer (about 550 bytes each) in Spillway's buffer, not ended.
    begun = await eventually_async(
        lambda: (e := lookup(s, conversation)) and e["total_bytes"] > 5000 and e)
    assert begun and not begun["is_done"], begun
    await ui.reload()
    # The reloaded document finds the stream again, by itself.
    await browser.wait_for("(window.__sent || []).some(r => r.url.startsWith('/v1/stream?'))")
    child = await asyncio.to_thread(s.child, "gpu")
    assert child["state"] == "READY" and child["pid"] == gpu, \
        f"the GPU child died before the reloaded page asked for its stream: {child}"
    sent = await ui.sent()
    assert any(r["url"] == "/v1/streams/lookup" and r["method"] == "POST" for r in sent), sent
    assert not any(r["url"].endswith("/v1/chat/completions") for r in sent), sent
    await ui.wait_answer_ended()
    assert (tmp_path / "fired").exists(), "the GPU child did not die"
    await finished_and_whole(s, ui, conversation)
    [record] = await chat_incidents(s)
    assert record["decision"] == "continued" and record["tokens_before"] > 0, said(record)
    [resume] = [r for r in await ui.sent() if r["url"].startswith("/v1/stream?")]
    assert resume["url"].startswith(f"/v1/stream?conv_id={conversation}&from="), resume
    assert resume["status"] == 200, resume


def get_with_child(url: str) -> tuple[int, str | None]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.headers.get("X-Spillway-Child")


POLLED = ("/", "/props", "/v1/models", "/slots", "/tools")  # and the app's own files at /


async def test_the_routes_the_ui_polls_answer_from_the_cpu_child_while_the_gpu_child_is_down(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, web_ui: Path) -> None:
    """Paused through Spillway's control, then dead and waiting to restart (a long back-off):
    the routes the UI polls answer 200 from the CPU child."""
    cfg = ui_config(llama_server, smollm2, web_ui)
    cfg["restart"] = {**cfg["restart"], "backoff_initial_s": 60.0, "backoff_max_s": 60.0}
    s = await start(spillway, cfg)

    async def answered_by(child: str) -> None:
        for route in POLLED:
            got = await asyncio.to_thread(get_with_child, s.url + route)
            assert got == (200, child), (route, got)

    await answered_by("gpu")
    code, _ = await asyncio.to_thread(s.post, "/spillway/gpu/pause", {})
    assert code == 200
    await asyncio.to_thread(s.wait_state, ("gpu",), ("STOPPED",))
    await answered_by("cpu")
    code, _ = await asyncio.to_thread(s.post, "/spillway/gpu/resume", {})
    assert code == 200
    await asyncio.to_thread(s.wait_state, ("gpu",), ("READY",))
    await answered_by("gpu")
    os.killpg((await asyncio.to_thread(s.child, "gpu"))["pid"], signal.SIGKILL)
    await asyncio.to_thread(s.wait_state, ("gpu",), ("BACKOFF",))
    await answered_by("cpu")


async def test_with_the_gpu_child_paused_the_page_loads_and_the_cpu_child_answers(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, web_ui: Path,
        browser: Any) -> None:
    s = await start(spillway, ui_config(llama_server, smollm2, web_ui))
    code, _ = await asyncio.to_thread(s.post, "/spillway/gpu/pause", {})
    assert code == 200
    await asyncio.to_thread(s.wait_state, ("gpu",), ("STOPPED",))
    ui = await answered(s, browser)
    assert " 200 " in next(line for line in s.log_text().splitlines()
                           if "POST /v1/chat/completions -> cpu" in line)
    polled = {r["url"].split("?")[0]: r["status"] for r in await ui.sent()
              if r["method"] == "GET"}
    assert all(polled[route] == 200 for route in ("/props", "/v1/models", "/tools")), polled
