"""What is known of each child's capacity, for admission: slots and context per slot (from its
`/props`), measured speeds, the GPU's free memory and the machine's free RAM.

The pool owns one of these (as its CapacitySource): it reads the figures for admission and feeds
in what each closed lease taught (timings of answers, durations of attempts). The daemon's tick
samples RAM and VRAM into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil

from ..config import gguf_meta, llama_args
from ..config.schema import Config
from ..gpu import MIB, GpuMonitor
from ..policy import estimate, media
from ..policy.estimate import Work
from ..policy.media import Modality
from ..policy.devices import Room, short_of, tightest
from ..policy.admission import ChildView
from ..policy.lifecycle import DEAD, ChildState
from ..vocabulary import Upstream

log = logging.getLogger("spillway.resources")

_NOT_STOPPED = tuple(s for s in ChildState if s is not ChildState.STOPPED)
RAM_FLOOR = 256 * MIB  # below this much free RAM, nothing more goes to the CPU child
SERVICE_ALPHA = 0.2


@dataclass
class Profile:
    slots: int | None = None  # from /props total_slots (or -np until then)
    ctx_per_slot: int | None = None  # default_generation_settings.n_ctx
    peak_rss: int = 0  # the most resident memory seen (CPU child)
    peak_vram: int = 0  # the most VRAM seen in use by it (GPU child, from NVML)
    # What its projector takes (/props `modalities`); None until read: taken as able.
    modalities: frozenset[Modality] | None = None


class Resources:
    def __init__(self, config: Config, children: Mapping[str, Upstream],
                 monitor: GpuMonitor) -> None:
        self.config = config
        self.children = children
        self.monitor = monitor
        self.profiles = {name: Profile(slots=self._slots_from_args(name)) for name in children}
        self.throughput = {name: estimate.Throughput() for name in children}
        # Each child's encoder: seconds per image or audio clip, from its own timings.
        self.encode_s: dict[str, float] = {}
        # The GPU child's encoder memory (policy/media.py), from its samples, and who says how
        # many media items it is working on (the pool; wired by the daemon).
        self.encoder_memory = media.EncoderMemory()
        self.media_in_flight: Callable[[str], int] = lambda name: 0
        # The tokens of a request's prefix a child already holds (the warm CPU child's
        # mirrored conversations; wired by the daemon): its prefill is the rest.
        self.warm_tokens: Callable[[str, Work], int] = lambda name, work: 0
        self.service: float | None = None  # seconds per generation request (moving average)
        self.ram_available: int | None = None
        self.model_size = 0
        self.model_shape: gguf_meta.ModelShape | None = None
        # The roles paused (the operator's, an upgrade's): written only by the fleet, the one
        # owner of the children (service/fleet.py), which also takes every start asked here.
        self.paused: set[str] = set()
        self.starter: Callable[[str], None] = _no_fleet
        self._cpu_need = 0  # cached: asked on every admission, changes only with the config
        self.refresh()

    def configure(self, config: Config) -> None:
        """A reload: the new config, and what depends on it."""
        self.config = config
        self.refresh()

    def refresh(self) -> None:
        """Recompute what depends on the config and the model (after a reload, a sample)."""
        self._cpu_need = self._compute_cpu_need()

    def _slots_from_args(self, name: str) -> int | None:
        value = llama_args.flag_value(self.config.child(name).args, "-np")
        return int(value) if value is not None and value.isdigit() and int(value) > 0 else None

    # --- learning ---------------------------------------------------------------------------

    def model_path(self) -> str:
        return self.config.model.path

    def props_path(self) -> str:
        return "/props"

    def read_model(self) -> None:
        """Blocking (reads the file's metadata): call it in a thread."""
        try:
            self.model_size = os.path.getsize(self.model_path())
            self.model_shape = gguf_meta.model_shape(self.model_path())
        except (OSError, gguf_meta.GgufError) as e:
            log.info("model shape unknown (%s): the KV estimate is a guess", e)
        self.refresh()

    async def fetch_profile(self, session: aiohttp.ClientSession, name: str) -> None:
        """Slots and context per slot, as the child reports them once ready."""
        child = self.children[name]
        try:
            async with session.get(f"{child.base_url}{self.props_path()}",
                                   headers={"Authorization": f"Bearer {child.api_key}"},
                                   timeout=aiohttp.ClientTimeout(total=10)) as r:
                props: Any = await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("[%s] /props unreadable: %s", name, e)
            return
        profile = self.profiles[name]
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            profile.slots = int(props.get("total_slots")) or profile.slots
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            profile.ctx_per_slot = int(props["default_generation_settings"]["n_ctx"])
        modalities = media.from_props(props)
        if modalities is not None:
            profile.modalities = modalities
        log.info("[%s] %s slots of %s tokens; admission cap %d; %s", name, profile.slots,
                 profile.ctx_per_slot, self.cap(name), media.takes_words(profile.modalities))

    def observe_timings(self, name: str, timings: Mapping[str, Any],
                        media_items: int = 0) -> None:
        """An answer's timings. With media, its prompt time holds the encoder's runs too: the
        part beyond its tokens at the child's text speed is the encoder's, per item; the text
        speeds are learned from answers without media only."""
        if not media_items:
            self.throughput[name] = estimate.observe(self.throughput[name], timings)
            return
        found = media.encode_sample(timings, self.throughput[name].prompt_tps, media_items)
        if found is not None:
            self.encode_s[name] = media.fold_encode(self.encode_s.get(name), found)

    def observe_duration(self, seconds: float) -> None:
        self.service = seconds if self.service is None else (
            (1 - SERVICE_ALPHA) * self.service + SERVICE_ALPHA * seconds)

    def sample(self) -> None:
        """RAM, and each child's own use (called on the monitor's interval)."""
        self.ram_available = psutil.virtual_memory().available
        cards = self.monitor.child_devices
        for name, child in self.children.items():
            if child.state is not ChildState.READY or child.pid is None:
                continue
            profile = self.profiles[name]
            if not self.config.child(name).uses_gpu:
                with contextlib.suppress(psutil.Error):
                    rss = psutil.Process(child.pid).memory_info().rss
                    profile.peak_rss = max(profile.peak_rss, rss)
            elif cards:
                used = sum(s.process_bytes.get(child.pid, 0) for s in cards)
                profile.peak_vram = max(profile.peak_vram, used)
                if name == self.config.gpu_child:
                    self.encoder_memory = media.observe_memory(
                        self.encoder_memory, used, self.media_in_flight(name))
        self.refresh()

    # --- what the child needs ---------------------------------------------------------------

    def _kv_bytes(self, name: str) -> int:
        shape = self.model_shape
        if shape is None:
            return self.model_size // 4  # a guess: a quarter of the weights
        ctx = llama_args.flag_value(self.config.child(name).args, "-c")
        n_ctx = int(ctx) if ctx is not None and ctx.isdigit() and int(ctx) > 0 \
            else shape.n_ctx_train
        return shape.kv_bytes(n_ctx)

    def _compute_cpu_need(self) -> int:
        name = self.config.cpu_child
        estimate_bytes = self.model_size + self._kv_bytes(name) + 256 * MIB
        return max(self.profiles[name].peak_rss, estimate_bytes)

    def cpu_need_bytes(self) -> int:
        """RAM the CPU child needs to start: what it used before, else the model plus its KV
        cache (and some room for compute buffers)."""
        return self._cpu_need

    def gpu_need_bytes(self) -> int:
        """VRAM the GPU child needs to load: what it used before, else the model plus its KV
        cache; plus the headroom."""
        name = self.config.gpu_child
        estimate_bytes = int(self.model_size * 1.1) + self._kv_bytes(name)
        need = max(self.profiles[name].peak_vram, estimate_bytes)
        return need + self.config.child(name).vram_headroom_mib * MIB

    def cpu_ram_ok(self, cold: bool) -> bool:
        available = self.ram_available
        if available is None:
            return True
        return available >= (self.cpu_need_bytes() if cold else RAM_FLOOR)

    # --- the pool's CapacitySource ----------------------------------------------------------

    def ctx_per_slot(self, name: str) -> int | None:
        return self.profiles[name].ctx_per_slot

    def cap(self, name: str) -> int:
        configured = self.config.child(name).max_concurrency
        return configured or self.profiles[name].slots or 1

    def child_view(self, name: str, busy: int, work: Work,
                   with_estimate: bool = True) -> ChildView:
        """What admission needs of one child; called on every request, so kept cheap (the
        time estimate only when the request has a deadline to weigh it against)."""
        state = self.children[name].state
        startable, ram_ok = self.startable(name, state)
        expected = self.expected_seconds(name, work) if with_estimate else None
        return ChildView(
            name=name, state=state, busy=busy, cap=self.cap(name),
            ctx_per_slot=self.profiles[name].ctx_per_slot, startable=startable, ram_ok=ram_ok,
            expected_s=expected, back_in_s=self.back_in_s(name),
            label=self.config.child(name).label, smaller=self.config.child(name).smaller,
            modalities=self.profiles[name].modalities)

    def modalities(self, name: str) -> frozenset[Modality] | None:
        return self.profiles[name].modalities

    def startable(self, name: str, state: ChildState) -> tuple[bool, bool]:
        """(may be started now, has the RAM it needs): an on-demand child's, without the GPU
        (the GPU child's VRAM is weighed by the headroom rule instead)."""
        cfg = self.config.child(name)
        if cfg.on_gpu:
            return False, True
        if cfg.smaller:
            # On demand, it takes the VRAM the GPU child's death freed: only while the GPU child
            # is down after a death (not while it holds the card or loads into it, nor when it
            # is stopped or paused: its start may come at any moment), and it is drained before
            # the GPU child starts again (service/small_tier.py).
            gpu = self.children[self.config.gpu_child].state
            return (state is ChildState.STOPPED and cfg.on_demand and name not in self.paused
                    and gpu in DEAD), True
        running = state is ChildState.READY or state is ChildState.STARTING
        startable = (state is ChildState.STOPPED and cfg.on_demand
                     and name not in self.paused and self.cpu_ram_ok(cold=True))
        return startable, self.cpu_ram_ok(cold=not running)

    def back_in_s(self, name: str) -> float | None:
        """Seconds until a child whose restart is under way serves again: what is left of its
        back-off, plus its last start time (how long its start takes). None for a ready child,
        or one that is not coming back by itself."""
        child = self.children[name]
        state = child.state
        if name in self.paused or child.last_start_s is None:
            return None
        if state is ChildState.BACKOFF:
            return (child.next_try_in_s() or 0.0) + child.last_start_s
        if state is ChildState.STARTING:
            elapsed = time.monotonic() - child.state_since
            if elapsed > 2 * child.last_start_s + 5:
                return None  # far slower than its last start: no forecast to wait on
            return max(0.0, child.last_start_s - elapsed)
        if state is ChildState.EXITED:
            return child.last_start_s
        return None

    def expected_seconds(self, name: str, work: Work) -> float | None:
        """How long a request would take on the child, from its own reported speeds, and its
        encoder's time for each image or audio clip."""
        warm = min(self.warm_tokens(name, work), work.prompt_tokens)
        text = estimate.expected_seconds(self.throughput[name],
                                         max(1, work.prompt_tokens - warm), work.max_tokens, warm)
        if text is None or not work.media:
            return text
        return text + media.encode_seconds(work.media, self.encode_s.get(name),
                                           self.config.child(name).uses_gpu)

    def prefill_seconds(self, name: str, prompt_tokens: int) -> float | None:
        """The child's prefill of a prompt from its first token, from its own timings."""
        return estimate.prefill_seconds(self.throughput[name], prompt_tokens)

    def _fresh_rooms(self) -> list[Room]:
        """The free memory of each card the GPU child uses; none when the figures are stale
        (say nothing rather than something old) or there are none."""
        taken = self.monitor.sampled_at()
        if taken is None or time.monotonic() - taken > max(10.0, 10 * self.monitor.interval_s):
            return []
        return self.monitor.rooms()

    def vram_free_mib(self) -> float | None:
        """The free memory of the tightest card the GPU child uses: the headroom rule holds on
        every card when it holds there."""
        room = tightest(self._fresh_rooms())
        return None if room is None else room.free_bytes / MIB

    def gpu_shortage(self) -> tuple[Room, int] | None:
        """The first of the GPU child's cards that cannot take its part of the child's need
        and keep the headroom, with that part (layers split by -ts, or by free memory as
        llama.cpp does); None when all can, or without figures."""
        headroom = self.config.child(self.config.gpu_child).vram_headroom_mib * MIB
        return short_of(self._fresh_rooms(), self.gpu_need_bytes() - headroom, headroom,
                        self.monitor.selection.shares)

    def vram_headroom_mib(self) -> float:
        return float(self.config.child(self.config.gpu_child).vram_headroom_mib)

    def media_reserve_mib(self, items: int) -> float:
        """Beyond the headroom: room for `items` media items encoded at once on the GPU."""
        return media.reserve_bytes(self.encoder_memory, items) / MIB

    def service_s(self) -> float | None:
        return self.service

    def start_child(self, name: str) -> None:
        """`name` started, on demand (a request needs it): asked of the fleet."""
        if name not in self.paused:
            self.starter(name)

    async def wait_ready(self, name: str, within_s: float) -> float | None:
        """Seconds until the child, just asked to start, is READY; None when it is not within
        `within_s` (or its start timeout), or when it stops or goes FATAL first: an on-demand
        small child stopped to make way for the GPU child will not be ready at all."""
        child = self.children[name]
        began = time.monotonic()
        limit = max(0.0, min(within_s, child.start_timeout_s))

        async def settled() -> bool:
            # Out of STOPPED first (the start asked for is taken), then READY or given up.
            await child.wait_state(*_NOT_STOPPED)
            await child.wait_state(ChildState.READY, ChildState.STOPPED, ChildState.FATAL)
            return child.state is ChildState.READY

        try:
            ready = await asyncio.wait_for(settled(), limit)
        except TimeoutError:
            return None
        return time.monotonic() - began if ready else None

    def to_json(self, name: str, busy: int) -> dict[str, Any]:
        p = self.profiles[name]
        t = self.throughput[name]
        out: dict[str, Any] = {
            "busy": busy, "cap": self.cap(name), "slots": p.slots,
            "ctx_per_slot": p.ctx_per_slot,
            "modalities": None if p.modalities is None else sorted(p.modalities),
            "encode_s_per_item": self.encode_s.get(name),
            "tokens_per_s": {"prompt": t.prompt_tps and round(t.prompt_tps, 1),
                             "generation": t.gen_tps and round(t.gen_tps, 1)},
        }
        if not self.config.child(name).uses_gpu:
            out["ram"] = {"available_bytes": self.ram_available,
                          "needs_bytes_to_start": self.cpu_need_bytes(),
                          "peak_rss_bytes": p.peak_rss}
        else:
            out["vram_peak_bytes"] = p.peak_vram
        return out


def _no_fleet(name: str) -> None:
    raise RuntimeError(f"no fleet to start the {name} child: Resources.starter is not wired")
