"""What llama-server counts as a request's prompt, route by route (policy/prompts.py), and the
figure Spillway's exceed-context 400 names (proxy/tokens.Count)."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.policy.prompts import (
    FIM_TOKENS, MediaBlob, Piece, Plan, Task, plan, upper_bound,
)
from supervisor.proxy.tokens import Count

CHAT = {"messages": [{"role": "user", "content": "hi"}]}

# (route, payload, the plan llama-server's way of counting gives)
TABLE: list[tuple[str, dict[str, Any], Plan | None]] = [
    # Templated routes: the child's own counting route, one call, exact.
    ("/v1/chat/completions", CHAT, Plan("/v1/chat/completions/input_tokens", (), True)),
    ("/chat/completions", CHAT, Plan("/v1/chat/completions/input_tokens", (), True)),
    ("/v1/responses", {"input": "hi"}, Plan("/v1/responses/input_tokens", (), True)),
    ("/responses", {"input": "hi"}, Plan("/v1/responses/input_tokens", (), True)),
    ("/v1/messages", CHAT, Plan("/v1/messages/count_tokens", (), True)),
    # Completions: the prompt with special tokens; a list of prompts is one task each.
    ("/completion", {"prompt": "hi"}, Plan(None, (Task((Piece("hi", True),)),), True)),
    ("/v1/completions", {"prompt": ["a", "b"]},
     Plan(None, (Task((Piece("a", True),)), Task((Piece("b", True),))), True)),
    ("/completions", {"prompt": [1, 2, 3]}, Plan(None, (Task((), 3),), True)),
    ("/completions", {"prompt": [1, "a", 2]}, Plan(None, (Task((Piece([1, "a", 2], True),)),),
                                                    True)),
    ("/completions", {"prompt": [[1, 2], "b"]},
     Plan(None, (Task((), 2), Task((Piece("b", True),))), True)),
    ("/completions", {"prompt": {"prompt_string": "hi"}},
     Plan(None, (Task((Piece("hi", True),)),), True)),
    ("/completions", {"prompt": {"prompt_string": "x", "multimodal_data": ["..."]}}, None),
    ("/completions", {"content": "hi"}, None),  # llama-server reads `prompt` only
    ("/completions", {"prompt": []}, None),
    ("/completions", {"prompt": ["a", 3.5]}, None),
    # Infill: only `prompt` is never trimmed: a lower bound, not the child's count.
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "prompt": "hi"},
     Plan(None, (Task((Piece("hi", False),), FIM_TOKENS),), False)),
    ("/infill", {"input_prefix": "a", "input_suffix": "b"},
     Plan(None, (Task((), FIM_TOKENS),), False)),
    # Embeddings: each input with special tokens; the check is the child's (pooling, batch).
    ("/v1/embeddings", {"input": "hi"}, Plan(None, (Task((Piece("hi", True),)),), False)),
    ("/embedding", {"content": "hi"}, Plan(None, (Task((Piece("hi", True),)),), False)),
    ("/embeddings", {"input": ["a", "b"]},
     Plan(None, (Task((Piece("a", True),)), Task((Piece("b", True),))), False)),
    ("/v1/embeddings", {"input": [{"content": [{"type": "text", "text": "x"}]}]}, None),
    # Not counted: llama-server checks no prompt here, or Spillway does not know its shape.
    ("/v1/rerank", {"query": "a", "documents": ["b"]}, None),
]


@pytest.mark.parametrize("route,payload,expected", TABLE,
                         ids=[f"{t[0]} {sorted(t[1])}" for t in TABLE])
def test_the_plan_follows_llama_servers_own_count(route: str, payload: dict[str, Any],
                                                   expected: Plan | None) -> None:
    assert plan(route, payload) == expected


def test_the_bound_covers_messages_and_response_items() -> None:
    assert upper_bound(100, None) == 100 + 64 + 32
    assert upper_bound(100, {"messages": [{}, {}, {}]}) == 100 + 64 + 32 * 3
    assert upper_bound(100, {"input": [{}, {}]}) == 100 + 64 + 32 * 2


def test_the_error_names_the_first_prompt_that_does_not_fit() -> None:
    count = Count((10, 700, 900), exact=True)
    assert count.largest == 900
    assert count.first_over(512) == 700
    assert count.first_over(700) == 700  # a prompt that fills the slot does not fit
    assert Count((), exact=True).largest == 0


def test_a_prompt_object_with_media_is_split_at_the_childrens_marker() -> None:
    """libmtmd's way: the text between markers tokenized without special tokens, the BOS (and
    EOS) once (`/tokenize` of an empty text with add_special), and each media item counted on
    the child."""
    m = "<__media_x__>"
    prompt = {"prompt_string": f"look {m} and {m}", "multimodal_data": ["AAA", "BBB"]}
    got = plan("/completion", {"prompt": prompt}, marker=m)
    assert got == Plan(None, (Task((Piece("", True), Piece("look ", False),
                                    Piece(" and ", False)),
                                   media=(MediaBlob("AAA"), MediaBlob("BBB"))),), True)
    # Without the marker (not known), or with data that is not base64 text: not counted.
    assert plan("/completion", {"prompt": prompt}) is None
    assert plan("/completion", {"prompt": {"prompt_string": "x", "multimodal_data": [1]}},
                marker=m) is None
