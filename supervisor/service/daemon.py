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
import socket
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
from ..upstreams.owned import MEDIA_MARKER_ENV
from . import heap
from .agent_port import AgentServer
from .lending import CardsView, Lending
from .model_lending import ModelLending
from ..config.schema import Config
from ..gpu import MIB, GpuMonitor
from ..gpu.placement import Placement, child_args
from ..policy.devices import HIDE_ALL_GPUS, parse_listing
from ..records.idempotency import IdempotencyStore
from ..serving.mirror import Lane, Mirror, MirrorSettings
from .modes import Mode, RouterMode, SingleModel
from .offload_watch import OffloadWatch
from .handover import COMMIT_MARGIN_S, UPGRADE_TIMEOUT_S, Control, Handover, \
    UpgradeFailed, answers_path, control_path, load_answers, save_answers, start_successor, \
    tell_old, wait_exit
from .ownership import Ownership
from ..records.timefmt import rfc3339
from ..policy import fleet as fleet_rules
from .fleet import Fleet, Lent
from .operator import Operator
from ..records.stream_sessions import StreamSessions
from ..records.incidents import IncidentLog, default_path
from ..records.metrics import Metrics
from ..policy.lifecycle import ChildState
from .own_routes import OwnRoutes, status_line
from .small_tier import SmallTier
from ..policy.balancer import agent_reply
from ..policy import mirror as mirror_rules
from ..policy.mirror import MIRROR, REWARM
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
from . import listen_fds, logs
from ..records.caches import figures
from ..upstreams.launcher import recent_ports_figures

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger("spillway")

# llama-server closes idle keep-alive connections after 5 s; reusing one just as it closes would
# look like a child dying mid-request, so idle upstream connections are dropped a bit sooner.
UPSTREAM_KEEPALIVE_S = 4.0
# An upgrade's old daemon, once it stops accepting: the moment given to the connections it has
# just accepted to have their requests read, before it drains what is in flight and exits.
HANDOVER_SETTLE_S = 0.5
# An upgrade's new daemon: how long its adopted children may take to answer before it serves.
ADOPTION_WAIT_S = 30.0



# --- settings from the config: one function each, used at start and on every reload -----------



def media_marker() -> str:
    """One media marker for every child: the environment's, else one drawn now, as random as
    llama-server's own (it keeps a prompt's text from posing as media)."""
    return os.environ.get(MEDIA_MARKER_ENV) or f"<__media_{secrets.token_hex(16)}__>"


def _mirror_settings(config: Config) -> MirrorSettings:
    cpu = config.child(config.cpu_child)
    return MirrorSettings(enabled=cpu.mirror and not cpu.on_demand, share=cpu.mirror_share,
                          max_prompt_tokens=cpu.mirror_max_prompt_tokens,
                          max_queued_bytes=cpu.mirror_max_queued_bytes)


def _rewarm_settings(config: Config) -> MirrorSettings:
    """The warm GPU child after its restart: the queue's bounds and the share of its time are
    the mirror's defaults; a conversation is sent where its prefill there pays."""
    return MirrorSettings(enabled=config.child(config.gpu_child).rewarm,
                          min_saved_s=mirror_rules.REWARM_MIN_SAVED_S)


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
                        stream_hold_s=f.stream_hold_s,
                        ping_flags={c.name: c.sse_ping_interval for c in config.children
                                    if c.sse_ping_interval is not None}),
        ProxySettings(max_body_bytes=s.max_body_bytes,
                      max_replay_body_bytes=f.max_replay_body_bytes, replay=f.replay,
                      continue_streams=f.continue_streams, fail_back=f.fail_back,
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
        self.started_wall = time.time()
        self.boot = f"{int(time.time()):x}"
        # The children the last daemon left running, and this one's state file (ownership.py).
        self.ownership = Ownership(config.path)
        # An upgrade in place (handover.py): the handover this daemon was started for, and
        # while it is not done (`_probation`) it starts and ends no process; what it took
        # over (`upgraded_from`); in the old daemon, the new one's pid once it serves.
        self.handover = Handover.from_env()
        self._probation = self.handover is not None
        self.upgraded_from: dict[str, Any] | None = None
        self.handed_to: int | None = None
        # In the old daemon: the child processes the new one adopted (name: pid), let go of
        # at the handover; the others it ends once its own requests are done.
        self.adopted_by_new: dict[str, int] = {}
        self._upgrading = False
        self._held: set[str] = set()  # children kept paused until the handover is done
        self._answers_kept = 0  # Idempotency-Key answers the old daemon handed over
        self._told_old = False  # the new daemon said it serves: the old one lets go
        self.control: Control | None = None  # the control socket (`spillway upgrade`)
        # The marker of a media item in a prompt (/completion's multimodal_data, which /props
        # names `media_marker`): llama-server draws a random one per process, so a client's
        # prompt written for one child would fail on the other, or on the same child after a
        # restart. Every child gets this one (the environment's LLAMA_MEDIA_MARKER if set).
        # Children adopted from the last daemon keep theirs: it stays the marker of them all.
        self.media_marker = os.environ.get(MEDIA_MARKER_ENV) or \
            self.ownership.inherited_marker() or media_marker()
        self.monitor = GpuMonitor(config.monitor.sample_interval_s)
        self.monitor.owners = self._gpu_owners
        # Which cards the GPU child uses: asked by the monitor at every sample.
        self.placement = Placement(config.gpu_settings,
                                   lambda: self._gpu_owners().get(self.config.gpu_child),
                                   lambda: self.monitor.listed)
        self.monitor.chooser = self.placement.choose
        self.children: dict[str, Child] = {}
        self.fleet = Fleet(self.children, set())  # (made again with the children, in run)
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
        self.lending: Lending | None = None  # the GPU lent when idle (single-model mode)
        self.model_lending: ModelLending | None = None  # router mode's, model by model
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
        self.listeners: list[listen_fds.Listener] = []  # the sockets served, passed or bound
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
        if self.mirror is not None:
            out.update(self.mirror.cache_figures())
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

    def _gpu_router_in_flight(self) -> int:
        """Router mode: the GPU router's requests in flight, its models' instances' with its
        own."""
        gpu = self.config.gpu_child
        models = self.models
        return self.children[gpu].load.in_flight + (sum(
            e.upstreams[gpu].load.in_flight for e in models.entries.values()
            if gpu in e.upstreams) if models is not None else 0)

    def _cpu_router_answers(self) -> int:
        """Router mode: the CPU router's answers, every model's and its own."""
        cpu = self.config.cpu_child
        pools = [self.pool, *(self.models.pools() if self.models is not None else [])]
        return sum(p.answers.get(cpu, 0) for p in pools if p is not None)

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
            if self.lending is not None:
                self.lending.tick()  # the GPU child idle for gpu.idle_release_s: lent
                self.lending.observe()
            if self.model_lending is not None:
                self.model_lending.tick()  # router mode: each model's GPU instance
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
        if fleet_rules.gpu_back_after_fatal(free, before, self._freed_bytes(),
                                            short=self.res.gpu_shortage() is not None):
            if self.small_tier is not None and self.small_tier.hold() is not None:
                return  # the small child makes way first; the tier starts the GPU child then
            since = f"; {freed // MIB} MiB freed since it went FATAL" if freed else ""
            where = "the GPU has" if len(rooms) == 1 else f"its {len(rooms)} cards have"
            self.fleet.restart(gpu.name, f"{where} {free // MIB} MiB free again (needs about "
                                         f"{need // MIB} MiB{since})")

    # --- systemd --------------------------------------------------------------------------------

    def can_serve(self) -> bool:
        """A child serving the model is ready, or one can start on demand (stopped, an
        on-demand child); the small child alone is not enough (only some requests go there)."""
        return any(not c.cfg.smaller and (c.state is ChildState.READY or (
            c.cfg.on_demand and c.state is ChildState.STOPPED))
            for c in self.children.values())

    def _maybe_ready(self) -> None:
        if self._probation:
            return  # an upgrade's new daemon: its READY=1 comes with MAINPID=
        if not self.notifier.ready_sent and self.listening and self.can_serve():
            heap.settle()
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
            for lane, settings in ((MIRROR, _mirror_settings), (REWARM, _rewarm_settings)):
                found = self.mirror.lane(lane)
                if found is not None:
                    found.configure(settings(new))
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
                self.fleet.start(cfg.name)
        if changed:
            if self.rollout is None:
                self.rollout = Rollout(self.children, self.fleet.take_command)
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
        # First: systemd's sockets (LISTEN_FDS) are taken, and its variables unset; or, at an
        # upgrade, the old daemon's.
        passed, source = listen_fds.from_systemd(), "systemd"
        if self.handover is not None:
            source = "the old daemon"
            passed = listen_fds.from_fds([fd for fd, _ in self.handover.listen], source)
        # Every passed socket is served, whatever server.listen says: the key rule holds for
        # each, before anything starts.
        unguarded = listen_fds.unguarded(self.config.server, [
            listen_fds.Listener(sock, listen_fds.address_of(sock), source) for sock in passed])
        if unguarded is not None:
            return self._refuse_to_start(unguarded)
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
        # The one owner of the children: every start, stop and hold goes through it.
        self.fleet = Fleet(self.children, self.res.paused)
        # The state file keeps the lent children, for an upgrade's new daemon.
        self.ownership.lent = lambda: {n: lent.to_json() for n, lent in self.fleet.lent.items()}
        self.fleet.on_lent = self.ownership.rewrite
        self.res.starter = self.fleet.start
        await asyncio.to_thread(self.res.read_model)
        self.res.sample()
        self.pool = Pool(self.res, self.children, self.config.queue.max_waiting,
                         self.config.queue.max_wait_s, metrics=self.metrics, boot=self.boot,
                         smaller=[c.name for c in self.config.children if c.smaller])
        self.pool.sick_after = self.config.restart.sick_after_errors
        self.pool.drain_upstream = self.fleet.drain
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
        self.operator = Operator(self.fleet, self.config.gpu_child, self.models)
        if self.models is None:  # single-model mode: a router's instances die on their own
            self.watchdog = StallWatchdog(self.children, self._stall_timeout, self._http,
                                          self.fleet.end_stalled)
            self.mirror = self._make_mirror()
            self.proxy.mirror = self.mirror
            self.lending = Lending(self.fleet, self.pool, lambda: self.config, self.incidents,
                                   self.metrics, CardsView(self.monitor, self.res),
                                   spawn=self._spawn)
        else:
            self.model_lending = ModelLending(self.models, lambda: self.config, self.incidents,
                                              self.metrics)
            # The whole GPU router gives way to another program (its models are lent when
            # idle one by one, above).
            self.lending = Lending(self.fleet, self.pool, lambda: self.config, self.incidents,
                                   self.metrics, CardsView(self.monitor, self.res),
                                   spawn=self._spawn, idle=False,
                                   in_flight=self._gpu_router_in_flight,
                                   answered=self._cpu_router_answers)
        self.small_tier = self._make_small_tier()
        self.routes = routes = OwnRoutes(self, started=self.started, children=self.children,
                           resources=self.res, pool=self.pool, monitor=self.monitor,
                           incidents=self.incidents, metrics=self.metrics, timeline=self.timeline,
                           models=self.models, operator=self.operator, streams=self.streams,
                           offload=self.offload.to_json, caches=self.caches,
                           daemon=self.daemon_json,
                           lending=self.lending.to_json if self.lending is not None else None,
                           lent_models=self.model_lending.to_json
                           if self.model_lending is not None else None,
                           others=self.lending.others_json if self.lending is not None else None)
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
        # The children the last daemon left are adopted (or ended) before a request is
        # accepted; at an upgrade, the old daemon's stored answers taken first, and the
        # adopted children answering before this daemon accepts beside the old one.
        if self.handover is not None:
            self._answers_kept = await load_answers(
                answers_path(self.ownership.state_id, "handover"), self.idempotency)
        adopted = await self._take_over("restart" if self.handover is None else "upgrade")
        if self.handover is not None:
            self._keep_lent(adopted)
            self._hold_for_handover(adopted)
            await self._until_answering(adopted)
        if not await self._listen(passed, source):
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
        if self.handover is None:
            await self._own_everything(adopted)
        else:
            self._spawn(self._take_handover(self.handover, adopted))
        self._maybe_ready()
        await self._stop.wait()
        await self._shutdown()
        return self.exit_code

    async def _own_everything(self, adopted: list[str]) -> None:
        """The children started (those not adopted), changed commands rolled out, the config
        file watched, and the control socket open: at a start, or once a handover is done."""
        assert self.mode is not None
        for name in self.config.order:
            child = self.children[name]
            if child.state is ChildState.STOPPED and (name in adopted or
                                                      self.mode.starts_at_boot(name)):
                self.fleet.start(name)
        self._roll_out_adopted()
        if self.config.path is not None and self.reloader is None:
            self.reloader = Reloader(self.config.path, lambda: self.config, self.apply_config,
                                     self._reload_result, self._reload_started,
                                     check=self._check_served)
            self.reloader.watch()
        if self.ownership.file is not None and self.control is None:
            self.control = Control(control_path(self.ownership.state_id), self._on_control)
            await self.control.start()

    # --- an upgrade in place (handover.py): the old daemon's side -----------------------------

    async def _on_control(self, request: dict[str, Any]) -> dict[str, Any]:
        """A request on the control socket: `upgrade`, `status` or `ping`."""
        if request.get("op") == "ping":
            return {"ok": True, "pid": os.getpid()}
        if request.get("op") == "status" and self.routes is not None:
            # `spillway status` when the config file no longer loads (the address and key are
            # in it): this socket is found by the file's path alone, and only its user or root
            # may ask (handover.Control), as only they may read the key.
            return {"ok": True, "status": self.routes.status()}
        if request.get("op") != "upgrade":
            return {"ok": False, "error": f"no such request: {request.get('op')!r}"}
        why = self._why_no_upgrade(request)
        if why is not None:
            return {"ok": False, "error": why}
        assert self.config.path is not None
        try:
            await asyncio.to_thread(config_module.load, self.config.path)
        except config_module.ConfigError as e:
            return {"ok": False, "error": f"{self.config.path} is not valid: " +
                    "; ".join(str(p) for p in e.problems) + " (nothing changed)"}
        self._upgrading = True
        answers = answers_path(self.ownership.state_id, "handover")
        try:
            saved = await save_answers(answers, self.idempotency)
            timeout = float(request.get("timeout_s") or UPGRADE_TIMEOUT_S)
            answer = await start_successor(self.config.path, self.listeners,
                                           self.config.server.drain_timeout_s, timeout)
        except UpgradeFailed as e:
            log.error("upgrade: %s", e)
            with contextlib.suppress(OSError):
                answers.unlink()
            return {"ok": False, "error": str(e)}
        finally:
            self._upgrading = False
        log.info("upgrade: %d stored answer(s) (Idempotency-Key) handed over", saved)
        adopted = {str(n): int(p) for n, p in (answer.get("adopted") or {}).items()}
        asyncio.get_running_loop().call_soon(self._hand_over, int(answer["pid"]), adopted)
        return {"ok": True, "old_pid": os.getpid(), "pid": answer["pid"], "adopted": adopted,
                "ended": {n: c.pid for n, c in self.children.items()
                          if c.pid is not None and adopted.get(n) != c.pid},
                "listening": answer.get("listening")}

    def _why_no_upgrade(self, request: dict[str, Any]) -> str | None:
        if self.stopping or self.handed_to is not None:
            return "this spillway is stopping"
        if self._probation:
            return "this spillway is itself taking over from another: try again in a moment"
        if self._upgrading:
            return "an upgrade is already in progress"
        if self.config.router:
            return ("router mode: an upgrade in place is not supported yet (its routers' "
                    "models are not handed over); restart spillway instead")
        asked, own = str(request.get("config") or ""), self.config.path or ""
        if os.path.realpath(asked) != os.path.realpath(own):
            return f"this spillway runs {own}, not {asked}"
        return None

    def _hand_over(self, new_pid: int, adopted: dict[str, int]) -> None:
        """The new daemon serves: this one says no more to systemd, lets go of the children
        it adopted, stops accepting, finishes its requests, ends the children it did not adopt
        and exits (`_shutdown`)."""
        self.handed_to = new_pid
        self.adopted_by_new = adopted
        self.notifier.silence()
        log.warning("upgrade: spillway pid %d serves now; this one (pid %d) lets go of the "
                    "children it adopted, stops accepting and finishes its %d request(s) in "
                    "flight (up to %.0f s)", new_pid, os.getpid(),
                    self.proxy.open_requests if self.proxy else 0,
                    self.config.server.drain_timeout_s)
        self._stop.set()

    # --- an upgrade in place: the new daemon's side -----------------------------------------

    def _keep_lent(self, adopted: list[str]) -> None:
        """The children the old daemon had lent (stopped, their card lent to other programs)
        stay so: this daemon does not start them, and they come back as they would have
        there (a request wakes one lent when idle; `resume` one lent by the operator)."""
        for name, raw in self.ownership.lent_before.items():
            if name not in self.children or name in adopted:
                continue  # (running after all: it serves)
            try:
                lent = Lent.carried(raw)
            except ValueError as e:
                log.warning("upgrade: the %s child's lending is not carried over: %s", name, e)
                continue
            self.fleet.lend(name, lent)
            log.warning("upgrade: the %s child stays lent (%s) since %s, as spillway pid %d "
                        "left it", name, lent.why, rfc3339(lent.since),
                        self.handover.from_pid if self.handover else 0)

    def _hold_for_handover(self, adopted: list[str]) -> None:
        """Until the old daemon has exited, no process is started: a child that dies waits
        (its hold), one not adopted stays stopped (paused)."""
        reason = "an upgrade's handover is in progress"
        for name in self.children:
            self.fleet.hold(name, "handover", lambda: reason)
            if name not in adopted and name not in self.res.paused:
                self._held.add(name)
        self.fleet.keep_stopped(self._held)

    async def _until_answering(self, adopted: list[str]) -> None:
        """Until each adopted child has answered its first /health (or failed it)."""
        await asyncio.gather(*(self.children[n].engine.until(
            lambda life: life.state is not ChildState.STARTING, ADOPTION_WAIT_S)
            for n in adopted))

    async def _take_handover(self, handover: Handover, adopted: list[str]) -> None:
        """Serving: tell systemd and the old daemon, wait for the old one's exit, then own
        everything. The old daemon lets go of exactly the processes named here (by pid: the
        ones this daemon holds now) and ends the others."""
        kept = {n: pid for n in adopted
                if (pid := self.children[n].pid) is not None and pid == self.ownership.adopted[n]}
        self.notifier.main_pid(self.status_line())
        self._told_old = True
        tell_old(handover, {"serving": True, "pid": os.getpid(), "adopted": kept,
                            "listening": list(self.listening)})
        self.upgraded_from = {"pid": handover.from_pid, "asked": rfc3339(handover.asked_at),
                              "serving": rfc3339(time.time()), "kept": kept,
                              "took_over": None, "answers_kept": self._answers_kept}
        log.warning("upgrade: serving, with %s adopted; spillway pid %d finishes its requests "
                    "in flight and exits", ", ".join(f"{n} (pid {p})" for n, p in kept.items())
                    or "no child", handover.from_pid)
        if not await wait_exit(handover.from_pid,
                               handover.drain_timeout_s + COMMIT_MARGIN_S):
            log.warning("upgrade: spillway pid %d has not exited %.0f s after its drain "
                        "timeout: going on without it", handover.from_pid, COMMIT_MARGIN_S)
        self._answers_kept += await load_answers(
            answers_path(self.ownership.state_id, "drained"), self.idempotency)
        self.upgraded_from["answers_kept"] = self._answers_kept
        self._probation = False
        for name in self.children:
            self.fleet.unhold(name, "handover")
        self.fleet.let_go(self._held)
        self.ownership.take_writing()
        await self.ownership.end_deferred()
        await self._own_everything(adopted)
        self.upgraded_from["took_over"] = rfc3339(time.time())
        heap.settle()
        log.warning("upgrade: done: this daemon (pid %d) took over from spillway pid %d, "
                    "keeping %s", os.getpid(), handover.from_pid,
                    ", ".join(f"{n} (pid {p})" for n, p in kept.items()) or "no child")
        if self.pool is not None:
            self.pool.dispatch()

    async def _take_over(self, how: str) -> list[str]:
        """The children the last daemon left running: adopted (their start is posted), or
        ended; the names adopted. From now on the state file follows the children."""
        self.ownership.watch(self.children, self.media_marker)
        return await self.ownership.take_over(self.config, self.children, self.incidents,
                                              router=self.config.router, how=how,
                                              adopt=self.fleet.adopt)

    def _roll_out_adopted(self) -> None:
        """Adopted children whose config asks another command now take it, as a reload's
        (one at a time, rollout.py)."""
        changed = self.ownership.changed
        if changed:
            log.info("adopted with another command asked for: %s (restarted with it, as a "
                     "reload would)", ", ".join(changed))
            self.rollout = self.rollout or Rollout(self.children, self.fleet.take_command)
            self.rollout.start(self.config, list(changed))

    def daemon_json(self) -> dict[str, Any]:
        """This daemon: its pid, when it started, and what it took over from the last one."""
        return {"pid": os.getpid(), "started": rfc3339(self.started_wall),
                "upgraded_from_pid": self.handover.from_pid if self.handover else None,
                "upgrade": self.upgraded_from, "handing_over_to": self.handed_to,
                "control_socket": str(self.control.path) if self.control else None,
                **self.ownership.to_json()}

    def _refuse_to_start(self, problem: config_module.Problem) -> int:
        """A passed socket this config cannot serve: said, and nothing started (at an upgrade
        the old daemon is told why, and serves on)."""
        log.error("not started: %s", problem)
        if self.handover is not None:
            tell_old(self.handover, {"serving": False, "error": str(problem)})
        return 1

    def _check_served(self, new: Config) -> list[config_module.Problem]:
        """A reload's new config, against the sockets served now: it may not leave one beyond
        loopback without a key (server.listen itself changes only at a restart)."""
        problem = listen_fds.unguarded(new.server, self.listeners)
        return [problem] if problem is not None else []

    async def _listen(self, passed: list[socket.socket], source: str) -> bool:
        """Serve on every listen address: on the socket passed for it (systemd's, or the old
        daemon's at an upgrade), else on one bound now (listen_fds.py). False when one cannot
        be listened on (said in the log)."""
        assert self._runner is not None
        try:
            self.listeners = listen_fds.open_all(self.config.server.listen, passed, source)
            for listener in self.listeners:
                site = web.SockSite(self._runner, listener.sock, backlog=listen_fds.BACKLOG)
                await site.start()
                self.listening.append(listener.address)
                if listener.how != "bound":
                    log.info("listening on %s: the socket %s passed", listener.address,
                             listener.how)
        except (listen_fds.ListenError, OSError) as e:
            log.error("%s", e if isinstance(e, listen_fds.ListenError) else
                      f"cannot listen: {e}")
            return False
        return True

    def _make_mode(self) -> Mode:
        """Single model or router, from the config at start (a change between them waits
        for a restart: see _defer_restart_keys)."""
        assert self.pool is not None
        if not self.config.router:
            return SingleModel(self.fleet, self.res, self.pool, lambda: self.config,
                               self._http, self._spawn)
        models = RouterModels(self.config, self.children, self.monitor, self.res.paused,
                              self._http, metrics=self.metrics, boot=self.boot,
                              on_change=self._model_changed)
        return RouterMode(models, self.pool, lambda: self.config)

    def mirror_json(self) -> dict[str, Any] | None:
        return self._lane_json(MIRROR)

    def rewarm_json(self) -> dict[str, Any] | None:
        return self._lane_json(REWARM)

    def _lane_json(self, name: str) -> dict[str, Any] | None:
        lane = self.mirror.lane(name) if self.mirror is not None else None
        return lane.to_json() if lane is not None else None

    def _make_mirror(self) -> Mirror:
        """The mirror's two lanes (serving/mirror.py): the warm CPU child, and the GPU child
        warmed again after its restart; their tasks, what they tell each child's expected time
        (the prefixes it holds) and speeds (their timings), and their metrics."""
        upstreams = list(self.children.values())
        cpu, gpu = self.children[self.config.cpu_child], self.children[self.config.gpu_child]
        to_cpu = Lane(self._http, cpu, upstreams, _mirror_settings(self.config), name=MIRROR)
        to_gpu = Lane(self._http, gpu, upstreams, _rewarm_settings(self.config), name=REWARM,
                      any_child=True, keeps=True)
        to_gpu.prefill_s = lambda tokens: self.res.prefill_seconds(gpu.name, tokens)
        mirror = Mirror([to_cpu, to_gpu])
        self.res.warm_tokens = lambda name, work: mirror.warm_tokens(name, work.prefix_keys)
        for lane in mirror.lanes:
            self._wire_lane(lane)
        return mirror

    def _wire_lane(self, lane: Lane) -> None:
        """A lane's timings teach its child's speeds; requests waiting in line are real work
        (for the GPU child on its way back, none is in flight anywhere); its figures are read
        at each scrape."""
        name, pool = lane.target.name, self.pool
        lane.on_timings = lambda timings: self.res.observe_timings(name, timings)
        if pool is not None:
            lane.waiting = lambda: len(pool.line) > 0
        self.metrics.track_mirror(lane.name, lane.counts, lambda: sum(lane.warm.values()),
                                  lambda: lane.budget.used_s(time.monotonic()))
        self._spawn(lane.run())

    def _make_small_tier(self) -> SmallTier | None:
        """The small child's starts and stops beside the GPU child, when there is one."""
        small = self.config.small_child
        if small is None:
            return None
        return SmallTier(self.fleet, self.config.gpu_child, small, lambda: self.config)

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

    async def _close_children(self, grace: float | None,
                              names: list[str] | None = None) -> None:
        """Every child (or those `names`) stopped for good, at once; one that fails to close
        is said, not hidden (the state file would keep naming it)."""
        ended = await self.fleet.close(grace, names)
        for name, outcome in ended.items():
            if outcome is not None:
                log.error("[%s] did not close cleanly: %r", name, outcome)

    async def _shutdown(self) -> None:
        # At an upgrade (this daemon handed over, or a new one stopped before it answered the
        # old one) the children the other daemon has are let go of, not stopped. A new one
        # that answered has those it adopted (the old one has let go of them and ends the
        # others): it stops them, as any stop.
        letting_go = self.handed_to is not None or (self._probation and not self._told_old)
        if letting_go:
            await self._let_go()
        else:
            self.notifier.stopping()
            self.ownership.writing = True  # its last word: no child left
        self.stopping = True  # the balancer's agent says "down" from now on
        if self.reloader is not None:
            self.reloader.stop()
        if self._runner is not None:
            await self._drain(self._runner)
        for task in self._tasks:
            task.cancel()
        if self.rollout is not None:
            await self.rollout.close()
        if self.mode is not None:
            await self.mode.close()
        # A second signal asked for speed: a short grace for the children too.
        grace = 1.0 if self._stop_signals >= 2 else None
        if not letting_go:
            await self._close_children(grace)
            await self.ownership.close()  # no child left: the state file goes
        else:
            await self._close_children(grace, self._not_handed_over())
        if self.control is not None:
            await self.control.close(unlink=not letting_go)
        if self._upstream is not None:
            self._upstream.close()
        if self._session is not None:
            await self._session.close()
        await self.monitor.close()
        if self.agent is not None:
            await self.agent.close()
        log.info("stopped%s", f": spillway pid {self.handed_to} serves on, with the children"
                 if self.handed_to is not None else "")

    async def _drain(self, runner: web.AppRunner) -> None:
        """Stop accepting, then let in-flight requests finish up to the drain timeout; a
        second signal cuts the wait short."""
        for site in list(runner.sites):
            await site.stop()
        if self.handed_to is not None:
            # The connections just accepted have their requests read before the drain looks
            # for requests in flight.
            await asyncio.sleep(HANDOVER_SETTLE_S)
        if self.proxy is not None and self.proxy.open_requests:
            log.info("waiting for %d in-flight request(s), up to %.0f s",
                     self.proxy.open_requests, self.config.server.drain_timeout_s)
            idle = asyncio.create_task(self.proxy.idle.wait())
            second = asyncio.create_task(self._second_signal())
            await asyncio.wait({idle, second}, timeout=self.config.server.drain_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
            idle.cancel()
            second.cancel()
        # Resumable streams still going past the drain end now, and so do their readers.
        self.streams.stop_all(time.time())
        with contextlib.suppress(Exception):
            await runner.cleanup()
        if self.handed_to is not None:  # what it answered meanwhile, for the new daemon
            saved = await save_answers(answers_path(self.ownership.state_id, "drained"),
                                       self.idempotency)
            log.info("upgrade: %d stored answer(s) (Idempotency-Key) handed over after the "
                     "drain", saved)

    def _not_handed_over(self) -> list[str]:
        """The children whose process the other daemon does not have: after a handover, those
        the new daemon did not adopt (by pid: a process this one started since is not the one
        it adopted); before the new daemon answered, none (this one, the old, has them all)."""
        if self.handed_to is None:
            return []
        return [n for n, c in self.children.items()
                if c.pid is None or self.adopted_by_new.get(n) != c.pid]

    async def _let_go(self) -> None:
        """Let go, without a signal, of every child whose process the other daemon has; the
        state file is the other daemon's. The others are this daemon's still: ended after its
        drain (`_shutdown`), never left running unowned."""
        if self.rollout is not None:
            await self.rollout.close()
        await self.ownership.close(keep=True)
        keeping = self._not_handed_over()
        letting = {n: c for n, c in self.children.items() if n not in keeping}
        log.info("let go of the children: %s", ", ".join(
            f"{n} (pid {c.pid})" for n, c in letting.items() if c.pid) or "none running")
        await self.fleet.release(letting)
        running = [f"{n} (pid {self.children[n].pid})" for n in keeping if self.children[n].pid]
        if running:
            log.warning("upgrade: spillway pid %s did not adopt %s: this daemon ends them once "
                        "its requests in flight are done (the new one starts its own then)",
                        self.handed_to, ", ".join(running))

    async def _second_signal(self) -> None:
        while self._stop_signals < 2:
            self._stop.clear()
            await self._stop.wait()
