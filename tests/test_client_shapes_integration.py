"""Issue 47: the clients home servers run, each sending its own request (tests/client_shapes.py)
through Spillway across a GPU death, and each reading the answer as its own code does.

Real llama-server children serving the embedded SmolLM2-135M-Instruct (its template ignores
tools: llama-server answers a request that offers them, or forces one, with text); the GPU child
dies on any request that carries MARKER (tests/gpu_fault_injector.py), either as the task
launches (before the first event: the request is replayed whole on the CPU child) or after four
events (the stream is continued from the CPU child, unless its body forbids it). One Spillway
for each kind of death serves every client in turn; each test waits for the GPU child to be back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from client_shapes import (
    Shape,
    aider,
    aider_retries,
    cline,
    continue_llamacpp,
    continue_stream_sse,
    home_llm,
    home_llm_read,
    jan,
    jan_read,
    open_webui,
    open_webui_read,
    roo_code,
    sdk_read,
)
from harness import Spillway, real_config

from supervisor.commands import bootstrap

pytestmark = [pytest.mark.integration]

MARKER = "Reply briefly."
QUESTION = f"What is the capital of France? {MARKER}"
# What the GPU child's injector waits for before it dies, and what Spillway then does.
DEATHS = {"launch": "replayed", "events:4": "continued"}
# The Node SDK's header (Cline, Roo Code, Continue's openai provider: timeout 600 s); the Python
# SDK that stands in for it here sends its own read timeout instead.
NODE_SDK_HEADERS = {"X-Stainless-Timeout": "600"}


@dataclass
class Dying:
    """A Spillway whose GPU child dies on every request that carries MARKER."""

    spillway: Spillway
    when: str
    folder: Path

    @property
    def expected(self) -> str:
        return DEATHS[self.when]

    def ready(self) -> int:
        """Both children ready (the GPU child back from the last death); the incidents so far."""
        self.spillway.wait_ready()
        return len(self.spillway.incidents())

    def incident(self, before: int) -> dict[str, Any]:
        """The one incident of the request just answered."""
        return self.spillway.wait_incidents(before + 1)[-1]

    def sent_to_cpu(self) -> list[dict[str, Any]]:
        path = self.folder / "cpu-bodies.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return bootstrap.ensure_model()


@pytest.fixture(scope="module", params=list(DEATHS))
def dying(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          llama_server: Path, smollm2: Path, injector: Path) -> Iterator[Dying]:
    """`-ub 1`: the continuation's prefill takes the same kernels as the decoding did (see
    test_continuation_integration.py). Both children behind the injector, which records what
    each was sent; only the GPU child's dies."""
    when = request.param
    folder = tmp_path_factory.mktemp(f"shapes-{when.replace(':', '-')}")
    cfg = real_config(llama_server, smollm2, model={"args": [
        "-c", "2048", "-np", "2", "-t", "1", "-tb", "1", "-ub", "1"]})
    cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector), "env": {
        "REAL_LLAMA_SERVER": str(llama_server), "FAULT_MARKER": MARKER, "FAULT_WHEN": when,
        "FAULT_LINES": "terse", "FAULT_BODIES_FILE": str(folder / "gpu-bodies.jsonl")}}
    cfg["cpu"] = {**cfg["cpu"], "llama_server": str(injector), "env": {
        "REAL_LLAMA_SERVER": str(llama_server),
        "FAULT_BODIES_FILE": str(folder / "cpu-bodies.jsonl")}}
    s = Spillway(folder / "spillway", cfg)
    try:
        s.start()
        yield Dying(s, when, folder)
    finally:
        s.stop()


async def post_raw(s: Spillway, shape: Shape) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        async with http.post(f"{s.url}{shape.route}", data=json.dumps(shape.body),
                             headers=shape.headers) as r:
            return r.status, r.headers, await r.read()


def check_incident(d: Dying, record: dict[str, Any], route: str) -> None:
    # (Not client_connected: an SDK closes its connection as soon as it reads [DONE], which
    # can land before Spillway's handler returns; the incident then says the client left.)
    assert record["route"] == route and record["decision"] == d.expected, record


@pytest.mark.asyncio
async def test_open_webui_reads_its_answer_and_usage(dying: Dying) -> None:
    before = dying.ready()
    status, _, raw = await post_raw(dying.spillway, open_webui(QUESTION))
    assert status == 200
    reading = open_webui_read(raw)
    assert reading.error is None and reading.text.strip()
    assert reading.finishes == ["stop"]
    assert reading.usage is not None and reading.usage["completion_tokens"] > 0
    check_incident(dying, dying.incident(before), "/v1/chat/completions")


@pytest.mark.asyncio
async def test_continues_llamacpp_provider_reads_its_completion(dying: Dying) -> None:
    before = dying.ready()
    status, _, raw = await post_raw(dying.spillway, continue_llamacpp(QUESTION))
    assert status == 200
    events = continue_stream_sse(raw)
    assert "".join(e.get("content", "") for e in events).strip()
    assert [e.get("stop") for e in events].count(True) == 1 and events[-1]["stop"] is True
    check_incident(dying, dying.incident(before), "/completion")


@pytest.mark.parametrize("shape", [cline, roo_code], ids=["cline", "roo-code"])
def test_the_node_sdk_agents_read_text_and_no_broken_tool_call(dying: Dying, shape: Any) -> None:
    """Cline and Roo Code offer their tools (tool_choice auto): one finish, the text, and no
    tool call left half-built for their tool-call processors."""
    before = dying.ready()
    body = shape(QUESTION).body
    oa = openai.OpenAI(base_url=f"{dying.spillway.url}/v1", api_key="none", timeout=600)
    raw = oa.chat.completions.with_raw_response.create(**body, extra_headers=NODE_SDK_HEADERS)
    reading = sdk_read(raw.parse())
    assert reading.finishes == ["stop"] and reading.text.strip()
    assert all(call["name"] and call["arguments"] for call in reading.tool_calls.values())
    if body.get("temperature") == 0:  # Roo Code's default: greedy, across the death too
        assert "Paris" in reading.text
    assert reading.usage is not None
    check_incident(dying, dying.incident(before), "/v1/chat/completions")


def test_aiders_forced_tool_choice_is_never_continued_as_free_text(dying: Dying) -> None:
    """aider through LiteLLM forces its one function. Before the first event the request is
    replayed whole, tool_choice and all; after events it is not continued (the continuation's
    prompt would lose the constraint) but ends with the error event, which LiteLLM raises as
    an exception aider shows as it came."""
    import os
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    before = dying.ready()
    cpu_before = len(dying.sent_to_cpu())
    body = aider(QUESTION).body
    chunks: list[Any] = []
    raised: BaseException | None = None
    try:
        for chunk in litellm.completion(**body, api_base=f"{dying.spillway.url}/v1",
                                        api_key="none", timeout=600):
            chunks.append(chunk)
    except Exception as e:  # what aider's send_message catches
        raised = e
    record = dying.incident(before)
    to_cpu = dying.sent_to_cpu()[cpu_before:]
    if dying.when == "launch":
        assert raised is None
        reading = sdk_read(chunks)
        assert reading.finishes == ["stop"]
        check_incident(dying, record, "/v1/chat/completions")
        [replay] = to_cpu
        assert replay["body"]["tool_choice"] == body["tool_choice"]
        assert replay["body"]["tools"] == body["tools"]
        return
    # LiteLLM (aider's pin) raises MidStreamFallbackError, which aider's table does not name:
    # aider shows Spillway's message and stops, with no retry; its user asks again.
    assert raised is not None and not aider_retries(raised), repr(raised)
    assert "the answer is incomplete" in str(raised)
    assert record["decision"] == "passed_on" and record["route"] == "/v1/chat/completions"
    assert to_cpu == []  # no continuation was asked for
    assert all(not (c.choices and c.choices[0].finish_reason) for c in chunks)


@pytest.mark.asyncio
async def test_home_llm_parses_every_line(dying: Dying) -> None:
    """home-llm runs json.loads on every non-empty line after `data: `: a comment line would
    fail the voice command."""
    before = dying.ready()
    status, _, raw = await post_raw(dying.spillway, home_llm(QUESTION))
    assert status == 200
    reading = home_llm_read(raw)  # strict_sse.Refused names the line it would fail on
    assert reading.text.strip() and reading.finishes == ["stop"]
    check_incident(dying, dying.incident(before), "/v1/chat/completions")


@pytest.mark.asyncio
async def test_jan_checks_health_then_parses_every_line(dying: Dying) -> None:
    """Jan's llama.cpp extension: GET /health first (a network failure would be a crash), then
    the chat with return_progress; any line but `data:` or `error:` is a "Malformed chunk", and
    a `length` finish is shown as a context overflow."""
    before = dying.ready()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{dying.spillway.url}/health") as r:
            assert r.status in (200, 503)
    status, _, raw = await post_raw(dying.spillway, jan(QUESTION))
    assert status == 200
    reading = jan_read(raw)
    assert reading.text.strip() and reading.finishes == ["stop"]
    assert b'"prompt_progress"' in raw  # what it asked for
    check_incident(dying, dying.incident(before), "/v1/chat/completions")
