"""Builds and wires everything: config, GPU monitor, children, the pool, proxy, records.

Nothing imports this module but the CLI. The daemon wires and shuts down: what is known of the
upstreams while serving is the pool's (pool.py), a request's path is the proxy's (proxy/), and
Spillway's own routes (/spillway/*) and the status they report are in own_routes.py. Left here:
the daemon's own clock (the tick: sampling, bringing a FATAL GPU child back when the card has
room, stopping an idle on-demand CPU child), systemd's notifications, reloads and shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import aiohttp
from aiohttp import web

from .. import __version__
from ..gpu.llama_devices import list_devices
from ..config import llama_args
from ..config import schema as config_module
from ..upstreams.children import Child
from .agent_port import AgentServer
from ..config.schema import Config
from ..gpu import MIB, GpuMonitor
from ..gpu.placement import Placement, child_args
from ..policy.devices import HIDE_ALL_GPUS, parse_listing
from ..records.idempotency import IdempotencyStore
from ..serving.mirror import Mirror, MirrorSettings
from .modes import Mode, RouterMode, SingleModel
from .offload_watch import OffloadWatch
from .operator import Operator
from ..records.stream_sessions import StreamSessions
from ..records.incidents import IncidentLog, default_path
from ..records.metrics import Metrics
from ..policy.lifecycle import ChildState
from .own_routes import OwnRoutes, status_line
from .small_tier import SmallTier
from ..policy.balancer import agent_reply
from ..policy import vertex
from ..policy.browser import BrowserRules
from ..serving.pool import Pool
from ..proxy.app import build_app
from ..proxy.auth import AuthSettings
from ..proxy.connections import UpstreamClient
from ..proxy.stream_routes import StreamRoutes
from ..proxy.forward import Forwarder, ForwardSettings
from ..proxy.handler import ProxyHandler, ProxySettings
from .reload import Reloader
from .rollout import Rollout
from ..serving.resources import Resources
from ..serving.watchdog import StallWatchdog
from ..policy.progress import DEFAULT_BATCH, stall_timeout
from ..router.models import RouterModels
from ..router.upstream import ModelUpstream
from .systemd import Notifier
from . import logs
from ..records.caches import figures
from ..upstreams.launcher import recent_ports_figures

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger("spillway")

# llama-server closes idle keep-alive connections after 5 s; reusing one just as it closes would
# look like a child dying mid-request, so idle upstream connections are dropped a bit sooner.
UPSTREAM_KEEPALIVE_S = 4.0



# --- settings from the config: one function each, used at start and on every reload -----------

MEDIA_MARKER_ENV = "LLAMA_MEDIA_MARKER"  # tools/server/server-common.cpp get_media_marker


def media_marker() -> str:
    """One media marker for every child: the environment's, else one drawn now, as random as
    llama-server's own (it keeps a prompt's text from posing as media)."""
    return os.environ.get(MEDIA_MARKER_ENV) or f"<__media_{secrets.token_hex(16)}__>"


def _mirror_settings(config: Config) -> MirrorSettings:
    cpu = config.child(config.cpu_child)
    return MirrorSettings(enabled=cpu.mirror and not cpu.on_demand, share=cpu.mirror_share,
                          max_prompt_tokens=cpu.mirror_max_prompt_tokens)


def _proxy_settings(config: Config, media_marker: str | None = None,
                    ) -> tuple[AuthSettings, ForwardSettings, ProxySettings]:
    """The proxy's settings. On a reload a fresh set is copied onto the live objects (the
    proxy holds them), so whatever is set here is applied live."""
    s, f = config.server, config.failover
    return (
        AuthSettings(api_key=s.api_key, browser=BrowserRules.build(
            (a.host for a in s.listen), s.allowed_hosts, s.allowed_origins),
            public_reads=vertex.open_reads(s.vertex)),
        ForwardSettings(read_timeout_s=s.read_timeout_s, connect_timeout_s=s.connect_timeout_s,
                        stream_hold_s=f.stream_hold_s),
        ProxySettings(max_body_bytes=s.max_body_bytes,
                      max_replay_body_bytes=f.max_replay_body_bytes, replay=f.replay,
                      continue_streams=f.continue_streams,
                      body_timeout_s=s.body_timeout_s, access_log=s.access_log,
                      no_prefill=frozenset(c.name for c in config.children
                                           if not c.prefills_assistant),
                      smaller_for_all=((config.small_child is not None
                                        or bool(config.smaller_models))
                                       and config.small.requests == "all"),
                      media_marker=media_marker, max_held_bytes=f.max_held_bytes),
    )


def _say_vertex(config: Config) -> None:
    """Under Vertex AI's contract, say so at start, as llama-server does ("overriding server
    port"), and what Vertex AI needs of the listen address."""
    contract = config.server.vertex
    if contract is None:
        return
    log.warning("Vertex AI's contract (%s=%s): listening on port %d (%s), predict route %s, "
                "health route %s; kept from the children", vertex.MODE, vertex.PREDICTION,
                contract.port, vertex.PORT, contract.predict_route,
                contract.health_route or "/health")
    if all(a.is_loopback for a in config.server.listen):
        log.warning("Vertex AI reaches the container from outside it: on loopback only, "
                    "nothing it sends arrives (server.listen = \"0.0.0.0:%d\")", contract.port)


def _copy_onto(live: DataclassInstance, fresh: DataclassInstance) -> None:
    for f in dataclasses.fields(fresh):
        setattr(live, f.name, getattr(fresh, f.name))


class _StoreLimits(TypedDict):
    max_entries: int
    ttl_s: float
    max_response_bytes: int
    max_total_bytes: int


def _idempotency_limits(config: Config) -> _StoreLimits:
    i = config.idempotency
    return {"max_entries": i.max_keys, "ttl_s": i.ttl_s,
            "max_response_bytes": i.max_response_bytes, "max_total_bytes": i.max_total_bytes}


def _stream_limits(config: Config) -> dict[str, Any]:
    s = config.streams
    return {"max_bytes": s.buffer_bytes, "ttl_s": s.ttl_s,
            "max_total_bytes": s.max_total_bytes, "max_finished": s.max_finished}


def _incident_limits(config: Config) -> tuple[Path, int, int]:
    """(path, max_bytes, backups) of the incident log."""
    i = config.incidents
    return Path(i.path) if i.path else default_path(), i.max_bytes, i.backups


class Daemon:
    def __init__(self, config: Config,
                 on_ready: Callable[[Sequence[str]], None] | None = None) -> None:
        self.config = config
        # Called once, with the listening addresses, when Spillway first serves (when systemd
        # is told READY=1): the quickstart prints its newcomer's lines then.
        self.on_ready = on_ready
        self.started = time.monotonic()
        self.boot = f"{int(time.time()):x}"
        # The marker of a media item in a prompt (/completion's multimodal_data, which /props
        # names `media_marker`): llama-server draws a random one per process, so a client's
        # prompt written for one child would fail on the other, or on the same child after a
        # restart. Every child gets this one (the environment's LLAMA_MEDIA_MARKER if set).
        self.media_marker = media_marker()
        self.monitor = GpuMonitor(config.monitor.sample_interval_s)
        self.monitor.owners = self._gpu_owners
        # Which cards the GPU child uses: asked by the monitor at every sample.
        self.placement = Placement(config.gpu_settings,
                                   lambda: self._gpu_owners().get(self.config.gpu_child),
                                   lambda: self.monitor.listed)
        self.monitor.chooser = self.placement.choose
        self.children: dict[str, Child] = {}
        self.gpu_devices: list[str] = []
        self.config_error: str | None = None
        self.auth, self.forward_settings, self.proxy_settings = _proxy_settings(
            config, self.media_marker)
        self.incidents = IncidentLog(*_incident_limits(config))
        self.idempotency = IdempotencyStore(**_idempotency_limits(config))
        self.streams = StreamSessions(**_stream_limits(config))
        self.resources: Resources | None = None
        self.watchdog: StallWatchdog | None = None
        self.small_tier: SmallTier | None = None  # the small child's starts and stops
        self.mirror: Mirror | None = None  # the warm CPU child (single-model mode)
        self.pool: Pool | None = None
        self.mode: Mode | None = None  # single model or router (modes.py), built once
        self.proxy: ProxyHandler | None = None
        self.operator: Operator | None = None  # spillway gpu restart|drain|pause|resume
        self.routes: OwnRoutes | None = None  # /spillway/*, and the drill's window
        self.metrics = Metrics(config.order)
        self.notifier = Notifier()
        self.reloader: Reloader | None = None
        self.rollout: Rollout | None = None  # a reload's new commands, one child at a time
        self.exit_code = 0  # what `run` returns: 1 when a child's command cannot start at all
        self.restart_notes: list[str] = []  # config changes that need a daemon restart
        # Child state changes with wall-clock times, for the drill's timeline.
        self.timeline: deque[dict[str, Any]] = deque(maxlen=2000)
        self._stop = asyncio.Event()
        self._stop_signals = 0
        self._tasks: list[asyncio.Task[None]] = []
        self.devices_listed = False  # whether gpu_devices is known yet
        self._runner: web.AppRunner | None = None
        self.agent: AgentServer | None = None  # HAProxy's agent-check port, when configured
        self.stopping = False
        self._session: aiohttp.ClientSession | None = None
        self._upstream: UpstreamClient | None = None
        self.listening: list[str] = []
        # The card's free memory when the GPU child went FATAL: memory freed since then (by a
        # game or another model quitting) is a reason to try it again at once.
        self._gpu_free_at_fatal: int | None = None
        # How much of the GPU child is on the GPU (offload_watch.py, policy/offload.py).
        self.offload = OffloadWatch(lambda: self.config, lambda: self.children, self.monitor,
                                    lambda: self.res, self.incidents, self._gpu_owners)

    @property
    def res(self) -> Resources:
        assert self.resources is not None
        return self.resources

    @property
    def models(self) -> RouterModels | None:
        """Router mode: every model's two upstreams and its pool."""
        return self.mode.models if self.mode is not None else None

    @property
    def gpu_paused(self) -> bool:
        return self.operator is not None and self.operator.gpu_paused

    # --- wiring -----------------------------------------------------------------------------------

    def _gpu_env(self) -> dict[str, str]:
        """The GPU child's: the NVIDIA cards it is given (gpu.device's, or unset every one it
        can see), numbered as NVML does."""
        return self.placement.env(self.monitor.devices)

    def _give_cards(self) -> None:
        """The children on the GPU (the GPU child, the small child beside it) see the cards
        the GPU child is given, as the listing numbers them."""
        for cfg in self.config.children:
            if cfg.uses_gpu:
                self.children[cfg.name].extra_env.update(self._gpu_env())

    def caches(self) -> dict[str, dict[str, Any]]:
        """Everything kept in memory beyond a request's life, each with its size and bounds
        (the status's `caches`; docs/performance.md lists them)."""
        out: dict[str, dict[str, Any]] = {
            "stream_sessions": self.streams.cache_figures(),
            "idempotency": self.idempotency.cache_figures(),
            "incidents_recent": self.incidents.cache_figures(),
            "timeline": figures(len(self.timeline), max_entries=self.timeline.maxlen),
            **self.monitor.cache_figures(),
            "metrics_request_series": self.metrics.cache_figures(),
            "systemd_pending": self.notifier.cache_figures(),
            "log_pending": logs.pending_figures(),
            "recent_ports": recent_ports_figures(),
        }
        if self.proxy is not None:
            held = self.proxy.held
            out["held_bodies"] = figures(held.holders, size=held.held, max_bytes=held.limit)
        for name, child in self.children.items():
            out[f"child_output_{name}"] = child.cache_figures()
        if self._upstream is not None:
            out["upstream_idle_connections"] = self._upstream.cache_figures()
        if self.models is not None:
            out.update(self.models.cache_figures())
        return out

    def _gpu_owners(self) -> dict[str, list[int] | None]:
        """Each child's processes, for the GPU chart: in router mode its models' instances
        (where the VRAM is) count as the router's own."""
        owners: dict[str, list[int] | None] = {}
        for name, child in self.children.items():
            pids = [child.pid] if child.pid is not None else []
            if self.mode is not None:
                pids += self.mode.instance_pids(name)
            owners[name] = pids or None
        return owners

    def _make_child(self, name: str) -> Child:
        cfg = self.config.child(name)
        # A child without the GPU must not touch any: even a CUDA context costs VRAM on every
        # card it sees, so every vendor's cards are hidden from it.
        # The small child shares the GPU child's cards, and sees what it sees.
        extra = self._gpu_env() if cfg.uses_gpu else dict(HIDE_ALL_GPUS)
        extra[MEDIA_MARKER_ENV] = self.media_marker
        child = Child(
            cfg, self.config.restart,
            drain_timeout_s=self.config.failover.drain_timeout_s,
            hang_timeout_s=self.config.restart.hang_timeout_s,
            vram_probe=self.monitor.vram_before if cfg.uses_gpu else None,
            vram_short_mib=max(256.0, float(self.config.gpu_settings.vram_headroom_mib)),
            # A start after a death waits for the card to have the dead process's memory back.
            release_probe=self.monitor if cfg.uses_gpu else None,
            release_slack_mib=self._freed_bytes() / MIB,
            extra_env=extra,
        )
        child.listeners.append(self._child_changed)
        if cfg.on_gpu:
            child.line_listeners.append(self.placement.on_line)  # its `using device` lines
            child.line_listeners.append(self.offload.on_line)  # its offload, as it loads
        return child

    def _child_changed(self, child: Child, old: ChildState, new: ChildState,
                       reason: str) -> None:
        self.timeline.append({"time": time.time(), "child": child.name, "state": str(new),
                              "reason": reason})
        self.metrics.set_state(child.name, new)
        if child.cfg.on_gpu and new is ChildState.STARTING:
            self.placement.on_start()  # a new process: its load log names its cards anew
            self.offload.on_start()
        if child.cfg.on_gpu and new is ChildState.FATAL:
            rooms = self.monitor.rooms()
            self._gpu_free_at_fatal = sum(r.free_bytes for r in rooms) if rooms else None
        if old is ChildState.EXITED and child.last_exit is not None and \
                child.last_exit.diagnosis is not None:  # EXITED -> BACKOFF: last_exit is set
            self.metrics.known_crashes.labels(child.name, child.last_exit.diagnosis.name).inc()
        if new is ChildState.FATAL:
            self._give_up_if_refused(child)
        if new is ChildState.STARTING and child.generation > 0:
            last = child.last_exit
            cause = last.kind if last is not None and not last.planned else "requested"
            self.metrics.restarts.labels(child.name, cause).inc()
        if new is ChildState.READY and self.mode is not None:
            self.mode.child_ready(child)
        if child.cfg.on_gpu and new is ChildState.READY:
            self.offload.judge()  # at once when its log says, or no sample is awaited
        self._maybe_ready()
        self.notifier.status(self.status_line())

    def _model_changed(self, upstream: ModelUpstream, old: ChildState, new: ChildState,
                       reason: str) -> None:
        self.timeline.append({"time": time.time(), "child": upstream.name,
                              "model": upstream.model, "state": str(new), "reason": reason})
        self.metrics.set_model_state(upstream.name, upstream.model, new)
        if new is ChildState.STARTING and upstream.generation > 0 and upstream.last_exit \
                is not None and old in (ChildState.BACKOFF, ChildState.FATAL):
            self.metrics.model_reloads.labels(upstream.name, upstream.model,
                                              str(upstream.last_exit.kind)).inc()

    def _http(self) -> aiohttp.ClientSession:
        assert self._session is not None
        return self._session

    def _spawn(self, coro: Any, then_dispatch: bool = False) -> None:
        """A background task of the daemon's, cancelled at shutdown."""
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(task)
        if then_dispatch:
            task.add_done_callback(lambda _t: self.pool.dispatch() if self.pool else None)

    def _stale_connection(self, child: str) -> None:
        self.metrics.stale_connection_resends.labels(child).inc()

    # --- the daemon's own clock -------------------------------------------------------------------

    async def _tick(self) -> None:
        """On the monitor's interval: sample RAM and use, bring the GPU child back after
        load-time OOMs once the card has room, stop an idle on-demand CPU child, and let
        waiting requests in if capacity freed."""
        while True:
            await asyncio.sleep(self.config.monitor.sample_interval_s)
            self.res.sample()
            self._recover_gpu()
            self.offload.judge()
            if self.mode is not None:
                self.mode.tick()  # idle CPU work stopped; router mode: each model's too
            if self.routes is not None:
                self.routes.tick()  # a drill gone silent is over, and disarmed
            if self.pool is not None:
                self.pool.dispatch()
            self.sample_metrics()
            self.notifier.status(self.status_line())

    def sample_metrics(self) -> None:
        sample = self.monitor.latest
        if sample is not None:
            self.metrics.gpu_free.set(sample.free_bytes)
            self.metrics.gpu_used.set(sample.used_bytes)
            self.metrics.gpu_total.set(sample.total_bytes)
        self.metrics.set_gpu_devices([(s.pci_bus_id, s.total_bytes, s.used_bytes, s.free_bytes)
                                      for s in self.monitor.devices])
        self.metrics.waiting.set(len(self.pool.line) if self.pool else 0)

    def _stall_timeout(self, name: str) -> float:
        """The child's stall timeout now: restart.stall_timeout_s, or from its own speeds."""
        speeds = self.res.throughput[name]
        batch = llama_args.flag_value(self.config.child(name).args, "-b")
        return stall_timeout(self.config.restart.stall_timeout_s, speeds.prompt_tps,
                             speeds.gen_tps, int(batch) if batch and batch.isdigit()
                             else DEFAULT_BATCH)

    def _freed_bytes(self) -> int:
        """How much more free memory counts as "freed by another process": the headroom, and
        never less than 256 MiB (NVML's figure moves a little on its own)."""
        return max(256, self.config.gpu_settings.vram_headroom_mib) * MIB

    def _recover_gpu(self) -> None:
        """A FATAL GPU child is tried again at once when the card's memory was freed by
        another process since it went FATAL, and the card now has room for it. Both are
        needed: free memory alone, if the estimate of the need is low, would restart it on
        every tick into the same failure."""
        gpu = self.children[self.config.gpu_child]
        rooms = self.monitor.rooms()
        if not rooms or gpu.state is not ChildState.FATAL or self.gpu_paused:
            return
        need = self.res.gpu_need_bytes()
        free = sum(r.free_bytes for r in rooms)
        before = self._gpu_free_at_fatal
        freed = None if before is None else free - before
        if self.res.gpu_shortage() is None and (freed is None or freed >= self._freed_bytes()):
            if self.small_tier is not None and self.small_tier.hold() is not None:
                return  # the small child makes way first; the tier starts the GPU child then
            since = f"; {freed // MIB} MiB freed since it went FATAL" if freed else ""
            where = "the GPU has" if len(rooms) == 1 else f"its {len(rooms)} cards have"
            gpu.restart(f"{where} {free // MIB} MiB free again (needs about "
                        f"{need // MIB} MiB{since})")

    # --- systemd --------------------------------------------------------------------------------

    def can_serve(self) -> bool:
        """A child serving the model is ready, or one can start on demand (stopped, an
        on-demand child); the small child alone is not enough (only some requests go there)."""
        return any(not c.cfg.smaller and (c.state is ChildState.READY or (
            c.cfg.on_demand and c.state is ChildState.STOPPED))
            for c in self.children.values())

    def _maybe_ready(self) -> None:
        if not self.notifier.ready_sent and self.listening and self.can_serve():
            self.notifier.ready(self.status_line())
            if self.on_ready is not None:
                self.on_ready(list(self.listening))

    def status_line(self) -> str:
        """systemd's STATUS=: one line."""
        return status_line(self.children, len(self.pool.line) if self.pool else 0,
                           self.incidents.recent, self.config_error)

    async def _extend_start(self) -> None:
        """While the children load (a first model load can take minutes), ask systemd for
        more time than its start timeout; only before READY=1."""
        while not self.notifier.ready_sent:
            self.notifier.extend_timeout(30)
            await asyncio.sleep(10)

    # --- reload -----------------------------------------------------------------------------------

    def _reload_started(self) -> None:
        self.notifier.reloading()

    def _reload_result(self, result: str, problems: list[config_module.Problem]) -> None:
        self.metrics.reloads.labels(result).inc()
        self.metrics.config_valid.set(0 if result == "invalid" else 1)
        self.config_error = ("; ".join(str(p) for p in problems) if result == "invalid"
                             else None)
        self.notifier.ready(self.status_line())

    async def apply_config(self, new: Config, changes: list[str]) -> None:
        """A valid new config, applied as a diff: proxy settings and limits at once; a child
        whose command changed is drained (its requests finish, new ones go to the other child
        or wait) and restarted with the new command."""
        new = self._defer_restart_keys(new, changes)
        self.config = new
        for configure in self._reconfigurable():
            configure(new)
        if self.pool is not None:
            self.pool.dispatch()

    def _reconfigurable(self) -> list[Callable[[Config], None]]:
        """Each long-lived part's `configure`, in the order a reload applies them (what the
        config says, taken by the parts that were wired with it)."""
        parts: list[Callable[[Config], None]] = [self.res.configure, self._configure_proxy]
        if self.pool is not None:
            parts.append(self.pool.configure)
        if self.mode is not None:
            parts.append(self.mode.configure)
        parts += [
            lambda new: self.idempotency.configure(**_idempotency_limits(new)),
            lambda new: self.streams.configure(**_stream_limits(new)),
            lambda new: self.incidents.configure(*_incident_limits(new)),
            lambda new: self.monitor.configure(new.monitor.sample_interval_s),
            lambda new: self.placement.configure(new.gpu_settings),
            lambda new: logging.getLogger().setLevel(new.server.log_level.upper()),
            self._apply_to_children,
        ]
        return parts

    def _configure_proxy(self, new: Config) -> None:
        """The proxy holds its settings objects: a fresh set is copied onto them."""
        auth, forward, proxy = _proxy_settings(new, self.media_marker)
        if self.mirror is not None:
            self.mirror.configure(_mirror_settings(new))
        _copy_onto(self.auth, auth)
        _copy_onto(self.forward_settings, forward)
        _copy_onto(self.proxy_settings, proxy)

    def _defer_restart_keys(self, new: Config, changes: list[str]) -> Config:
        """RESTART_KEYS that changed are noted for status; the GPU child keeps the card we
        started with (the monitor keeps watching it). A change between single-model and router
        mode is wired at start: noted, and the running config kept until spillway restarts."""
        if new.router != self.config.router:
            note = ("model.path changed between a model and router mode: it takes effect when "
                    "spillway restarts")
            log.warning("%s", note)
            self.restart_notes.append(note)
            return self.config
        if new.order != self.config.order or new.smaller_models != self.config.smaller_models:
            # The children are wired at start (the pool, the metrics, the small tier), and each
            # model's pool with its smaller model when the model is first seen.
            note = ("small.path was given or removed, or small.models changed: that takes "
                    "effect when spillway restarts")
            log.warning("%s", note)
            self.restart_notes.append(note)
            new = dataclasses.replace(new, small=self.config.small)
        for key in config_module.RESTART_KEYS:
            if key in changes:
                note = f"{key} changed: it takes effect when spillway restarts"
                log.warning("%s", note)
                self.restart_notes.append(note)
        return new.keeping_restart_keys(self.config, changes)

    def _apply_to_children(self, new: Config) -> None:
        """Each child takes its section (children.Child.configure); a hot child without the GPU
        that is stopped (and not paused: it was on demand) is started. The running children
        whose command changed take it one at a time (rollout.py)."""
        changed: list[str] = []
        for cfg in new.children:
            child = self.children[cfg.name]
            if child.configure(cfg, new.restart, new.failover.drain_timeout_s):
                changed.append(cfg.name)
            if not cfg.on_gpu and not cfg.on_demand and child.state is ChildState.STOPPED \
                    and cfg.name not in self.res.paused:
                child.start()
        if changed:
            if self.rollout is None:
                self.rollout = Rollout(self.children)
            self.rollout.start(new, changed)

    def rollout_json(self) -> dict[str, Any] | None:
        """The last reload's new commands: in which order, where it is, how each settled."""
        return self.rollout.to_json() if self.rollout is not None else None

    def _give_up_if_refused(self, child: Child) -> None:
        """A child started at boot whose command llama-server refused (a bad flag or value, a
        file it cannot open) before it was ever ready: with no good command to go back to,
        Spillway exits non-zero with llama-server's own words, as llama-server itself would,
        instead of answering 503 until someone reads the status."""
        last = child.last_exit
        if last is None or last.refusal is None or child.ever_ready or self.stopping or \
                self.mode is None or not self.mode.starts_at_boot(child.name):
            return
        for line in last.refusal.said:
            log.error("[%s] %s", child.name, line)
        log.error("the %s's command cannot start (%s), and there is no earlier command to go "
                  "back to: mend the config and start spillway again", child.cfg.label,
                  last.refusal.summary())
        self.exit_code = 1
        self._stop.set()

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
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        # Listing devices takes a moment (a CUDA build initialises the driver): it runs while
        # Spillway sets up, and is awaited before it listens and the children start, since it
        # says which vendors' cards the GPU child can use (gpu.device's index counts those).
        listing = asyncio.create_task(self._list_gpu_devices())
        await self.monitor.start()
        self.children = {name: self._make_child(name) for name in self.config.order}
        self.resources = Resources(self.config, self.children, self.monitor)
        await asyncio.to_thread(self.res.read_model)
        self.res.sample()
        self.pool = Pool(self.res, self.children, self.config.queue.max_waiting,
                         self.config.queue.max_wait_s, metrics=self.metrics, boot=self.boot,
                         smaller=[c.name for c in self.config.children if c.smaller])
        self.pool.sick_after = self.config.restart.sick_after_errors
        self.pool.wait_for_gpu = self.config.failover.wait_for_gpu
        self.res.media_in_flight = self.pool.media_in_flight  # the encoder's memory, learned
        # The proxy's own keep-alive connections to the children (proxy/connections.py).
        self._upstream = UpstreamClient(keepalive_s=UPSTREAM_KEEPALIVE_S)
        # aiohttp's client, for Spillway's own questions to a child (/props, token counts).
        # No cookie jar: a cookie one answer set must never ride along with another request.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
            auto_decompress=False, skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        forwarder = Forwarder(self._upstream, self._session, self.forward_settings,
                              on_resend=self._stale_connection)
        self.mode = self._make_mode()
        self.proxy = ProxyHandler(self.mode.pools(), forwarder, self.proxy_settings, self.incidents,
                                  self.idempotency, self.metrics, self.streams)
        self.metrics.track_streams(self.streams)
        self.operator = Operator(self.children[self.config.gpu_child], self.res.paused,
                                 self.models)
        if self.models is None:  # single-model mode: a router's instances die on their own
            self.watchdog = StallWatchdog(self.children, self._stall_timeout, self._http)
            self.mirror = self._make_mirror()
            self.proxy.mirror = self.mirror
        self.small_tier = self._make_small_tier()
        self.routes = routes = OwnRoutes(self, started=self.started, children=self.children,
                           resources=self.res, pool=self.pool, monitor=self.monitor,
                           incidents=self.incidents, metrics=self.metrics, timeline=self.timeline,
                           models=self.models, operator=self.operator, streams=self.streams,
                           offload=self.offload.to_json, caches=self.caches)
        app = build_app(self.proxy, self.auth, routes.table(),
                        StreamRoutes(self.streams, self.metrics, time.time,
                                     lambda: self.config.server.body_timeout_s).table(),
                        on_refused=lambda reason: self.metrics.rejections.labels(reason).inc(),
                        vertex=self.config.server.vertex)
        # In-flight requests are drained by _shutdown itself (the drain timeout can change on
        # reload); the runner's own wait is only for stragglers after that.
        # keepalive_timeout also bounds a client that never finishes its headers: aiohttp
        # starts that clock when the connection opens (a slowloris is closed after it).
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=2.0,
                                     keepalive_timeout=self.config.server.idle_timeout_s)
        await self._runner.setup()
        await listing
        await self.monitor.sample_now()  # the cards it can use, now that the listing says
        self._give_cards()
        self._warn_if_split_over_hidden_cards()
        try:
            for addr in self.config.server.listen:
                site = web.TCPSite(self._runner, addr.host, addr.port, reuse_address=True)
                await site.start()
                self.listening.append(str(addr))
        except OSError as e:
            log.error("cannot listen on %s: %s", addr, e)
            await self._shutdown()
            return 1
        if self.config.balancer.agent_listen:
            self.agent = AgentServer(self.config.balancer.agent_listen,
                                     lambda: self._agent_line(routes))
            try:
                await self.agent.start()
            except OSError as e:
                log.error("cannot listen on %s (balancer.agent_listen): %s",
                          self.config.balancer.agent_listen, e)
                await self._shutdown()
                return 1
        log.info("spillway %s listening on %s", __version__, ", ".join(self.listening))
        _say_vertex(self.config)
        log.info("incidents go to %s", self.incidents.path)
        self._spawn(self._tick())
        if self.watchdog is not None:
            self._spawn(self.watchdog.run())
        self._spawn(self.notifier.watchdog())
        self._spawn(self._extend_start())
        if self.config.path is not None:
            self.reloader = Reloader(self.config.path, lambda: self.config, self.apply_config,
                                     self._reload_result, self._reload_started)
            self.reloader.watch()
        for name in self.config.order:
            if self.mode.starts_at_boot(name):
                self.children[name].start()
        self._maybe_ready()
        await self._stop.wait()
        await self._shutdown()
        return self.exit_code

    def _make_mode(self) -> Mode:
        """Single model or router, from the config at start (a change between them waits
        for a restart: see _defer_restart_keys)."""
        assert self.pool is not None
        if not self.config.router:
            return SingleModel(self.children, self.res, self.pool, lambda: self.config,
                               self._http, self._spawn)
        models = RouterModels(self.config, self.children, self.monitor, self.res.paused,
                              self._http, metrics=self.metrics, boot=self.boot,
                              on_change=self._model_changed)
        return RouterMode(models, self.pool, lambda: self.config)

    def mirror_json(self) -> dict[str, Any] | None:
        return self.mirror.to_json() if self.mirror is not None else None

    def _make_mirror(self) -> Mirror:
        """The warm CPU child (serving/mirror.py): its task, and what it tells the CPU
        child's expected time (the prefix it holds)."""
        cpu = self.children[self.config.cpu_child]
        mirror = Mirror(self._http, cpu, list(self.children.values()),
                        _mirror_settings(self.config))
        self.res.warm_tokens = lambda name, work: (
            mirror.warm_tokens(work.prefix_keys) if name == cpu.name else 0)
        mirror.on_timings = lambda timings: self.res.observe_timings(cpu.name, timings)
        self._spawn(mirror.run())
        return mirror

    def _make_small_tier(self) -> SmallTier | None:
        """The small child's starts and stops beside the GPU child, when there is one."""
        small = self.config.small_child
        if small is None:
            return None
        return SmallTier(self.children[self.config.gpu_child], self.children[small],
                         lambda: self.config, self.res.paused)

    def _agent_line(self, routes: OwnRoutes) -> str:
        if self.stopping:
            # Out of the balancer's rotation while in-flight requests drain (HAProxy takes a
            # refused agent connection for no news, so the agent says it, to the end).
            return "down #spillway is stopping"
        return agent_reply(routes.machine_health())

    def _on_sighup(self) -> None:
        if self.reloader is not None:
            self._spawn(self._reload("SIGHUP"))

    async def _reload(self, trigger: str) -> None:
        assert self.reloader is not None
        await self.reloader.reload(trigger)

    async def _list_gpu_devices(self) -> None:
        self.gpu_devices = await asyncio.to_thread(
            list_devices, self.config.gpu_settings.llama_server, 10.0, self._gpu_env())
        self.devices_listed = True
        # Which vendors' cards it can use, and Intel's totals (drm.py): the listing says.
        self.monitor.listed = parse_listing(self.gpu_devices)
        if not self.gpu_devices:
            log.warning("the GPU child's llama-server (%s) lists no GPU device: it runs "
                        "CPU-only", self.config.gpu_settings.llama_server)
        else:
            log.info("the GPU child's llama-server sees %s", "; ".join(self.gpu_devices))

    def _warn_if_split_over_hidden_cards(self) -> None:
        """Args that split the layers over several devices while the child is given fewer
        cards: it would load on what it sees, not as asked."""
        wanted = child_args(self.config.gpu_settings).splits_across()
        cards = [s.card for s in self.monitor.devices]
        given = self.placement.candidates(cards)
        device = self.config.gpu_settings.device
        if not cards or wanted <= len(given):
            return
        if device is None:  # every card it can see: the machine (or its environment) has fewer
            log.warning("gpu.args split the layers over %d devices (-dev/-ts) but the GPU "
                        "child can see %d card(s) of its build's vendor", wanted, len(given))
        else:
            log.warning("gpu.args split the layers over %d devices (-dev/-ts) but gpu.device = "
                        "%r gives the GPU child %d card(s): leave gpu.device unset (every card "
                        "it can see, as llama-server alone) or list the cards", wanted, device,
                        len(given))

    async def _shutdown(self) -> None:
        self.notifier.stopping()
        self.stopping = True  # the balancer's agent says "down" from now on
        if self.reloader is not None:
            self.reloader.stop()
        if self._runner is not None:
            # Stop accepting, then let in-flight requests finish up to the drain timeout; a
            # second signal cuts the wait short.
            for site in list(self._runner.sites):
                await site.stop()
            if self.proxy is not None and self.proxy.open_requests:
                log.info("waiting for %d in-flight request(s), up to %.0f s",
                         self.proxy.open_requests,
                         self.config.server.drain_timeout_s)
                idle = asyncio.create_task(self.proxy.idle.wait())
                second = asyncio.create_task(self._second_signal())
                await asyncio.wait({idle, second}, timeout=self.config.server.drain_timeout_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                idle.cancel()
                second.cancel()
            # Resumable streams still going past the drain end now, and so do their readers.
            self.streams.stop_all(time.time())
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
        for task in self._tasks:
            task.cancel()
        if self.rollout is not None:
            await self.rollout.close()
        if self.mode is not None:
            await self.mode.close()
        # A second signal asked for speed: a short grace for the children too.
        grace = 1.0 if self._stop_signals >= 2 else None
        await asyncio.gather(*(c.close(grace) for c in self.children.values()),
                             return_exceptions=True)
        if self._upstream is not None:
            self._upstream.close()
        if self._session is not None:
            await self._session.close()
        await self.monitor.close()
        if self.agent is not None:
            await self.agent.close()
        log.info("stopped")

    async def _second_signal(self) -> None:
        while self._stop_signals < 2:
            self._stop.clear()
            await self._stop.wait()
