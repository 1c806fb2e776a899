"""The status page at /spillway/: the GPU memory history behind its chart (unit), its headers and
key rules (the app on its own), and the page itself in headless Chromium against a real daemon
with real llama-server children, driven over the DevTools protocol (tests/cdp.py): it renders,
follows the daemon without a reload, its buttons act (and cancel does not), and it asks for the
key when one is set.

`SPILLWAY_WRITE_SCREENSHOT=1` also copies the first test's screenshot to docs/status-page.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from cdp import Browser, Page
from harness import (
    DOOMED_TOKENS,
    PATIENCE_S,
    REPO,
    Spillway,
    real_config,
    router_config,
    until,
    write_json,
)
from test_own_routes import make_routes

from conftest import SpillwayFactory
from supervisor.gpu import MIB, GpuSample
from supervisor.gpu.history import GpuHistory, MemoryPoint
from supervisor.policy.devices import Selection
from supervisor.proxy.app import build_app
from supervisor.proxy.auth import AuthSettings
from supervisor.service.status_page import StatusPage, content_security_policy

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# --- the history behind the chart -------------------------------------------------------------

def point(t: float, free: int = 100, children: Mapping[str, int | None] | None = None,
          wall_offset: float = 1000.0) -> MemoryPoint:
    """A point at monotonic time `t` (the wall clock `wall_offset` ahead of it)."""
    return MemoryPoint(monotonic=t, wall=t + wall_offset, total_bytes=1000, free_bytes=free,
                       used_bytes=1000 - free, children=dict(children or {}))


def test_the_history_keeps_at_most_max_points_a_step_apart_and_the_newest_sample() -> None:
    h = GpuHistory(span_s=100.0, max_points=10)  # a step of 10 s
    assert h.step_s == 10.0
    for i in range(50):  # one sample a second for 50 s
        h.add(point(float(i), free=i))
    kept = h.since(0.0)
    times = [p.monotonic for p in kept]
    assert times == [0.0, 10.0, 20.0, 30.0, 40.0, 49.0]  # thinned; the newest is the last sample
    assert kept[-1].free_bytes == 49
    for i in range(50, 1000):
        h.add(point(float(i)))
    assert len(h) <= 11  # max_points, and the newest
    assert h.since(0.0)[-1].monotonic == 999.0


def test_the_history_forgets_what_is_older_than_its_span() -> None:
    h = GpuHistory(span_s=60.0, max_points=600)  # a step of 0.1 s: nothing thinned here
    for t in (0.0, 10.0, 50.0, 65.0, 100.0):
        h.add(point(t))
    assert [p.monotonic for p in h.since(0.0)] == [50.0, 65.0, 100.0]
    # Sampling stopped (the driver went away): nothing older than the span counts now.
    assert [p.monotonic for p in h.since(0.0, now=120.0)] == [65.0, 100.0]
    assert h.since(0.0, now=500.0) == []


def test_since_is_wall_time_and_strictly_after() -> None:
    h = GpuHistory(span_s=600.0, max_points=600)
    for t in (1.0, 2.0, 3.0, 4.0):
        h.add(point(t, wall_offset=1_700_000_000.0))
    assert [p.monotonic for p in h.since(1_700_000_002.0)] == [3.0, 4.0]
    assert h.since(1_700_000_004.0) == []
    assert point(2.0, children={"gpu": 5 * MIB, "cpu": None}).to_json() == {
        "time": 1002.0, "total_bytes": 1000, "free_bytes": 100, "used_bytes": 900,
        "children": {"gpu": 5 * MIB, "cpu": None}, "devices": {}}
    with pytest.raises(ValueError):
        GpuHistory(span_s=0)


def test_each_point_sums_each_childs_own_processes_at_the_moment_of_the_sample(
        tmp_path: Path) -> None:
    routes, _ = make_routes(tmp_path)
    monitor = routes.monitor
    owners: dict[str, list[int] | None] = {"gpu": [10, 11], "cpu": None}
    monitor.owners = lambda: owners
    sample = GpuSample(monotonic=1.0, wall=2.0, index=0, name="x", pci_bus_id="b", uuid="u",
                       total_bytes=100 * MIB, free_bytes=60 * MIB, used_bytes=40 * MIB,
                       process_bytes={10: 30 * MIB, 11: 5 * MIB, 99: 5 * MIB})
    assert monitor._point([sample], owners).children == {"gpu": 35 * MIB, "cpu": None}
    owners["gpu"] = [12]  # restarted: its new pid is not on the card (yet)
    assert monitor._point([sample], owners).children == {"gpu": 0, "cpu": None}


# --- the page's headers and key rules, on the app alone ---------------------------------------

@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    """The app with a key, Spillway's own routes (children never started), and a stand-in for
    the proxy that says whether a request got past the key."""
    routes, _ = make_routes(tmp_path)
    now = time.monotonic()
    for i in (3, 2, 1):  # taken 3, 2 and 1 s ago, at wall times 1001, 1002 and 1003
        routes.monitor.chart.add(point(now - i, wall_offset=1004 - now))

    async def proxy(request: web.Request) -> web.StreamResponse:
        return web.Response(text="proxied")

    app = build_app(cast(Any, proxy), AuthSettings(api_key=KEY), routes.table())
    async with TestClient(TestServer(app)) as c:
        yield c


async def test_the_page_is_public_with_strict_headers_and_its_data_is_not(
        guarded: TestClient[web.Request, web.Application]) -> None:
    page = await guarded.get("/spillway/")
    html = await page.text()
    assert page.status == 200 and page.content_type == "text/html"
    assert page.headers["Cache-Control"] == "no-store"
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert page.headers["Referrer-Policy"] == "no-referrer"
    csp = page.headers["Content-Security-Policy"]
    assert csp == content_security_policy(html)
    assert "unsafe-inline" not in csp and "default-src 'none'" in csp
    assert "connect-src 'self'" in csp and "form-action 'none'" in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]{44}'$", csp.split(";")[4].strip())
    assert not re.search(r"<(script|link)[^>]+(src|href)=\"?https?:", html)  # nothing remote
    head = await guarded.head("/spillway/")
    assert head.status == 200 and await head.read() == b""
    moved = await guarded.get("/spillway", allow_redirects=False)
    assert moved.status == 301 and moved.headers["Location"] == "spillway/"
    # Only GET and HEAD are open; the data the page reads keeps asking for the key.
    assert (await guarded.post("/spillway/")).status == 401
    assert (await guarded.post("/spillway/", headers=AUTH)).status == 405
    for path in ("/spillway/status", "/spillway/gpu/history", "/spillway/incidents",
                 "/spillway/metrics", "/spillway/timeline"):
        assert (await guarded.get(path)).status == 401, path
    assert (await guarded.post("/spillway/gpu/pause")).status == 401
    assert (await guarded.get("/spillway//")).status == 401  # not the page: a data path


async def test_the_history_route_answers_the_points_after_since(
        guarded: TestClient[web.Request, web.Application]) -> None:
    async def times(since: str) -> list[float]:
        body = await (await guarded.get("/spillway/gpu/history", params={"since": since},
                                        headers=AUTH)).json()
        return [p["time"] for p in body["points"]]

    assert await times("0") == [1001.0, 1002.0, 1003.0]
    assert await times("1001") == [1002.0, 1003.0]
    assert await times("1003") == []
    assert await times("x") == [1001.0, 1002.0, 1003.0]
    body = await (await guarded.get("/spillway/gpu/history", headers=AUTH)).json()
    assert body["points"][0] == {"time": 1001.0, "total_bytes": 1000, "free_bytes": 100,
                                 "used_bytes": 900, "children": {}, "devices": {}}
    assert body["span_s"] == 600.0 and body["step_s"] == 1.0
    assert body["note"] == "GPU monitor not started"
    assert isinstance(body["time"], float)


def test_the_policy_hashes_exactly_the_inline_blocks() -> None:
    html = "<style>a{}</style><p>x</p><script>go()</script>"
    csp = content_security_policy(html)
    assert "style-src 'sha256-" in csp and "script-src 'sha256-" in csp
    assert content_security_policy(html.replace("go()", "go();")) != csp
    with pytest.raises(ValueError):
        content_security_policy("<p>no script</p>")
    assert StatusPage.load().headers["Content-Security-Policy"].startswith("default-src 'none'")


# --- the page in a browser, against a real daemon ---------------------------------------------

integration = pytest.mark.integration


def on_the_card(nvml: Path, s: Spillway, free_mib: int) -> None:
    """The fake card's figures, with the GPU child's process (whatever its pid now) on it."""
    pid = s.child("gpu", AUTH if "api_key" in s.config["server"] else None)["pid"]
    write_json(nvml, total_mib=24576, free_mib=free_mib, name="fake NVML card (test)",
               pci_bus_id="00000000:01:00.0",
               processes={str(pid): 24576 - free_mib - 900} if pid else {})


def daemon(spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path,
           **server: Any) -> tuple[Spillway, Path]:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, total_mib=24576, free_mib=23000, name="fake NVML card (test)")
    cfg = real_config(llama_server, tiny_model, monitor={"sample_interval_s": 0.25},
                      server=server)
    s = spillway(cfg, fake_nvml=nvml, wait_ready=False)
    s.wait_ready(headers=AUTH if server else None)
    return s, nvml


async def updated(page: Page, more_than: int = 0, timeout: float = PATIENCE_S) -> int:
    """The page's count of refreshes, once it is past `more_than`."""
    return int(await page.wait_for(
        f"Number(document.body.dataset.updates || 0) > {more_than} && "
        "Number(document.body.dataset.updates)", timeout))


def card(child: str) -> str:
    """An expression: the child's card as the page shows it (state, paused, reason)."""
    return (f"(() => {{ const c = document.querySelector('article[data-child=\"{child}\"]');"
            " return c && {state: c.dataset.state, paused: c.dataset.paused,"
            " badge: c.querySelector('[data-role=state]').textContent,"
            " reason: c.querySelector('[data-role=reason]').textContent}; })()")


SERIES = ("(() => Object.fromEntries([...document.querySelectorAll('path[data-series]')]"
          ".map(p => [p.dataset.series, Number(p.dataset.points)])))()")


@integration
async def test_the_page_renders_and_follows_the_daemon_without_a_reload(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path,
        chromium: Path) -> None:
    s, nvml = await asyncio.to_thread(daemon, spillway, llama_server, tiny_model, tmp_path)
    on_the_card(nvml, s, free_mib=19800)
    # An incident for the incidents pane: the GPU child dies as the request's task launches.
    assert s.arm({})[0] == 200
    code, _ = await asyncio.to_thread(s.post, "/v1/chat/completions",
                                      {**CHAT, "max_tokens": DOOMED_TOKENS, "ignore_eos": True})
    assert code == 200
    [incident] = await asyncio.to_thread(s.wait_incidents, 1)
    await asyncio.to_thread(s.wait_ready)
    on_the_card(nvml, s, free_mib=19700)
    async with Browser.launch(chromium, tmp_path) as page:
        await page.set_viewport(1280, 900)
        assert await page.navigate(f"{s.url}/spillway") == f"{s.url}/spillway/"
        await updated(page)
        for child in ("gpu", "cpu"):
            shown = await page.wait_for(card(child))
            assert shown["state"] == "READY" and shown["badge"] == "READY", shown
        # The chart: free, used and each child's own, each with points.
        series = await page.wait_for(
            f"(() => {{ const s = {SERIES}; return Object.keys(s).length === 4 && "
            "Object.values(s).every(n => n >= 2) && s; })()")
        assert set(series) == {"free", "used", "child:gpu", "child:cpu"}, series
        legend = await page.evaluate("document.querySelector('#legend').textContent")
        assert "gpu child" in legend and "GiB" in legend
        assert await page.evaluate("document.querySelector('#queue').dataset.waiting") == "0"
        row = await page.wait_for(
            f"(() => {{ const r = document.querySelector('tr[data-incident=\"{incident['id']}\"]');"
            " return r && r.textContent; })()")
        assert "killed by SIGABRT" in row and "replayed" in row, row
        assert await page.evaluate("document.querySelector('#key-panel').hidden") is True
        # Paused through the API: the page shows it by itself (the same document: no reload).
        await page.evaluate("window.sameDocument = true")
        assert (await asyncio.to_thread(s.post, "/spillway/gpu/pause", {}))[0] == 200
        shown = await page.wait_for(
            f"(() => {{ const c = {card('gpu')}; return c.state === 'STOPPED' && c; }})()")
        assert shown["paused"] == "true" and shown["badge"] == "STOPPED", shown
        await page.wait_for(  # the chart, too: no process of the GPU child's on the card
            "document.querySelector('li[data-series=\"child:gpu\"] strong').textContent"
            " === 'not running'")
        assert (await asyncio.to_thread(s.post, "/spillway/gpu/resume", {}))[0] == 200
        await page.wait_for(f"{card('gpu')}.state === 'READY'")
        assert await page.evaluate("window.sameDocument") is True
        on_the_card(nvml, s, free_mib=19700)
        await updated(page, await updated(page) + 1)
        png = await page.screenshot()
        assert page.problems == []  # no script error, nothing the policy refused
        # The policy holds in a real browser: an injected inline script does not run.
        await page.evaluate("document.body.append(Object.assign(document.createElement("
                            "'script'), {textContent: 'window.injected = true'})); 0")
        # The browser reports the refusal a moment later.
        await until(lambda: any("Content Security Policy" in p for p in page.problems))
        assert any("Content Security Policy" in p for p in page.problems), page.problems
        assert await page.evaluate("window.injected") is None
    assert png.startswith(b"\x89PNG")
    (tmp_path / "status-page.png").write_bytes(png)
    if os.environ.get("SPILLWAY_WRITE_SCREENSHOT") == "1":
        shutil.copyfile(tmp_path / "status-page.png", REPO / "docs" / "status-page.png")


async def confirm_dialog(page: Page) -> dict[str, Any]:
    return cast(dict[str, Any], await page.wait_for(
        "document.querySelector('#confirm').open && {title: "
        "document.querySelector('#confirm-title').textContent}"))


@integration
async def test_a_button_asks_first_then_does_what_it_says(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path,
        chromium: Path) -> None:
    s, _ = await asyncio.to_thread(daemon, spillway, llama_server, tiny_model, tmp_path)
    async with Browser.launch(chromium, tmp_path) as page:
        await page.navigate(f"{s.url}/spillway/")
        await page.wait_for(f"{card('gpu')}?.state === 'READY'")
        # Cancel: the dialog closes and nothing is asked of the daemon.
        await page.click("button[data-action=pause]")
        assert (await confirm_dialog(page))["title"] == "Pause the GPU child?"
        await page.click("#confirm-no")
        await page.wait_for("!document.querySelector('#confirm').open")
        # Escape, too, is a cancel; and Enter presses Cancel, where the focus starts.
        for key in ("Escape", "Enter"):
            await page.click("button[data-action=restart]")
            await confirm_dialog(page)
            await page.press(key)
            await page.wait_for("!document.querySelector('#confirm').open")
        await updated(page, await updated(page) + 1)
        assert await page.evaluate("document.querySelector('#action-message').textContent") == ""
        gpu = s.child("gpu")
        assert gpu["state"] == "READY" and gpu["paused"] is False and gpu["restarts"] == 0
        # Confirmed: the GPU child is paused, and the page says what the daemon answered.
        await page.click("button[data-action=pause]")
        await confirm_dialog(page)
        await page.click("#confirm-yes")
        message = await page.wait_for(
            "document.querySelector('#action-message[data-action=pause]')?.textContent")
        assert message == "the GPU child is stopped and its VRAM free; the CPU child serves"
        gpu = s.child("gpu")
        assert gpu["state"] == "STOPPED" and gpu["paused"] is True
        await page.wait_for(f"{card('gpu')}.paused === 'true'")
        # And back.
        await page.click("button[data-action=resume]")
        await confirm_dialog(page)
        await page.click("#confirm-yes")
        await page.wait_for(
            "document.querySelector('#action-message[data-action=resume]')?.textContent")
        await asyncio.to_thread(s.wait_state, ("gpu",), ("READY",))
        assert s.child("gpu")["paused"] is False
        await page.wait_for(f"{card('gpu')}.state === 'READY'")
        assert page.problems == []


GIB = 1024 * MIB
NVIDIA = "0000:01:00.0"
INTEL = "0000:03:00.0"
GPU_PID = 4242


class TwoCards:
    """A source of figures (gpu/sampler.py's Sampler) with two cards: an NVIDIA card the GPU
    child's process is on, and an Intel card whose figures are an estimate. Each sample the
    NVIDIA card has 1 GiB more in use."""

    def __init__(self) -> None:
        self.nvidia_used = 16 * GIB

    def open(self) -> None:
        pass

    def sample(self, monotonic: float, wall: float, pids: object) -> list[GpuSample]:
        self.nvidia_used = min(self.nvidia_used + GIB, 20 * GIB)
        return [
            GpuSample(monotonic=monotonic, wall=wall, index=0, name="NVIDIA GeForce RTX 4090",
                      pci_bus_id=NVIDIA, uuid="GPU-1", total_bytes=24 * GIB,
                      free_bytes=24 * GIB - self.nvidia_used, used_bytes=self.nvidia_used,
                      process_bytes={GPU_PID: self.nvidia_used - GIB}),
            GpuSample(monotonic=monotonic, wall=wall, index=1, name="Intel Arc A770",
                      pci_bus_id=INTEL, uuid="", total_bytes=16 * GIB, free_bytes=15 * GIB,
                      used_bytes=GIB, vendor="intel", estimated=True,
                      source="estimate: SYCL0's listing by llama-server, and the children's "
                             "fdinfo"),
        ]

    def close(self) -> None:
        pass


DEVICES = ("(() => Object.fromEntries([...document.querySelectorAll('#chart path[data-device]')]"
           ".map(p => [p.dataset.device, Number(p.dataset.points)])))()")


async def test_with_two_cards_the_chart_draws_a_line_for_each_and_the_page_names_both(
        tmp_path: Path, chromium: Path) -> None:
    """The daemon's own routes with a monitor of two cards (no children started): the chart
    has a line per card, from the points' `devices`, the legend and the line under the title
    name both, the GPU child's marked, the estimate and the assumption said, and which card
    gpu.device gives the GPU child (the other one not given to it)."""
    routes, _ = make_routes(tmp_path)
    monitor = routes.monitor
    monitor.samplers = [TwoCards()]
    assumed = "the backend numbers its devices in its own order, so every card it may use counts"
    monitor.chooser = lambda samples: Selection((NVIDIA,), "config (assumed)", assumed,
                                                given=(NVIDIA,), given_why='gpu.device = "0"')
    monitor.owners = lambda: {"gpu": [GPU_PID], "cpu": None}
    monitor.chart = GpuHistory(span_s=600.0, max_points=60_000)  # a point per sample
    await monitor.start()
    try:
        for _ in range(3):
            await monitor.sample_now()
        status_gpu = routes.status()["gpu"]
        assert [d["pci_bus_id"] for d in status_gpu["devices"]] == [NVIDIA, INTEL]

        async def proxy(request: web.Request) -> web.StreamResponse:
            return web.Response(status=404)

        app = build_app(cast(Any, proxy), AuthSettings(api_key=None), routes.table())
        async with TestServer(app) as server, Browser.launch(chromium, tmp_path) as page:
            await page.set_viewport(1280, 900)
            await page.navigate(str(server.make_url("/spillway/")))
            lines = await page.wait_for(
                f"(() => {{ const d = {DEVICES}; return Object.keys(d).length === 2 && "
                "Object.values(d).every(n => n >= 4) && d; })()")
            assert set(lines) == {NVIDIA, INTEL}, lines
            series = await page.evaluate(SERIES)
            assert set(series) == {"free", "used", "child:gpu", "child:cpu",
                                   f"device:{NVIDIA}", f"device:{INTEL}"}, series
            assert series["used"] >= 4 and series["child:gpu"] >= 4 and series["child:cpu"] == 0
            # Two lines, not one drawn twice: the NVIDIA card's climbs, the Intel card's is flat.
            paths = await page.evaluate(
                "Object.fromEntries([...document.querySelectorAll('#chart path[data-device]')]"
                ".map(p => [p.dataset.device, p.getAttribute('d')]))")
            assert paths[NVIDIA] != paths[INTEL]
            assert len({y for y in re.findall(r"[ML][\d.]+ ([\d.]+)", paths[INTEL])}) == 1
            assert len({y for y in re.findall(r"[ML][\d.]+ ([\d.]+)", paths[NVIDIA])}) > 1
            legend = await page.evaluate(
                "Object.fromEntries([...document.querySelectorAll('#legend li[data-device]')]"
                ".map(li => [li.dataset.device, li.textContent]))")
            assert set(legend) == {NVIDIA, INTEL}, legend
            assert legend[NVIDIA].startswith(f"NVIDIA GeForce RTX 4090 · {NVIDIA} · GPU child ")
            assert legend[INTEL].startswith(f"Intel Arc A770 · {INTEL} ") and \
                legend[INTEL].endswith(" 1 GiB"), legend
            assert "GPU child" not in legend[INTEL]
            # With several cards, free and used say which cards they sum.
            used = await page.evaluate(
                "document.querySelector('#legend li[data-series=used]').textContent")
            assert used.startswith("used (the GPU child's card) "), used
            # The line under the title: every card, the GPU child's marked, the estimate said,
            # and why its cards are assumed.
            cards = await page.evaluate(
                "[...document.querySelectorAll('#gpu-card p')].map(p => "
                "[p.dataset.device || p.dataset.role, p.dataset.gpuChild, p.textContent])")
            assert cards[0][:2] == [NVIDIA, "true"] and cards[1][:2] == [INTEL, "false"], cards
            assert cards[0][2] == (f"NVIDIA GeForce RTX 4090 · {NVIDIA} · nvidia · 24 GiB in all"
                                   " · 4 GiB free · nvml · used by the GPU child"), cards
            assert cards[1][2].startswith(f"Intel Arc A770 · {INTEL} · intel · 16 GiB in all · "
                                          "15 GiB free · estimate: SYCL0's listing"), cards
            # The Intel card is not merely idle: gpu.device keeps it from the GPU child.
            assert cards[1][2].endswith(" · estimate · not given to the GPU child"), cards
            assert cards[2] == ["gpu-child-given", None,
                                f'The GPU child is given {NVIDIA}: gpu.device = "0"'], cards
            assert cards[3] == ["gpu-child-devices", None,
                                f"The GPU child's cards are assumed: {assumed}"], cards
            assert page.problems == []
    finally:
        await monitor.close()


@pytest.mark.asyncio
async def test_a_lent_gpu_child_says_why_and_to_whom_on_the_page(
        tmp_path: Path, chromium: Path) -> None:
    """Issue 49: the GPU child's card lent to another program, and (router mode) the models
    lent when idle, as badges on the GPU child's card, from the status's `lent` and
    `lent_models`."""
    routes, _ = make_routes(tmp_path)
    routes.lending = lambda: {"why": "yield", "reason": "pid 4242 (ComfyUI) took the card",
                              "since": "2026-12-07T21:00:00Z", "for_s": 12.0,
                              "answered_by_cpu": 3, "vram": "12000 MiB back on the card",
                              "to_whom": "pid 4242 (ComfyUI)", "pid": 4242}
    routes.lent_models = lambda: {"alpha": {"why": "idle", "since": "2026-12-07T21:00:00Z",
                                            "for_s": 30.0, "answered_by_cpu": 1}}

    async def proxy(request: web.Request) -> web.StreamResponse:
        return web.Response(status=404)

    app = build_app(cast(Any, proxy), AuthSettings(api_key=None), routes.table())
    async with TestServer(app) as server, Browser.launch(chromium, tmp_path) as page:
        await page.navigate(str(server.make_url("/spillway/")))
        badges = await page.wait_for(
            "(() => { const b = [...document.querySelectorAll('[data-child=gpu] .badge.tag')]"
            ".map(e => [e.dataset.role, e.textContent, e.title]); "
            "return b.length >= 2 && b; })()")
        lent = {role: (text, title) for role, text, title in badges if role}
        assert lent["lent"] == ("GPU lent (yield) to pid 4242 (ComfyUI), 3 answered by the CPU "
                                "child", "pid 4242 (ComfyUI) took the card"), badges
        assert lent["lent-models"][0] == "lent when idle: alpha", badges
        assert page.problems == []


def raw_status(url: str, headers: Mapping[str, str] | None = None, method: str = "GET") -> int:
    req = urllib.request.Request(url, headers=dict(headers or {}), method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@integration
async def test_with_a_key_the_page_asks_for_it_keeps_it_in_the_session_and_asks_again(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path,
        chromium: Path) -> None:
    s, _ = await asyncio.to_thread(daemon, spillway, llama_server, tiny_model, tmp_path,
                                   api_key=KEY)
    async with Browser.launch(chromium, tmp_path) as page:
        await page.navigate(f"{s.url}/spillway/")
        await page.wait_for("!document.querySelector('#key-panel').hidden")
        assert "asks for its API key" in await page.evaluate(
            "document.querySelector('#key-message').textContent")
        assert await page.evaluate("document.body.dataset.updates") is None  # nothing shown
        # A wrong key: refused, forgotten, asked again.
        await page.type_text("#key-input", "wrong")
        await page.press("Enter")
        await page.wait_for("document.querySelector('#key-message').className === 'refused'")
        assert await page.evaluate("document.querySelector('#key-panel').hidden") is False
        assert await page.evaluate("sessionStorage.getItem('spillway-key')") is None
        # The right one: the status shows, the key stays in this tab's session and nowhere else.
        await page.type_text("#key-input", KEY)
        await page.click("#key-submit")
        await updated(page)
        assert (await page.wait_for(card("gpu")))["state"] == "READY"
        assert await page.evaluate("sessionStorage.getItem('spillway-key')") == KEY
        stored = await page.evaluate(
            "JSON.stringify({href: location.href, local: localStorage.length, "
            "cookie: document.cookie, input: document.querySelector('#key-input').value})")
        assert json.loads(stored) == {"href": f"{s.url}/spillway/", "local": 0, "cookie": "",
                                      "input": ""}
        # Asked once: later refreshes use the key and never ask again.
        await updated(page, await updated(page) + 2)
        assert await page.evaluate("document.querySelector('#key-panel').hidden") is True
        # A button carries the key too.
        await page.click("button[data-action=drain]")
        await confirm_dialog(page)
        await page.click("#confirm-yes")
        await page.wait_for(
            "document.querySelector('#action-message[data-action=drain]')?.textContent")
        # The refusals were the two 401s (the first ask, the wrong key) and nothing else.
        assert page.problems and all("401" in p for p in page.problems), page.problems
    # The page is open; what it reads is not.
    assert raw_status(f"{s.url}/spillway/") == 200
    assert raw_status(f"{s.url}/spillway/", method="HEAD") == 200
    for path in ("status", "gpu/history", "incidents?limit=20", "metrics", "timeline"):
        assert raw_status(f"{s.url}/spillway/{path}") == 401, path
        assert raw_status(f"{s.url}/spillway/{path}", AUTH) == 200, path
    assert raw_status(f"{s.url}/spillway/gpu/pause", method="POST") == 401
    assert raw_status(f"{s.url}/spillway/", method="POST") == 401
    assert s.child("gpu", AUTH)["paused"] is False


@integration
async def test_in_router_mode_each_model_on_each_router_is_shown_with_its_state(
        spillway: SpillwayFactory, llama_server: Path, models_dir: Path, tmp_path: Path,
        chromium: Path) -> None:
    s = await asyncio.to_thread(spillway, router_config(llama_server, models_dir))
    chat = {**CHAT, "model": "alpha"}
    assert (await asyncio.to_thread(s.post, "/v1/chat/completions", chat))[0] == 200
    async with Browser.launch(chromium, tmp_path) as page:
        await page.navigate(f"{s.url}/spillway/")
        rows = await page.wait_for(
            "(() => { const r = [...document.querySelectorAll('tr[data-model]')].map(t => "
            "[t.dataset.child, t.dataset.model, t.dataset.state]); return r.length === 4 && r; "
            "})()")
        assert ["gpu", "alpha", "READY"] in rows, rows
        assert {(c, m) for c, m, _ in rows} == {(c, m) for c in ("gpu", "cpu")
                                                for m in ("alpha", "beta")}
        assert "router mode" in await page.evaluate("document.querySelector('#summary')"
                                                    ".textContent")
        assert page.problems == []
