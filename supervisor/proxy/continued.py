"""The other child's continuation events, rewritten so that the client sees one stream.

The client already has the first child's role delta, its id, created and model: the
continuation's own are replaced by those, its role delta is dropped, an echo of the relayed text
is stripped, its usage counts the tokens sent before, and its final event says, in a
`spillway_continuation` field, that it was continued and from where. Pure bytes in, bytes out.
"""

from __future__ import annotations

import json
from typing import Any

from ..policy.continuation import Transcript
from . import sse


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + \
        sse.SEPARATOR


class ContinuedStream:
    def __init__(self, before: Transcript, note: dict[str, Any]) -> None:
        self.before = before
        self.note = note  # the final event's `spillway_continuation`
        self._echo = before.text  # stripped from the first text, if it starts with it
        self.text = ""  # what the continuation added

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
                out.append(_event(kept) if isinstance(kept, dict) else block + sse.SEPARATOR)
        return b"".join(out)

    def _piece(self, text: str) -> str:
        if self._echo and text.startswith(self._echo):
            text = text[len(self._echo):]
        self._echo = ""  # only the first piece may echo
        self.text += text
        return text

    def _one(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if "error" in obj:
            return obj
        b = self.before
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
            said = bool(delta.get("content")) or \
                any(v is not None for k, v in delta.items() if k != "content")
        elif isinstance(choice.get("text"), str):
            choice["text"] = self._piece(choice["text"])
            said = bool(choice["text"])
        else:
            said = False
        return said or bool(choice.get("finish_reason"))

    def _usage(self, usage: dict[str, Any]) -> None:
        """Summed: the tokens generated before count as generated; the continuation's prompt
        held them, so they come off its prompt count."""
        n = self.before.tokens
        done, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if isinstance(done, int):
            usage["completion_tokens"] = done + n
        if isinstance(prompt, int):
            usage["prompt_tokens"] = max(prompt - n, 0)
        if isinstance(usage.get("completion_tokens"), int) and \
                isinstance(usage.get("prompt_tokens"), int):
            usage["total_tokens"] = usage["completion_tokens"] + usage["prompt_tokens"]

    def _native(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if isinstance(obj.get("content"), str):
            obj["content"] = self._piece(obj["content"])
        if isinstance(obj.get("tokens_predicted"), int):  # a running count: from the start
            obj["tokens_predicted"] += self.before.tokens
        if obj.get("stop") is True:
            obj["spillway_continuation"] = self.note
            return obj
        return obj if obj.get("content") else None
