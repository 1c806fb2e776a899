"""One model's capacity, for admission: the pool's CapacitySource over its two upstreams.

The figures are Resources' (resources.py) with the model's own file, `/props?model=M` and
instance, and one rule more: a model that is not loaded may be loaded on demand only when the
load would fit. On the GPU router that is the article's scenario prevented: a second model whose
weights and KV cache (from its GGUF metadata, or the most it was seen using) plus the headroom do
not fit the free VRAM of every card the GPU router uses is not loaded there; its work goes to
the CPU router or waits. Without figures for any card the VRAM check is skipped, as the
headroom rule is in single-model mode. A router's `--models-max` is kept too: at the limit, an
idle loaded model is unloaded first (the least recently used); when all are busy, nothing more
is loaded there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from ..config.schema import SMALL_CHILD, Config
from ..gpu import MIB, GpuMonitor
from ..policy.admission import ChildView
from ..policy.estimate import Work
from ..policy.lifecycle import ChildState
from ..serving.resources import Resources
from .upstream import ModelUpstream

log = logging.getLogger("spillway.router")

EVICT_WAIT_S = 30.0


def models_max(config: Config, child: str) -> int:
    """The router's --models-max (0: no limit)."""
    return config.child(child).models_max


class ModelResources(Resources):
    def __init__(self, config: Config, upstreams: Mapping[str, ModelUpstream],
                 monitor: GpuMonitor, model: str,
                 neighbours: Callable[[str], Sequence[ModelUpstream]],
                 smaller: ModelResources | None = None) -> None:
        self.model = model
        self.upstreams = upstreams
        # The other models' upstreams on the same router (for --models-max).
        self.neighbours = neighbours
        self.path = ""
        # Its smaller model's figures (small.models), read for the pool's `small` upstream:
        # that model's instance on the GPU router.
        self.smaller = smaller
        super().__init__(config, upstreams, monitor)
        for name, upstream in upstreams.items():
            upstream.load_guard = functools.partial(self.load_refusal, name)

    # --- the smaller model's upstream: its own figures, on the GPU router ----------------------

    def _smaller(self, name: str) -> ModelResources | None:
        return self.smaller if name == SMALL_CHILD else None

    def child_view(self, name: str, busy: int, work: Work,
                   with_estimate: bool = True) -> ChildView:
        smaller = self._smaller(name)
        if smaller is None:
            return super().child_view(name, busy, work, with_estimate)
        view = smaller.child_view(self.config.gpu_child, busy, work,
                                  with_estimate)
        return dataclasses.replace(view, name=name, smaller=True,
                                   label=f"{smaller.model} on the GPU router")

    def ctx_per_slot(self, name: str) -> int | None:
        smaller = self._smaller(name)
        return super().ctx_per_slot(name) if smaller is None else \
            smaller.ctx_per_slot(self.config.gpu_child)

    def expected_seconds(self, name: str, work: Work) -> float | None:
        smaller = self._smaller(name)
        return super().expected_seconds(name, work) if smaller is None else \
            smaller.expected_seconds(self.config.gpu_child, work)

    def observe_timings(self, name: str, timings: Mapping[str, Any],
                        media_items: int = 0) -> None:
        smaller = self._smaller(name)
        if smaller is None:
            super().observe_timings(name, timings, media_items)
        else:
            smaller.observe_timings(self.config.gpu_child, timings, media_items)

    async def wait_ready(self, name: str, within_s: float) -> float | None:
        smaller = self._smaller(name)
        return await (super().wait_ready(name, within_s) if smaller is None else
                      smaller.wait_ready(self.config.gpu_child, within_s))

    def model_path(self) -> str:
        return self.path

    def props_path(self) -> str:
        return f"/props?model={quote(self.model, safe='')}"

    # --- may it be loaded now? -------------------------------------------------------------------

    def load_refusal(self, name: str) -> str | None:
        """Why loading the model on `name` now would not fit, or None."""
        if name in self.paused:
            return f"the {name} child is paused"
        if self.config.child(name).on_gpu:
            short = self._vram_short()
            if short is not None:
                return short
        elif not self.cpu_ram_ok(cold=True):
            return (f"not enough free RAM (needs about {self.cpu_need_bytes() // MIB} MiB, "
                    f"{(self.ram_available or 0) // MIB} MiB available)")
        limit = models_max(self.config, name)
        if limit and self._running_elsewhere(name) >= limit and self._idle_victim(name) is None:
            return f"the {name} router has its --models-max ({limit}) models loaded, all busy"
        return None

    def _vram_short(self) -> str | None:
        short = self.gpu_shortage()
        if short is None:
            return None  # it fits on every card, or there are no figures: no check
        room, part = short
        on = f" on {room.label}" if len(self.monitor.rooms()) > 1 else ""
        return (f"loading it needs about {part / MIB:.0f} MiB of VRAM{on} (weights, KV cache, "
                f"headroom); {room.free_bytes / MIB:.0f} MiB free")

    def _running_elsewhere(self, name: str) -> int:
        return sum(1 for u in self.neighbours(name)
                   if u.model != self.model and u.state in
                   (ChildState.STARTING, ChildState.READY, ChildState.DRAINING,
                    ChildState.STOPPING))

    def _idle_victim(self, name: str) -> ModelUpstream | None:
        idle = [u for u in self.neighbours(name)
                if u.model != self.model and u.state is ChildState.READY
                and u.load.in_flight == 0]
        return min(idle, key=lambda u: u.loaded_at or 0.0) if idle else None

    def startable(self, name: str, state: ChildState) -> tuple[bool, bool]:
        ram_ok = self.config.child(name).on_gpu or self.cpu_ram_ok(
            cold=state not in (ChildState.READY, ChildState.STARTING))
        if state is not ChildState.STOPPED:
            return False, ram_ok
        return self.load_refusal(name) is None, ram_ok

    def start_child(self, name: str) -> None:
        """Load the model on `name`; at the router's --models-max, unload an idle model
        first and load when it is gone."""
        smaller = self._smaller(name)
        if smaller is not None:
            smaller.start_child(self.config.gpu_child)
            return
        upstream = self.upstreams[name]
        limit = models_max(self.config, name)
        victim = self._idle_victim(name) if limit and \
            self._running_elsewhere(name) >= limit else None
        if victim is None:
            upstream.start()
            return
        victim.unload(f"--models-max ({limit}) reached: making room for {self.model}")
        asyncio.get_running_loop().create_task(self._start_after(victim, upstream))

    async def _start_after(self, victim: ModelUpstream, upstream: ModelUpstream) -> None:
        began = time.monotonic()
        await victim.wait_state(ChildState.STOPPED, ChildState.EXITED, ChildState.BACKOFF,
                                timeout=EVICT_WAIT_S)
        log.info("[%s:%s] unloaded in %.2f s to make room for %s", victim.name, victim.model,
                 time.monotonic() - began, self.model)
        upstream.start()

    def to_json(self, name: str, busy: int) -> dict[str, Any]:
        out = super().to_json(name, busy)
        out.update(self.upstreams[name].to_json())
        if self.config.child(name).on_gpu:
            out["vram_needs_bytes_to_load"] = self.gpu_need_bytes()
        out["file"] = self.path or None
        return out
