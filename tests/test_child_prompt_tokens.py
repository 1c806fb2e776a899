"""The prompt's tokens as the child that answered reported them (proxy/forward.py), beside
Spillway's own count in the access log and spillway_prompt_count_error_tokens: from every answer
shape of the pinned llama-server (tools/server/server-task.cpp). The Responses API's and
Anthropic's answers carry no `timings`: their usage says it, Anthropic's without the tokens
found cached."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.proxy.forward import _answer_figures

TIMINGS = {"cache_n": 21, "prompt_n": 1, "prompt_ms": 0.46, "predicted_n": 2}


@pytest.mark.parametrize(("answer", "expected"), [
    # chat and /v1/completions: timings, and usage.prompt_tokens (the same figure)
    ({"usage": {"completion_tokens": 2, "prompt_tokens": 22}, "timings": TIMINGS}, 22),
    ({"usage": {"completion_tokens": 2, "prompt_tokens": 22}}, 22),
    # /completion: timings only
    ({"content": "x", "tokens_predicted": 2, "timings": TIMINGS}, 22),
    # the Responses API: input_tokens holds the cached ones (input_tokens_details says how many)
    ({"object": "response", "usage": {"input_tokens": 38, "output_tokens": 2,
                                      "input_tokens_details": {"cached_tokens": 30}}}, 38),
    # Anthropic: input_tokens leaves out cache_read_input_tokens
    ({"type": "message", "usage": {"cache_read_input_tokens": 9, "input_tokens": 13,
                                   "output_tokens": 2}}, 22),
    ({"type": "message", "usage": {"input_tokens": 13, "output_tokens": 2}}, 13),
    # nothing said
    ({"choices": []}, None),
    ({"usage": {"input_tokens": "13"}}, None),
    ([1, 2], None),
])
def test_the_childs_prompt_tokens_from_each_answer(answer: Any, expected: int | None) -> None:
    assert _answer_figures(answer).prompt_tokens == expected
