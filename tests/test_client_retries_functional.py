"""What a client's own retry rule makes of Spillway's waiting-line 503 (fake children: the line
is full while both are busy). Continue retries only a 429 or an error whose message says
"overloaded" (its rule: tests/client_shapes.continue_retries); the OpenAI SDKs retry by status
and headers, which stay as they were; aider retries the exception LiteLLM makes of it."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from client_shapes import aider, aider_retries, continue_llamacpp, continue_retries
from test_admission_functional import occupy_both, one_each

from conftest import SpillwayFactory


def test_continue_retries_the_waiting_lines_503_and_the_sdks_still_do(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(one_each(fake_server, tiny_model, queue={"max_waiting": 0}))
    busy = occupy_both(s)
    shape = continue_llamacpp("hi")
    status, body = s.post(shape.route, shape.body, shape.headers)
    oa = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as sdk:
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    busy.join()
    assert status == 503
    error = body["error"]
    assert error["message"].startswith("overloaded: the waiting line is full"), error
    assert error["type"] == "unavailable_error" and error["code"] == 503
    # The error Continue's fetch makes of it (its body as text), through its retry rule.
    assert continue_retries(503, "Service Unavailable", f"{s.url}/completion",
                            json.dumps(body))
    # The OpenAI SDK's rule is untouched: 503, Retry-After within its 60 s, x-should-retry.
    headers = sdk.value.response.headers
    assert sdk.value.status_code == 503 and headers["x-should-retry"] == "true"
    assert 1 <= int(headers["retry-after"]) <= 60


def test_loading_model_keeps_llama_servers_words() -> None:
    """What llama-server says while it loads: no retry by Continue there either."""
    from supervisor.proxy import errors
    response = errors.unavailable(errors.LOADING, "rid", retry_after_s=2)
    assert response.text is not None
    assert '"message": "Loading model"' in response.text
    assert not continue_retries(503, "Service Unavailable", "http://x/completion",
                                response.text)


def test_aider_retries_the_503_litellm_raises(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """LiteLLM (after its SDK's own retries, left out here: max_retries 0) raises Spillway's 503
    as ServiceUnavailableError, which aider's table retries."""
    import os
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    s = spillway(one_each(fake_server, tiny_model, queue={"max_waiting": 0}))
    busy = occupy_both(s)
    body = aider("hi").body
    with pytest.raises(Exception) as caught:
        litellm.completion(**body, api_base=f"{s.url}/v1", api_key="none", timeout=600,
                           max_retries=0)
    busy.join()
    assert type(caught.value).__name__ == "ServiceUnavailableError", repr(caught.value)
    assert aider_retries(caught.value) and "overloaded" in str(caught.value)
