"""Every model the routers serve: its two upstreams (one on each router), its capacity and its
pool. A model gets its entry the first time a router names it (its listing, an event, a spawn
line), and keeps it: the pool of a model that was removed from the folder just finds both
upstreams not loaded.

Each model has a pool of its own, because its capacity is its own: an instance has its own
slots, context and failures, and a request for `qwen` must not wait behind requests for `gemma`
that only `gemma`'s slots can serve. The roles stay the two of single-model mode: a request for
M that fails on the GPU router is replayed on the CPU router for M.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from ..upstreams.children import Child
from ..config.schema import Config
from ..gpu import GpuMonitor
from ..records.caches import figures
from ..records.metrics import Metrics
from ..policy.lifecycle import ChildState
from ..config.schema import SMALL_CHILD
from ..serving.pool import Pool
from ..vocabulary import Upstream
from .capacity import ModelResources
from .smaller import SmallerModel
from .upstream import ModelUpstream
from .watch import RouterWatch

log = logging.getLogger("spillway.router")

# The longest a request naming a model waits for a router's first listing (its GET /models is
# given 10 s; past that, the request goes on as naming no known model, as before).
LISTING_WAIT_S = 10.0


@dataclass
class ModelEntry:
    name: str
    upstreams: dict[str, ModelUpstream]
    resources: ModelResources
    pool: Pool


ModelListener = Callable[[ModelUpstream, ChildState, ChildState, str], None]


class RouterModels:
    def __init__(self, config: Config, children: Mapping[str, Child], monitor: GpuMonitor,
                 paused: set[str], session: Callable[[], aiohttp.ClientSession], *,
                 metrics: Metrics | None = None, boot: str = "",
                 on_change: ModelListener | None = None) -> None:
        self.config = config
        self.children = children
        self.monitor = monitor
        self.paused = paused  # the operator's (shared with the routers' own pool)
        self.session = session
        self.metrics = metrics
        self.boot = boot
        self.on_change = on_change
        self.entries: dict[str, ModelEntry] = {}
        self.aliases: dict[str, str] = {}
        self.watches = {name: RouterWatch(child, functools.partial(self.upstream, name), session,
                                          on_loaded=self._loaded,
                                          neighbours=functools.partial(self.neighbours, name))
                        for name, child in children.items()}
        self._tasks: set[asyncio.Task[None]] = set()

    def find(self, name: str | None) -> ModelEntry | None:
        """The entry of a model named by a request (its name or an alias), if known."""
        if name is None:
            return None
        entry = self.entries.get(name)
        if entry is None and name in self.aliases:
            entry = self.entries.get(self.aliases[name])
        return entry

    def upstream(self, child: str, model: str) -> ModelUpstream:
        return self.entry(model).upstreams[child]

    def entry(self, model: str) -> ModelEntry:
        found = self.entries.get(model)
        if found is not None:
            return found
        cfg = self.config
        upstreams = {
            name: ModelUpstream(
                child, model, self.watches[name],
                vram_probe=self.monitor.vram_before if cfg.child(name).on_gpu else None,
                vram_short_mib=max(256.0, float(cfg.gpu_settings.vram_headroom_mib)),
                drain_timeout_s=cfg.failover.drain_timeout_s)
            for name, child in self.children.items()}
        # Its smaller model (small.models), on the GPU router: the pool's third upstream.
        smaller = cfg.smaller_models.get(model)
        smaller_entry = self.entry(smaller) if smaller is not None else None
        resources = ModelResources(cfg, upstreams, self.monitor, model, self.neighbours,
                                   smaller_entry.resources if smaller_entry else None)
        resources.paused = self.paused
        members: dict[str, Upstream] = dict(upstreams)
        if smaller_entry is not None:
            members = {cfg.gpu_child: upstreams[cfg.gpu_child],
                       SMALL_CHILD: SmallerModel(smaller_entry.upstreams[cfg.gpu_child],
                                                 SMALL_CHILD),
                       **{n: u for n, u in upstreams.items() if n != cfg.gpu_child}}
        pool = Pool(resources, members, cfg.queue.max_waiting, cfg.queue.max_wait_s,
                    metrics=self.metrics, boot=f"{self.boot}-{model}",
                    smaller=[SMALL_CHILD] if smaller_entry is not None else [])
        pool.sick_after = cfg.restart.sick_after_errors
        pool.wait_for_gpu = cfg.failover.wait_for_gpu
        for name, upstream in upstreams.items():
            upstream.listeners.append(self._changed)
            if self.metrics is not None:
                self.metrics.set_model_state(name, model, upstream.state)  # 0s, not absent
        entry = self.entries[model] = ModelEntry(model, upstreams, resources, pool)
        log.info("model %s: served by both routers%s", model,
                 f"; its smaller model {smaller} on the GPU router" if smaller else "")
        return entry

    def cache_figures(self) -> dict[str, dict[str, Any]]:
        """For the status's caches: the models (and aliases) the routers have listed, and
        their instances' output lines kept (STDERR_TAIL_LINES per model and router)."""
        lines = [u.cache_figures() for e in self.entries.values() for u in e.upstreams.values()]
        return {"router_models": figures(len(self.entries) + len(self.aliases)),
                "router_model_output": figures(sum(f["entries"] for f in lines),
                                               max_entries=sum(f["max_entries"] for f in lines),
                                               size=sum(f["bytes"] for f in lines))}

    def configure(self, config: Config) -> None:
        """A reload: the new limits for every model's pool and figures."""
        self.config = config
        for entry in self.entries.values():
            entry.resources.configure(config)
            entry.pool.configure(config)
            for upstream in entry.upstreams.values():
                upstream.drain_timeout_s = config.failover.drain_timeout_s

    def neighbours(self, child: str) -> list[ModelUpstream]:
        """Every model's upstream on one router."""
        return [e.upstreams[child] for e in self.entries.values()]

    def pools(self) -> list[Pool]:
        return [e.pool for e in self.entries.values()]

    def _changed(self, upstream: ModelUpstream, old: ChildState, new: ChildState,
                 reason: str) -> None:
        if self.on_change is not None:
            self.on_change(upstream, old, new, reason)

    def _loaded(self, upstream: ModelUpstream) -> None:
        """A model became READY on a router: learn its file (once), its slots and context."""
        entry = self.entry(upstream.model)
        info = upstream.info
        for alias in info.aliases if info is not None else ():
            self.aliases.setdefault(alias, entry.name)
        self._spawn(self._learn(entry, upstream))

    async def _learn(self, entry: ModelEntry, upstream: ModelUpstream) -> None:
        res = entry.resources
        if not res.path:
            path = self._path_of(entry.name)
            if path:
                res.path = path
                await asyncio.to_thread(res.read_model)
        await res.fetch_profile(self.session(), upstream.name)
        entry.pool.dispatch()

    def _path_of(self, model: str) -> str | None:
        for entry in (self.entries[model].upstreams[n].info for n in self.children):
            if entry is not None and entry.path:
                return entry.path
        return None

    def sample(self) -> None:
        for entry in self.entries.values():
            entry.resources.sample()
        self._keep_smaller_loaded()

    def _keep_smaller_loaded(self) -> None:
        """The smaller models (small.models) stay loaded on the GPU router, as a resident small
        child: loaded once the router lists them, and again whenever they are not (an eviction,
        a death after its back-off), when they fit."""
        gpu = self.config.gpu_child
        if self.children[gpu].state is not ChildState.READY or gpu in self.paused:
            return
        for smaller in set(self.config.smaller_models.values()):
            if smaller not in self.watches[gpu].listed:
                continue  # not in the router's listing (yet): nothing to load
            entry = self.entry(smaller)
            if entry.upstreams[gpu].state is ChildState.STOPPED and \
                    entry.resources.load_refusal(gpu) is None:
                log.info("[%s:%s] loading it: the smaller model of %s", gpu, smaller,
                         ", ".join(m for m, s in self.config.smaller_models.items()
                                   if s == smaller))
                entry.resources.start_child(gpu)

    def dispatch(self) -> None:
        for entry in self.entries.values():
            entry.pool.dispatch()

    async def listed(self, timeout: float = LISTING_WAIT_S) -> None:
        """Until every router that is ready has listed its models since it became ready (at
        most `timeout`): a request for a model sent as Spillway became ready went to the
        routers' own pool as naming no known model, and the GPU router, which loads only what
        Spillway asks, answered 400 `model is not loaded`."""
        pending = [w.listed_since_ready.wait() for w in self.watches.values()
                   if not w.listed_since_ready.is_set()]
        if pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*pending), timeout)

    def listing(self) -> list[str]:
        """The models in the routers' own order (the GPU router's first)."""
        names: list[str] = []
        for watch in self.watches.values():
            names += [n for n in watch.listed if n not in names]
        names += [n for n in self.entries if n not in names]
        return names

    def to_json(self, child: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.listing():
            entry = self.entries.get(name)
            if entry is not None:
                out[name] = entry.resources.to_json(child, entry.pool.busy(child))
        return out

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for watch in self.watches.values():
            await watch.close()
        for entry in self.entries.values():
            for upstream in entry.upstreams.values():
                await upstream.close()
