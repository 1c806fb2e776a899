"""The closing events of a stream whose child died after its token limit was reached and
before its finish (policy/continuation.py's `at_limit`: llama-server's own count, or one event
a token, reached the limit; a recount of the text never decides it): the client has the whole
answer, so Spillway ends it as llama-server ends a stream stopped by its limit
(tools/server/server-task.cpp, `server_task_result_cmpl_final`, streaming):

- chat: a chunk with an empty delta and `finish_reason: "length"`; with
  `stream_options.include_usage`, a chunk with empty `choices` and the usage; then `[DONE]`;
- OAI completions: a chunk with empty `text`, `finish_reason: "length"` and the usage (there
  always); then `[DONE]`;
- /completion: its final event, `stop: true`, `stop_type: "limit"`, `tokens_predicted`;
- /v1/messages: `content_block_stop` (the open text block), `message_delta` with
  `stop_reason: "max_tokens"` and `output_tokens`, `message_stop`;
- /v1/responses: `output_text.done`, `content_part.done`, `output_item.done` with the whole
  text, then `response.completed` (llama-server says "completed" at its limit too).

A stream whose child died after its finish was relayed (`after_finish`) gets only the rest of
that end (`rest_events`): chat's usage chunk when asked for and `[DONE]`, `[DONE]` after a
completion's finish, `message_stop`, or the /v1/responses events after the last one relayed;
nothing after /completion's last event. llama-server sends them in one go after the finish, so a
death between them is rare, but it must not turn a whole answer into an error.

Only what the relayed events told can be given: completion tokens are the tokens counted (the
limit's worth), the prompt's tokens only when an event said them (else left out, not guessed);
llama-server's `timings`, `generation_settings` and `prompt` are left out. The final event
says, in a `spillway_closed` field, that Spillway closed it and why. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from ..policy.continuation import Transcript
from .continued import encode_event


def closing_events(before: Transcript, payload: dict[str, Any],
                   note: dict[str, Any]) -> bytes:
    """The events that end the stream `before` tells of; `note`: the final event's
    `spillway_closed` (the failed child, its failure, the tokens)."""
    kind = before.kind
    if kind == "messages":
        return _messages(before, note)
    if kind == "responses":
        return _responses(before, note)
    if kind == "native_completion":
        return _native(before, note)
    return _openai(before, payload, note)


def rest_events(before: Transcript, payload: dict[str, Any], note: dict[str, Any]) -> bytes:
    """What llama-server sends after the finish `before` ends with and the client did not get
    (policy/continuation.py's `after_finish` says it can be told); `note` goes on the first
    event left that carries a body, when one is."""
    kind, last = before.kind, before.ends[-1] if before.ends else None
    if kind == "native_completion":
        return b""  # its final event is its end: nothing follows it
    if kind in ("chat", "oai_completion"):
        options = payload.get("stream_options")
        events: list[dict[str, Any]] = []
        if kind == "chat" and last == "finish" and isinstance(options, dict) and \
                options.get("include_usage") is True:
            events.append({"choices": [], **_head(before), "usage": _usage(before),
                           "spillway_closed": note})
        return b"".join(encode_event(e) for e in events) + b"data: [DONE]\n\n"
    whole = _messages_events(before, note) if kind == "messages" else \
        _responses_events(before, note)
    sent = [e["type"] for e in whole].index(last) + 1 if last is not None else 0
    return b"".join(encode_event(e, named=True) for e in whole[sent:])


def _head(before: Transcript) -> dict[str, Any]:
    """The chunk fields llama-server stamps on every chat chunk, as the relayed ones said."""
    head = {k: v for k, v in (("created", before.created), ("id", before.id),
                              ("model", before.model),
                              ("system_fingerprint", before.system_fingerprint)) if v is not None}
    head["object"] = "chat.completion.chunk" if before.kind == "chat" else "text_completion"
    return head


def _usage(before: Transcript, generated: str = "completion_tokens",
           prompt: str = "prompt_tokens") -> dict[str, Any]:
    usage: dict[str, Any] = {generated: before.tokens}
    if before.prompt_tokens is not None:
        usage[prompt] = before.prompt_tokens
        usage["total_tokens"] = before.tokens + before.prompt_tokens
    return usage


def _openai(before: Transcript, payload: dict[str, Any], note: dict[str, Any]) -> bytes:
    chat = before.kind == "chat"
    head = _head(before)
    choice: dict[str, Any] = {"finish_reason": "length", "index": 0}
    if chat:
        choice["delta"] = {}
    else:
        choice.update(text="", logprobs=None)
    final: dict[str, Any] = {"choices": [choice], **head, "spillway_closed": note}
    events = [final]
    options = payload.get("stream_options")
    if not chat:
        final["usage"] = _usage(before)  # llama-server's completion chunk always has it
    elif isinstance(options, dict) and options.get("include_usage") is True:
        events.append({"choices": [], **head, "usage": _usage(before)})
    return b"".join(encode_event(e) for e in events) + b"data: [DONE]\n\n"


def _native(before: Transcript, note: dict[str, Any]) -> bytes:
    final: dict[str, Any] = {"index": 0, "content": "", "tokens": [], "stop": True}
    if before.model is not None:
        final["model"] = before.model
    final["tokens_predicted"] = before.tokens
    if before.prompt_tokens is not None:
        final["tokens_evaluated"] = before.prompt_tokens
    final.update(truncated=False, stop_type="limit", stopping_word="", spillway_closed=note)
    return encode_event(final)


def _messages(before: Transcript, note: dict[str, Any]) -> bytes:
    return b"".join(encode_event(e, named=True) for e in _messages_events(before, note))


def _messages_events(before: Transcript, note: dict[str, Any]) -> list[dict[str, Any]]:
    """The end of a /v1/messages stream stopped by its limit (the only stop reason that can be
    told: `after_finish` refuses the others)."""
    return [{"type": "content_block_stop", "index": before.text_block},
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
             "usage": {"output_tokens": before.tokens}, "spillway_closed": note},
            {"type": "message_stop"}]


def _responses(before: Transcript, note: dict[str, Any]) -> bytes:
    return b"".join(encode_event(e, named=True) for e in _responses_events(before, note))


def _responses_events(before: Transcript, note: dict[str, Any]) -> list[dict[str, Any]]:
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": before.text}
    item = {"type": "message", "status": "completed", "id": before.item_id, "content": [part],
            "role": "assistant"}
    response: dict[str, Any] = {"id": before.id, "object": "response", "status": "completed"}
    if before.model is not None:  # (llama-server's opening events do not name it)
        response["model"] = before.model
    response.update(output=[item], usage=_usage(before, "output_tokens", "input_tokens"))
    events: list[dict[str, Any]] = [{"type": "response.output_text.done", "item_id": before.item_id,
               "text": before.text},
              {"type": "response.content_part.done", "item_id": before.item_id, "part": part},
              {"type": "response.output_item.done", "item": item},
              {"type": "response.completed", "response": response, "spillway_closed": note}]
    return events
