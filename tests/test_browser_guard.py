"""Spillway against web pages, on the app alone (the real middleware, the real own routes with
children never started, the real resumable streams' routes, a stand-in for the proxy): the Host
check (own routes always, every route on loopback only), the cross-site check of the routes that
change something, the drill's window, and the settings behind them. The same against a real
daemon in a real browser is in test_browser_attack.py."""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from test_own_routes import make_routes

from supervisor.config.schema import ConfigError, build
from supervisor.service.drill_window import DrillWindow
from supervisor.service.own_routes import OwnRoutes
from supervisor.policy.browser import BrowserRules
from supervisor.proxy.app import build_app
from supervisor.proxy.auth import AuthSettings
from supervisor.proxy.browser_guard import MachineAddresses
from supervisor.proxy.stream_routes import StreamRoutes
from supervisor.records.metrics import Metrics
from supervisor.records.stream_sessions import StreamSessions

KEY = "sekret"
EVIL = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site",
        "Content-Type": "text/plain"}


class Rig:
    def __init__(self, routes: OwnRoutes, auth: AuthSettings) -> None:
        self.routes = routes
        self.auth = auth
        self.proxied: list[str] = []
        self.refused: list[str] = []
        self.clock = [1000.0]
        routes.drill = DrillWindow(clock=lambda: self.clock[0], idle_s=60.0)
        self.streams = StreamSessions()

    @property
    def gpu(self) -> Any:
        return self.routes.children["gpu"]


async def rig_client(tmp_path: Path, api_key: str | None = None,
                     listen: tuple[str, ...] = ("127.0.0.1",)
                     ) -> AsyncIterator[tuple[TestClient[web.Request, web.Application], Rig]]:
    routes, _ = make_routes(tmp_path)
    auth = AuthSettings(api_key=api_key, browser=BrowserRules.build(listen))
    rig = Rig(routes, auth)

    async def proxy(request: web.Request) -> web.StreamResponse:
        rig.proxied.append(request.path)
        return web.Response(text="proxied")

    answered = StreamRoutes(rig.streams, Metrics(), lambda: rig.clock[0], lambda: 30.0).table()
    app = build_app(cast(Any, proxy), auth, routes.table(), answered,
                    on_refused=rig.refused.append)
    async with TestClient(TestServer(app)) as c:
        yield c, rig


@pytest.fixture
async def open_app(tmp_path: Path
                   ) -> AsyncIterator[tuple[TestClient[web.Request, web.Application], Rig]]:
    async for pair in rig_client(tmp_path):
        yield pair


@pytest.fixture
async def everywhere_app(tmp_path: Path
                         ) -> AsyncIterator[tuple[TestClient[web.Request, web.Application], Rig]]:
    """Listening beyond loopback too (the test client still reaches it on 127.0.0.1)."""
    async for pair in rig_client(tmp_path, listen=("127.0.0.1", "0.0.0.0")):
        yield pair


@pytest.fixture
async def keyed_app(tmp_path: Path
                    ) -> AsyncIterator[tuple[TestClient[web.Request, web.Application], Rig]]:
    async for pair in rig_client(tmp_path, KEY):
        yield pair


def own(client: TestClient[web.Request, web.Application]) -> str:
    """Spillway's own origin, as its page's requests carry it."""
    return f"http://{client.host}:{client.port}"


async def refused_as(resp: Any, status: int, setting: str | None) -> dict[str, Any]:
    body: dict[str, Any] = await resp.json()
    assert resp.status == status, body
    error = body["error"]
    assert error["src"] == "spillway" and error["code"] == status
    assert error["type"] == ("permission_error" if status == 403 else "invalid_request_error")
    assert error.get("setting") == setting
    return body


# --- the cross-site check -----------------------------------------------------------------

@pytest.mark.parametrize("path", ["/spillway/gpu/pause", "/spillway/gpu/restart",
                                  "/spillway/gpu/drain", "/spillway/drill/start",
                                  "/spillway/drill/arm", "/spillway/drill/end",
                                  "/spillway/nothing-here"])
async def test_a_cross_site_post_changes_nothing(
        open_app: tuple[TestClient[web.Request, web.Application], Rig], path: str) -> None:
    client, rig = open_app
    for headers in (EVIL, {**EVIL, "Content-Type": "application/json"},
                    {"Origin": f"http://127.0.0.1:{(client.port or 0) + 1}", "Sec-Fetch-Site":
                     "same-site", "Content-Type": "text/plain"},  # another port
                    {"Origin": "null", "Content-Type": "application/x-www-form-urlencoded"}):
        resp = await client.post(path, data='{"now": true}', headers=headers)
        await refused_as(resp, 403, "server.allowed_origins")
        assert "Access-Control-Allow-Origin" not in resp.headers
    assert not rig.routes.operator.gpu_paused and rig.gpu.armed_signal is None
    assert not rig.routes.drill.running
    assert rig.refused == ["cross_site"] * 4


async def test_spillways_own_page_and_the_commands_still_act(
        open_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = open_app
    page = {"Origin": own(client), "Sec-Fetch-Site": "same-origin",
            "Content-Type": "application/json"}
    resp = await client.post("/spillway/gpu/pause", data="{}", headers=page)
    assert resp.status == 200 and rig.routes.operator.gpu_paused
    # The same page, but a body a form could send without a preflight: 415, nothing done.
    resp = await client.post("/spillway/gpu/resume", data="{}",
                             headers={**page, "Content-Type": "text/plain"})
    await refused_as(resp, 415, None)
    assert rig.routes.operator.gpu_paused
    # curl -X POST, `spillway gpu resume`: no Origin, any body.
    resp = await client.post("/spillway/gpu/resume")
    assert resp.status == 200 and not rig.routes.operator.gpu_paused
    assert rig.refused == ["not_json"]


async def test_a_preflight_is_never_granted(
        open_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, _ = open_app
    resp = await client.options("/spillway/gpu/pause", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert "Access-Control-Allow-Origin" not in resp.headers
    assert "Access-Control-Allow-Methods" not in resp.headers


async def test_an_allowed_origin_may_act_and_a_reload_changes_the_rules(
        open_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = open_app
    dash = {"Origin": "http://dash.lan:3000", "Sec-Fetch-Site": "cross-site",
            "Content-Type": "application/json"}
    await refused_as(await client.post("/spillway/gpu/pause", data="{}", headers=dash), 403,
                     "server.allowed_origins")
    # What a reload does: the daemon copies fresh settings onto the live object.
    rig.auth.browser = BrowserRules.build(["127.0.0.1"], allowed_origins=["http://dash.lan:3000"])
    assert (await client.post("/spillway/gpu/pause", data="{}", headers=dash)).status == 200
    assert rig.routes.operator.gpu_paused


# --- the Host check -----------------------------------------------------------------------

async def test_a_foreign_host_reads_and_changes_nothing_of_spillways(
        open_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = open_app
    rebound = {"Host": f"evil.example:{client.port}"}
    for path in ("/spillway/status", "/spillway/incidents", "/spillway/metrics",
                 "/spillway/", "/spillway/health"):
        body = await refused_as(await client.get(path, headers=rebound), 403,
                                "server.allowed_hosts")
        assert "'evil.example:" in body["error"]["message"]
    # Same-origin as far as the browser knows (the name resolves to 127.0.0.1 now).
    resp = await client.post("/spillway/gpu/pause", data="{}", headers={
        **rebound, "Origin": f"http://evil.example:{client.port}", "Sec-Fetch-Site":
        "same-origin", "Content-Type": "application/json"})
    await refused_as(resp, 403, "server.allowed_hosts")
    assert not rig.routes.operator.gpu_paused
    for host in ("localhost", f"127.0.0.1:{client.port}", "[::1]:1"):
        assert (await client.get("/spillway/status", headers={"Host": host})).status == 200
    rig.auth.browser = BrowserRules.build(["127.0.0.1"], ["evil.example"])
    assert (await client.get("/spillway/status", headers=rebound)).status == 200


async def test_with_a_key_the_key_comes_first_and_the_checks_still_hold(
        keyed_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = keyed_app
    auth = {"Authorization": f"Bearer {KEY}"}
    assert (await client.post("/spillway/gpu/pause", headers=EVIL)).status == 401
    # The key does not make a cross-site request one of Spillway's page's.
    await refused_as(await client.post("/spillway/gpu/pause", headers={**EVIL, **auth}), 403,
                     "server.allowed_origins")
    await refused_as(await client.get("/spillway/status", headers={**auth, "Host": "x.example"}),
                     403, "server.allowed_hosts")
    assert (await client.post("/spillway/gpu/pause", headers=auth)).status == 200
    assert rig.routes.operator.gpu_paused
    # Every route that changes something needs the key (no drill window opens without it).
    for path in ("/spillway/gpu/resume", "/spillway/drill/start", "/spillway/drill/arm",
                 "/spillway/drill/end"):
        assert (await client.post(path, json={})).status == 401, path
    assert not rig.routes.drill.running


# --- llama-server's routes ----------------------------------------------------------------

LLAMA_READS = ("/props", "/slots", "/v1/models", "/metrics", "/health", "/",
               "/v1/stream?conv_id=c")


async def test_on_loopback_a_rebinding_page_reads_and_runs_nothing(
        open_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = open_app
    rebound = {"Host": f"evil.example:{client.port}"}
    for path in LLAMA_READS:
        body = await refused_as(await client.get(path, headers=rebound), 403,
                                "server.allowed_hosts")
        assert "'evil.example:" in body["error"]["message"]
    resp = await client.post("/v1/chat/completions", json={"messages": []}, headers={
        **rebound, "Origin": f"http://evil.example:{client.port}"})
    await refused_as(resp, 403, "server.allowed_hosts")
    assert rig.proxied == []
    assert rig.refused == ["foreign_host"] * (len(LLAMA_READS) + 1)


async def test_on_loopback_curl_and_the_sdks_names_still_reach_llama_servers_routes(
        open_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = open_app
    # What curl, the OpenAI SDK and a browser on this machine send, and an HTTP/1.0 probe's
    # nothing (aiohttp's client always sends a Host: skipped to send none).
    for host in (f"127.0.0.1:{client.port}", f"localhost:{client.port}", "localhost",
                 f"[::1]:{client.port}", f"LOCALHOST.:{client.port}", None):
        headers = {"Host": host} if host is not None else {}
        resp = await client.get("/props", headers=headers,
                                skip_auto_headers=() if host else ("Host",))
        assert resp.status == 200 and await resp.text() == "proxied", host
    assert rig.proxied == ["/props"] * 6 and rig.refused == []
    # A name the operator listed (nginx in front, by a name of its own), and "*".
    rig.auth.browser = BrowserRules.build(["127.0.0.1"], ["spillway.lan"])
    assert (await client.get("/props", headers={"Host": "spillway.lan"})).status == 200
    rig.auth.browser = BrowserRules.build(["127.0.0.1"], ["*"])
    assert (await client.get("/props", headers={"Host": "evil.example"})).status == 200


async def test_beyond_loopback_llama_servers_routes_take_any_host_and_spillways_do_not(
        everywhere_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = everywhere_app
    named = {"Host": f"gpu-box.example:{client.port}"}
    assert (await client.get("/v1/models", headers=named)).status == 200
    assert (await client.post("/v1/chat/completions", json={}, headers=named)).status == 200
    assert rig.proxied == ["/v1/models", "/v1/chat/completions"]
    await refused_as(await client.get("/spillway/status", headers=named), 403,
                     "server.allowed_hosts")


async def test_a_page_of_another_site_cannot_stop_a_resumable_stream(
        everywhere_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = everywhere_app
    session = rig.streams.start("chat-1", "r1", rig.clock[0])
    stops: list[int] = []
    session.stop = lambda: stops.append(1)
    for headers in (EVIL, {"Origin": "null"},
                    {"Origin": f"http://127.0.0.1:{(client.port or 0) + 1}",
                     "Sec-Fetch-Site": "same-site"}):
        resp = await client.delete("/v1/stream?conv_id=chat-1", headers=headers)
        await refused_as(resp, 403, "server.allowed_origins")
    assert rig.streams.get("chat-1", rig.clock[0]) is session and not session.cancelled
    assert stops == [] and rig.refused == ["cross_site"] * 3
    # Reads change nothing: a lookup from another page is answered (as llama-server does).
    resp = await client.post("/v1/streams/lookup", json={"conversation_ids": ["chat-1"]},
                             headers={"Origin": "http://evil.example"})
    assert resp.status == 200 and len(await resp.json()) == 1
    # llama-server's web UI, served through Spillway, stops it: same origin, no body, no type.
    resp = await client.delete("/v1/stream?conv_id=chat-1", headers={
        "Origin": own(client), "Sec-Fetch-Site": "same-origin"})
    assert resp.status == 204 and session.cancelled and stops == [1]
    # curl, and a page the operator listed.
    rig.streams.start("chat-2", "r2", rig.clock[0])
    assert (await client.delete("/v1/stream?conv_id=chat-2")).status == 204
    assert rig.streams.get("chat-2", rig.clock[0]) is None
    rig.auth.browser = BrowserRules.build(["127.0.0.1", "0.0.0.0"],
                                          allowed_origins=["http://evil.example"])
    assert (await client.delete("/v1/stream?conv_id=chat-3", headers=EVIL)).status == 204


# --- the drill's window -------------------------------------------------------------------

async def test_arming_answers_only_inside_a_drill_and_with_its_token(
        open_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = open_app
    resp = await client.post("/spillway/drill/arm", json={"now": True})
    body = await refused_as(resp, 409, None)
    assert "no drill is running" in body["error"]["message"]
    opened = await (await client.post("/spillway/drill/start")).json()
    token = opened["drill"]
    assert opened["idle_timeout_s"] == 60.0 and len(token) >= 32
    assert (await client.post("/spillway/drill/start")).status == 409  # one at a time
    status = (await (await client.get("/spillway/status")).json())["drill"]
    assert status == {"running": True, "for_s": 0.0, "closes_in_s": 60.0}
    for wrong in ({}, {"X-Spillway-Drill": "guess"}, {"X-Spillway-Drill": token[:-1]}):
        await refused_as(await client.post("/spillway/drill/arm", json={}, headers=wrong), 403,
                         None)
    assert rig.gpu.armed_signal is None
    drill = {"X-Spillway-Drill": token}
    assert (await client.post("/spillway/drill/arm", json={}, headers=drill)).status == 200
    assert rig.gpu.armed_signal == signal.SIGABRT
    await refused_as(await client.post("/spillway/drill/end", headers={}), 403, None)
    assert (await client.post("/spillway/drill/end", headers=drill)).status == 200
    assert rig.gpu.armed_signal is None  # the end disarms
    assert (await (await client.get("/spillway/status")).json())["drill"] == {"running": False}
    assert (await client.post("/spillway/drill/arm", json={}, headers=drill)).status == 409


async def test_a_drill_gone_silent_is_over_and_disarmed(
        open_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, rig = open_app
    token = (await (await client.post("/spillway/drill/start")).json())["drill"]
    drill = {"X-Spillway-Drill": token}
    assert (await client.post("/spillway/drill/arm", json={}, headers=drill)).status == 200
    rig.clock[0] += 59.0
    rig.routes.tick()
    assert rig.routes.drill.running and rig.gpu.armed_signal == signal.SIGABRT
    assert (await client.post("/spillway/drill/arm", json={}, headers=drill)).status == 200
    rig.clock[0] += 59.0  # an arm keeps the window open
    rig.routes.tick()
    assert rig.routes.drill.running
    rig.clock[0] += 1.0
    rig.routes.tick()
    assert not rig.routes.drill.running and rig.gpu.armed_signal is None
    assert (await client.post("/spillway/drill/arm", json={}, headers=drill)).status == 409
    assert (await client.post("/spillway/drill/start")).status == 200  # a new drill may begin


def test_the_window_on_its_own() -> None:
    now = [0.0]
    window = DrillWindow(clock=lambda: now[0], idle_s=10.0)
    assert not window.admits(None) and not window.expired()
    token = window.open()
    assert token is not None and window.open() is None
    assert not window.admits(None) and not window.admits("x") and window.admits(token)
    now[0] = 10.0
    assert not window.running and not window.admits(token)
    assert window.expired() and not window.expired()  # said once
    assert window.open() not in (None, token)


# --- the settings -------------------------------------------------------------------------

def test_the_settings_are_checked_and_named() -> None:
    cfg = build({"model": {"path": "/m.gguf"}, "server": {
        "allowed_hosts": ["spillway.lan", "*.home.arpa", "192.168.1.9"],
        "allowed_origins": ["http://dash.lan:3000"]}}, check_paths=False)
    assert cfg.server.allowed_hosts == ("spillway.lan", "*.home.arpa", "192.168.1.9")
    assert cfg.server.allowed_origins == ("http://dash.lan:3000",)
    with pytest.raises(ConfigError) as bad:
        build({"model": {"path": "/m.gguf"}, "server": {
            "allowed_hosts": ["spillway.lan:8080"], "allowed_origins": ["*"]}},
            check_paths=False)
    paths = {p.path for p in bad.value.problems}
    assert paths == {"server.allowed_hosts", "server.allowed_origins"}


def test_the_machines_addresses_are_read_again_after_a_while() -> None:
    now = [0.0]
    reads: list[int] = []

    def read() -> list[str]:
        reads.append(1)
        return ["192.168.1.5", "fe80::1%eth0", "00:11:22:33:44:55"]

    addresses = MachineAddresses(read, clock=lambda: now[0])
    assert addresses() == {"192.168.1.5", "fe80::1"}
    now[0] = 9.9
    addresses()
    assert len(reads) == 1
    now[0] = 10.0
    addresses()
    assert len(reads) == 2


def test_the_daemons_settings_carry_the_rules_and_a_reload_copies_them() -> None:
    from supervisor.service.daemon import _copy_onto, _proxy_settings

    def config(**server: Any) -> Any:
        return build({"model": {"path": "/m.gguf"}, "server": {
            "listen": ["127.0.0.1:8080", "[::1]:8080"], **server}}, check_paths=False)

    live = _proxy_settings(config())[0]
    assert live.browser == BrowserRules.build(["127.0.0.1", "::1"])
    fresh = _proxy_settings(config(allowed_hosts=["spillway.lan"],
                                   allowed_origins=["http://dash.lan:3000"]))[0]
    _copy_onto(live, fresh)  # what a reload does (Daemon._configure_proxy)
    assert live.browser.allowed_hosts == {"spillway.lan"}
    assert live.browser.allowed_origins == {"http://dash.lan:3000"}


async def test_an_unknown_own_route_is_a_404_typed_as_llama_servers(
        open_app: tuple[TestClient[web.Request, web.Application], Rig]) -> None:
    client, _ = open_app
    resp = await client.get("/spillway/nothing-here")
    body = await resp.json()
    assert resp.status == 404 and body["error"]["type"] == "not_found_error", body
    assert body["error"]["src"] == "spillway"


async def test_a_refusal_logs_the_path_with_its_control_characters_escaped(
        open_app: tuple[TestClient[web.Request, web.Application], Rig],
        caplog: pytest.LogCaptureFixture) -> None:
    """A decoded %0d%0a in the path would otherwise end the warning and forge a line of its own."""
    client, _ = open_app
    with caplog.at_level(logging.WARNING, logger="spillway.browser"):
        resp = await client.post("/spillway/gpu/pause%0d%0aFORGED%1b[2J", data="{}",
                                 headers=EVIL)
    assert resp.status == 403
    [line] = [r.getMessage() for r in caplog.records if r.name == "spillway.browser"]
    assert "/spillway/gpu/pause\\x0d\\x0aFORGED\\x1b[2J" in line
    assert not any(c in line for c in "\r\n\x1b")
