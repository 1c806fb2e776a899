"""The other child's continuation events, rewritten so that the client sees one stream.

The client already has the first child's role delta, its id, created and model: the
continuation's own are replaced by those, its role delta is dropped (its prompt progress
events, asked for with `return_progress`, go on without the role: the client sees the other
child's prefill), an echo of the relayed text (and of the relayed reasoning) is stripped, its
usage counts the tokens sent before, and its final event says, in a `spillway_continuation`
field, that it was continued and from where: the only word of it on the wire (no comment line,
which llama-server would not send). That event is the one that finishes the stream: on chat and
completions the chunk with the `finish_reason` and, when `stream_options.include_usage` asks for
one, the usage chunk after it (the last); on `/completion` the `stop` event; on `/v1/messages`
`message_delta` (with the stop reason and usage; `message_stop` after it carries nothing); on
`/v1/responses` `response.completed` (or `response.incomplete`). /v1/messages and
/v1/responses, whose events open a message (a content block, an output item) before its text,
lose the continuation's opening events, and their closing ones carry the whole text. Pure bytes
in, bytes out.
"""

from __future__ import annotations

import json
from typing import Any

from ..policy.continuation import Transcript
from . import sse


def encode_event(obj: dict[str, Any], named: bool = False) -> bytes:
    """One event; `named`: with its `event:` line, as the Messages API sends each."""
    data = b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + \
        sse.SEPARATOR
    name = obj.get("type")
    if named and isinstance(name, str):
        return b"event: " + name.encode() + b"\n" + data
    return data


# The APIs whose events each have an `event:` line naming their type.
_NAMED_EVENTS = frozenset({"messages", "responses"})
# /v1/responses: the events that open the response, its message and its text part, which the
# client already has.
_RESPONSE_OPENINGS = frozenset({"response.created", "response.in_progress",
                                "response.output_item.added", "response.content_part.added"})


class ContinuedStream:
    def __init__(self, before: Transcript, note: dict[str, Any]) -> None:
        self.before = before
        self.note = note  # the final event's `spillway_continuation`
        self._echo = before.text  # stripped from the first text, if it starts with it
        self._reasoning_echo = before.reasoning_text  # the same, for the first reasoning
        self.text = ""  # what the continuation added
        self.generated = False  # whether a generated piece (text, reasoning, a call) went out

    def rewrite(self, blocks: bytes) -> bytes:
        """Whole SSE events (each ending in a blank line) -> what the client gets."""
        out = []
        for block in blocks.split(sse.SEPARATOR):
            if not block.strip():
                continue
            data = sse.event_data(block)
            if not data.startswith(b"{"):
                out.append(block + sse.SEPARATOR)  # [DONE], comments: as they are
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                out.append(block + sse.SEPARATOR)
                continue
            kept = self._one(obj) if isinstance(obj, dict) else obj
            if kept is not None:
                out.append(encode_event(kept, self.before.kind in _NAMED_EVENTS)
                           if isinstance(kept, dict) else block + sse.SEPARATOR)
        return b"".join(out)

    def _piece(self, text: str) -> str:
        if self._echo and text.startswith(self._echo):
            text = text[len(self._echo):]
        self._echo = ""  # only the first piece may echo
        self.text += text
        self.generated = self.generated or bool(text)
        return text

    def _reasoning_piece(self, text: str) -> str:
        if self._reasoning_echo and text.startswith(self._reasoning_echo):
            text = text[len(self._reasoning_echo):]
        self._reasoning_echo = ""
        self.generated = self.generated or bool(text)
        return text

    def _one(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if "error" in obj or obj.get("type") == "error":
            return obj
        b = self.before
        if b.kind == "messages":
            return self._message_event(obj)
        if b.kind == "responses":
            return self._response_event(obj)
        for key, value in (("id", b.id), ("created", b.created), ("model", b.model),
                           ("system_fingerprint", b.system_fingerprint)):
            if value is not None and key in obj:
                obj[key] = value
        if b.kind == "native_completion":
            return self._native(obj)
        choices = [ch for ch in obj.get("choices") or [] if isinstance(ch, dict)]
        final = any(ch.get("finish_reason") for ch in choices)
        keep = any([self._choice(ch) for ch in choices])  # (every choice rewritten)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
            keep = True
            # The usage chunk that include_usage adds after the finish: the stream's last.
            final = final or not choices
        # A prompt progress event says something even without its role delta.
        keep = keep or "prompt_progress" in obj
        if final:
            obj["spillway_continuation"] = self.note
        return obj if keep else None

    def _choice(self, choice: dict[str, Any]) -> bool:
        """One choice rewritten; whether it still says anything."""
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if self.before.role_sent:  # one role delta in all: the client has it already
                delta.pop("role", None)
            if isinstance(delta.get("content"), str):
                delta["content"] = self._piece(delta["content"])
            if isinstance(delta.get("reasoning_content"), str):
                delta["reasoning_content"] = self._reasoning_piece(delta["reasoning_content"])
                if not delta["reasoning_content"]:
                    del delta["reasoning_content"]  # all echo: nothing left to say
            self.generated = self.generated or bool(delta.get("tool_calls") or
                                                    delta.get("function_call"))
            said = bool(delta.get("content")) or \
                any(v is not None for k, v in delta.items() if k != "content")
        elif isinstance(choice.get("text"), str):
            choice["text"] = self._piece(choice["text"])
            said = bool(choice["text"])
        else:
            said = False
        return said or bool(choice.get("finish_reason"))

    def _usage(self, usage: dict[str, Any], generated: str = "completion_tokens",
               prompt: str = "prompt_tokens") -> None:
        """Summed: the tokens known to be sampled before (llama-server's own count, else one
        event a token: never more than were) and the continuation's own; no more than were
        sent. The prompt is the first child's, when an event told it; else the continuation's,
        less the tokens before, which it held. (/v1/responses names them output and input
        tokens.)"""
        n = self.before.tokens
        done, given = usage.get(generated), usage.get(prompt)
        if isinstance(done, int):
            usage[generated] = done + n
        if isinstance(given, int):
            first = self.before.prompt_tokens
            usage[prompt] = first if first is not None else max(given - n, 0)
        if isinstance(usage.get(generated), int) and isinstance(usage.get(prompt), int):
            usage["total_tokens"] = usage[generated] + usage[prompt]

    def _message_event(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """/v1/messages: the client has its message_start and its open text block (a stream
        whose block was closed is not continued), so the continuation's own go; its text goes
        on in the client's block; its output_tokens count the tokens before."""
        kind = obj.get("type")
        if kind in ("message_start", "content_block_start"):
            return None
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("text"), str):
                delta["text"] = self._piece(delta["text"])
                if not delta["text"]:
                    return None
        if kind == "message_delta":
            usage = obj.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
                usage["output_tokens"] += self.before.tokens
            obj["spillway_continuation"] = self.note
        return obj

    def _response_event(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """/v1/responses: the client has the response's opening events, so the
        continuation's own go; its ids become the client's; its text deltas go on; the done
        events and response.completed carry the whole text (before and after) and usage
        summed."""
        b = self.before
        kind = obj.get("type")
        if kind in _RESPONSE_OPENINGS:
            return None
        if b.item_id is not None and "item_id" in obj:
            obj["item_id"] = b.item_id
        if kind == "response.output_text.delta":
            if isinstance(obj.get("delta"), str):
                obj["delta"] = self._piece(obj["delta"])
            return obj if obj.get("delta") else None
        whole = b.text + self.text
        if kind == "response.output_text.done":
            obj["text"] = whole
        elif kind == "response.content_part.done":
            _set_text(obj.get("part"), whole)
        elif kind == "response.output_item.done":
            self._item(obj.get("item"), whole)
        elif kind in ("response.completed", "response.incomplete"):
            self._response(obj.get("response"), whole)
            obj["spillway_continuation"] = self.note
        return obj

    def _response(self, response: Any, whole: str) -> None:
        """The final response object: the client's id, the whole text, usage summed."""
        if not isinstance(response, dict):
            return
        if self.before.id is not None:
            response["id"] = self.before.id
        for item in response.get("output") or []:
            self._item(item, whole)
        usage = response.get("usage")
        if isinstance(usage, dict):
            self._usage(usage, "output_tokens", "input_tokens")

    def _item(self, item: Any, whole: str) -> None:
        if isinstance(item, dict) and item.get("type") == "message":
            if self.before.item_id is not None:
                item["id"] = self.before.item_id
            for part in item.get("content") or []:
                _set_text(part, whole)

    def _native(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if isinstance(obj.get("content"), str):
            obj["content"] = self._piece(obj["content"])
        if isinstance(obj.get("tokens_predicted"), int):  # a running count: from the start
            obj["tokens_predicted"] += self.before.tokens
        if obj.get("stop") is True:
            obj["spillway_continuation"] = self.note
            return obj
        return obj if obj.get("content") else None


def _set_text(part: Any, whole: str) -> None:
    """A text part of a /v1/responses message: the whole text, before and after."""
    if isinstance(part, dict) and part.get("type") == "output_text":
        part["text"] = whole
