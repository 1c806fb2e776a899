"""Builds and wires everything: config, GPU monitor, children, proxy, signals.

Nothing imports this module but the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any

import aiohttp
from aiohttp import web

from . import __version__, bootstrap
from .children import Child
from .config import CHILD_NAMES, Config
from .gpu import GpuMonitor
from .policy.lifecycle import ChildState
from .proxy.app import AuthSettings, build_app, json_response
from .proxy.forward import Forwarder, ForwardSettings
from .proxy.handler import ProxyHandler, ProxySettings

log = logging.getLogger("spillway")

# llama-server closes idle keep-alive connections after 5 s; reusing one just as it closes would
# look like a child dying mid-request, so idle upstream connections are dropped a bit sooner.
UPSTREAM_KEEPALIVE_S = 4.0


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.monitor = GpuMonitor(config.gpu.device, config.monitor.sample_interval_s)
        self.children: dict[str, Child] = {}
        self.gpu_devices: list[str] = []
        self.config_error: str | None = None
        self.auth = AuthSettings(api_key=config.server.api_key)
        self.forward_settings = ForwardSettings(
            read_timeout_s=config.server.read_timeout_s,
            connect_timeout_s=config.server.connect_timeout_s,
            stream_hold_s=config.failover.stream_hold_s,
        )
        self.proxy_settings = ProxySettings(max_body_bytes=config.server.max_body_bytes)
        self._stop = asyncio.Event()
        self._stop_signals = 0
        self._devices_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.listening: list[str] = []

    # --- wiring -----------------------------------------------------------------------------------

    def _gpu_env(self) -> dict[str, str]:
        """The GPU child sees only the watched card; device order as NVML numbers them."""
        env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        if self.monitor.latest is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.monitor.latest.uuid
        elif self.config.gpu.device is not None and self.config.gpu.device.isdigit():
            env["CUDA_VISIBLE_DEVICES"] = self.config.gpu.device
        return env

    def _make_child(self, name: str) -> Child:
        cfg = self.config.child(name)
        # The CPU child must not touch the GPU at all: even a CUDA context costs VRAM.
        extra = self._gpu_env() if name == "gpu" else {"CUDA_VISIBLE_DEVICES": ""}
        headroom = self.config.gpu.vram_headroom_mib
        return Child(
            cfg, self.config.restart,
            drain_timeout_s=self.config.failover.drain_timeout_s,
            hang_timeout_s=self.config.restart.hang_timeout_s,
            vram_probe=self.monitor.vram_before if name == "gpu" else None,
            vram_short_mib=max(256.0, float(headroom)),
            extra_env=extra,
        )

    def states(self) -> dict[str, str]:
        return {name: str(child.state) for name, child in self.children.items()}

    # --- Spillway's own routes --------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        pids = {name: child.pid for name, child in self.children.items()}
        children = {}
        for name, child in self.children.items():
            info = child.to_json()
            if name == "gpu":
                info["devices"] = self.gpu_devices
                info["runs_on"] = (self.gpu_devices[0] if self.gpu_devices else
                                   "CPU: this llama-server lists no GPU device "
                                   "(--list-devices), so the GPU child runs CPU-only")
            else:
                info["runs_on"] = "CPU"
            children[name] = info
        ready = [n for n, c in self.children.items() if c.state is ChildState.READY]
        return {
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "listen": self.listening,
            "serving": bool(ready),
            "why_not_serving": None if ready else (
                "no child is ready: " + "; ".join(
                    f"{n} is {c.state} ({c.reason})" for n, c in self.children.items())),
            "children": children,
            "gpu": self.monitor.to_json(pids),
            "gpu_note": self.monitor.note,
            "gpu_child_on_cpu": (not self.gpu_devices if self._devices_task is not None
                                 and self._devices_task.done() else None),
            "waiting": 0,
            "config": {"path": self.config.path, "error": self.config_error},
        }

    def own_routes(self) -> dict[tuple[str, str], Any]:
        async def health(request: web.Request) -> web.StreamResponse:
            return json_response({"status": "ok", "version": __version__})

        async def ready(request: web.Request) -> web.StreamResponse:
            status = self.status()
            body = {"ready": status["serving"], "why_not": status["why_not_serving"],
                    "children": self.states()}
            return json_response(body, 200 if status["serving"] else 503)

        async def status_route(request: web.Request) -> web.StreamResponse:
            return json_response(self.status())

        return {
            ("GET", "/spillway/health"): health,
            ("GET", "/spillway/ready"): ready,
            ("GET", "/spillway/status"): status_route,
        }

    # --- running ----------------------------------------------------------------------------------

    def request_stop(self, signame: str) -> None:
        self._stop_signals += 1
        if self._stop_signals == 1:
            log.info("%s: stopping (in-flight requests get up to %.0f s)", signame,
                     self.config.server.drain_timeout_s)
        else:
            log.info("%s again: stopping now", signame)
        self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        await self.monitor.start()
        # Listing devices takes a moment (a CUDA build initialises the driver): do it while the
        # children start; it only informs the status.
        self._devices_task = asyncio.create_task(self._list_gpu_devices())
        self.children = {name: self._make_child(name) for name in CHILD_NAMES}
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
            auto_decompress=False, skip_auto_headers=("User-Agent",),
        )
        forwarder = Forwarder(self._session, self.forward_settings)
        proxy = ProxyHandler(lambda: self.children, self.states, forwarder, self.proxy_settings)
        app = build_app(proxy, self.auth, self.own_routes())
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.config.server.drain_timeout_s)
        await self._runner.setup()
        try:
            for addr in self.config.server.listen:
                site = web.TCPSite(self._runner, addr.host, addr.port, reuse_address=True)
                await site.start()
                self.listening.append(str(addr))
        except OSError as e:
            log.error("cannot listen on %s: %s", addr, e)
            await self._shutdown()
            return 1
        log.info("spillway %s listening on %s", __version__, ", ".join(self.listening))
        for name in CHILD_NAMES:
            if name == "cpu" and self.config.cpu.mode == "on-demand":
                continue
            self.children[name].start()
        await self._stop.wait()
        await self._shutdown()
        return 0

    async def _list_gpu_devices(self) -> None:
        env = self._gpu_env()
        self.gpu_devices = await asyncio.to_thread(
            bootstrap.list_devices, self.config.gpu.llama_server, 10.0, env)
        if not self.gpu_devices:
            log.warning("the GPU child's llama-server (%s) lists no GPU device: it runs "
                        "CPU-only", self.config.gpu.llama_server)
        else:
            log.info("the GPU child's llama-server sees %s", "; ".join(self.gpu_devices))

    async def _shutdown(self) -> None:
        if self._runner is not None:
            # Stop accepting, then let in-flight requests finish up to the drain timeout; a
            # second signal cuts the wait short.
            drain = asyncio.create_task(self._runner.cleanup())
            second = asyncio.create_task(self._second_signal())
            await asyncio.wait({drain, second}, return_when=asyncio.FIRST_COMPLETED)
            second.cancel()
            if not drain.done():
                drain.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await drain
        await asyncio.gather(*(c.close() for c in self.children.values()),
                             return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        await self.monitor.close()
        log.info("stopped")

    async def _second_signal(self) -> None:
        while self._stop_signals < 2:
            self._stop.clear()
            await self._stop.wait()
