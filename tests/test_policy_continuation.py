"""The continuation rule and the continuation's body (policy/continuation.py), and the rewrite
of the other child's events into one stream (proxy/continued.py), on the pinned server's
chunk shapes (tests/fixtures/llama-server/cpu/*-stream.sse)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.policy import continuation as c
from supervisor.proxy import sse
from supervisor.proxy.continued import ContinuedStream

FIXTURES = Path(__file__).parent / "fixtures" / "llama-server" / "cpu"
CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "stream": True,
        "max_tokens": 100, "temperature": 0, "seed": 7}


@pytest.mark.parametrize(("path", "payload", "opted_out", "expected"), [
    ("/v1/chat/completions", CHAT, False, None),
    ("/chat/completions", CHAT, False, None),
    ("/v1/chat/completions", CHAT, True, c.Refusal.OPTED_OUT),
    ("/v1/embeddings", {"input": "x"}, False, c.Refusal.ROUTE),
    ("/v1/messages", CHAT, False, None),
    ("/v1/messages", {**CHAT, "thinking": {"type": "enabled", "budget_tokens": 99}}, False,
     c.Refusal.REASONING),
    # Tools offered are no reason to refuse (issue 42): only a tool call relayed is.
    ("/v1/messages", {**CHAT, "tools": [{"name": "t", "input_schema": {}}]}, False, None),
    ("/v1/responses", {"input": "x", "stream": True}, False, None),
    ("/responses", {"input": [{"role": "user", "content": "x"}]}, False, None),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema"}}}, False,
     c.Refusal.CONSTRAINED),
    ("/v1/responses", {"input": []}, False, c.Refusal.PROMPT),
    ("/v1/responses", {"input": [{"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "x"}]}]}, False, c.Refusal.PROMPT),
    ("/v1/rerank", {"query": "x"}, False, c.Refusal.ROUTE),
    ("/v1/chat/completions", None, False, c.Refusal.ROUTE),
    ("/v1/chat/completions", {**CHAT, "grammar": "root ::= \"a\""}, False,
     c.Refusal.CONSTRAINED),
    ("/v1/chat/completions", {**CHAT, "json_schema": {"type": "object"}}, False,
     c.Refusal.CONSTRAINED),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, False,
     c.Refusal.CONSTRAINED),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}, False, None),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, False, None),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, False, None),
    # A forced tool call is constrained from the first token, as a grammar is.
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}], "tool_choice": "auto"},
     False, None),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}],
                              "tool_choice": "required"}, False, c.Refusal.CONSTRAINED),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}], "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, False, c.Refusal.CONSTRAINED),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}],
                              "function_call": {"name": "f"}}, False, c.Refusal.CONSTRAINED),
    ("/v1/messages", {**CHAT, "tools": [{"name": "t", "input_schema": {}}],
                      "tool_choice": {"type": "any"}}, False, c.Refusal.CONSTRAINED),
    ("/v1/messages", {**CHAT, "tools": [{"name": "t", "input_schema": {}}],
                      "tool_choice": {"type": "auto"}}, False, None),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}]}, False,
     None),
    ("/v1/chat/completions", {**CHAT, "n": 2}, False, c.Refusal.CHOICES),
    ("/v1/chat/completions", {**CHAT, "messages": []}, False, c.Refusal.PROMPT),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": [
        {"type": "text", "text": "x"}]}]}, False, c.Refusal.PROMPT),
    ("/completion", {"prompt": "Once", "n_predict": 9}, False, None),
    ("/completion", {"prompt": [1, 2, 3]}, False, c.Refusal.PROMPT),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 9}, False, None),
    ("/v1/completions", {"prompt": ["a", "b"]}, False, c.Refusal.PROMPT),
])
def test_which_bodies_may_ever_be_continued(path: str, payload: dict[str, Any] | None,
                                            opted_out: bool, expected: c.Refusal | None) -> None:
    assert c.body_refusal(path, payload, opted_out) == expected


def chat_transcript(*pieces: str, **extra: Any) -> c.Transcript:
    t = c.Transcript("chat")
    t.take({"id": "chatcmpl-A", "created": 100, "model": "m", "system_fingerprint": "b0",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                         "finish_reason": None}]})
    for piece in pieces:
        t.take({"id": "chatcmpl-A", "choices": [{"index": 0, "delta": {"content": piece},
                                                 "finish_reason": None}]})
    for key, value in extra.items():
        setattr(t, key, value)
    return t


def test_the_transcript_follows_what_the_client_received() -> None:
    t = chat_transcript("Once", " upon", " a")
    assert (t.text, t.tokens, t.id, t.created, t.model, t.role_sent) == \
        ("Once upon a", 3, "chatcmpl-A", 100, "m", True)
    t.take({"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "x"}]}}]})
    assert t.tool_calls
    t.take({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert t.finished
    # The pinned server's own streams, event by event.
    for name, kind in (("chat-completions-stream.sse", "chat"),
                       ("completion-stream.sse", "native_completion")):
        t = c.Transcript(kind)
        raw = (FIXTURES / name).read_bytes()
        pieces = []
        for block in raw.split(sse.SEPARATOR):
            data = sse.event_data(block)
            if data.startswith(b"{"):
                event = json.loads(data)
                t.take(event)
                if kind == "chat":
                    pieces += [ch["delta"].get("content") or "" for ch in event["choices"]]
                else:
                    pieces.append(event.get("content") or "")
        assert t.text == "".join(pieces) and t.text and t.finished
    assert t.tokens == 4  # /completion counts its own tokens: the last event's figure


@pytest.mark.parametrize(("transcript", "continued", "left", "available", "refusal"), [
    (chat_transcript("a", "b"), False, None, True, None),
    (chat_transcript("a"), True, None, True, c.Refusal.ALREADY),
    (chat_transcript("a", finished=True), False, None, True, c.Refusal.FINISHED),
    (chat_transcript("a", tool_calls=True), False, None, True, c.Refusal.TOOLS),
    (chat_transcript("a", reasoning=True), False, None, True, c.Refusal.REASONING),
    (chat_transcript(*["x"] * 100), False, None, True, c.Refusal.SPENT),
    (chat_transcript("a"), False, 0.5, True, c.Refusal.DEADLINE),
    (chat_transcript("a"), False, 9.0, True, None),
    (chat_transcript("a"), False, None, False, c.Refusal.NO_TARGET),
])
def test_the_continuation_rule(transcript: c.Transcript, continued: bool, left: float | None,
                               available: bool, refusal: c.Refusal | None) -> None:
    d = c.decide(CHAT, transcript, continued, left, target_expected_s=2.0,
                 target_available=available)
    assert d.allowed == (refusal is None) and d.refusal == refusal


def test_a_chat_continues_from_the_relayed_text_with_the_limit_lowered() -> None:
    before = copy.deepcopy(CHAT)
    body = c.continuation_body(CHAT, chat_transcript("Once", " upon"))
    assert before == CHAT  # the client's body is left as it was
    assert body["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 98 and body["seed"] == 7 and body["temperature"] == 0
    # max_completion_tokens wins where both are given, as OpenAI's API has it.
    both = c.continuation_body({**CHAT, "max_completion_tokens": 50}, chat_transcript("a"))
    assert both["max_completion_tokens"] == 49 and both["max_tokens"] == 100
    # The client's own prefill: the relayed text extends it, no second assistant message.
    prefill = {**CHAT, "messages": [*CHAT["messages"],
                                    {"role": "assistant", "content": "Title:"}]}
    body = c.continuation_body(prefill, chat_transcript(" The", " end"))
    assert body["messages"][-1] == {"role": "assistant", "content": "Title: The end"}
    assert len(body["messages"]) == 2
    # Nothing but the role relayed: the same request once more (no limit to lower).
    assert c.continuation_body(CHAT, chat_transcript())["messages"] == CHAT["messages"]


def test_completions_continue_from_the_prompt_and_the_text() -> None:
    t = c.Transcript("native_completion")
    t.take({"content": " upon", "stop": False})
    body = c.continuation_body({"prompt": "Once", "n_predict": 9, "stream": True}, t)
    assert body == {"prompt": "Once upon", "n_predict": 8, "stream": True}
    t = c.Transcript("oai_completion")
    t.take({"id": "cmpl-1", "choices": [{"text": " upon", "index": 0, "finish_reason": None}]})
    assert t.text == " upon" and t.id == "cmpl-1"
    body = c.continuation_body({"prompt": "Once", "max_tokens": 9}, t)
    assert body["prompt"] == "Once upon" and body["max_tokens"] == 8


def events_of(raw: bytes) -> list[Any]:
    out = []
    for block in raw.split(sse.SEPARATOR):
        data = sse.event_data(block)
        if data:
            out.append(json.loads(data) if data.startswith(b"{") else data.decode())
    return out


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_the_other_childs_events_join_the_first_stream() -> None:
    before = chat_transcript("Once", " upon")
    note = {"from_child": "gpu", "child": "cpu", "kind": "runtime_oom", "tokens_before": 2}
    stream = ContinuedStream(before, note)
    ident = {"id": "chatcmpl-B", "created": 200, "model": "m2", "system_fingerprint": "b9",
             "object": "chat.completion.chunk"}
    raw = b"".join([
        event({**ident, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                            "content": None},
                                     "finish_reason": None}]}),
        event({**ident, "choices": [{"index": 0, "delta": {"content": " a"},
                                     "finish_reason": None}]}),
        event({**ident, "choices": [{"index": 0, "delta": {"content": " time"},
                                     "finish_reason": None}]}),
        event({**ident, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
               "usage": {"completion_tokens": 2, "prompt_tokens": 12, "total_tokens": 14}}),
        b"data: [DONE]\n\n",
    ])
    out = events_of(stream.rewrite(raw))
    assert len(out) == 4  # the second role delta is gone
    assert all(e["id"] == "chatcmpl-A" and e["created"] == 100 and e["model"] == "m" and
               e["system_fingerprint"] == "b0" for e in out[:3])
    assert all("role" not in e["choices"][0]["delta"] for e in out[:3])
    assert [e["choices"][0]["delta"].get("content") for e in out[:2]] == [" a", " time"]
    final = out[2]
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["usage"] == {"completion_tokens": 4, "prompt_tokens": 10, "total_tokens": 14}
    assert final["spillway_continuation"] == note
    assert out[3] == "[DONE]"
    assert stream.text == " a time"


def test_an_echo_of_the_relayed_text_is_stripped_once() -> None:
    stream = ContinuedStream(chat_transcript("Once", " upon"), {})
    first = stream.rewrite(event({"choices": [{"index": 0, "delta": {
        "content": "Once upon a"}}]}))
    assert events_of(first)[0]["choices"][0]["delta"]["content"] == " a"
    # Later pieces are never cut, even when they repeat the text.
    again = stream.rewrite(event({"choices": [{"index": 0, "delta": {
        "content": "Once upon"}}]}))
    assert events_of(again)[0]["choices"][0]["delta"]["content"] == "Once upon"


def test_native_completion_events_join_too() -> None:
    t = c.Transcript("native_completion")
    t.take({"content": "Once", "stop": False})
    stream = ContinuedStream(t, {"tokens_before": 1})
    out = events_of(stream.rewrite(event({"content": " upon", "stop": False,
                                          "tokens_predicted": 1}) +
                                   event({"content": "", "stop": True, "tokens_predicted": 3})))
    assert out[0]["content"] == " upon" and out[0]["tokens_predicted"] == 2
    assert out[1]["tokens_predicted"] == 4 and out[1]["spillway_continuation"] == {
        "tokens_before": 1}


def test_a_stream_cut_before_its_role_delta_keeps_the_continuations() -> None:
    stream = ContinuedStream(c.Transcript("chat"), {})  # only a comment had gone out
    out = events_of(stream.rewrite(event({"id": "x", "choices": [{"index": 0, "delta": {
        "role": "assistant", "content": None}, "finish_reason": None}]})))
    assert out[0]["choices"][0]["delta"]["role"] == "assistant"


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(sse.event_data(b)) for b in raw.split(sse.SEPARATOR)
            if sse.event_data(b).startswith(b"{")]


def test_a_messages_stream_is_followed_and_continued_as_one_message() -> None:
    """/v1/messages (Anthropic's API) on the pinned server: the client had message_start, the
    open text block and 9 text deltas when the child died; the other child, given the text as
    a final assistant message (which llama-server continues by itself), echoes it in its first
    delta (captured: messages-prefill-stream.sse)."""
    whole = sse_events((FIXTURES / "messages-stream.sse").read_bytes())
    t = c.Transcript("messages")
    for event in whole[:11]:  # message_start, content_block_start, 9 text deltas
        t.take(event)
    assert t.id is not None and t.id.startswith("chatcmpl-") and t.role_sent
    assert t.text == "The robot, a sleek and futuristic robot named" and t.tokens == 9
    assert not t.finished
    body = c.continuation_body({**CHAT, "max_tokens": 12}, t)
    assert body["messages"][-1] == {"role": "assistant", "content": t.text}
    assert body["max_tokens"] == 3 and "continue_final_message" not in body
    note = {"from_child": "gpu", "child": "cpu", "kind": "runtime_oom", "tokens_before": 9}
    out = ContinuedStream(t, note).rewrite(
        (FIXTURES / "messages-prefill-stream.sse").read_bytes())
    blocks = [b for b in out.split(sse.SEPARATOR) if b]
    # Named events, as the Messages API sends them; no second message_start or block start.
    assert all(b.startswith(b"event: ") for b in blocks)
    rest = sse_events(out)
    assert [e["type"] for e in rest][:1] == ["content_block_delta"]
    assert "message_start" not in {e["type"] for e in rest}
    assert "content_block_start" not in {e["type"] for e in rest}
    text = "".join(e["delta"]["text"] for e in rest if e["type"] == "content_block_delta")
    assert text.startswith(' "') and not text.startswith("The robot")  # the echo stripped
    # The uninterrupted answer's next tokens were the same: ' "', 'E', 'cho'.
    uninterrupted = "".join(e["delta"]["text"] for e in whole
                            if e["type"] == "content_block_delta")
    assert (t.text + text).startswith(uninterrupted[:len(t.text) + 5])
    [final] = [e for e in rest if e["type"] == "message_delta"]
    assert final["usage"]["output_tokens"] == 6 + 9
    assert final["spillway_continuation"] == note
    # A death after the text block closed is not continued: only the stop reason was left.
    t.take({"type": "content_block_stop", "index": 0})
    assert t.finished
    thinking = c.Transcript("messages")
    thinking.take({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "thinking", "thinking": ""}})
    assert thinking.reasoning


def test_a_responses_stream_is_followed_and_continued_as_one_response() -> None:
    """/v1/responses (OpenAI's Responses API) on the pinned server: the client had the
    response's opening events and 9 text deltas; the other child, asked to continue the final
    assistant message (captured: responses-prefill-stream.sse), sends its own ids and, in its
    done events, the whole text."""
    whole = sse_events((FIXTURES / "responses-stream.sse").read_bytes())
    t = c.Transcript("responses")
    for event in whole[:13]:  # created, in_progress, item added, part added, 9 deltas
        t.take(event)
    assert t.text == "The robot, a sleek and futuristic robot named" and t.tokens == 9
    assert t.id is not None and t.id.startswith("resp_")
    assert t.item_id is not None and t.item_id.startswith("msg_") and not t.finished
    body = c.continuation_body({"input": "Tell me a story.", "max_output_tokens": 12,
                                "stream": True}, t)
    assert body["input"] == [{"role": "user", "content": "Tell me a story."},
                             {"type": "message", "role": "assistant", "content": t.text}]
    assert body["max_output_tokens"] == 3 and body["continue_final_message"] is True
    note = {"from_child": "gpu", "child": "cpu", "kind": "runtime_oom", "tokens_before": 9}
    out = ContinuedStream(t, note).rewrite(
        (FIXTURES / "responses-prefill-stream.sse").read_bytes())
    assert all(b.startswith(b"event: ") for b in out.split(sse.SEPARATOR) if b)
    rest = sse_events(out)
    kinds = [e["type"] for e in rest]
    assert not set(kinds) & {"response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"}
    added = "".join(e["delta"] for e in rest if e["type"] == "response.output_text.delta")
    assert added.startswith(' "')
    full = t.text + added
    assert {e.get("item_id") for e in rest if "item_id" in e} == {t.item_id}
    [done] = [e for e in rest if e["type"] == "response.output_text.done"]
    assert done["text"] == full
    [completed] = [e for e in rest if e["type"] == "response.completed"]
    response = completed["response"]
    assert response["id"] == t.id and response["output"][0]["id"] == t.item_id
    assert response["output"][0]["content"][0]["text"] == full
    assert response["usage"]["output_tokens"] == 6 + 9
    assert response["usage"]["total_tokens"] == \
        response["usage"]["input_tokens"] + response["usage"]["output_tokens"]
    assert completed["spillway_continuation"] == note
    # A reasoning or a function call item is never continued; a done event ends the text.
    for event, flag in (({"type": "response.output_item.added", "item": {"type": "reasoning"}},
                         "reasoning"),
                        ({"type": "response.function_call_arguments.delta", "delta": "{"},
                         "tool_calls"),
                        ({"type": "response.output_text.done", "text": "x"}, "finished")):
        probe = c.Transcript("responses")
        probe.take(event)
        assert getattr(probe, flag), event


def test_a_messages_stream_is_not_continued_on_a_child_that_does_not_prefill() -> None:
    """/v1/messages cannot ask for continue_final_message: a child started with
    --no-prefill-assistant would begin a new answer after the relayed text."""
    t = c.Transcript("messages")
    t.take({"type": "message_start", "message": {"id": "msg_1", "model": "m"}})
    t.take({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "Once"}})
    assert c.decide(CHAT, t, False, None, 1.0, True).allowed
    refused = c.decide(CHAT, t, False, None, 1.0, True, target_prefills=False)
    assert not refused.allowed and "--no-prefill-assistant" in refused.reason
    # Chat asks for it in the body: a child's default does not matter there.
    assert c.decide(CHAT, chat_transcript("a"), False, None, 1.0, True,
                    target_prefills=False).allowed


def test_which_children_prefill_a_final_assistant_message() -> None:
    from supervisor.config.schema import ChildConfig
    base = ChildConfig(name="cpu", args=("-ngl", "0"), llama_server="llama-server",
                       model_path="m.gguf", env={}, start_timeout_s=1.0, stop_grace_s=1.0,
                       max_concurrency=None)
    assert base.prefills_assistant
    assert not ChildConfig(**{**base.__dict__, "args": ("--no-prefill-assistant",)}) \
        .prefills_assistant
    assert not ChildConfig(**{**base.__dict__,
                              "env": {"LLAMA_ARG_PREFILL_ASSISTANT": "false"}}).prefills_assistant


# --- issue 42: what llama.cpp's web UI sends ----------------------------------------------------

# The web UI's chat body (tools/ui/src/lib/services/chat.service.ts in the pinned llama.cpp):
# its two built-in client tools, progress events, a ping every second, reasoning parsed.
UI_TOOLS = [
    {"type": "function", "function": {
        "name": "get_datetime",
        "description": "Returns the current local date and time in ISO 8601 format, with the "
                       "IANA time zone name",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {
        "name": "get_info",
        "description": "Get runtime info (OS name), may call when user asks about local files "
                       "or shell commands",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
]
UI_BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Tell me a story."}], "stream": True,
    "return_progress": True, "sse_ping_interval": 1, "tools": UI_TOOLS,
    "reasoning_format": "auto", "reasoning_control": True, "timings_per_token": True,
    "backend_sampling": False, "chat_template_kwargs": {"enable_thinking": True},
    "max_tokens": 100}
# The pinned server's chunks for it, as measured with curl: every prompt progress event is a
# role delta with `prompt_progress`; then a role delta without; then the tokens.
IDENT = {"id": "chatcmpl-A", "created": 100, "model": "m", "system_fingerprint": "b0",
         "object": "chat.completion.chunk"}


def progress(processed: int, total: int = 48, ident: dict[str, Any] = IDENT) -> dict[str, Any]:
    return {**ident, "choices": [{"index": 0, "finish_reason": None,
                                  "delta": {"role": "assistant", "content": None}}],
            "prompt_progress": {"total": total, "cache": 0, "processed": processed,
                                "time_ms": processed}}


def delta(ident: dict[str, Any] = IDENT, **fields: Any) -> dict[str, Any]:
    return {**ident, "choices": [{"index": 0, "finish_reason": None, "delta": fields}]}


def followed(*events: dict[str, Any]) -> c.Transcript:
    t = c.Transcript("chat")
    for e in events:
        t.take(e)
    return t


TOOL_CALL = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                             "function": {"name": "get_datetime", "arguments": ""}}]}


@pytest.mark.parametrize(("name", "body", "events", "refusal"), [
    ("tools offered, text relayed", UI_BODY,
     [progress(0), progress(48), delta(role="assistant", content=None), delta(content="Once")],
     None),
    ("a tool call relayed", UI_BODY, [progress(0), delta(**TOOL_CALL)], c.Refusal.TOOLS),
    ("progress only", UI_BODY, [progress(0)], None),
    ("progress and a ping only", UI_BODY, [progress(0), progress(16)], None),
    ("text, then a tool call", UI_BODY,
     [progress(0), delta(content="Let me look."), delta(**TOOL_CALL)], c.Refusal.TOOLS),
    ("functions offered, text relayed", {**CHAT, "functions": [{"name": "f"}]},
     [delta(role="assistant", content=None), delta(content="Once")], None),
    ("a legacy function call relayed", {**CHAT, "functions": [{"name": "f"}]},
     [delta(role="assistant", content=None), delta(function_call={"name": "f"})],
     c.Refusal.TOOLS),
    ("reasoning relayed", UI_BODY, [progress(0), delta(reasoning_content="Hm")], None),
    ("reasoning, then text", UI_BODY,
     [delta(reasoning_content="Hm"), delta(content="Once")], None),
    ("text, then reasoning", UI_BODY,
     [delta(content="Once"), delta(reasoning_content="Hm")], c.Refusal.REASONING),
    # Reasoning parsing off (the UI's "disable reasoning parsing"): the text may be a think
    # block's that the template opened, and the continuation would close it.
    ("reasoning parsing off, text relayed", {**UI_BODY, "reasoning_format": "none"},
     [delta(content="Once")], c.Refusal.REASONING),
    ("reasoning parsing off, progress only", {**UI_BODY, "reasoning_format": "none"},
     [progress(0)], None),
])
def test_tools_offered_are_continued_unless_a_call_was_relayed(
        name: str, body: dict[str, Any], events: list[dict[str, Any]],
        refusal: c.Refusal | None) -> None:
    """Issue 42: the web UI offers its built-in tools with every chat. A stream that offers
    tools is followed (body_refusal) and continued unless a tool call was relayed."""
    assert c.body_refusal("/v1/chat/completions", body, False) is None, name
    d = c.decide(body, followed(*events), False, None, 1.0, True)
    assert d.refusal == refusal and d.allowed == (refusal is None), name


def test_messages_and_responses_with_tools_continue_until_a_call_is_relayed() -> None:
    tools = {**CHAT, "tools": [{"name": "t", "input_schema": {}}]}
    assert c.body_refusal("/v1/messages", tools, False) is None
    t = c.Transcript("messages")
    t.take({"type": "message_start", "message": {"id": "msg_1", "model": "m"}})
    t.take({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}})
    t.take({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "Once"}})
    assert c.decide(tools, t, False, None, 1.0, True).allowed
    assert c.continuation_body(tools, t)["tools"] == tools["tools"]
    t.take({"type": "content_block_start", "index": 1,
            "content_block": {"type": "tool_use", "id": "t1", "name": "t", "input": {}}})
    assert c.decide(tools, t, False, None, 1.0, True).refusal == c.Refusal.TOOLS
    offered = {"input": "x", "stream": True, "tools": [{"type": "function", "name": "f"}]}
    r = c.Transcript("responses")
    r.take({"type": "response.created", "response": {"id": "resp_1"}})
    r.take({"type": "response.output_item.added", "item": {"type": "message", "id": "msg_1"}})
    r.take({"type": "response.output_text.delta", "delta": "Once"})
    assert c.decide(offered, r, False, None, 1.0, True).allowed
    assert c.continuation_body(offered, r)["tools"] == offered["tools"]
    r.take({"type": "response.output_item.added", "item": {"type": "function_call"}})
    assert c.decide(offered, r, False, None, 1.0, True).refusal == c.Refusal.TOOLS


def test_a_stream_cut_during_prefill_is_the_same_request_once_more() -> None:
    """Only progress events relayed: nothing generated, nothing to continue from."""
    t = followed(progress(0), progress(16))
    assert t.role_sent and t.id == "chatcmpl-A" and t.tokens == 0 and not t.generated
    body = c.continuation_body(UI_BODY, t)
    assert body == UI_BODY and body is not UI_BODY


def test_everything_else_the_ui_sends_goes_to_the_continuation_as_it_was() -> None:
    t = followed(progress(0), delta(role="assistant", content=None),
                 delta(reasoning_content="Hm,"), delta(reasoning_content=" a robot"),
                 delta(content="Once"))
    body = c.continuation_body(UI_BODY, t)
    for key in ("return_progress", "sse_ping_interval", "tools", "reasoning_format",
                "reasoning_control", "timings_per_token", "backend_sampling",
                "chat_template_kwargs", "stream"):
        assert body[key] == UI_BODY[key], key
    # Reasoning tokens are generated tokens too; the content right after them may be the last
    # reasoning token's (one partial result, two events): 2 known, not 3.
    assert body["max_tokens"] == 98


def test_relayed_reasoning_goes_back_as_the_final_messages_reasoning_content() -> None:
    """The pinned llama-server continues a final assistant message's reasoning_content (its
    autoparser: the template's reasoning start and the text end the prompt, the reasoning
    closed before any content)."""
    t = followed(delta(role="assistant", content=None), delta(reasoning_content="Hm,"),
                 delta(reasoning_content=" a robot"))
    assert (t.reasoning_text, t.text, t.tokens, t.reasoning) == ("Hm, a robot", "", 2, False)
    body = c.continuation_body(UI_BODY, t)
    assert body["messages"][-1] == {"role": "assistant", "content": "",
                                    "reasoning_content": "Hm, a robot"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    t.take(delta(content="Once"))
    assert c.continuation_body(UI_BODY, t)["messages"][-1] == {
        "role": "assistant", "content": "Once", "reasoning_content": "Hm, a robot"}
    assert t.generated == "Hm, a robotOnce"
    # The client's own prefill (with its reasoning) is extended.
    prefill = {**UI_BODY, "messages": [*UI_BODY["messages"], {
        "role": "assistant", "content": "", "reasoning_content": "First,"}]}
    body = c.continuation_body(prefill, followed(delta(reasoning_content=" think")))
    assert body["messages"][-1] == {"role": "assistant", "content": "",
                                    "reasoning_content": "First, think"}
    assert len(body["messages"]) == 2
    # Reasoning counts toward the token limit.
    many = followed(*[delta(reasoning_content="x")] * 100)
    assert c.decide(CHAT, many, False, None, 1.0, True).refusal == c.Refusal.SPENT


def test_the_continuations_progress_and_reasoning_join_the_stream() -> None:
    """The other child's prompt progress events go on without their role (the client has one);
    an echo of the relayed reasoning is stripped from its first reasoning delta."""
    before = followed(progress(0), progress(48), delta(role="assistant", content=None),
                      delta(reasoning_content="Hm,"))
    stream = ContinuedStream(before, {"tokens_before": 1})
    other = {**IDENT, "id": "chatcmpl-B", "created": 200}
    prefill = b"".join(event(e) for e in (progress(0, 52, other), progress(52, 52, other)))
    out = stream.rewrite(prefill)
    # Not a token yet: the incident's continued_after_s runs on to the first one.
    assert out and not stream.generated
    out += stream.rewrite(b"".join(event(e) for e in (
        delta(other, role="assistant", content=None),
        delta(other, reasoning_content="Hm, a"), delta(other, reasoning_content="Hm,"),
        delta(other, content="Once"))) + b":\n\n")
    assert stream.generated
    assert out.endswith(b":\n\n")  # llama-server's ping, a comment: as it is
    events = events_of(out)  # (the comment has no data)
    assert [e["prompt_progress"]["processed"] for e in events[:2]] == [0, 52]
    assert all(e["id"] == "chatcmpl-A" and e["created"] == 100 for e in events)
    assert all("role" not in e["choices"][0]["delta"] for e in events)
    assert [e["choices"][0]["delta"] for e in events[2:]] == [
        {"reasoning_content": " a"}, {"reasoning_content": "Hm,"}, {"content": "Once"}]


def test_the_continuations_own_tool_call_reaches_the_client() -> None:
    """The continuation offers the same tools: a call the model makes after the relayed text
    goes to the client as it came, in the first stream's id."""
    stream = ContinuedStream(followed(delta(role="assistant", content=None),
                                      delta(content="Let me see.")), {})
    other = {**IDENT, "id": "chatcmpl-B"}
    out = events_of(stream.rewrite(event(delta(other, **TOOL_CALL))))
    assert out[0]["id"] == "chatcmpl-A" and out[0]["choices"][0]["delta"] == TOOL_CALL
    assert stream.generated


# --- issue 47: the limit as llama-server reads it, the tokens as it sampled them --------------

KINDS = {"chat": "/v1/chat/completions", "oai_completion": "/v1/completions",
         "native_completion": "/completion", "messages": "/v1/messages",
         "responses": "/v1/responses"}


@pytest.mark.parametrize(("kind", "limits", "read"), [
    # llama-server's schema: n_predict, then its aliases max_completion_tokens and max_tokens;
    # the first present and not null wins, on every route that passes the body on.
    *[(k, {"max_tokens": 16, "n_predict": 256}, 256)
      for k in ("chat", "oai_completion", "native_completion", "responses")],
    *[(k, {"max_tokens": 16, "max_completion_tokens": 50}, 50)
      for k in ("chat", "oai_completion", "native_completion", "responses")],
    ("chat", {"max_completion_tokens": 50, "n_predict": 30, "max_tokens": 16}, 30),
    ("native_completion", {"max_tokens": 16}, 16),
    ("oai_completion", {"max_completion_tokens": 16}, 16),
    ("chat", {"n_predict": None, "max_tokens": 16}, 16),  # null: as if absent
    ("chat", {"n_predict": -1, "max_tokens": 16}, None),  # -1: no limit (the child's -n)
    ("chat", {"max_tokens": -1}, None),
    ("chat", {}, None),
    ("chat", {"max_tokens": 16.9}, 16),  # nlohmann's get<int>: the fraction cut off
    ("chat", {"max_tokens": True}, 1),  # ... and a boolean as 0 or 1
    ("chat", {"max_tokens": 0}, 0),
    # /v1/responses: max_output_tokens, when given, replaces max_tokens (server-chat.cpp).
    ("responses", {"max_output_tokens": 16, "max_tokens": 99}, 16),
    ("responses", {"max_output_tokens": None, "max_tokens": 99}, None),
    ("responses", {"max_output_tokens": 16, "n_predict": 99}, 99),
    ("responses", {"max_tokens": 99}, 99),
    # /v1/messages: its max_tokens alone (the rest is not passed on), 4096 when absent.
    ("messages", {"max_tokens": 16, "n_predict": 256}, 16),
    ("messages", {"n_predict": 256}, 4096),
    ("messages", {}, 4096),
    ("messages", {"max_tokens": None}, None),
])
def test_the_token_limit_is_read_as_llama_server_reads_it(
        kind: str, limits: dict[str, Any], read: int | None) -> None:
    assert c.token_limit(kind, limits) == read


def transcript_of(kind: str, pieces: int) -> c.Transcript:
    """A stream of `kind` cut after `pieces` text events, as its route sends them."""
    t = c.Transcript(kind)
    opening = {"chat": [delta(role="assistant", content=None)],
               "messages": [{"type": "message_start", "message": {"id": "msg_1"}},
                            {"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}],
               "responses": [{"type": "response.created", "response": {"id": "resp_1"}},
                             {"type": "response.output_item.added",
                              "item": {"type": "message", "id": "msg_1"}}]}.get(kind, [])
    piece = {"chat": lambda: delta(content="x"),
             "oai_completion": lambda: {"choices": [{"index": 0, "text": "x"}]},
             "native_completion": lambda: {"content": "x", "stop": False},
             "messages": lambda: {"type": "content_block_delta", "index": 0,
                                  "delta": {"type": "text_delta", "text": "x"}},
             "responses": lambda: {"type": "response.output_text.delta", "delta": "x"}}[kind]
    for e in [*opening, *(piece() for _ in range(pieces))]:
        t.take(e)
    return t


@pytest.mark.parametrize(("kind", "limits", "left"), [
    (kind, limits, left) for kind in KINDS for limits, left in [
        ({"max_tokens": 16, "n_predict": 256}, {"chat": 246, "oai_completion": 246,
                                                "native_completion": 246, "messages": 6,
                                                "responses": 246}[kind]),
        ({"max_completion_tokens": 50, "max_tokens": 16}, {"messages": 6}.get(kind, 40)),
        ({"n_predict": None, "max_tokens": 16}, 6),
        ({"max_tokens": 10}, 1),  # 10 events of 10 would be closed: never under 1
        ({"max_tokens": 0}, 1),
        ({}, {"messages": 4086}.get(kind)),
        ({"n_predict": -1, "max_tokens": 16}, {"messages": 6}.get(kind)),
        ({"max_output_tokens": 30, "max_tokens": 16}, {"responses": 20, "messages": 6}.get(
            kind, 6)),
    ]])
def test_the_continuation_asks_for_what_is_left_where_llama_server_reads_it(
        kind: str, limits: dict[str, Any], left: int | None) -> None:
    """Cut after 10 text events: the other child, reading the continuation's body as
    llama-server reads a body, finds the limit less the 10 tokens (never under 1); no other
    key in the body overrides it; a request without a limit of its own keeps none."""
    prompt = {"prompt": "Once"} if "completion" in kind else \
        {"input": "Once"} if kind == "responses" else {"messages": CHAT["messages"]}
    payload = {**prompt, "stream": True, **limits}
    t = transcript_of(kind, 10)
    assert t.tokens == 10 and not t.finished
    assert c.tokens_left(payload, t) == left
    body = c.continuation_body(payload, t)
    assert c.token_limit(kind, body) == left
    if left is None:
        assert {k: body.get(k) for k in limits} == limits  # nothing to lower


@pytest.mark.parametrize(("limits", "events", "closing"), [
    ({"max_tokens": 16, "n_predict": 256}, 16, False),  # llama-server stops at 256, not 16
    ({"max_tokens": 256, "n_predict": 16}, 16, True),
    ({"max_tokens": 0}, 0, False),  # n_predict 0 still samples one token
    ({"max_tokens": 0}, 1, True),
    ({"n_predict": -1, "max_tokens": 16}, 16, False),
])
def test_a_stream_is_closed_at_the_limit_llama_server_read(
        limits: dict[str, Any], events: int, closing: bool) -> None:
    t = transcript_of("chat", events)
    d = c.decide({**CHAT, **limits}, t, False, None, 1.0, True)
    assert d.closing == closing and d.allowed == (not closing)


def test_a_close_and_a_continuation_say_what_counted() -> None:
    by_events = c.decide({**CHAT, "max_tokens": 3}, transcript_of("chat", 3), False, None,
                         1.0, True)
    assert by_events.closing and "3 of 3 tokens, by its events (one a token)" in by_events.reason
    own = c.Transcript("native_completion")
    own.take({"content": "x", "tokens_predicted": 3, "stop": False})
    by_own = c.decide({"prompt": "Once", "n_predict": 3}, own, False, None, 1.0, True)
    assert by_own.closing
    assert "3 of 3 tokens, by llama-server's own count (tokens_predicted)" in by_own.reason
    going = c.decide({**CHAT, "max_tokens": 3}, transcript_of("chat", 2), False, None, 1.0,
                     True)
    assert going.allowed and going.reason == "continued after 2 tokens, by its events " \
                                             "(one a token)"


@pytest.mark.parametrize(("partials", "counted"), [
    # Each inner list: the events one sampled token's partial result made (its diffs).
    ([["reasoning", "content"]], 1),  # one token split by the parser: one
    ([["reasoning"], ["content"]], 1),  # two tokens, but they cannot be told from the above
    ([["reasoning"], ["reasoning"], ["content"], ["content"]], 3),
    ([["content"], ["reasoning"]], 2),  # reasoning comes first in a partial result: a new one
    ([["content"], [], [], ["content"]], 2),  # held tokens (UTF-8, a stop word) make no event
])
def test_the_chat_events_never_count_more_tokens_than_were_sampled(
        partials: list[list[str]], counted: int) -> None:
    t = followed(delta(role="assistant", content=None))
    for diffs in partials:
        for diff in diffs:
            t.take(delta(**{"reasoning_content" if diff == "reasoning" else "content": "x"}))
    assert t.tokens == counted and not t.counted


# The events of one sampled token on a chat route, as the pinned server makes them: none (its
# text held back), a reasoning diff, a content diff, or both, each its own event.
PARTIAL = st.sampled_from([(), ("reasoning",), ("content",), ("reasoning", "content")])


@given(st.lists(PARTIAL, max_size=60), st.booleans())
def test_no_stream_of_partial_results_counts_more_than_were_sampled(
        partials: list[tuple[str, ...]], timings: bool) -> None:
    """Property: whatever the parser made of each sampled token, the transcript's count is at
    most the tokens sampled (with `timings_per_token`, on the last event of a partial result:
    llama-server's own count)."""
    t = followed(delta(role="assistant", content=None))
    for sampled, diffs in enumerate(partials, start=1):
        events = [delta(**{"reasoning_content" if d == "reasoning" else "content": "x"})
                  for d in diffs]
        if timings and events:
            events[-1]["timings"] = {"predicted_n": sampled}
        for e in events:
            t.take(e)
            assert t.tokens <= sampled


def test_a_continued_streams_usage_claims_no_more_than_was_sent() -> None:
    """The tokens known before (the events: 2, whatever the text would re-tokenize to) and the
    continuation's own; the prompt is the first child's when an event told it."""
    before = chat_transcript("Onceupon", "atimethere")
    stream = ContinuedStream(before, {})
    final = {"choices": [], "usage": {"completion_tokens": 5, "prompt_tokens": 30,
                                      "total_tokens": 35}}
    assert events_of(stream.rewrite(event(final)))[0]["usage"] == {
        "completion_tokens": 7, "prompt_tokens": 28, "total_tokens": 35}
    before.prompt_tokens = 12  # (timings' prompt_n + cache_n, or prompt_progress' total)
    stream = ContinuedStream(before, {})
    assert events_of(stream.rewrite(event(final)))[0]["usage"] == {
        "completion_tokens": 7, "prompt_tokens": 12, "total_tokens": 19}
