"""Spillway's own routes, on their own: real children (never started), estimates and waiting
line, and a stand-in for the daemon's own state (`Host`). The routes through a running daemon
are covered by the functional tests; these pin the route table and the status's shape."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from supervisor import __version__
from supervisor.upstreams.children import Child
from supervisor.config.schema import Config, build
from supervisor.serving.pool import Pool
from supervisor.gpu import GpuMonitor
from supervisor.records.incidents import IncidentLog
from supervisor.records.metrics import Metrics
from supervisor.service.fleet import Fleet
from supervisor.service.operator import Operator
from supervisor.service.own_routes import Host, OwnRoutes, status_line
from supervisor.serving.resources import Resources


@dataclass
class FakeHost:
    config: Config
    config_error: str | None = None
    restart_notes: list[str] = field(default_factory=list)
    listening: list[str] = field(default_factory=lambda: ["127.0.0.1:8080"])
    gpu_devices: list[str] = field(default_factory=list)
    devices_listed: bool = False
    sampled: int = 0

    def sample_metrics(self) -> None:
        self.sampled += 1

    def rollout_json(self) -> dict[str, Any] | None:
        return None  # no reload has changed a command

    def mirror_json(self) -> dict[str, Any] | None:
        return None  # no warm CPU child here

    def rewarm_json(self) -> dict[str, Any] | None:
        return None  # nor a rewarm of the GPU child


def make_routes(tmp_path: Path, cpu_mode: str = "hot") -> tuple[OwnRoutes, FakeHost]:
    cfg = build({"model": {"path": "/m.gguf"}, "cpu": {"mode": cpu_mode}}, check_paths=False)
    children = {name: Child(cfg.child(name), cfg.restart) for name in cfg.order}
    monitor = GpuMonitor(cfg.monitor.sample_interval_s)
    resources = Resources(cfg, children, monitor)
    host = FakeHost(cfg)
    timeline = [{"time": 10.0, "child": "gpu", "state": "STARTING", "reason": "a"},
                {"time": 20.0, "child": "gpu", "state": "READY", "reason": "b"}]
    checked: Host = host  # a Host, as the daemon is (`mypy --strict` on this file checks it)
    operator = Operator(Fleet(children, resources.paused), cfg.gpu_child)
    routes = OwnRoutes(checked, started=time.monotonic(), children=children,
                       resources=resources, pool=Pool(resources, children, 5, 10.0),
                       monitor=monitor,
                       incidents=IncidentLog(tmp_path / "incidents.jsonl", 1 << 20),
                       metrics=Metrics(), timeline=timeline, operator=operator)
    return routes, host


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    routes, _ = make_routes(tmp_path)
    app = web.Application()
    for (method, path), handler in routes.table().items():
        app.router.add_route(method, path, handler)
    async with TestClient(TestServer(app)) as c:
        yield c


def test_the_route_table_is_spillways_routes(tmp_path: Path) -> None:
    routes, _ = make_routes(tmp_path)
    assert set(routes.table()) == {
        ("GET", "/spillway/health"), ("GET", "/spillway/ready"), ("GET", "/spillway/status"),
        ("GET", "/spillway/incidents"), ("GET", "/spillway/metrics"),
        ("GET", "/spillway/timeline"), ("POST", "/spillway/drill/arm"),
        ("POST", "/spillway/drill/start"), ("POST", "/spillway/drill/end"),
        ("POST", "/spillway/gpu/restart"), ("POST", "/spillway/gpu/drain"),
        ("POST", "/spillway/gpu/pause"), ("POST", "/spillway/gpu/resume"),
        ("GET", "/spillway/gpu/history"),
        # The status page (status_page.py), and the redirect to it.
        ("GET", "/spillway/"), ("HEAD", "/spillway/"), ("GET", "/spillway"), ("HEAD", "/spillway"),
    }


def test_the_status_keeps_its_shape(tmp_path: Path) -> None:
    routes, host = make_routes(tmp_path)
    host.restart_notes.append("server.listen changed: it takes effect when spillway restarts")
    status = routes.status()
    assert set(status) >= {
        "version", "uptime_s", "listen", "serving", "why_not_serving", "children", "gpu",
        "gpu_note", "gpu_child_on_cpu", "waiting", "waiting_requests", "queue", "incidents",
        "config", "caches", "process"}
    assert status["caches"] == {}  # the daemon's (Daemon.caches): none given here
    assert status["process"] == {"asyncio_tasks": None}  # no running loop here
    assert set(status["queue"]) >= {"max_waiting", "max_wait_s", "service_s"}
    assert set(status["incidents"]) >= {"path", "written", "error", "last"}
    assert status["config"] == {"path": None, "error": None,
                                "restart_needed": host.restart_notes, "rollout": None}
    assert set(status["children"]["gpu"]) >= {"state", "devices", "runs_on", "paused", "busy"}
    assert set(status["children"]["cpu"]) >= {"state", "runs_on", "mode", "busy"}
    assert status["children"]["cpu"]["runs_on"] == "CPU"
    assert status["gpu_child_on_cpu"] is None  # the devices are not listed yet
    host.devices_listed = True
    assert routes.status()["gpu_child_on_cpu"] is True
    host.gpu_devices = ["CUDA0: a card"]
    status = routes.status()
    assert status["gpu_child_on_cpu"] is False
    assert status["children"]["gpu"]["runs_on"] == "CUDA0: a card"


def test_not_serving_says_why_and_an_on_demand_cpu_child_counts(tmp_path: Path) -> None:
    status = make_routes(tmp_path)[0].status()
    assert status["serving"] is False
    assert status["why_not_serving"].startswith("no child is ready: gpu is STOPPED")
    on_demand = make_routes(tmp_path, cpu_mode="on-demand")[0].status()
    assert on_demand["serving"] is True and on_demand["why_not_serving"] is None


def test_status_line() -> None:
    class C:
        def __init__(self, state: str) -> None:
            self.state = state

    children: Any = {"gpu": C("READY"), "cpu": C("STOPPED")}
    assert status_line(children, 2, [], None) == "gpu READY, cpu STOPPED; 2 waiting"
    recent = [{"kind": "oom", "child": "gpu", "decision": "replayed", "time": "12:00"}]
    assert status_line(children, 0, recent, "bad") == (
        "gpu READY, cpu STOPPED; 0 waiting; last incident: oom on gpu, replayed at 12:00; "
        "config reload refused (see status)")


async def test_health_ready_and_status_answer(
        client: TestClient[web.Request, web.Application]) -> None:
    resp = await client.get("/spillway/health")
    assert await resp.json() == {"status": "ok", "version": __version__}
    resp = await client.get("/spillway/ready")
    assert resp.status == 503
    body = await resp.json()
    assert body["ready"] is False and body["children"] == {"gpu": "STOPPED", "cpu": "STOPPED"}
    resp = await client.get("/spillway/status")
    assert resp.status == 200 and (await resp.json())["version"] == __version__


async def test_timeline_since_and_bad_queries(
        client: TestClient[web.Request, web.Application]) -> None:
    body = await (await client.get("/spillway/timeline", params={"since": "15"})).json()
    assert [e["state"] for e in body["events"]] == ["READY"]
    assert body["now"] == {"gpu": "STOPPED", "cpu": "STOPPED"}
    body = await (await client.get("/spillway/timeline", params={"since": "x"})).json()
    assert len(body["events"]) == 2
    body = await (await client.get("/spillway/incidents", params={"limit": "x"})).json()
    assert body["incidents"] == [] and body["path"].endswith("incidents.jsonl")


async def test_metrics_are_sampled_first(tmp_path: Path) -> None:
    routes, host = make_routes(tmp_path)
    app = web.Application()
    for (method, path), handler in routes.table().items():
        app.router.add_route(method, path, handler)
    async with TestClient(TestServer(app)) as c:
        resp = await c.get("/spillway/metrics")
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    assert host.sampled == 1


async def test_the_drill_arm_and_a_gpu_drain_of_a_stopped_child(
        client: TestClient[web.Request, web.Application]) -> None:
    token = (await (await client.post("/spillway/drill/start")).json())["drill"]
    drill = {"X-Spillway-Drill": token}
    body = await (await client.post("/spillway/drill/arm", json={"disarm": True},
                                    headers=drill)).json()
    assert body == {"armed": False, "child": "gpu", "signal": "SIGABRT"}
    # At once, mid-answer (scenario 7): nothing runs, so nothing is sent, and it says so.
    resp = await client.post("/spillway/drill/arm", json={"now": True}, headers=drill)
    assert resp.status == 409
    assert await resp.json() == {"sent": False, "child": "gpu", "signal": "SIGABRT"}
    body = await (await client.post("/spillway/gpu/drain")).json()
    assert body["message"] == "the GPU child is STOPPED; nothing to drain"
    assert body["gpu"]["state"] == "STOPPED"


async def test_only_a_well_formed_arm_arms(tmp_path: Path) -> None:
    """Arming kills the GPU child: a body that is not JSON, or `{"disarm": "true"}`, used to be
    read as the plain arm. Anything but a well-formed request is a 400 that arms nothing."""
    routes, _ = make_routes(tmp_path)
    app = web.Application()
    for (method, path), handler in routes.table().items():
        app.router.add_route(method, path, handler)
    gpu = routes.children["gpu"]
    async with TestClient(TestServer(app)) as client:
        token = (await (await client.post("/spillway/drill/start")).json())["drill"]
        drill = {"X-Spillway-Drill": token}
        for body in (b"not json", b'{"disarm": "true"}', b'{"disarn": true}', b"[]",
                     b'{"now": 1}', b'{"when": "task"}', b" ", b"[" * 1000 + b"]" * 1000):
            resp = await client.post("/spillway/drill/arm", data=body, headers=drill)
            assert resp.status == 400, body
            error = (await resp.json())["error"]
            assert error["type"] == "invalid_request_error" and error["src"] == "spillway"
            assert error["message"].startswith("nothing armed: "), error
            assert gpu.armed_signal is None, body
        # A well-formed arm arms (no body at all is the plain arm), and a disarm disarms.
        resp = await client.post("/spillway/drill/arm", data=b"", headers=drill)
        assert resp.status == 200 and gpu.armed_signal == signal.SIGABRT
        resp = await client.post("/spillway/drill/arm", json={"disarm": True}, headers=drill)
        assert (await resp.json())["armed"] is False and gpu.armed_signal is None
        resp = await client.post("/spillway/drill/arm", json={}, headers=drill)
        assert resp.status == 200 and gpu.armed_signal == signal.SIGABRT
        # A bad request after an arm leaves what was armed as it was.
        resp = await client.post("/spillway/drill/arm", data=b'{"disarm": "yes"}',
                                 headers=drill)
        assert resp.status == 400 and gpu.armed_signal == signal.SIGABRT
