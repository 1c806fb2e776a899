"""The GPU monitor: every card's figures, sampled on an interval in a worker thread from the
sources there are (NVML for NVIDIA, nvml.py; amdgpu's sysfs and the DRM fdinfo for AMD and
Intel, drm.py), and which of them the GPU child uses (placement.py), kept for the rest of
Spillway.

Without figures (no driver, no card) the monitor says why in `note` and samples nothing;
nothing else changes. The samples feed the status, the VRAM headroom rule of admission (on
every card the GPU child uses), the evidence of a GPU child's death and the status page's chart
(the last minutes, history.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..records.caches import figures
from ..policy import release
from ..policy.devices import Listed, Room, Selection, tightest
from ..policy.evidence import VramSample
from .drm import DrmSampler
from .history import GpuHistory, MemoryPoint
from .nvml import NvmlSampler
from .sampler import MIB, GpuSample, Sampler, Unavailable

log = logging.getLogger("spillway.gpu")

# Who is on the cards: child name -> the pids that are its own (a router's instances count as
# the router's), or None while it has no process. Asked on the event loop at each sample.
Owners = Callable[[], Mapping[str, Iterable[int] | None]]
# Which cards the GPU child uses, given every card's latest figures (placement.py).
Chooser = Callable[[Sequence[GpuSample]], Selection]


def _every_card(samples: Sequence[GpuSample]) -> Selection:
    return Selection(tuple(s.pci_bus_id for s in samples), "config", "every card")


class GpuMonitor:
    def __init__(self, interval_s: float, samplers: Sequence[Sampler] | None = None) -> None:
        self.interval_s = interval_s
        # The GPU child's llama-server's own listing (--list-devices), once the daemon has it:
        # Intel's totals come from it.
        self.listed: list[Listed] = []
        self.samplers: list[Sampler] = list(samplers) if samplers is not None else [
            NvmlSampler(), DrmSampler(listed=lambda: self.listed)]
        self._open: list[Sampler] = []
        self.devices: list[GpuSample] = []  # the latest figures of every card, in PCI order
        self.selection = Selection((), "none", "not sampled yet")
        self._mine: list[GpuSample] = []  # kept with the sample: asked on every request
        self._tightest: GpuSample | None = None
        self._rooms: list[Room] = []
        self.chooser: Chooser = _every_card  # set by the daemon once it knows the child
        # A short history, so the evidence of a death is the sample from just *before* it
        # (after the death the child's own memory is free again and the figure says nothing).
        self.history: deque[tuple[GpuSample, ...]] = deque(maxlen=64)
        # The last minutes of memory figures, each child's own among them, for the status page.
        self.chart = GpuHistory()
        self.owners: Owners = lambda: {}  # set by the daemon once the children exist
        self.note: str | None = "GPU monitor not started"
        self.available = False
        self._task: asyncio.Task[None] | None = None
        # One sampling at a time: the interval's, and one asked for now (`cards_now`).
        self._sampling = asyncio.Lock()

    def cache_figures(self) -> dict[str, dict[str, Any]]:
        """For the status's caches: the samples kept for a death's evidence (a fixed count),
        and the status page's chart (a count and an age)."""
        return {"gpu_samples": figures(len(self.history), max_entries=self.history.maxlen),
                "gpu_chart": figures(len(self.chart), max_entries=self.chart.max_points,
                                     max_age_s=self.chart.span_s)}

    def configure(self, interval_s: float) -> None:
        """A reload: the new sampling interval (the cards stay: gpu.device needs a
        restart)."""
        self.interval_s = interval_s

    def _open_all(self) -> None:
        notes = []
        for sampler in self.samplers:
            try:
                sampler.open()
            except Unavailable as e:
                notes.append(str(e))
                continue
            self._open.append(sampler)
        self.available = bool(self._open)
        self.note = None if self.available else "; ".join(notes) or "no GPU source"

    # --- what the rest of Spillway reads ------------------------------------------------------

    @property
    def child_devices(self) -> list[GpuSample]:
        """The latest figures of the cards the GPU child uses."""
        return self._mine

    @property
    def latest(self) -> GpuSample | None:
        """The tightest card the GPU child uses (the least free): where its headroom runs
        out first."""
        return self._tightest

    @property
    def index(self) -> int | None:
        latest = self.latest
        return latest.index if latest is not None else None

    def rooms(self) -> list[Room]:
        """Each of the GPU child's cards' free memory (kept from the last sample: admission
        asks on every request)."""
        return self._rooms

    def _keep(self, samples: list[GpuSample], selection: Selection) -> None:
        chosen = set(selection.pci_bus_ids)
        self.devices = samples
        self.selection = selection
        self._mine = [s for s in samples if s.pci_bus_id in chosen]
        self._tightest = min(self._mine, key=lambda s: s.free_bytes) if self._mine else None
        self._rooms = [Room(s.pci_bus_id, s.label, s.free_bytes, s.total_bytes)
                       for s in self._mine]

    def sampled_at(self) -> float | None:
        return self.devices[0].monotonic if self.devices else None

    # --- sampling ---------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self._open_all)
        if not self.available:
            log.info("%s", self.note)
            return
        await self.sample_now()
        for s in self.devices:
            log.info("GPU %s %s (%s, %s): %d MiB free of %d MiB", s.pci_bus_id, s.name,
                     s.vendor, s.source, s.free_bytes // MIB, s.total_bytes // MIB)
        self._task = asyncio.create_task(self._run(), name="gpu-monitor")

    async def sample_now(self) -> GpuSample | None:
        if not self.available:
            return None
        owners = self.owners()
        pids = {pid for group in owners.values() if group is not None for pid in group}
        try:
            async with self._sampling:
                samples = await asyncio.to_thread(self._sample_all, time.monotonic(),
                                                  time.time(), pids)
        except Exception as e:  # noqa: BLE001 - a lost GPU must not take the daemon down
            self.note = f"GPU sampling failed: {e}"
            log.warning("%s", self.note)
            return self.latest
        self._keep(samples, self.chooser(samples))
        self.history.append(tuple(samples))
        if samples:
            self.chart.add(self._point(samples, owners))
        self.note = None
        return self.latest

    def _sample_all(self, monotonic: float, wall: float, pids: set[int]) -> list[GpuSample]:
        samples: list[GpuSample] = []
        for sampler in self._open:
            samples += sampler.sample(monotonic, wall, pids)
        return sorted(samples, key=lambda s: s.pci_bus_id)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sample_now()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sampler in self._open:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(sampler.close)

    def _point(self, samples: Sequence[GpuSample],
               owners: Mapping[str, Iterable[int] | None]) -> MemoryPoint:
        """The cards the child uses as one chart point (summed), each owner's processes summed
        under its name (read now, at the sample: pids change when a child restarts), and each
        card's own use for its line."""
        chosen = set(self.selection.pci_bus_ids)
        mine = [s for s in samples if s.pci_bus_id in chosen] or list(samples)
        groups = {name: None if pids is None else list(pids) for name, pids in owners.items()}
        children = {name: None if pids is None else
                    sum(s.process_bytes.get(pid, 0) for s in mine for pid in pids)
                    for name, pids in groups.items()}
        return MemoryPoint(monotonic=samples[0].monotonic, wall=samples[0].wall,
                           total_bytes=sum(s.total_bytes for s in mine),
                           free_bytes=sum(s.free_bytes for s in mine),
                           used_bytes=sum(s.used_bytes for s in mine), children=children,
                           devices={s.pci_bus_id: s.used_bytes for s in samples})

    # --- a dead GPU child's memory, for the release rule (policy/release.py) ------------------

    async def cards_now(self) -> list[release.Card] | None:
        """The GPU child's cards as the release rule reads them, from a sample taken now;
        None without figures."""
        if not self.available:
            return None
        await self.sample_now()
        if self.note is not None or not self._mine:
            return None  # the sampling failed, or the child's cards are not known
        return [release.Card(s.pci_bus_id, s.free_bytes, dict(s.process_bytes),
                             s.lists_every_process) for s in self._mine]

    def listed_on(self, pid: int) -> frozenset[str]:
        """The cards whose list of every process showed `pid` in the samples kept: where its
        absence from the list later means its memory is free."""
        return frozenset(s.pci_bus_id for samples in self.history for s in samples
                         if s.lists_every_process and s.process_bytes.get(pid, 0) > 0)

    def vram_before(self, moment: float) -> VramSample | None:
        """The tightest of the child's cards in the last sampling before `moment` (monotonic),
        as evidence, with its age then."""
        chosen = set(self.selection.pci_bus_ids)
        for samples in reversed(self.history):
            mine = [s for s in samples if s.pci_bus_id in chosen]
            if not mine or mine[0].monotonic > moment:
                continue
            room = tightest([Room(s.pci_bus_id, s.label, s.free_bytes, s.total_bytes)
                             for s in mine])
            assert room is not None
            return VramSample(free_mib=room.free_bytes / MIB, total_mib=room.total_bytes / MIB,
                              age_s=moment - mine[0].monotonic,
                              device=room.label if len(self.devices) > 1 else "")
        return None

    def to_json(self, owners: Mapping[str, Iterable[int] | None]) -> dict[str, Any] | None:
        """The tightest card the GPU child uses, as before several cards (its fields at the
        top), and every card in `devices`, with which the child uses and how that is known;
        and, where the chooser says, which cards it was given and why (`gpu_child_given`:
        gpu.device's, or every card it can see), so that a card it does not use is told
        apart from one it was never given."""
        latest = self.latest
        if latest is None and not self.devices:
            return None
        now = time.monotonic()
        groups = {name: None if pids is None else list(pids) for name, pids in owners.items()}
        chosen = set(self.selection.pci_bus_ids)
        given = self.selection.given
        out: dict[str, Any] = latest.to_json(now, groups) if latest is not None else {}
        out["devices"] = [{**s.to_json(now, groups), "used_by_gpu_child": s.pci_bus_id in chosen,
                           **({} if given is None else
                              {"given_to_gpu_child": s.pci_bus_id in given})}
                          for s in self.devices]
        out["gpu_child_devices"] = {"pci_bus_ids": list(self.selection.pci_bus_ids),
                                    "how": self.selection.how, "why": self.selection.why}
        if given is not None:
            out["gpu_child_given"] = {"pci_bus_ids": list(given),
                                      "why": self.selection.given_why}
        return out
