"""Strict SSE parsers, built line for line as two clients that home servers run parse a stream.

Each takes the raw bytes of a response body and returns the events it read, or raises `Refused`
naming the offending line, where the client would have failed the user's request:

- `home_llm`: Home Assistant's home-llm integration (acon96/home-llm,
  `custom_components/llama_conversation/backends/generic_openai.py`, `_generate_stream`). It
  reads the body line by line (aiohttp's `async for line in response.content`), decodes each as
  UTF-8 and strips it; a line starting `error: ` raises; `data: ` is removed; a line holding
  `[DONE]` ends the stream; every other non-empty line goes to `json.loads`, and the object to
  `_extract_response`, which reads `choices[0]` by the `object` it names (`delta` for a
  `chat.completion.chunk`, `message` for a `chat.completion`, `text` otherwise). An SSE comment
  (`:`) is a line `json.loads` refuses: the voice command fails.
- `jan`: Jan's llama.cpp extension (janhq/jan, `extensions/llamacpp-extension/src/index.ts`,
  `handleStreamingResponse`). It splits the decoded text on `\\n` (a last line without one is
  never read), trims each line and skips the empty ones and `data: [DONE]`; a line starting
  `data: ` is `JSON.parse`d, one starting `error: ` throws its message, and any other throws
  "Malformed chunk". (Jan also throws on `finish_reason: "length"`, which it takes for a full
  context: a matter of the answer, not of its lines, left out here.)

aiohttp's line reader also refuses a line over 128 KiB (twice its 64 KiB limit); no stream
these tests read comes near it, so that is not checked.
"""

from __future__ import annotations

import json
from typing import Any


class Refused(AssertionError):
    """The client would have failed here: which parser, which line (1-based), and why."""

    def __init__(self, client: str, number: int, line: bytes, why: str) -> None:
        super().__init__(f"{client} refuses line {number} ({why}): {line[:200]!r}")
        self.client, self.number, self.line, self.why = client, number, line, why


def _lines_as_aiohttp_reads_them(body: bytes) -> list[bytes]:
    """aiohttp's StreamReader iteration: each line with its `\\n`; a last one without."""
    lines = body.split(b"\n")
    out = [line + b"\n" for line in lines[:-1]]
    return out + ([lines[-1]] if lines[-1] else [])


def home_llm(body: bytes) -> list[Any]:
    events: list[Any] = []
    for number, line_bytes in enumerate(_lines_as_aiohttp_reads_them(body), 1):
        try:
            raw_line = line_bytes.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise Refused("home-llm", number, line_bytes, f"not UTF-8: {e}") from e
        if raw_line.startswith("error: "):
            raise Refused("home-llm", number, line_bytes, "an `error: ` line")
        chunk = raw_line.removeprefix("data: ")
        if "[DONE]" in chunk:
            break
        if chunk and chunk.strip():
            try:
                event = json.loads(chunk)
            except ValueError as e:
                raise Refused("home-llm", number, line_bytes, f"json.loads: {e}") from e
            why = _home_llm_extract(event)
            if why:
                raise Refused("home-llm", number, line_bytes, why)
            events.append(event)
    return events


def _home_llm_extract(event: Any) -> str:
    """What `_extract_response` would raise on (its KeyError or TypeError), or ""."""
    if not isinstance(event, dict):
        return "not an object"  # (its warning reads the keys of what has no choices)
    choices = event.get("choices")
    if not choices:
        return ""  # it logs a warning and goes on
    try:
        choice = choices[0]
        kind = event["object"]
        if kind == "chat.completion":
            choice["message"]["content"]
        elif kind == "chat.completion.chunk":
            choice["delta"].get("content", "")
        else:
            choice["text"]
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        return f"_extract_response: {type(e).__name__}: {e}"
    return ""


def jan(body: bytes) -> list[Any]:
    events: list[Any] = []
    text = body.decode("utf-8", "replace")  # TextDecoder: not fatal
    for number, line in enumerate(text.split("\n")[:-1], 1):
        trimmed = line.strip()
        if not trimmed or trimmed == "data: [DONE]":
            continue
        raw = line.encode()
        if trimmed.startswith("data: "):
            payload = trimmed[6:]
        elif trimmed.startswith("error: "):
            raise Refused("jan", number, raw, "an `error: ` line")
        else:
            raise Refused("jan", number, raw, "Malformed chunk")
        try:
            events.append(json.loads(payload, parse_constant=_not_json))
        except ValueError as e:
            raise Refused("jan", number, raw, f"JSON.parse: {e}") from e
    return events


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is no JSON (JSON.parse refuses it)")


def both(body: bytes) -> list[Any]:
    """Both parsers over the same body; home-llm's events (it stops at [DONE])."""
    jan(body)
    return home_llm(body)
