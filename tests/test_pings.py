"""Issue 47: no line on the wire that llama-server would not send on that request.

Pings (`:` comments) only for a client that asked for them (policy/pings.py), the continuation
said in its final event, and the strict parsers the integration tests hold streams to
(tests/strict_sse.py) refusing what those clients refuse."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import strict_sse

from supervisor.config.schema import ChildConfig
from supervisor.policy import continuation as c
from supervisor.policy import pings
from supervisor.proxy import sse
from supervisor.proxy.continued import ContinuedStream
from supervisor.proxy.forward import pinging


@pytest.mark.parametrize(("payload", "messages", "flag", "asked"), [
    ({"stream": True}, False, None, None),  # llama-server's built-in 30 s is no ask
    ({"sse_ping_interval": 1}, False, None, 1),  # llama.cpp's web UI asks so
    ({"sse_ping_interval": 5}, False, 10, 5),  # the request's field over the server's flag
    ({"sse_ping_interval": -1}, False, 10, None),  # ... both ways: it asked for none
    ({"sse_ping_interval": 0}, False, None, None),
    ({"sse_ping_interval": 0.5}, False, None, None),  # an int32 for llama-server: 0
    ({"sse_ping_interval": 2.9}, False, None, 2),
    ({"sse_ping_interval": None}, False, 7, 7),  # null is absent: the server's
    ({"stream": True}, False, 7, 7),  # the operator's --sse-ping-interval asks for everyone
    ({"stream": True}, False, -1, None),
    # /v1/messages: llama-server's conversion drops the field; the server's flag applies.
    ({"sse_ping_interval": 1}, True, None, None),
    ({"sse_ping_interval": 1}, True, 4, 4),
    (None, False, None, None),
])
def test_a_client_asked_for_pings_only_when_someone_set_an_interval(
        payload: Any, messages: bool, flag: int | None, asked: int | None) -> None:
    assert pings.asked_interval(payload, messages, flag) == asked


def test_the_operators_flag_is_read_from_the_childs_args_else_its_environment() -> None:
    base = ChildConfig(name="cpu", args=("-ngl", "0"), llama_server="llama-server",
                       model_path="m.gguf", env={}, start_timeout_s=1.0, stop_grace_s=1.0,
                       max_concurrency=None)
    assert base.sse_ping_interval is None

    def child(args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> ChildConfig:
        return ChildConfig(**{**base.__dict__, "args": args, "env": env or {}})

    assert child(("--sse-ping-interval", "10")).sse_ping_interval == 10
    assert child(("--sse-ping-interval=-1",)).sse_ping_interval == -1
    assert child(env={"LLAMA_ARG_SSE_PING_INTERVAL": "5"}).sse_ping_interval == 5
    # As llama.cpp reads them: the command line over the environment.
    assert child(("--sse-ping-interval", "3"),
                 {"LLAMA_ARG_SSE_PING_INTERVAL": "5"}).sse_ping_interval == 3


def test_comment_lines_and_the_blocks_they_leave_empty_are_dropped() -> None:
    events = b'data: {"a":1}\n\n:\n\ndata: {"b":2}\n\n'
    assert sse.without_comments(events) == b'data: {"a":1}\n\ndata: {"b":2}\n\n'
    assert sse.without_comments(b":\n\n:\n\n") == b""
    assert sse.without_comments(b'data: {"a":1}\n: note\n\n') == b'data: {"a":1}\n\n'
    assert sse.without_comments(events.replace(b":\n\n", b"")) == \
        events.replace(b":\n\n", b"")
    # An unfinished block is left as it is, to be judged when whole.
    assert sse.without_comments(b":\n\ndata: {") == b"data: {"


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_with_include_usage_the_last_event_says_the_stream_was_continued_too() -> None:
    """The usage chunk that `stream_options.include_usage` adds after the finish is the
    stream's last event: it carries `spillway_continuation` as the finish does."""
    before = c.Transcript("chat")
    before.take({"id": "chatcmpl-A", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": "Once"}}]})
    note = {"from_child": "gpu", "child": "cpu", "kind": "runtime_oom", "tokens_before": 1}
    out = ContinuedStream(before, note).rewrite(
        event({"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) +
        event({"id": "x", "choices": [], "usage": {"completion_tokens": 2,
                                                   "prompt_tokens": 9, "total_tokens": 11}}) +
        b"data: [DONE]\n\n")
    finish, usage = [json.loads(sse.event_data(b)) for b in out.split(b"\n\n")[:2]]
    assert finish["spillway_continuation"] == note == usage["spillway_continuation"]
    assert usage["usage"]["completion_tokens"] == 3


CHUNK = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "a"}}]}


@pytest.mark.parametrize("parse", [strict_sse.home_llm, strict_sse.jan])
def test_the_strict_parsers_read_llama_servers_lines_and_refuse_a_comment(parse: Any) -> None:
    plain = event(CHUNK) + event({**CHUNK, "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop"}]}) + b"data: [DONE]\n\n"
    assert len(parse(plain)) == 2
    for line in (b":", b": spillway: waiting for the first token"):
        with pytest.raises(strict_sse.Refused) as refused:
            parse(event(CHUNK) + line + b"\n\n" + plain)
        assert refused.value.line.rstrip(b"\n") == line and refused.value.number == 3


def test_home_llm_reads_each_event_as_its_extract_response_does() -> None:
    with pytest.raises(strict_sse.Refused, match="KeyError"):
        strict_sse.home_llm(event({"choices": [{"index": 0, "delta": {}}]}))  # no `object`
    with pytest.raises(strict_sse.Refused, match="Malformed chunk"):
        strict_sse.jan(b"data:" + json.dumps(CHUNK).encode() + b"\n\n")  # `data:`, no space


class Written:
    """What a stream response was sent, and an event per write."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.wrote = asyncio.Event()

    async def write(self, data: bytes) -> None:
        self.data.append(data)
        self.wrote.set()


async def test_a_client_that_asked_hears_pings_while_spillway_keeps_it_waiting() -> None:
    """Between a death and the continuation's first byte no child writes to the client: one
    that asked for pings hears them there, each after its interval of silence, and none after
    the wait is over."""
    resp, done = Written(), asyncio.Event()

    async def the_other_child_answers() -> str:
        await done.wait()
        return "answered"

    waiting = asyncio.create_task(pinging(resp, 1, the_other_child_answers()))  # type: ignore[arg-type]
    await resp.wrote.wait()  # (about a second)
    assert resp.data == [pings.PING] == [b":\n\n"]
    done.set()
    assert await waiting == "answered"
    ended = len(resp.data)
    assert await pinging(resp, None, asyncio.sleep(0, "no ask")) == "no ask"  # type: ignore[arg-type]
    assert len(resp.data) == ended  # no ping after the wait, nor without an ask
