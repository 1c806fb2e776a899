"""What differs between single-model mode and router mode, in one object built once.

Single-model mode: each child serves the one model; the model's figures (slots, context,
speeds) are the pool's, read from each child's /props when it is READY; an on-demand CPU child
is started for a request and stopped when idle.

Router mode: each child is a llama-server router; every model has its own two upstreams and its
own pool (router/models.py); the VRAM is held by the models' instances; an on-demand CPU router
always runs, and its models are unloaded when idle.

The daemon asks its mode and never which mode it is in (issue 22: the daemon was the hub of
13 mode branches).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import aiohttp

from ..upstreams.children import Child
from ..config.schema import Config
from ..policy.lifecycle import ChildState
from ..serving.pool import Pool
from ..serving.pools import Pools
from ..serving.resources import Resources
from ..policy import fleet as fleet_rules
from ..router.models import RouterModels
from .fleet import Fleet

Spawn = Callable[[Coroutine[Any, Any, None], bool], None]  # (a task, dispatch after it)


class Mode(Protocol):
    @property
    def models(self) -> RouterModels | None: ...

    def pools(self) -> Pools: ...

    def instance_pids(self, role: str) -> list[int]:
        """Processes besides the child's own that hold its role's memory."""
        ...

    def child_ready(self, child: Child) -> None: ...

    def tick(self) -> None:
        """On the daemon's interval, after the samples: what the mode does with them."""
        ...

    def starts_at_boot(self, role: str) -> bool: ...

    def configure(self, new: Config) -> None: ...

    async def close(self) -> None: ...


class SingleModel:
    models: RouterModels | None = None

    def __init__(self, fleet: Fleet, resources: Resources, pool: Pool,
                 config: Callable[[], Config], session: Callable[[], aiohttp.ClientSession],
                 spawn: Spawn) -> None:
        self.fleet = fleet  # the one owner of the children: it stops an idle one
        self.children = fleet.children
        self.res = resources
        self.pool = pool
        self.config = config  # the running config (a reload replaces it)
        self.session = session
        self.spawn = spawn

    def pools(self) -> Pools:
        return Pools(self.pool)

    def instance_pids(self, role: str) -> list[int]:
        return []

    def child_ready(self, child: Child) -> None:
        # The model's slots, context and speeds, from the child's /props; then the line moves.
        self.spawn(self.res.fetch_profile(self.session(), child.name), True)

    def tick(self) -> None:
        """An on-demand child idle for its idle_stop_s is stopped."""
        now = time.monotonic()
        for cfg in self.config().children:
            child = self.children[cfg.name]
            idle = now - self.pool.last_used[cfg.name]
            if fleet_rules.idle_stop(cfg.on_demand, child.state, child.load.in_flight, idle,
                                     cfg.idle_stop_s):
                self.fleet.stop(cfg.name, f"on-demand: idle for {idle:.0f} s")

    def starts_at_boot(self, role: str) -> bool:
        return not self.config().child(role).on_demand

    def configure(self, new: Config) -> None:
        pass  # the pool and the resources take theirs themselves

    async def close(self) -> None:
        pass


class RouterMode:
    def __init__(self, models: RouterModels, pool: Pool, config: Callable[[], Config]) -> None:
        self._models = models
        self.pool = pool  # the routers' own: requests that name no model
        self.config = config

    @property
    def models(self) -> RouterModels | None:
        return self._models

    def pools(self) -> Pools:
        return Pools(self.pool, self.find_model, self._models.pools, self._models.listed)

    def find_model(self, name: str) -> tuple[str, Pool] | None:
        entry = self._models.find(name)
        return (entry.name, entry.pool) if entry is not None else None

    def instance_pids(self, role: str) -> list[int]:
        """The models' instances hold the VRAM: they count as the router's own."""
        return [pid for e in self._models.entries.values()
                if (pid := e.upstreams[role].pid) is not None]

    def child_ready(self, child: Child) -> None:
        pass  # a router has no model of its own: each model's figures are its own pool's

    def tick(self) -> None:
        self._models.sample()
        self._unload_idle_cpu_models()
        self._models.dispatch()

    def _unload_idle_cpu_models(self) -> None:
        """An on-demand router: a model idle on it for its idle_stop_s is unloaded (the router
        itself keeps running: without models it costs little)."""
        now = time.monotonic()
        for cfg in self.config().children:
            if not cfg.on_demand:
                continue
            for entry in self._models.entries.values():
                upstream = entry.upstreams[cfg.name]
                idle = now - entry.pool.last_used[cfg.name]
                if upstream.state is ChildState.READY and upstream.load.in_flight == 0 \
                        and idle >= cfg.idle_stop_s:
                    upstream.unload(f"on-demand: idle for {idle:.0f} s")

    def starts_at_boot(self, role: str) -> bool:
        return True  # a CPU router always runs: its models load on demand

    def configure(self, new: Config) -> None:
        self._models.configure(new)

    async def close(self) -> None:
        await self._models.close()
