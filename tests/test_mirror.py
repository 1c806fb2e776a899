"""The warm CPU child's rules (policy/mirror.py) and its task (serving/mirror.py) against a
slow stand-in for the CPU child (an aiohttp server streaming a mirror's answer slowly): which
request is offered, which conversation goes next, the queue's bounds, the budget, the body; a
mirror starts only after an idle spell, real work cancels it at once (the stream is closed),
and it is tried again once idle. Then through a daemon with fake children: a request sent with
`X-Spillway-Replay: never` is never mirrored, and the queue is in the status's caches."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from conftest import SpillwayFactory
from harness import eventually, fake_config

from supervisor.config.schema import build
from supervisor.policy import mirror as rules
from supervisor.policy.lifecycle import ChildState
from supervisor.service.daemon import _mirror_settings
from supervisor.serving.mirror import Lane, MirrorSettings
from supervisor.vocabulary import Load

CHAT = {"messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "hello"}],
        "max_tokens": 64, "stream": False, "tool_choice": "auto", "tools": [{"type": "x"}],
        "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.2}


def test_the_body_is_the_conversation_with_its_answer_prefilled() -> None:
    made = rules.offer_body(CHAT, "hi there", prefills=True)
    assert made is not None
    key, body = made
    assert body["messages"][-1] == {"role": "assistant", "content": "hi there"}
    assert (body["n_predict"], body["stream"], body["cache_prompt"]) == (0, True, True)
    assert "max_tokens" not in body and "tool_choice" not in body
    assert body["tools"] == CHAT["tools"] and body["temperature"] == 0.2  # shapes the prompt
    # The next turn looks up its messages less the new one: the mirrored key.
    next_turn = {**CHAT, "messages": [*body["messages"], {"role": "user", "content": "more"}]}
    assert key in rules.lookup_keys(next_turn)
    # Under --no-prefill-assistant only the prompt is mirrored; a client's own prefill is not.
    plain = rules.offer_body(CHAT, "hi there", prefills=False)
    assert plain is not None and plain[1]["messages"] == CHAT["messages"]
    prefill = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure"}]}
    assert rules.offer_body(prefill, "x", True) is None
    assert rules.offer_body({"prompt": "x"}, "x", True) is None
    # Templates' inputs are part of the key: another tool list is another prefix.
    assert rules.prefix_key(CHAT["messages"], CHAT) != rules.prefix_key(CHAT["messages"],
                                                                         {"tools": []})


def test_the_newest_then_the_longest_goes_first_within_the_bound() -> None:
    offers = [rules.Offer(b"{}", None, True, 500, at=1.0),
              rules.Offer(b"{}", None, True, 900, at=5.0),
              rules.Offer(b"{}", None, True, 2000, at=5.02),
              rules.Offer(b"{}", None, True, 99999, at=9.0)]
    assert rules.choose(offers, max_prompt_tokens=4096) == 2  # d too long; b and c at 5.0
    assert rules.choose(offers[:1], max_prompt_tokens=100) is None


PLAIN_END = {"status": 200, "chat": True, "media": False, "continued": False, "attempts": 1,
             "child": "gpu", "first_child": True, "opted_out": False}


@pytest.mark.parametrize("change", [{}, {"opted_out": True}, {"status": 500}, {"chat": False},
                                    {"media": True}, {"continued": True}, {"attempts": 2},
                                    {"first_child": False}])
def test_only_a_plain_chat_the_gpu_child_answered_whole_is_offered(change: dict[str, Any],
                                                                   ) -> None:
    # X-Spillway-Replay: never (opted_out): its client would rather not have it run twice.
    assert rules.offered(rules.Ended(**{**PLAIN_END, **change})) is (change == {})


def offer_of(size: int, at: float, tokens: int = 100, answer: str | None = None) -> rules.Offer:
    return rules.Offer(b"x" * size, answer, True, tokens, at)


def test_the_queue_keeps_the_newest_offers_within_its_entries_and_bytes() -> None:
    bounds = rules.Bounds(max_entries=3, max_bytes=1000, max_prompt_tokens=500)
    queued = [offer_of(400, 1.0), offer_of(290, 2.0, answer="0123456789")]
    assert queued[1].size == 300  # its body and its answer
    assert rules.admit(rules.Held.of(queued), offer_of(300, 3.0), bounds) == 0  # 1000 bytes, 3 offers
    assert rules.admit(rules.Held.of(queued), offer_of(400, 3.0), bounds) == 1  # 1100: the oldest goes
    assert rules.admit(rules.Held.of(queued), offer_of(1000, 3.0), bounds) == 2  # alone it fills the bound
    assert rules.admit(rules.Held.of([*queued, offer_of(10, 2.5)]), offer_of(10, 3.0), bounds) == 1
    # Not queued: larger alone than the bound, or too long to be ever chosen.
    assert rules.admit(rules.Held.of(queued), offer_of(1001, 3.0), bounds) is None
    assert rules.admit(rules.Held.of(queued), offer_of(10, 3.0, tokens=501), bounds) is None
    # A reload that lowers a bound: the oldest go until the rest fit.
    assert rules.over(rules.Held.of(queued), rules.Bounds(3, 350, 500)) == 1
    assert rules.over(rules.Held.of(queued), rules.Bounds(1, 1000, 500)) == 1
    assert rules.over(rules.Held.of(queued), bounds) == 0


def chat_body(i: int, words: int = 100) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": f"turn {i} " + "w " * words}],
                       "max_tokens": 4}).encode()


def test_the_mirrors_queue_holds_its_newest_offers_within_its_bytes_and_reports_them() -> None:
    cpu = StandIn("http://unused")
    mirror = Lane(lambda: None, cpu, [cpu],  # type: ignore[arg-type,list-item,return-value]
                    MirrorSettings(max_queued_bytes=1000))
    size = len(chat_body(0)) + len("an answer")
    for i in range(6):
        mirror.offer(chat_body(i), "an answer", prompt_tokens=50)
    kept = 1000 // size
    assert 1 <= kept < 6
    assert mirror.cache_figures()["mirror_queue"] == {
        "entries": kept, "bytes": kept * size, "max_entries": rules.DEFAULT_MAX_QUEUED,
        "max_bytes": 1000, "max_age_s": None}
    assert [o.body for o in mirror.queue] == [chat_body(i) for i in range(6 - kept, 6)]
    assert mirror.counts["skipped"] == 6 - kept and mirror.to_json()["queued_bytes"] == kept * size
    # Larger than the whole bound: not queued, nothing dropped for it.
    mirror.offer(chat_body(9, words=600), None, prompt_tokens=50)
    assert len(mirror.queue) == kept and mirror.counts["skipped"] == 7 - kept
    # A reload that lowers the bound drops the oldest at once.
    mirror.configure(MirrorSettings(max_queued_bytes=size))
    assert mirror.cache_figures()["mirror_queue"]["bytes"] == size
    assert [o.body for o in mirror.queue] == [chat_body(5)]
    assert mirror.cache_figures()["mirror_warm"] == {
        "entries": 0, "bytes": None, "max_entries": 64, "max_bytes": None, "max_age_s": None}


def test_the_budget_is_a_share_of_a_sliding_minute() -> None:
    budget = rules.Budget().after(10.0, 20.0).after(30.0, 9.0)
    assert budget.used_s(31.0) == 29.0 and budget.allows(31.0, 0.5)
    budget = budget.after(40.0, 2.0)
    assert not budget.allows(41.0, 0.5)  # 31 s of 30
    assert budget.allows(75.0, 0.5)  # the first 20 s left the window


class StandIn:
    """The CPU child as the mirror sees it: an upstream with a load, and a slow server."""

    def __init__(self, base_url: str, name: str = "cpu") -> None:
        self.name = name
        self.base_url = base_url
        self.api_key = "k"
        self.state = ChildState.READY
        self.load = Load()
        self.listeners: list[Any] = []


async def test_a_mirror_waits_for_idle_yields_to_real_work_and_is_tried_again() -> None:
    seen: list[dict[str, Any]] = []
    closed: list[bool] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            for _ in range(20):  # a slow prefill: 1 s in all
                await asyncio.sleep(0.05)
                await response.write(b": still here\n\n")
            await response.write(b'data: {"timings": {"prompt_n": 1500, "cache_n": 20}}\n\n')
        except (ConnectionResetError, asyncio.CancelledError):
            closed.append(True)
            raise
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with TestServer(app) as server:
        async with aiohttp.ClientSession() as session:
            cpu = StandIn(str(server.make_url("")).rstrip("/"))
            gpu = StandIn("http://unused")
            mirror = Lane(lambda: session, cpu, [gpu, cpu],  # type: ignore[list-item,arg-type]
                            MirrorSettings(idle_s=0.1))
            task = asyncio.get_running_loop().create_task(mirror.run())
            try:
                gpu.load.take(generation=True)  # the GPU child busy: nothing starts
                mirror.offer(json.dumps(CHAT).encode(), "hi there", prompt_tokens=1500)
                await asyncio.sleep(0.3)
                assert not seen and mirror.to_json()["queued"] == 1
                gpu.load.give_back(generation=True)
                await _until(lambda: mirror.running is not None and seen)
                assert seen[0]["n_predict"] == 0 and seen[0]["messages"][-1]["role"] == \
                    "assistant"
                gpu.load.take(generation=True)  # real work: the mirror yields at once
                await _until(lambda: mirror.counts["cancelled"] == 1)
                await _until(lambda: bool(closed))
                assert mirror.running is None and mirror.to_json()["queued"] == 1
                gpu.load.give_back(generation=True)
                await _until(lambda: mirror.counts["mirrored"] == 1, timeout=5.0)
                state = mirror.to_json()
                assert state["warm_prefixes"] == 1 and state["warm_tokens"] == 1520
                assert state["budget_used_s"] > 0.9  # the cancelled try counts too
                next_turn = {**CHAT, "messages": [*seen[-1]["messages"],
                                                  {"role": "user", "content": "more"}]}
                assert mirror.warm_tokens(rules.lookup_keys(next_turn)) == 1520
                # A new process has an empty cache.
                mirror._target_changed(cpu, ChildState.EXITED, ChildState.STARTING, "restart")
                assert mirror.warm_tokens(rules.lookup_keys(next_turn)) == 0
            finally:
                task.cancel()


async def _until(check: Any, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_key_does_not_depend_on_the_order_of_fields() -> None:
    assert rules.prefix_key([{"b": 1, "a": 2}]) == rules.prefix_key([{"a": 2, "b": 1}])


@pytest.mark.parametrize("mode, enabled", [("hot", True), ("on-demand", False)])
def test_off_for_an_on_demand_cpu_child(mode: str, enabled: bool) -> None:
    cfg = build({"model": {"path": "/m.gguf"}, "cpu": {"mode": mode}}, check_paths=False)
    assert _mirror_settings(cfg).enabled is enabled


def test_a_request_sent_with_replay_never_is_not_mirrored_and_the_queue_is_in_the_caches(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    """Two conversations the GPU child answered: the one sent with X-Spillway-Replay: never
    never reaches the CPU child (a mirror is its request run again, on another child); the
    other is mirrored. The queue shows its bound in the status's caches."""
    seen = tmp_path / "cpu-requests.jsonl"
    s = spillway(fake_config(fake_server, tiny_model,
                             cpu={"env": {"FAKE_STATE_FILE": str(seen)},
                                  "mirror_max_queued_mib": 2}))
    chat = "/v1/chat/completions"
    code, _ = s.post(chat, {"messages": [{"role": "user", "content": "run me once"}],
                            "max_tokens": 4}, headers={"X-Spillway-Replay": "never"})
    assert code == 200
    code, _ = s.post(chat, {"messages": [{"role": "user", "content": "hello"}],
                            "max_tokens": 4})
    assert code == 200

    def done() -> dict[str, Any] | None:
        m = s.status()["mirror"]
        return m if m["mirrored"] >= 1 and m["queued"] == 0 and not m["running"] else None

    mirror = eventually(done)
    assert mirror, s.status()["mirror"]
    assert (mirror["mirrored"], mirror["warm_prefixes"], mirror["failed"]) == (1, 1, 0)
    mirrors = [line for line in seen.read_text().splitlines()
               if json.loads(line)["headers"].get("X-Spillway-Mirror") == "1"]
    assert len(mirrors) == 1, mirrors
    caches = s.status()["caches"]
    assert caches["mirror_queue"] == {"entries": 0, "bytes": 0, "max_entries": 8,
                                      "max_bytes": 2 * 1024 * 1024, "max_age_s": None}
    assert caches["mirror_warm"]["entries"] == 1


# --- the rewarm: the GPU child warmed again after its restart ---------------------------------

@pytest.mark.parametrize("change, taken", [
    ({}, True), ({"continued": True}, True), ({"attempts": 2, "child": "cpu"}, True),
    ({"first_child": False, "child": "cpu"}, True), ({"opted_out": True}, False),
    ({"status": 500}, False), ({"media": True}, False), ({"chat": False}, False)])
def test_the_rewarm_takes_what_any_child_answered_whole(change: dict[str, Any],
                                                        taken: bool) -> None:
    """The CPU child's answers in an outage (its own, a replay's, a continued stream's) are
    conversations the restarted GPU child will be asked to go on with."""
    assert rules.offered(rules.Ended(**{**PLAIN_END, **change}), any_child=True) is taken


def test_a_mirror_pays_where_the_childs_measured_prefill_is_long_enough() -> None:
    assert rules.pays(0.25, rules.REWARM_MIN_SAVED_S)
    assert not rules.pays(0.05, rules.REWARM_MIN_SAVED_S)
    assert rules.pays(None, rules.REWARM_MIN_SAVED_S)  # nothing measured: the mirror measures
    assert rules.pays(0.0, 0.0)  # the warm CPU child's lane: every conversation


def test_a_later_turns_mirror_covers_the_earlier_turn() -> None:
    made = rules.offer_body(CHAT, "hi there", prefills=True)
    assert made is not None
    later = {**CHAT, "messages": [*made[1]["messages"], {"role": "user", "content": "more"}]}
    later_made = rules.offer_body(later, "more it is", prefills=True)
    assert later_made is not None
    assert made[0] in rules.covers(later_made[1]) and later_made[0] in rules.covers(
        later_made[1])
    assert later_made[0] not in rules.covers(made[1])  # never the other way
    assert rules.covers({"prompt": "x"}) == ()


def turn_body(*turns: str) -> bytes:
    """A conversation of user turns, each earlier one answered `answer to <turn>`."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"answer to {text}"})
    return json.dumps({"messages": messages, "max_tokens": 8}).encode()


async def test_the_rewarm_sends_what_the_child_held_and_the_outage_served_after_its_restart(
        ) -> None:
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        response = web.StreamResponse()
        await response.prepare(request)
        prompt = 100 * len(body["messages"])
        await response.write(b'data: {"timings": {"prompt_n": %d, "cache_n": 0}}\n\n' % prompt)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with TestServer(app) as server:
        async with aiohttp.ClientSession() as session:
            gpu = StandIn(str(server.make_url("")).rstrip("/"), "gpu")
            cpu = StandIn("http://unused", "cpu")
            lane = Lane(lambda: session, gpu, [gpu, cpu],  # type: ignore[list-item,arg-type]
                        MirrorSettings(idle_s=0.05, min_saved_s=rules.REWARM_MIN_SAVED_S),
                        name=rules.REWARM, any_child=True, keeps=True)
            lane.prefill_s = lambda tokens: tokens / 1000  # the child's measured 1,000 a second
            task = asyncio.get_running_loop().create_task(lane.run())
            try:
                # The GPU child answers two conversations: it holds them; nothing is sent.
                lane.offer(turn_body("a1"), "answer to a1", prompt_tokens=500, held=True)
                lane.offer(turn_body("b1"), "answer to b1", prompt_tokens=50, held=True)
                assert len(lane.kept) == 2 and not lane.queue
                # It dies; the CPU child answers conversation a's next turn meanwhile.
                gpu.state = ChildState.EXITED
                lane.offer(turn_body("a1", "a2"), "answer to a2", prompt_tokens=700)
                assert len(lane.queue) == 1 and lane._wait_s() > 0  # not READY: it waits
                assert lane.cache_figures()["rewarm_queue"]["entries"] == 3
                # A new process: what it held is queued too, and sent once it is READY.
                gpu.state = ChildState.STARTING
                lane._target_changed(gpu, ChildState.EXITED, ChildState.STARTING, "restart")
                assert [json.loads(o.body)["messages"][-1]["content"] for o in lane.queue] == [
                    "a1", "b1", "a2"] and not lane.kept
                gpu.state = ChildState.READY
                waiting = [True]  # a request waits in line for it: real work, though none runs
                lane.waiting = lambda: waiting[0]
                assert lane._wait_s() > 0
                waiting[0] = False
                await _until(lambda: not lane.queue and lane.running is None, timeout=5.0)
                # The newest only: a1 is its earlier turn (held by a2's mirror: sending it would
                # cut the slot back), b1's 50 tokens would save 0.05 s (it does not pay).
                assert [m["messages"][-2]["content"] for m in seen] == ["a2"]
                assert seen[0]["messages"][-1] == {"role": "assistant",
                                                   "content": "answer to a2"}
                assert (lane.counts["mirrored"], lane.counts["skipped"]) == (1, 2)
                state = lane.to_json()
                assert (state["child"], state["kept"], state["warm_tokens"]) == ("gpu", 1, 500)
                # The GPU child holds a2 now; after its next restart it is sent again.
                lane._target_changed(gpu, ChildState.EXITED, ChildState.STARTING, "restart")
                assert lane.warm_tokens(rules.lookup_keys(json.loads(turn_body(
                    "a1", "a2", "a3")))) == 0
                await _until(lambda: lane.counts["mirrored"] == 2, timeout=5.0)
                assert seen[1] == seen[0]
            finally:
                task.cancel()


async def test_a_mirror_whose_child_died_under_it_is_tried_again_and_a_refused_one_is_not(
        ) -> None:
    calls: list[str] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        content = (await request.json())["messages"][-2]["content"]
        calls.append(content)
        if content == "refused":
            return web.json_response({"error": {"code": 400}}, status=400)
        response = web.StreamResponse()
        await response.prepare(request)
        if calls.count(content) == 1:  # the child dies in the middle of it
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write(b'data: {"timings": {"prompt_n": 300, "cache_n": 0}}\n\n')
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with TestServer(app) as server:
        async with aiohttp.ClientSession() as session:
            gpu = StandIn(str(server.make_url("")).rstrip("/"), "gpu")
            lane = Lane(lambda: session, gpu, [gpu],  # type: ignore[list-item,arg-type]
                        MirrorSettings(idle_s=0.05), name=rules.REWARM, any_child=True,
                        keeps=True)
            task = asyncio.get_running_loop().create_task(lane.run())
            try:
                lane.offer(turn_body("refused"), "an answer", prompt_tokens=300)
                lane.offer(turn_body("cut"), "an answer", prompt_tokens=300)
                await _until(lambda: lane.counts["mirrored"] == 1 and
                             lane.counts["failed"] == 2, timeout=5.0)
                assert sorted(calls) == ["cut", "cut", "refused"]
                assert (lane.counts["failed"], len(lane.queue), len(lane.kept)) == (2, 0, 1)
            finally:
                task.cancel()
