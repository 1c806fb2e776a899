"""The recovery coordinator (serving/recovery.py): the decisions of an outage from the request
as received, in one place: its work and its place (the earliest expected finish included), its
replay, its continuation, what is mirrored."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy
from test_failover_unit import OOM, transcript
from test_mirror import StandIn
from test_pool import FakeMember, FakeSource

from supervisor.policy.estimate import Work
from supervisor.policy.media import find
from supervisor.policy.mirror import REWARM
from supervisor.policy.routes import RouteClass
from supervisor.serving.mirror import Lane, Mirror, MirrorSettings
from supervisor.serving.pool import Lease, Pool
from supervisor.serving.recovery import GoOn, Recovery, RecoverySettings, Replay, safe_read
from supervisor.vocabulary import Attempt, OwnHeaders, Received

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "stream": True}


def received(payload: dict[str, Any] | None = None, **more: Any) -> Received:
    payload = CHAT if payload is None else payload
    body = b'{"messages": []}' + b" " * 300
    values: dict[str, Any] = dict(
        request_id="r1", method="POST", path="/v1/chat/completions",
        path_qs="/v1/chat/completions", route=RouteClass.GENERATION, body=body,
        payload=payload, stream=True, client_headers=CIMultiDictProxy(CIMultiDict()),
        received=time.monotonic(), media=find("/v1/chat/completions", payload))
    values.update(more)
    return Received(**values)


def pool(states: dict[str, str] | None = None) -> Pool:
    source = FakeSource({"gpu": 1, "cpu": 1}, states or {"gpu": "READY", "cpu": "READY"})
    members = {n: FakeMember(n, source) for n in ("gpu", "cpu")}
    return Pool(source, members, 4, 30.0)  # type: ignore[arg-type]


def test_the_request_as_received_is_frozen() -> None:
    req = received()
    try:
        req.path = "/elsewhere"  # type: ignore[misc]
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("a received request was written")


def test_a_light_request_keeps_its_bytes_alone_and_is_parsed_again_whole() -> None:
    """A held body's parsed JSON is let go once admission has read it (proxy/handler.py): the
    request is still a JSON one (replayable, mirrorable), and a continuation reads its JSON
    again from its bytes."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}'
    req = received(payload={"messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 32}, body=body)
    light = req.light()
    assert light.payload is None and light.is_json and light.body is req.body
    assert light.whole().payload == req.payload and not light.whole().payload_let_go
    not_json = dataclasses.replace(req, payload=None)
    assert req.whole() is req and not_json.light() is not_json and not not_json.is_json
    # Its work is read before: a light request's would not know its max_tokens.
    recovery = Recovery(pool(), RecoverySettings())
    assert recovery.work(req).max_tokens == 32


async def test_its_work_and_its_place() -> None:
    recovery = Recovery(pool(), RecoverySettings())
    req = received()
    counted = recovery.work(req, 1234, counted=True)
    assert (counted.prompt_tokens, counted.max_tokens) == (1234, 32)
    bound = recovery.work(req, 1234, counted=False)
    assert bound.prompt_tokens == len(req.body) // 3  # not counted: its bytes' bound
    got = await recovery.admit(req, counted, 1234, exact=True)
    assert isinstance(got, Lease) and got.name == "gpu"
    got.close(None, None)


async def test_its_deadline_and_its_opt_out_reach_the_replay_rule() -> None:
    recovery = Recovery(pool({"gpu": "EXITED", "cpu": "READY"}), RecoverySettings())
    nxt = await recovery.after_failure(received(), Work(10, 32), OOM, 1, 10)
    assert isinstance(nxt, Replay) and nxt.lease.name == "cpu"
    nxt.lease.close(None, None)
    never = received(own=OwnHeaders(replay=False))
    refused = await recovery.after_failure(never, Work(10, 32), OOM, 1, 10)
    assert not isinstance(refused, Replay) and "opted out" in refused.reason
    gone = received(own=OwnHeaders(deadline_s=1.0), received=time.monotonic() - 5)
    assert recovery.deadline_left(gone) is not None and recovery.deadline_left(gone) < 0
    off = Recovery(recovery.pool, RecoverySettings(replay=False))
    assert not isinstance(await off.after_failure(received(), Work(10, 32), OOM, 1, 10),
                          Replay)


async def test_a_cut_stream_goes_on_with_its_prompt_and_the_text_sent() -> None:
    recovery = Recovery(pool({"gpu": "EXITED", "cpu": "READY"}), RecoverySettings())
    nxt = await recovery.after_cut(received(), Work(10, 32), transcript(), False, OOM)
    assert isinstance(nxt, GoOn) and nxt.lease.name == "cpu"
    nxt.lease.close(None, None)


def test_what_is_offered_to_each_lane_of_the_mirror() -> None:
    """The warm CPU child's lane takes what the GPU child answered alone; the rewarm's keeps
    that (the GPU child holds it) and queues what the CPU child answered: a replay, a continued
    stream, a request it took alone."""
    gpu, cpu = StandIn("http://unused", "gpu"), StandIn("http://unused", "cpu")
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    to_cpu = Lane(lambda: None, cpu, [gpu, cpu], MirrorSettings(),  # type: ignore[arg-type,list-item,return-value]
                  clock)
    to_gpu = Lane(lambda: None, gpu, [gpu, cpu], MirrorSettings(),  # type: ignore[arg-type,list-item,return-value]
                  clock, name=REWARM, any_child=True, keeps=True)
    recovery = Recovery(pool(), RecoverySettings(no_prefill=frozenset({"cpu"})),
                        Mirror([to_cpu, to_gpu]))
    on_gpu = Attempt("gpu", 1, answer_text="hello")
    recovery.served(received(), [on_gpu], 200, False, None, 40)
    # Its body as received; the CPU child, under --no-prefill-assistant, holds the prompt alone.
    assert [(o.body, o.answer, o.prompt_tokens, o.prefills) for o in to_cpu.queue] == [
        (received().body, "hello", 40, False)]
    assert [o.prefills for o in to_gpu.kept] == [True] and not to_gpu.queue
    recovery.served(received(), [Attempt("gpu", 1)], 200, False, "streamed", 40)
    assert to_cpu.queue[-1].answer == "streamed" and len(to_gpu.kept) == 2
    # The CPU child's answers, in an outage: only the rewarm takes them, to send.
    for args in ((received(), [on_gpu, Attempt("cpu", 2)], 200, False),
                 (received(), [on_gpu, Attempt("cpu", 2)], 200, True),
                 (received(), [Attempt("cpu", 1)], 200, False)):
        recovery.served(*args, "an answer", 40)  # type: ignore[arg-type]
    assert len(to_cpu.queue) == 2 and len(to_gpu.queue) == 3 and len(to_gpu.kept) == 2
    # Neither lane: an error, another route, X-Spillway-Replay: never (a mirror runs it
    # again), an image.
    image = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    for args in ((received(), [on_gpu], 500, False),
                 (received(path="/completion"), [on_gpu], 200, False),
                 (received(own=OwnHeaders(replay=False)), [on_gpu], 200, False),
                 (received(own=OwnHeaders(replay=False)), [Attempt("cpu", 1)], 200, False),
                 (received(image), [on_gpu], 200, False)):
        now[0] += 1.0
        recovery.served(*args, None, 40)  # type: ignore[arg-type]
        # Every ending is real work: a mirror waits for the next idle spell.
        assert to_cpu._last_busy == to_gpu._last_busy == now[0]
    assert len(to_cpu.queue) == 2 and len(to_gpu.queue) == 3 and len(to_gpu.kept) == 2


def test_safe_read_is_a_body_less_get_or_head_of_a_route_that_only_reads() -> None:
    def get(path_qs: str, body: bytes = b"") -> Received:
        return received(method="GET", path=path_qs.partition("?")[0], path_qs=path_qs,
                        body=body, route=RouteClass.PASSTHROUGH)

    assert safe_read(get("/props"))
    assert not safe_read(get("/props", body=b"x"))
    assert not safe_read(received())
    # The query is read from the request as it came (path_qs).
    assert not safe_read(get("/v1/models?autoload=true"))
    assert not safe_read(get("/cors-proxy?url=http://example.com/"))
