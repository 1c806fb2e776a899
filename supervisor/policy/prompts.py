"""What llama-server counts as a request's prompt, route by route: the plan a token count
follows (branch 3 of admission: a prompt over a slot's context).

Pure: proxy/tokens.py carries a plan out against a child. The pinned llama-server counts so
(tools/server/server-context.cpp, server-common.cpp):

- chat, `/v1/responses` and `/v1/messages` are converted to a chat request, templated, and the
  templated prompt tokenized with special tokens. The child's own counting routes do exactly
  that, in one call: `/v1/chat/completions/input_tokens`, `/v1/responses/input_tokens`,
  `/v1/messages/count_tokens`. The count is exact.
- completions tokenize `prompt` with special tokens; a list of prompts is one task each, and
  each is checked on its own. Exact.
- infill builds its own prompt: the fill-in-the-middle tokens around a prefix and a suffix that
  the child trims to its batch size, and extra context trimmed to its context. Only `prompt` is
  never trimmed: it, plus the three FIM tokens, is a lower bound, not the child's count.
- embeddings tokenize each input with special tokens, but whether an input of exactly a slot's
  size is refused, and with which words, depends on the model's pooling and the child's batch
  size, which Spillway does not see. The tokens are exact, the check is not.

A count that is not exact routes a request to a child with room for it, but a request over every
child's context is then left to the child with the largest context, which refuses it in its own
words (admission.decide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHAT_ROUTES = frozenset({"/chat/completions", "/v1/chat/completions"})
RESPONSES_ROUTES = frozenset({"/v1/responses", "/responses"})
MESSAGES_ROUTES = frozenset({"/v1/messages"})
COMPLETION_ROUTES = frozenset({"/completion", "/completions", "/v1/completions"})
INFILL_ROUTES = frozenset({"/infill"})
EMBEDDING_ROUTES = frozenset({"/embedding", "/embeddings", "/v1/embeddings"})

# The child's own counting route for each templated route.
_COUNT_ROUTES = {
    **dict.fromkeys(CHAT_ROUTES, "/v1/chat/completions/input_tokens"),
    **dict.fromkeys(RESPONSES_ROUTES, "/v1/responses/input_tokens"),
    **dict.fromkeys(MESSAGES_ROUTES, "/v1/messages/count_tokens"),
}
FIM_TOKENS = 3  # prefix, suffix and middle: around every infill prompt

# The cheap bound: no text has more tokens than bytes (llama.cpp's tokenizers fall back to one
# token per byte at worst), and the body holds the text plus JSON; a chat template adds its own
# tokens, a few for each message and some for the whole.
TEMPLATE_TOKENS_PER_MESSAGE = 32
TEMPLATE_TOKENS = 64


@dataclass(frozen=True)
class Piece:
    """One text (or list of texts and token ids) to tokenize the child's way."""

    content: str | list[Any]
    add_special: bool
    parse_special: bool = True


@dataclass(frozen=True)
class MediaBlob:
    """One media item of a prompt object (`multimodal_data`), counted on the child as its own
    counting route counts an image or audio part: what the part adds to a chat prompt."""

    data: str  # base64, as the client sent it (its modality: media.sniff)


@dataclass(frozen=True)
class Task:
    """One prompt the child checks against a slot's context on its own."""

    pieces: tuple[Piece, ...] = ()
    known: int = 0  # tokens known without asking: token ids given as numbers, FIM tokens
    media: tuple[MediaBlob, ...] = ()


@dataclass(frozen=True)
class Plan:
    count_route: str | None  # the child's counting route (templated routes): one call, exact
    tasks: tuple[Task, ...]  # else the prompts, each tokenized
    exact: bool  # counted and checked as the child counts and checks


def upper_bound(body_size: int, payload: dict[str, Any] | None) -> int:
    """Tokens the prompt cannot exceed, from the body's size alone."""
    items = None
    if payload:
        items = payload.get("messages", payload.get("input"))
    count = len(items) if isinstance(items, list) else 1
    return body_size + TEMPLATE_TOKENS + TEMPLATE_TOKENS_PER_MESSAGE * count


def plan(path: str, payload: dict[str, Any], marker: str | None = None) -> Plan | None:
    """How the child counts the prompt of a request to `path`; None when it cannot be told
    (the request is then forwarded, and the child judges it). `marker`: the children's media
    marker, which splits a prompt object with `multimodal_data`."""
    route = _COUNT_ROUTES.get(path)
    if route is not None:
        return Plan(route, (), exact=True)
    if path in COMPLETION_ROUTES:
        tasks = _prompts(payload.get("prompt"), add_special=True, marker=marker)
        return Plan(None, tasks, exact=True) if tasks else None
    if path in INFILL_ROUTES:
        prompt = payload.get("prompt", "")
        if not isinstance(prompt, str):
            return None
        pieces = (Piece(prompt, add_special=False),) if prompt else ()
        return Plan(None, (Task(pieces, FIM_TOKENS),), exact=False)
    if path in EMBEDDING_ROUTES:
        given = payload.get("input", payload.get("content"))
        tasks = _prompts(given, add_special=True)
        return Plan(None, tasks, exact=False) if tasks else None
    return None


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(prompt: Any, add_special: bool, marker: str | None = None) -> tuple[Task, ...]:
    """llama-server's tokenize_input_prompts: a list without token ids is several prompts, each
    a task of its own; anything else is one prompt. Empty when a prompt cannot be told."""
    if isinstance(prompt, list) and prompt and not any(_is_id(p) for p in prompt):
        tasks = [_prompt(p, add_special, marker) for p in prompt]
        return tuple(t for t in tasks if t is not None) if None not in tasks else ()
    one = _prompt(prompt, add_special, marker)
    return (one,) if one is not None else ()


def _prompt(prompt: Any, add_special: bool, marker: str | None = None) -> Task | None:
    """One prompt (llama-server's tokenize_input_subprompt): a string, token ids, a mix of the
    two, or an object with `prompt_string` (and its `multimodal_data`); None for anything
    else."""
    if isinstance(prompt, dict) and "multimodal_data" in prompt:
        return _multimodal(prompt, marker)
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_string")
    if isinstance(prompt, str):
        return Task((Piece(prompt, add_special),))
    if isinstance(prompt, list) and prompt and all(_is_id(p) for p in prompt):
        return Task((), len(prompt))
    if isinstance(prompt, list) and prompt and all(_is_id(p) or isinstance(p, str)
                                                   for p in prompt):
        return Task((Piece(prompt, add_special),))
    return None


def _multimodal(prompt: dict[str, Any], marker: str | None) -> Task | None:
    """A prompt object with media, as libmtmd tokenizes it (mtmd.cpp, mtmd_tokenizer): the
    string split at each marker, each text part tokenized without special tokens, the BOS (and
    EOS) of the vocabulary added once around the whole (what `/tokenize` with add_special
    adds to an empty text), and each media item's own tokens. None without the marker (the
    children's media marker is what splits it) or with anything but base64 strings."""
    text, data = prompt.get("prompt_string"), prompt.get("multimodal_data")
    blobs = [b for b in (data if isinstance(data, list) else [data]) if isinstance(b, str)]
    if marker is None or not isinstance(text, str) or len(blobs) != (
            len(data) if isinstance(data, list) else 1):
        return None
    segments = [seg for seg in text.split(marker) if seg]
    pieces = (Piece("", add_special=True),
              *(Piece(seg, add_special=False) for seg in segments))
    return Task(pieces, media=tuple(MediaBlob(b) for b in blobs))
