"""Drop-in fidelity: every answer Spillway makes itself, beside what the pinned llama-server
answers in the same situation (captured from the real binary by scripts/capture_errors.py into
tests/fixtures/llama-server/answers), field by field.

The table below is the whole list of statuses and bodies Spillway makes itself. Each row says
how Spillway's answer stands to llama-server's:

- SAME: Spillway answers, with llama-server's status, `type`, `code`, its other fields
  (`n_prompt_tokens`, `n_ctx`) and its words; plus its own `src` and `request_id`, and the
  row's own extra fields.
- OWN_WORDS: the same status, `type` and `code`, in Spillway's words (its JSON parser is not
  llama-server's).
- CHILD: Spillway leaves the answer to a child: the child's own, unchanged.
- DIFFERENT: Spillway answers otherwise, on purpose.
- NO_COUNTERPART: llama-server has no such situation (a waiting line, a replay, ...).

Every row but SAME and CHILD is a deliberate difference, and docs/failover.md's table says why
(`test_every_difference_is_in_the_docs`). The requests are the captures' own, sent by the
same code (tests/llama_answers.py) to three daemons: `main` with real children like the capture's
`main` server, `embeddings` with real children like its `embeddings` server, and `loading`,
whose children never finish loading.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, Spillway, eventually, fake_config, real_config
from llama_answers import captures, parsed, send
from tinymodel import write_tiny_model

pytestmark = [pytest.mark.integration]

KEY = "capture-key"  # the captures' key (scripts/capture_errors.py)
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY_MIB = 1
BODY_TIMEOUT_S = 1.0


class Kind(enum.Enum):
    SAME = "same"
    OWN_WORDS = "own words"
    CHILD = "the child's"
    DIFFERENT = "different"
    NO_COUNTERPART = "no counterpart"


@dataclass(frozen=True)
class Row:
    situation: str  # a capture's name, or (NO_COUNTERPART) what happens
    kind: Kind
    daemon: str = "main"
    status: int | None = None  # Spillway's, where it differs (DIFFERENT, NO_COUNTERPART)
    extra: tuple[str, ...] = ()  # Spillway's own fields beside llama-server's
    readme: str = ""  # docs/failover.md's row that says why it differs
    body_size: int | None = None  # Spillway's own limit stands in for llama-server's


OVER_CONTEXT_OWN = [f"over-context-{route}{stream}"
                    for route in ("completion", "completions", "v1-completions",
                                  "chat-completions", "v1-chat-completions", "v1-responses",
                                  "responses", "v1-messages")
                    for stream in ("", "-stream")]
QUEUE = ("queue_position", "retry_after_s", "reason")

TABLE: list[Row] = [
    *(Row(name, Kind.SAME) for name in OVER_CONTEXT_OWN),
    Row("over-context-infill", Kind.CHILD),
    Row("over-context-infill-stream", Kind.CHILD),
    Row("over-context-embedding", Kind.CHILD, "embeddings"),
    Row("over-context-embeddings", Kind.CHILD, "embeddings"),
    Row("over-context-v1-embeddings", Kind.CHILD, "embeddings"),
    Row("no-key", Kind.SAME),
    Row("wrong-key", Kind.SAME),
    Row("no-key-models", Kind.SAME),
    Row("unknown-route-no-key", Kind.SAME),
    Row("unknown-route", Kind.CHILD),
    Row("health-ready", Kind.CHILD),
    Row("bad-json", Kind.OWN_WORDS, readme="a body that is not JSON"),
    Row("empty-body", Kind.OWN_WORDS, readme="a body that is not JSON"),
    Row("invalid-utf8", Kind.OWN_WORDS, readme="a body that is not JSON"),
    Row("not-an-object", Kind.OWN_WORDS, readme="JSON that is not an object"),
    Row("body-over-limit", Kind.DIFFERENT, status=413, readme="a body over the limit",
        body_size=MAX_BODY_MIB * 1024 * 1024 + 1),
    Row("body-trickled", Kind.DIFFERENT, status=408, readme="a client that trickles its body"),
    Row("headers-over-32k", Kind.DIFFERENT, status=431, readme="headers over 32 KiB in all"),
    Row("loading-health", Kind.SAME, "loading", extra=QUEUE),
    Row("loading-v1-health", Kind.SAME, "loading", extra=QUEUE),
    Row("loading-unknown-route", Kind.SAME, "loading", extra=QUEUE),
    Row("loading-props", Kind.SAME, "loading", extra=QUEUE),
    # With a waiting line of 0 (the loading daemon's): else it waits for the child, on purpose.
    Row("loading-chat", Kind.SAME, "loading", extra=QUEUE,
        readme="a generation request while the model loads"),
    Row("loading-chat-stream", Kind.SAME, "loading", extra=QUEUE,
        readme="a generation request while the model loads"),
    Row("loading-chat-no-key", Kind.DIFFERENT, "loading", status=401,
        readme="no key while the model loads"),
    # Spillway's alone (tested where they are made: test_proxy_functional, test_admission_*,
    # test_failover_integration, test_idempotency_functional, test_own_routes, ...).
    Row("no child can serve (back-off, FATAL), the waiting line full, or the wait too long",
        Kind.NO_COUNTERPART, status=503, readme="no child can serve"),
    Row("a child failed and the request may not be replayed", Kind.NO_COUNTERPART, status=502,
        readme="a child failed"),
    Row("an Idempotency-Key, X-Conversation-Id or Spillway's own routes", Kind.NO_COUNTERPART,
        status=400, readme="an Idempotency-Key"),
    # llama-server checks neither (test_browser_guard, test_browser_attack).
    Row("a Host that names no address of Spillway's, listening on loopback only",
        Kind.NO_COUNTERPART, status=403, readme="a `Host` that names none of Spillway's"),
    Row("a DELETE /v1/stream from a page of another origin", Kind.NO_COUNTERPART, status=403,
        readme="a browser's `DELETE /v1/stream` from another origin"),
    # Vertex AI's contract (test_vertex, which holds the predictions to the real binary's).
    Row("Vertex AI's health route without a key, with server.api_key set",
        Kind.NO_COUNTERPART, status=200, readme="Vertex AI's health route (`AIP_HEALTH_ROUTE`)"),
    Row("an instance of a prediction that Spillway cannot take now", Kind.NO_COUNTERPART,
        status=503, readme="an instance of a prediction"),
]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The captures' model: the tiny one with fill-in-the-middle tokens."""
    return write_tiny_model(tmp_path_factory.mktemp("fim") / "tiny-fim.gguf", fim=True)


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory, llama_server: Path, fim_model: Path,
            fake_server: Path) -> Iterator[dict[str, Spillway]]:
    """The three daemons, started together (their children load at the same time)."""
    main = real_config(llama_server, fim_model,
                       model={"args": ["-c", "1024", "-np", "2", "-t", "1", "-tb", "1"]},
                       server={"api_key": KEY, "max_body_mib": MAX_BODY_MIB,
                               "body_timeout_s": BODY_TIMEOUT_S})
    embeddings = real_config(llama_server, fim_model, server={"api_key": KEY}, model={
        "args": ["--embeddings", "--pooling", "mean", "-c", "512", "-np", "2", "-b", "1024",
                 "-ub", "1024", "-t", "1", "-tb", "1"]})
    hang = {"env": {"FAKE_HANG_START": "1"}}
    loading = fake_config(fake_server, fim_model, server={"api_key": KEY}, gpu=hang, cpu=hang,
                          queue={"max_waiting": 0})
    root = tmp_path_factory.mktemp("fidelity")
    made = {name: Spillway(root / name, config) for name, config in
            (("main", main), ("embeddings", embeddings), ("loading", loading))}
    try:
        for s in made.values():
            s.start(wait_ready=False)
        made["loading"].wait_state(("gpu", "cpu"), ("STARTING",), headers=AUTH)
        for s in (made["main"], made["embeddings"]):
            s.wait_state(("gpu", "cpu"), ("READY",), headers=AUTH)
            # The slots' context comes from /props, a moment after READY.
            assert eventually(lambda s=s: all(c.get("ctx_per_slot") for c in
                                              s.status(AUTH)["children"].values()))
        yield made
    finally:
        for s in made.values():
            s.stop()


def _error_fields(body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    return dict(body["error"])


def _spillways_own(status: int, content_type: str | None, body: Any) -> dict[str, Any]:
    """An error Spillway made: JSON, marked with its source and the request's id."""
    assert content_type is not None and content_type.startswith("application/json"), \
        (content_type, body)
    error = _error_fields(body)
    assert error["src"] == "spillway" and error["request_id"], error
    assert error["code"] == status, error
    return error


COMPARED = [r for r in TABLE if r.kind is not Kind.NO_COUNTERPART]


@pytest.mark.parametrize("row", COMPARED, ids=[r.situation for r in COMPARED])
def test_spillways_answer_beside_llama_servers(row: Row, daemons: dict[str, Spillway]) -> None:
    theirs = captures()[row.situation]
    status, content_type, raw = send(daemons[row.daemon].port, theirs["request"], row.body_size)
    body = parsed(raw)
    if row.kind is Kind.CHILD:
        # Left to the child: its answer as it gave it, a stream's error as plain JSON too.
        assert (status, body) == (theirs["status"], theirs["body"])
        assert content_type == theirs["content_type"]
        return
    ours = _spillways_own(status, content_type, body)
    if row.kind is Kind.DIFFERENT:
        assert status == row.status, body
        return
    assert status == theirs["status"], body
    assert content_type == theirs["content_type"]  # JSON, never an SSE error event
    expected = _error_fields(theirs["body"])
    if row.kind is Kind.OWN_WORDS:
        expected.pop("message")
        assert ours["message"]
    assert {k: ours.get(k) for k in expected} == expected
    assert all(k in ours for k in row.extra), ours


def test_the_table_covers_every_capture() -> None:
    named = {r.situation for r in TABLE}
    assert set(captures()) == named - {r.situation for r in TABLE
                                       if r.kind is Kind.NO_COUNTERPART}


def test_every_difference_is_in_the_docs() -> None:
    readme = (REPO / "docs" / "failover.md").read_text()
    section = readme.split("### Spillway's answers beside llama-server's", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    for row in TABLE:
        if row.kind in (Kind.SAME, Kind.CHILD) and not row.readme:
            continue
        assert any(row.readme in line for line in rows), \
            f"docs/failover.md: no row for {row.readme!r}"


def test_the_over_context_answer_names_the_childs_own_count() -> None:
    """The captures are what the test above holds Spillway to: over a slot of 512 tokens, with
    the tokens of the templated prompt (the same for chat, /v1/responses and /v1/messages,
    which llama-server converts to the same chat) and of the raw prompt for completions."""
    answers = captures()
    counts = {name: _error_fields(answers[name]["body"])["n_prompt_tokens"]
              for name in OVER_CONTEXT_OWN}
    templated = {counts[n] for n in counts if re.search("chat|responses|messages", n)}
    raw = {counts[n] for n in counts if "completion" in n and "chat" not in n}
    assert len(templated) == 1 and len(raw) == 1 and templated != raw
    assert all(_error_fields(answers[n]["body"])["n_ctx"] == 512 for n in OVER_CONTEXT_OWN)
