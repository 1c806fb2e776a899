"""Spillway's own routes (/spillway/*), the status they report, and systemd's one-line status.

The daemon builds an `OwnRoutes` once its parts exist and hands `table()` to the app. The parts
that never change once wired (the children, the estimates, the waiting line, the GPU monitor,
the records) are given to the constructor; what the daemon itself keeps and changes while it
runs (the config after a reload, a refused reload, the listening addresses, the devices the
GPU child's llama-server lists) is read through `Host`. The routes act only on the GPU child:
the operator's `spillway gpu` actions and the drill's arm. The status page that reads them from
a browser (/spillway/) is served by status_page.py; its chart's history is the GPU monitor's.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from aiohttp import web

from .. import __version__
from ..upstreams.children import Child
from ..config.schema import Config
from .drill_window import Arm, DrillWindow, read_arm
from ..gpu import MIB, GpuMonitor
from ..records.incidents import IncidentLog
from ..records.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..records.metrics import Metrics
from .operator import ACTIONS, Operator
from ..records.stream_sessions import StreamSessions
from ..serving.pool import Pool
from ..policy.balancer import MachineHealth
from ..policy.evidence import FailureKind
from ..policy.lifecycle import ChildState
from ..proxy import errors
from ..proxy.app import OwnRoute, json_response
from ..proxy.bodies import OWN_ROUTE_BYTES, BodyTimeout, BodyTooLarge, BodyUnreadable, \
    parse_json, read_body, refusal
from ..proxy.identity import request_id_of
from ..serving.resources import Resources
from ..router.models import RouterModels
from .status_page import StatusPage
from . import memory_debug

# The header the drill shows its token in (drill_window.py).
DRILL_HEADER = "X-Spillway-Drill"


class Host(Protocol):
    """What the routes read from the daemon itself (each may change while it runs)."""

    @property
    def config(self) -> Config: ...

    @property
    def config_error(self) -> str | None: ...  # the last refused reload's problems

    @property
    def restart_notes(self) -> Sequence[str]: ...  # changes that wait for a daemon restart

    def rollout_json(self) -> dict[str, Any] | None: ...  # the last reload's new commands

    def mirror_json(self) -> dict[str, Any] | None: ...  # the warm CPU child, if any

    def rewarm_json(self) -> dict[str, Any] | None: ...  # the GPU child after its restart

    @property
    def listening(self) -> Sequence[str]: ...

    @property
    def gpu_devices(self) -> Sequence[str]: ...  # as the GPU child's llama-server lists them

    @property
    def devices_listed(self) -> bool: ...  # whether that listing is done

    def sample_metrics(self) -> None: ...  # bring the gauges up to date


def status_line(children: Mapping[str, Child], waiting: int, recent: Sequence[dict[str, Any]],
                config_error: str | None) -> str:
    """systemd's STATUS=: one line."""
    parts = [f"{n} {c.state}" for n, c in children.items()]
    line = ", ".join(parts) + f"; {waiting} waiting"
    if recent:
        last = recent[-1]
        line += (f"; last incident: {last['kind']} on {last['child']}, {last['decision']} "
                 f"at {last['time']}")
    if config_error:
        line += "; config reload refused (see status)"
    return line


def why_gpu_fatal(child: Child, fatal_retry_max_s: float, need_bytes: int) -> str:
    last = child.last_exit
    cause = ("cannot load (out of memory)" if last is not None and
             last.kind is FailureKind.LOAD_OOM else
             f"lost its GPU ({last.evidence})" if last is not None and
             last.kind is FailureKind.GPU_FAULT else
             f"failed {child.quick_failures} times in a row" +
             (f" (last: {last.kind}: {last.evidence})" if last is not None else ""))
    return (f"the GPU child {cause}; serving from the CPU child. It is tried again in "
            f"{child.next_try_in_s() or 0:.0f} s (the wait doubles up to "
            f"restart.fatal_retry_max_s = {fatal_retry_max_s:.0f} s), "
            f"at once when the card's memory is freed and it has about "
            f"{need_bytes // MIB} MiB free, or on `spillway gpu restart`")


def why_cpu_fatal(child: Child, label: str = "CPU child") -> str:
    return (f"the {label} failed {child.quick_failures} times in a "
            f"row ({child.reason}); it is tried again in "
            f"{child.next_try_in_s() or 0:.0f} s (the wait doubles up to "
            "restart.fatal_retry_max_s)")


def process_figures() -> dict[str, Any]:
    """The daemon's own figures a long run watches (bench/soak.py): its asyncio tasks (RSS,
    fds and threads are the kernel's, in /proc)."""
    try:
        tasks: int | None = len(asyncio.all_tasks())
    except RuntimeError:  # no running loop (a status built outside the daemon's loop)
        tasks = None
    return {"asyncio_tasks": tasks}


class OwnRoutes:
    def __init__(self, host: Host, *, started: float, children: Mapping[str, Child],
                 resources: Resources, pool: Pool, monitor: GpuMonitor, incidents: IncidentLog,
                 metrics: Metrics, timeline: Iterable[dict[str, Any]], operator: Operator,
                 models: RouterModels | None = None,
                 streams: StreamSessions | None = None,
                 drill: DrillWindow | None = None,
                 offload: Callable[[], dict[str, Any] | None] | None = None,
                 lending: Callable[[], dict[str, Any] | None] | None = None,
                 lent_models: Callable[[], dict[str, Any] | None] | None = None,
                 others: Callable[[], dict[str, Any] | None] | None = None,
                 caches: Callable[[], dict[str, dict[str, Any]]] | None = None,
                 daemon: Callable[[], dict[str, Any]] | None = None) -> None:
        self.host = host
        self.models = models  # router mode: every model on both routers
        self.started = started  # time.monotonic() when the daemon began
        self.children = children
        self.res = resources
        self.pool = pool
        self.monitor = monitor
        self.incidents = incidents
        self.metrics = metrics
        self.timeline = timeline  # child state changes with wall-clock times, for the drill
        self.operator = operator
        self.streams = streams  # resumable streams' replay buffers
        self.drill = drill or DrillWindow()  # arming answers only while a drill runs
        self.offload = offload  # how much of the GPU child is on the GPU (the daemon's)
        self.lending = lending  # the GPU lent to other programs: why, since when (None: not)
        self.lent_models = lent_models  # router mode: the models whose GPU instance is lent
        self.others = others  # other programs' memory on the GPU child's cards (lending.py)
        self.caches = caches  # what the daemon keeps in memory, with each one's bounds
        self.daemon = daemon  # the daemon's pid, start, and what it took over (an upgrade)

    def table(self) -> dict[tuple[str, str], OwnRoute]:
        """(method, path) -> handler, for `build_app`."""
        routes: dict[tuple[str, str], OwnRoute] = {
            ("GET", "/spillway/health"): self.health,
            ("GET", "/spillway/ready"): self.ready,
            ("GET", "/spillway/status"): self.status_route,
            ("GET", "/spillway/incidents"): self.incidents_route,
            ("GET", "/spillway/metrics"): self.metrics_route,
            ("GET", "/spillway/timeline"): self.timeline_route,
            ("GET", "/spillway/gpu/history"): self.gpu_history_route,
            ("POST", "/spillway/drill/start"): self.drill_start,
            ("POST", "/spillway/drill/arm"): self.drill_arm,
            ("POST", "/spillway/drill/end"): self.drill_end,
        }
        for action in ACTIONS:
            routes[("POST", f"/spillway/gpu/{action}")] = self._gpu_action(action)
        routes.update(StatusPage.load().routes())  # the page at /spillway/ (status_page.py)
        routes.update(memory_debug.routes_from_env())  # SPILLWAY_DEBUG_MEMORY=1 only
        return routes

    # --- the status -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        children = {name: self._child_status(name, child)
                    for name, child in self.children.items()}
        ready = [n for n, c in self.children.items() if c.state is ChildState.READY]
        config = self.host.config
        serving = bool(ready) or any(self._startable(c.name) for c in config.children)
        return {
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "daemon": self.daemon() if self.daemon is not None else None,
            "listen": list(self.host.listening),
            "serving": serving,
            "why_not_serving": None if serving else (
                "no child is ready: " + "; ".join(
                    f"{n} is {c.state} ({c.reason})" for n, c in self.children.items())),
            "children": children,
            "gpu": self.monitor.to_json(self.monitor.owners()),
            "gpu_note": self.monitor.note or (None if self.monitor.selection.pci_bus_ids
                                              else self.monitor.selection.why),
            "gpu_child_on_cpu": (not self.host.gpu_devices) if self.host.devices_listed
            else None,
            "waiting": len(self.pool.line),
            "waiting_requests": self.pool.waiting(),
            "queue": {"max_waiting": config.queue.max_waiting,
                      "max_wait_s": config.queue.max_wait_s,
                      "service_s": self.res.service and round(self.res.service, 3)},
            "incidents": {"path": str(self.incidents.path), "written": self.incidents.written,
                          "error": self.incidents.error,
                          "last": list(self.incidents.recent)[-5:]},
            "config": {"path": config.path, "error": self.host.config_error,
                       "restart_needed": list(self.host.restart_notes),
                       "rollout": self.host.rollout_json()},
            "router": self.models is not None,
            "models": self.models.listing() if self.models is not None else None,
            # Router mode: each model's smaller model on the GPU router (small.models).
            "smaller_models": dict(self.host.config.smaller_models),
            "streams": self.streams.summary() if self.streams is not None else None,
            # The warm CPU child: its mirrored prefixes, the budget used (serving/mirror.py).
            "mirror": self.host.mirror_json(),
            # The GPU child warmed again after its restart: the same figures (the rewarm lane).
            "rewarm": self.host.rewarm_json(),
            "drill": self.drill.to_json(),
            "process": process_figures(),
            # name -> {entries, bytes, max_entries, max_bytes, max_age_s} (records/caches.py)
            "caches": self.caches() if self.caches is not None else {},
        }

    def _startable(self, name: str) -> bool:
        """An on-demand child, stopped (and not paused): it starts when a request needs it."""
        return (self.host.config.child(name).on_demand and name not in self.pool.paused
                and self.children[name].state is ChildState.STOPPED)

    @property
    def _gpu(self) -> Child:
        """The child given the GPU: the drill's and the operator's."""
        return self.children[self.host.config.gpu_child]

    def machine_health(self) -> MachineHealth:
        """What a load balancer is told (policy/balancer.py): is the GPU side serving, can the
        rest, and how much of the GPU's capacity is free (router mode: over the models loaded
        on the GPU router)."""
        gpu = self._gpu
        rest = [c for n, c in self.children.items() if n != gpu.name]
        if self.models is None:
            slots, busy = self.res.cap(gpu.name), self.pool.busy(gpu.name)
        else:
            loaded = [e for e in self.models.entries.values()
                      if e.upstreams[gpu.name].is_ready]
            slots = sum(e.resources.cap(gpu.name) for e in loaded)
            busy = sum(e.pool.busy(gpu.name) for e in loaded)
        rest_serving = any(c.is_ready or self._startable(c.name) for c in rest)
        status = None if any(c.is_ready for c in self.children.values()) else self.status()
        return MachineHealth(
            gpu_serving=gpu.is_ready and not self.operator.gpu_paused,
            cpu_serving=rest_serving, gpu_slots=slots, gpu_busy=busy,
            why_not=(status or {}).get("why_not_serving") or "")

    def _child_status(self, name: str, child: Child) -> dict[str, Any]:
        info = child.to_json()
        info.update(self.res.to_json(name, self.pool.busy(name)))
        fatal = child.state is ChildState.FATAL
        cfg = self.host.config.child(name)
        if cfg.on_gpu:
            devices = list(self.host.gpu_devices)
            info["devices"] = devices
            info["runs_on"] = (devices[0] if devices else
                               "CPU: this llama-server lists no GPU device "
                               f"(--list-devices), so the {cfg.label} runs CPU-only")
            info["paused"] = name in self.pool.paused
            lent = self.lending() if self.lending is not None else None
            if lent is not None:
                info["lent"] = lent  # service/lending.py
            others = self.others() if self.others is not None else None
            if others is not None:
                info["others_on_cards"] = others  # service/lending.py
            models_lent = self.lent_models() if self.lent_models is not None else None
            if models_lent is not None:
                info["lent_models"] = models_lent  # service/model_lending.py
            told = self.offload() if self.offload is not None else None
            if told is not None:
                info["offload"] = told  # {state, layers, why}: policy/offload.py
            if fatal:
                info["why"] = why_gpu_fatal(child, self.host.config.restart.fatal_retry_max_s,
                                            self.res.gpu_need_bytes())
        elif cfg.smaller:
            devices = list(self.host.gpu_devices)
            info["runs_on"] = devices[0] if devices else "CPU"  # the GPU child's cards
            info["mode"] = cfg.mode
            info["smaller_model"] = Path(cfg.model_path).name
            info["requests"] = cfg.requests
        else:
            info["runs_on"] = "CPU"
            info["mode"] = cfg.mode
            if fatal:
                info["why"] = why_cpu_fatal(child, cfg.label)
        if self.models is not None:
            info["models"] = self.models.to_json(name)
        return info

    # --- the routes -------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.StreamResponse:
        return json_response({"status": "ok", "version": __version__})

    async def ready(self, request: web.Request) -> web.StreamResponse:
        status = self.status()
        body = {"ready": status["serving"], "why_not": status["why_not_serving"],
                "children": {name: str(c.state) for name, c in self.children.items()}}
        return json_response(body, 200 if status["serving"] else 503)

    async def status_route(self, request: web.Request) -> web.StreamResponse:
        return json_response(self.status())

    async def incidents_route(self, request: web.Request) -> web.StreamResponse:
        try:
            limit = max(0, min(10_000, int(request.query.get("limit", "50"))))
        except ValueError:
            limit = 50
        records = await asyncio.to_thread(self.incidents.read, limit)
        return json_response({"incidents": records, "path": str(self.incidents.path),
                              "error": self.incidents.error})

    async def metrics_route(self, request: web.Request) -> web.StreamResponse:
        self.host.sample_metrics()
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def timeline_route(self, request: web.Request) -> web.StreamResponse:
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            since = 0.0
        events = [e for e in self.timeline if e["time"] >= since]
        now = {name: str(c.state) for name, c in self.children.items()}
        return json_response({"events": events, "now": now, "time": time.time()})

    async def gpu_history_route(self, request: web.Request) -> web.StreamResponse:
        """The GPU's memory over the last minutes (the status page's chart): the points taken
        after `since` (wall-clock seconds, as `time` in the answer)."""
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            since = 0.0
        chart = self.monitor.chart
        points = chart.since(since, now=time.monotonic())
        return json_response({"time": time.time(), "span_s": chart.span_s,
                              "step_s": chart.step_s, "note": self.monitor.note,
                              "points": [p.to_json() for p in points]})

    # --- the drill: its window, and the arm -------------------------------------------------

    async def drill_start(self, request: web.Request) -> web.StreamResponse:
        """`spillway drill` begins: its token, which every arm and the end must show."""
        token = self.drill.open()
        if token is None:
            return errors.json_error(409, "invalid_request_error",
                                     "a drill is already running: wait for it to end (or "
                                     f"for {self.drill.idle_s:.0f} s without an arm)",
                                     request_id_of(request), drill=self.drill.to_json())
        return json_response({"drill": token, "idle_timeout_s": self.drill.idle_s})

    async def drill_end(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._drill_refusal(request)) is not None:
            return refused
        self.disarm_all()
        self.drill.close()
        return json_response({"ended": True})

    def tick(self) -> None:
        """On the daemon's clock: a drill that went silent is over, and disarmed."""
        if self.drill.expired():
            self.disarm_all()

    def disarm_all(self) -> None:
        self._gpu.arm(None)
        for entry in (self.models.entries.values() if self.models is not None else ()):
            entry.upstreams[self._gpu.name].arm(None)

    def _drill_refusal(self, request: web.Request) -> web.StreamResponse | None:
        """None when the request carries the running drill's token."""
        if self.drill.admits(request.headers.get(DRILL_HEADER)):
            return None
        if not self.drill.running:
            return errors.json_error(409, "invalid_request_error",
                                     "no drill is running: arming kills the GPU child, so it "
                                     "answers only inside `spillway drill`",
                                     request_id_of(request))
        return errors.json_error(403, "permission_error",
                                 f"a drill is running, and this request does not carry its "
                                 f"token ({DRILL_HEADER})", request_id_of(request))

    async def drill_arm(self, request: web.Request) -> web.StreamResponse:
        """The drill without a GPU: SIGABRT to the GPU child as its next task launches, or
        at once (`"now": true`, for a death in the middle of an answer). Only inside a drill."""
        if (refused := self._drill_refusal(request)) is not None:
            return refused
        rid = request_id_of(request)
        timeout_s = self.host.config.server.body_timeout_s
        try:
            raw = await read_body(request, OWN_ROUTE_BYTES, timeout_s)
            # No body at all is the plain arm; anything else must be a well-formed one.
            arm = read_arm(parse_json(raw) if raw else {})
        except (BodyTimeout, BodyTooLarge, BodyUnreadable) as e:
            return refusal(e, rid, timeout_s)
        except ValueError as e:
            arm = f"the body must be a JSON object: {e}"
        if isinstance(arm, str):
            return errors.invalid_request(400, f"nothing armed: {arm}", rid, param="body")
        if arm.model is not None:
            return self._arm_model(arm, rid)
        if arm.now:
            # In the middle of an answer (scenario 7): at once, not at the next task.
            sent = self._gpu.signal_now(signal.SIGABRT)
            return json_response({"sent": sent, "child": self._gpu.name, "signal": "SIGABRT"},
                                 200 if sent else 409)
        self._gpu.arm(None if arm.disarm else signal.SIGABRT)
        return json_response({"armed": not arm.disarm, "child": self._gpu.name,
                              "signal": "SIGABRT"})

    def _arm_model(self, arm: Arm, rid: str) -> web.StreamResponse:
        """Router mode: the model's instance on the GPU router, not the router itself."""
        entry = self.models.find(arm.model) if self.models is not None and arm.model else None
        if entry is None:
            return errors.json_error(404, "not_found_error",
                                     f"no model {arm.model!r} on the routers", rid)
        gpu = entry.upstreams[self._gpu.name]
        if arm.now:
            sent = gpu.signal_now(signal.SIGABRT)
            return json_response({"sent": sent, "child": gpu.name, "model": entry.name,
                                  "signal": "SIGABRT"}, 200 if sent else 409)
        gpu.arm(None if arm.disarm else signal.SIGABRT,
                on_neighbour_load=arm.when == "neighbour_load")
        return json_response({"armed": not arm.disarm, "child": gpu.name, "model": entry.name,
                              "signal": "SIGABRT", "when": arm.when})

    def _gpu_action(self, action: str) -> OwnRoute:
        async def act(request: web.Request) -> web.StreamResponse:
            message = await self.operator.act(action)
            return json_response({"action": action, "message": message,
                                  "gpu": self._gpu.to_json()})
        return act
