"""Just enough of Server-Sent Events to find whole events and spot an error event.

llama-server separates events with a blank line (`\\n\\n`). A stream's first event is its first
block with a `data:` line (`event:` may come first, as on `/v1/messages`).
"""

from __future__ import annotations

import json
from typing import Any

SEPARATOR = b"\n\n"


def split_complete(buffer: bytes) -> tuple[bytes, bytes]:
    """(whole events, the unfinished rest)."""
    cut = buffer.rfind(SEPARATOR)
    if cut < 0:
        return b"", buffer
    return buffer[: cut + 2], buffer[cut + 2:]


def first_data_event(buffer: bytes) -> tuple[bytes, int] | None:
    """The first complete block that carries data, and the offset just past it; None if the
    buffer does not hold one yet (comment-only blocks are skipped)."""
    start = 0
    while True:
        end = buffer.find(SEPARATOR, start)
        if end < 0:
            return None
        block = buffer[start:end]
        if any(line.startswith(b"data:") for line in block.split(b"\n")):
            return block, end + 2
        start = end + 2


def without_comments(data: bytes) -> bytes:
    """`data` less its comment lines (`:` first: llama-server's pings), and less the blocks
    that held nothing else; an unfinished last block is kept as it is."""
    if not (data.startswith(b":") or b"\n:" in data):
        return data  # (the usual case: a data line's JSON holds no raw newline)
    whole, pending = split_complete(data)
    kept = []
    for block in whole.split(SEPARATOR)[:-1]:
        lines = [line for line in block.split(b"\n") if not line.startswith(b":")]
        if any(lines):
            kept.append(b"\n".join(lines) + SEPARATOR)
    return b"".join(kept) + pending


def event_data(block: bytes) -> bytes:
    """The data of one event: its `data:` lines joined by newlines."""
    parts = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts)


def error_of(block: bytes) -> dict[str, Any] | None:
    """The `error` object when the event is an error event, else None."""
    data = event_data(block)
    if b'"error"' not in data:
        return None
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):
            return error
    return None


def count_data_events(chunk: bytes) -> int:
    """How many events a run of whole events holds (a token count for streams)."""
    return chunk.count(b"\ndata:") + (1 if chunk.startswith(b"data:") else 0)


# The last event of each of llama-server's streams: `[DONE]` (OpenAI's chat and completions),
# Anthropic's `message_stop`, OpenAI's `response.completed` (its /v1/responses), the native
# /completion's final event (`"stop":true`; the others say `"stop":false`). Each is looked for
# as SSE or JSON writes it, never as a token's text could (inside a JSON string, its quotes
# are escaped and its newlines too: `[DONE]` counts at a line's start only).
_DONE = b"data: [DONE]"
_ENDS = (b"\n" + _DONE, b'"type":"message_stop"', b'"type":"response.completed"',
         b'"stop":true')


def ends_answer(events: bytes) -> bool:
    """Whether these whole events hold their stream's last event: a client that has them has
    the whole answer, however it leaves after."""
    return events.startswith(_DONE) or any(end in events for end in _ENDS)
