"""The watch of one router (supervisor/router/watch.py), functional: against a fake router on
loopback (an aiohttp app standing in for llama-server's /models and /models/sse, named for what
it is) whose event stream drops; the watch reads the listing again and reconnects, and what it
missed meanwhile is not left wrong. The router's output lines come from the captured fixture."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from harness import PATIENCE_S, until
from test_router_upstream import FakeLoader, FakeRouter, told

from supervisor.policy.lifecycle import ChildState as S
from supervisor.policy.router import StatusChange
from supervisor.router.upstream import ModelUpstream
from supervisor.router.watch import RouterWatch

FIXTURES = Path(__file__).parent / "fixtures" / "llama-server" / "router"


class FakeRouterServer:
    """/models answers the current listing; /models/sse sends the queued events, then drops the
    connection (as a router that restarted its stream would)."""

    def __init__(self) -> None:
        self.status = {"alpha": "unloaded", "beta": "unloaded"}
        self.events: list[dict[str, Any]] = []
        self.listings = 0
        self.streams = 0
        self.keys: list[str | None] = []
        self.gate: asyncio.Event | None = None  # when set here, /models answers once it is set
        self.asked = 0  # /models requests received (held by the gate or not)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/models", self.models)
        app.router.add_get("/models/sse", self.sse)
        return app

    async def models(self, request: web.Request) -> web.Response:
        self.asked += 1
        if self.gate is not None:
            await self.gate.wait()
        self.listings += 1
        self.keys.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": [
            {"id": name, "status": {"value": value, "args": ["--port", "5100"]}}
            for name, value in self.status.items()]})

    async def sse(self, request: web.Request) -> web.StreamResponse:
        self.streams += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while self.events:
            event = self.events.pop(0)
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await asyncio.sleep(0.05)
        return resp  # the stream ends: the watch must reconnect


def upstream_maker(router: FakeRouter) -> tuple[dict[str, ModelUpstream],
                                                Callable[[str], ModelUpstream]]:
    """Each model's upstream on the fake router, made on first sight (as RouterModels does)."""
    loader = FakeLoader()
    upstreams: dict[str, ModelUpstream] = {}

    def upstream_for(model: str) -> ModelUpstream:
        if model not in upstreams:
            upstreams[model] = ModelUpstream(router, model, loader)  # type: ignore[arg-type]
        return upstreams[model]
    return upstreams, upstream_for


@pytest.mark.asyncio
async def test_a_dropped_event_stream_is_reconnected_and_the_listing_read_again() -> None:
    fake = FakeRouterServer()
    fake.events.append({"model": "alpha", "event": "status_change",
                        "data": {"status": "loaded", "info": {"meta": {"n_ctx": 1024}}}})
    server = TestServer(fake.app())
    await server.start_server()
    router = FakeRouter()
    router.base_url = f"http://127.0.0.1:{server.port}"
    router.line_listeners = []  # type: ignore[attr-defined]
    router.pid = None  # type: ignore[attr-defined]
    upstreams, upstream_for = upstream_maker(router)
    async with aiohttp.ClientSession() as session:
        watch = RouterWatch(router, upstream_for, lambda: session)  # type: ignore[arg-type]
        router.to(S.STARTING)
        router.to(S.READY)  # the watch starts following
        await until(lambda: "alpha" in upstreams and upstreams["alpha"].state is S.READY)
        assert upstreams["alpha"].state is S.READY and upstreams["beta"].state is S.STOPPED
        # While the stream is down, alpha's instance died and nobody sent the event: the
        # listing read on reconnecting says so.
        fake.status["alpha"] = "unloaded"
        await until(lambda: fake.streams >= 2 and upstreams["alpha"].state is not S.READY)
        assert fake.listings >= 2 and fake.streams >= 2
        assert upstreams["alpha"].state is S.STOPPED  # an instance gone without a failure code
        assert set(fake.keys) == {"Bearer k"}  # the router's private key, on every question
        await watch.close()
    await server.close()


@pytest.mark.asyncio
async def test_a_router_just_ready_is_waited_for_until_it_has_listed_its_models() -> None:
    # A request for alpha sent as Spillway became ready went to the routers' own pool (alpha's
    # entry not yet made: the listing not yet read), and the GPU router answered 400 `model is
    # not loaded`. Requests that name a model wait for `listed_since_ready` (RouterModels.listed).
    fake = FakeRouterServer()
    fake.gate = asyncio.Event()
    server = TestServer(fake.app())
    await server.start_server()
    router = FakeRouter()
    router.state = S.STOPPED
    router.base_url = f"http://127.0.0.1:{server.port}"
    router.line_listeners = []  # type: ignore[attr-defined]
    router.pid = None  # type: ignore[attr-defined]
    upstreams, upstream_for = upstream_maker(router)
    async with aiohttp.ClientSession() as session:
        watch = RouterWatch(router, upstream_for, lambda: session)  # type: ignore[arg-type]
        assert watch.listed_since_ready.is_set()  # not serving: nothing to wait for
        router.to(S.STARTING)
        router.to(S.READY)
        assert not watch.listed_since_ready.is_set()
        await until(lambda: fake.asked == 1)  # the listing asked for, and held
        assert not watch.listed_since_ready.is_set() and upstreams == {}
        fake.gate.set()
        await asyncio.wait_for(watch.listed_since_ready.wait(), PATIENCE_S)
        assert set(upstreams) == {"alpha", "beta"}  # every model's entry made by then
        router.to(S.STOPPING)  # not serving: nothing to wait for again
        assert watch.listed_since_ready.is_set()
        await watch.close()
    await server.close()


@pytest.mark.asyncio
async def test_the_routers_output_lines_tell_which_instance_is_which_model() -> None:
    router = FakeRouter()
    router.line_listeners = []  # type: ignore[attr-defined]
    upstreams, upstream_for = upstream_maker(router)
    watch = RouterWatch(router, upstream_for, lambda: None,  # type: ignore[arg-type,return-value]
                        neighbours=lambda: list(upstreams.values()))
    lines = (FIXTURES / "router.log").read_text().splitlines()
    for line in lines:
        watch.heard_line(line)
        if "alpha" in upstreams:
            await told(upstreams["alpha"])  # its owner takes what the line told
        if "proxy_reques" in line and upstreams["alpha"].state is S.STARTING:
            # (the router's "loaded" comes as an event, not a line)
            upstreams["alpha"].heard_status(StatusChange("alpha", "loaded", None, None, 1024,
                                                         None))
    alpha = upstreams["alpha"]
    await told(alpha)
    # The fixture: alpha spawned on 52251, killed (status 1), spawned again on 53723.
    assert alpha.failures >= 1 and alpha.last_exit is not None
    assert alpha.instance_port != 52251
    assert any("llama_server: model loaded" in line for line in alpha.stderr_tail)
    assert "beta" in upstreams  # its spawn line made its upstream


@pytest.mark.asyncio
async def test_an_instance_loaded_before_its_spawn_line_is_read_gets_its_pid_then() -> None:
    # On busy cores the router's output is read behind its event stream: `loaded` arrives
    # while the port known is the previous instance's (dead), so no pid is found at load; the
    # spawn line read just after names the new port, and the pid is found there (the drill's
    # SIGABRT and NVML's per-process figure need it).
    router = FakeRouter()
    router.line_listeners = []  # type: ignore[attr-defined]
    upstreams, upstream_for = upstream_maker(router)
    watch = RouterWatch(router, upstream_for, lambda: None)  # type: ignore[arg-type,return-value]
    pids = {5200: 4242}
    watch.instance_pid = pids.get  # type: ignore[assignment,method-assign]
    watch.heard_line("srv          load: spawning server instance with name=alpha on port 5100")
    alpha = upstreams["alpha"]
    alpha.heard_status(StatusChange("alpha", "loaded", None, None, 1024, None))
    await told(alpha)  # READY: the watch looks its pid up (the port's: none)
    alpha.heard_exit(1)  # killed; loaded again, and its `loaded` comes before its spawn line
    alpha.heard_status(StatusChange("alpha", "loading", None, None, None, None))
    alpha.heard_status(StatusChange("alpha", "loaded", None, None, 1024, None))
    await told(alpha)
    assert alpha.state is S.READY and alpha.pid is None
    watch.heard_line("srv          load: spawning server instance with name=alpha on port 5200")
    assert alpha.instance_port == 5200 and alpha.pid == 4242
