"""The warm CPU child's rules (policy/mirror.py) and its task (serving/mirror.py) against a
slow stand-in for the CPU child (an aiohttp server streaming a mirror's answer slowly): which
conversation goes next, the budget, the body; a mirror starts only after an idle spell, real
work cancels it at once (the stream is closed), and it is tried again once idle."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor.config.schema import build
from supervisor.policy import mirror as rules
from supervisor.policy.lifecycle import ChildState
from supervisor.service.daemon import _mirror_settings
from supervisor.serving.mirror import Mirror, MirrorSettings
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
    offers = [rules.Offer({}, None, True, 500, at=1.0), rules.Offer({}, None, True, 900, at=5.0),
              rules.Offer({}, None, True, 2000, at=5.02),
              rules.Offer({}, None, True, 99999, at=9.0)]
    assert rules.choose(offers, max_prompt_tokens=4096) == 2  # d too long; b and c at 5.0
    assert rules.choose(offers[:1], max_prompt_tokens=100) is None


def test_the_budget_is_a_share_of_a_sliding_minute() -> None:
    budget = rules.Budget().after(10.0, 20.0).after(30.0, 9.0)
    assert budget.used_s(31.0) == 29.0 and budget.allows(31.0, 0.5)
    budget = budget.after(40.0, 2.0)
    assert not budget.allows(41.0, 0.5)  # 31 s of 30
    assert budget.allows(75.0, 0.5)  # the first 20 s left the window


class StandIn:
    """The CPU child as the mirror sees it: an upstream with a load, and a slow server."""

    def __init__(self, base_url: str) -> None:
        self.name = "cpu"
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
            mirror = Mirror(lambda: session, cpu, [gpu, cpu],  # type: ignore[list-item,arg-type]
                            MirrorSettings(idle_s=0.1))
            task = asyncio.get_running_loop().create_task(mirror.run())
            try:
                gpu.load.take(generation=True)  # the GPU child busy: nothing starts
                mirror.offer(CHAT, "hi there", prompt_tokens=1500)
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
                mirror._cpu_changed(cpu, ChildState.EXITED, ChildState.STARTING, "restart")
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
