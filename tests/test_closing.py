"""A stream whose child died after its token limit was reached and before its finish (issue
43): the token count as llama-server counts it (policy/continuation.py's Transcript), the
decision to close it (`at_limit`, `decide`), and the closing events (proxy/closing.py) against
the pinned llama-server's own, on streams captured from it with a limit of 16 tokens
(tests/fixtures/llama-server/limit/, SmolLM2-135M-Instruct: curl, `max_tokens: 16` or
`n_predict: 16`, greedy but for the emoji one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.policy import continuation as c
from supervisor.proxy import sse
from supervisor.proxy.closing import closing_events, rest_events

LIMIT = Path(__file__).parent / "fixtures" / "llama-server" / "limit"
STORY = [{"role": "user", "content": "Tell me a story about a cat."}]
NOTE = {"from_child": "gpu", "kind": "cuda_error", "tokens": 16, "reason": "length"}


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.split(sse.SEPARATOR):
        data = sse.event_data(block)
        if data.startswith(b"{"):
            out.append(json.loads(data))
    return out


def is_final(kind: str, event: dict[str, Any]) -> bool:
    """The first of the events llama-server sends only as the answer ends."""
    if kind == "native_completion":
        return event.get("stop") is True
    if kind == "messages":
        return event.get("type") in ("content_block_stop", "message_delta", "message_stop")
    if kind == "responses":
        return str(event.get("type")).endswith(".done") or event.get("type") == \
            "response.completed"
    return any(ch.get("finish_reason") for ch in event.get("choices") or []) or \
        "usage" in event


def cut(name: str, kind: str) -> tuple[c.Transcript, list[dict[str, Any]], bytes]:
    """The capture, cut where the GPU child died: after the last token, before the finish.
    The transcript of what the client had, the finals it missed, and the capture's bytes."""
    raw = (LIMIT / name).read_bytes()
    every = events(raw)
    first_final = next(i for i, e in enumerate(every) if is_final(kind, e))
    t = c.Transcript(kind)
    for event in every[:first_final]:
        t.take(event)
    return t, every[first_final:], raw


# Each capture: the route kind, the body's limit, and llama-server's own count at its end.
CAPTURES = [
    ("chat-max16.sse", "chat", {"messages": STORY, "max_tokens": 16}),
    ("chat-max16-usage.sse", "chat", {"messages": STORY, "max_tokens": 16,
                                      "stream_options": {"include_usage": True}}),
    # 16 tokens in 10 text events (emoji pieces merge): timings_per_token's predicted_n
    # tells what the events cannot.
    ("chat-max16-emoji-timings.sse", "chat", {"messages": STORY, "max_tokens": 16,
                                              "timings_per_token": True}),
    ("oai-completion-max16.sse", "oai_completion", {"prompt": "Once upon a time",
                                                    "max_tokens": 16}),
    ("completion-n16.sse", "native_completion", {"prompt": "Once upon a time",
                                                 "n_predict": 16}),
    ("messages-max16.sse", "messages", {"messages": STORY, "max_tokens": 16}),
    ("responses-max16.sse", "responses", {"input": STORY[0]["content"],
                                          "max_output_tokens": 16}),
]


@pytest.mark.parametrize(("name", "kind", "payload"), CAPTURES)
def test_the_tokens_are_counted_as_llama_server_counts_them(
        name: str, kind: str, payload: dict[str, Any]) -> None:
    """Cut after the last token, each capture's transcript holds llama-server's own count (the
    `n_decoded` its limit was checked against: 16), so the stream is at its limit."""
    t, finals, _ = cut(name, kind)
    assert t.tokens == 16 and not t.finished
    decision = c.decide(payload, t, False, None, 1.0, True)
    assert decision.closing and decision.refusal is c.Refusal.SPENT and not decision.allowed
    assert "16 of 16 tokens" in decision.reason


@pytest.mark.parametrize(("events_", "tokens", "counted"), [
    # The role delta (content null) and an empty content are no token.
    ([{"choices": [{"delta": {"role": "assistant", "content": None}}]},
      {"choices": [{"delta": {"content": ""}}]}], 0, False),
    ([{"choices": [{"delta": {"content": "Once"}}]}], 1, False),
    # One event with reasoning and content both (a build that sends them together): one token.
    ([{"choices": [{"delta": {"reasoning_content": "Hm", "content": "Once"}}]}], 1, False),
    # llama-server's own running count wins over the events (they merge UTF-8 pieces).
    ([{"choices": [{"delta": {"content": "🔄"}}], "timings": {"predicted_n": 5}}], 5, True),
    ([{"content": " the", "tokens_predicted": 3, "tokens_evaluated": 4}], 3, True),
])
def test_the_count_of_events(events_: list[dict[str, Any]], tokens: int, counted: bool) -> None:
    t = c.Transcript("chat" if "choices" in events_[0] else "native_completion")
    for event in events_:
        t.take(event)
    assert (t.tokens, t.counted) == (tokens, counted)


def chat_at(n: int, **extra: Any) -> c.Transcript:
    t = c.Transcript("chat", tokens=n, text="x" * n)
    for key, value in extra.items():
        setattr(t, key, value)
    return t


@pytest.mark.parametrize(("transcript", "payload", "closing", "refusal"), [
    (chat_at(15), {"max_tokens": 16}, False, None),  # a token left: continued
    (chat_at(16), {"max_tokens": 16}, True, c.Refusal.SPENT),
    (chat_at(16, reasoning=True), {"max_tokens": 16}, True, c.Refusal.SPENT),  # finish alike
    (chat_at(16, tool_calls=True), {"max_tokens": 16}, False, c.Refusal.SPENT),
    (chat_at(16, finished=True), {"max_tokens": 16}, True, c.Refusal.FINISHED),
    (chat_at(16), {"max_tokens": 40, "max_completion_tokens": 16}, True, c.Refusal.SPENT),
    (chat_at(99), {}, False, None),  # no limit: never spent
    (c.Transcript("messages", tokens=16, text_block=0), {"max_tokens": 16}, True,
     c.Refusal.SPENT),
    (c.Transcript("messages", tokens=16), {"max_tokens": 16}, False, c.Refusal.SPENT),
    (c.Transcript("messages", tokens=16, text_block=1, reasoning=True), {"max_tokens": 16},
     False, c.Refusal.SPENT),
    (c.Transcript("responses", tokens=16, item_id="msg_1"), {"max_output_tokens": 16}, True,
     c.Refusal.SPENT),
    (c.Transcript("responses", tokens=16), {"max_output_tokens": 16}, False, c.Refusal.SPENT),
    (c.Transcript("native_completion", tokens=16), {"n_predict": 16}, True, c.Refusal.SPENT),
])
def test_a_stream_at_its_limit_is_closed_where_its_finish_can_be_told(
        transcript: c.Transcript, payload: dict[str, Any], closing: bool,
        refusal: c.Refusal | None) -> None:
    d = c.decide({"messages": STORY, **payload}, transcript, False, None, 1.0, True)
    assert (d.closing, d.refusal) == (closing, refusal)
    if closing:
        assert d.reason.startswith(c.CLOSED_AFTER_FINISH if transcript.finished
                                   else c.CLOSED_AT_LIMIT)
    # Closing needs no other child: the answer is whole.
    assert c.decide({"messages": STORY, **payload}, transcript, False, None, 1.0,
                    target_available=False).closing == closing


# What llama-server's final events hold that Spillway cannot know (its timings and settings,
# the time, the cached part of the prompt), or that it does not send (the prompt's tokens
# where no relayed event told them).
UNKNOWN = {"timings", "created", "created_at", "generation_settings", "prompt", "tokens_cached",
           "has_new_line", "id_slot", "prompt_tokens_details", "input_tokens_details",
           "prompt_tokens", "input_tokens", "total_tokens", "tokens_evaluated"}


def known(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: known(v) for k, v in value.items() if k not in UNKNOWN}
    if isinstance(value, list):
        return [known(v) for v in value]
    return value


def theirs_known(kind: str, finals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama-server's final events, but what Spillway cannot know of them."""
    theirs = [known(e) for e in finals]
    if kind in ("native_completion", "responses"):
        # The model's name: no event before these finals gives it on these routes.
        for e in theirs:
            e.pop("model", None)
            e.get("response", {}).pop("model", None)
    return theirs


@pytest.mark.parametrize(("name", "kind", "payload"), CAPTURES)
def test_the_closing_events_are_llama_servers_own(name: str, kind: str,
                                                   payload: dict[str, Any]) -> None:
    """Spillway's closing events, next to the ones llama-server sent at its limit: the same
    events in the same order, with the same finish, ids, text and token count; [DONE] where
    the route has it."""
    t, finals, raw = cut(name, kind)
    closing = closing_events(t, payload, NOTE)
    ours = events(closing)
    assert [e.pop("spillway_closed") for e in ours if "spillway_closed" in e] == [NOTE]
    assert [known(e) for e in ours] == theirs_known(kind, finals)
    assert closing.endswith(b"data: [DONE]\n\n") == raw.rstrip().endswith(b"data: [DONE]")
    if kind in ("messages", "responses"):  # each event named, as llama-server names them
        for block in closing.split(sse.SEPARATOR)[:-1]:
            assert block.startswith(b"event: " + json.loads(sse.event_data(block))["type"]
                                    .encode())


def test_the_usage_says_the_prompt_only_when_an_event_told_it() -> None:
    """With timings_per_token each event carries the prompt's tokens (prompt_n and the cached
    cache_n): the closing usage gives them; without, it leaves them out."""
    t, _, _ = cut("chat-max16-emoji-timings.sse", "chat")
    assert t.prompt_tokens == 39
    payload = {"max_tokens": 16, "stream_options": {"include_usage": True}}
    usage = events(closing_events(t, payload, NOTE))[-1]["usage"]
    assert usage == {"completion_tokens": 16, "prompt_tokens": 39, "total_tokens": 55}
    t, finals, _ = cut("chat-max16-usage.sse", "chat")
    assert t.prompt_tokens is None
    assert events(closing_events(t, payload, NOTE))[-1]["usage"] == {"completion_tokens": 16}
    assert finals[-1]["usage"]["completion_tokens"] == 16


def cut_after(name: str, kind: str, relayed: int) -> tuple[c.Transcript, list[dict[str, Any]],
                                                           bytes]:
    """The capture cut after `relayed` of its final events (the finish and what follows it)."""
    raw = (LIMIT / name).read_bytes()
    every = events(raw)
    first_final = next(i for i, e in enumerate(every) if is_final(kind, e))
    t = c.Transcript(kind)
    for event in every[:first_final + relayed]:
        t.take(event)
    return t, every[first_final + relayed:], raw


def finals_of(name: str, kind: str) -> int:
    every = events((LIMIT / name).read_bytes())
    return len(every) - next(i for i, e in enumerate(every) if is_final(kind, e))


# Every cut from just after the finish to just after the last event.
AFTER_FINISH = [(name, kind, payload, relayed) for name, kind, payload in CAPTURES
                for relayed in range(1, finals_of(name, kind) + 1)]


@pytest.mark.parametrize(("name", "kind", "payload", "relayed"), AFTER_FINISH)
def test_a_death_after_the_finish_sends_the_rest_of_llama_servers_end(
        name: str, kind: str, payload: dict[str, Any], relayed: int) -> None:
    """Cut after each of llama-server's final events in turn (the GPU child died between its
    finish and its [DONE], say): the client had the whole answer, so it gets the rest of the
    end, llama-server's own events (but what no relayed event told), and no error event."""
    t, missed, raw = cut_after(name, kind, relayed)
    assert t.finished and t.ends
    d = c.decide(payload, t, False, None, 1.0, target_available=False)
    assert d.closing and d.refusal is c.Refusal.FINISHED and d.reason == c.CLOSED_AFTER_FINISH
    rest = rest_events(t, payload, NOTE)
    ours = events(rest)
    for e in ours:
        e.pop("spillway_closed", None)
    assert [known(e) for e in ours] == theirs_known(kind, missed)
    assert rest.endswith(b"data: [DONE]\n\n") == raw.rstrip().endswith(b"data: [DONE]")
    assert not any("error" in e for e in ours)


def test_a_chat_finish_without_its_usage_chunk_gets_it_when_asked() -> None:
    """include_usage: the usage chunk, with the tokens relayed, then [DONE]; without it, only
    [DONE]."""
    t, missed, _ = cut_after("chat-max16-usage.sse", "chat", 1)
    assert t.ends == ["finish"]
    payload = {"max_tokens": 16, "stream_options": {"include_usage": True}}
    ours = events(rest_events(t, payload, NOTE))
    assert ours[-1]["choices"] == [] and ours[-1]["usage"] == {"completion_tokens": 16}
    assert ours[-1]["spillway_closed"] == NOTE
    assert rest_events(t, {"max_tokens": 16}, NOTE) == b"data: [DONE]\n\n"


@pytest.mark.parametrize(("ends", "extra", "payload", "closing"), [
    # Only the text block's end went out: the stop reason is known at the limit alone.
    (["content_block_stop"], {}, {"max_tokens": 16}, True),
    (["content_block_stop"], {}, {"max_tokens": 40}, False),
    (["content_block_stop", "message_delta"], {}, {"max_tokens": 40}, True),
    (["content_block_stop"], {"tool_calls": True}, {"max_tokens": 16}, False),
    (["content_block_stop", "message_delta", "message_stop"], {"tool_calls": True},
     {"max_tokens": 40}, True),  # the whole end went out: nothing to send but the stream's end
])
def test_a_messages_end_is_sent_only_where_its_stop_reason_was_told(
        ends: list[str], extra: dict[str, Any], payload: dict[str, Any], closing: bool) -> None:
    t = c.Transcript("messages", tokens=16, text_block=0, finished=True, ends=ends, **extra)
    d = c.decide({"messages": STORY, **payload}, t, False, None, 1.0, True)
    assert (d.closing, d.refusal) == (closing, c.Refusal.FINISHED)


@pytest.mark.parametrize("name", sorted(p.name for p in LIMIT.glob("*.sse")))
def test_only_a_streams_last_event_says_the_answer_ended(name: str) -> None:
    # llama-server's own captures: every event before the last leaves the answer open (a
    # client leaving there left early, a 499); the last one ends it, whatever the route.
    blocks = [b + sse.SEPARATOR for b in (LIMIT / name).read_bytes().split(sse.SEPARATOR)
              if b.strip()]
    assert len(blocks) > 10
    assert [sse.ends_answer(block) for block in blocks] == [False] * (len(blocks) - 1) + [True]
    assert not sse.ends_answer(b"".join(blocks[:-1]))
    # A token whose text looks like an end is escaped in its JSON: not an end.
    token = json.dumps({"content": 'data: [DONE] "stop":true "type":"message_stop"'})
    assert not sse.ends_answer(b"data: " + token.encode() + sse.SEPARATOR)
