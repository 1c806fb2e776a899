"""The GPU monitor: one device's figures, sampled on an interval in a worker thread from a
sampler (sampler.py; NVML by default, nvml.py), kept for the rest of Spillway.

Without figures (no driver, no such device) the monitor says why in `note` and samples nothing;
nothing else changes. The samples feed the status, the VRAM headroom rule of admission, the
evidence of a GPU child's death and the status page's chart (the last minutes, history.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..policy.evidence import VramSample
from .history import GpuHistory, MemoryPoint
from .nvml import NvmlSampler
from .sampler import MIB, GpuSample, Sampler, Unavailable

log = logging.getLogger("spillway.gpu")

# Who is on the card: child name -> the pids that are its own (a router's instances count as
# the router's), or None while it has no process. Asked on the event loop at each sample.
Owners = Callable[[], Mapping[str, Iterable[int] | None]]


class GpuMonitor:
    """Samples one device, chosen by index, PCI bus id or UUID (`gpu.device`)."""

    def __init__(self, device: str | None, interval_s: float,
                 sampler: Sampler | None = None) -> None:
        self.device = device if device is not None else "0"
        self.interval_s = interval_s
        self.sampler: Sampler = sampler or NvmlSampler(self.device)
        self.latest: GpuSample | None = None
        # A short history, so the evidence of a death is the sample from just *before* it (after
        # the death the child's own memory is free again and the figure says nothing).
        self.history: deque[GpuSample] = deque(maxlen=64)
        # The last minutes of memory figures, each child's own among them, for the status page.
        self.chart = GpuHistory()
        self.owners: Owners = lambda: {}  # set by the daemon once the children exist
        self.note: str | None = "GPU monitor not started"
        self.available = False
        self._task: asyncio.Task[None] | None = None

    def configure(self, interval_s: float) -> None:
        """A reload: the new sampling interval (the device stays: gpu.device needs a
        restart)."""
        self.interval_s = interval_s

    def _open(self) -> None:
        try:
            self.sampler.open()
        except Unavailable as e:
            self.note = str(e)
            return
        self.available = True
        self.note = None

    @property
    def index(self) -> int | None:
        """The watched device's index (the CUDA index under PCI_BUS_ID order)."""
        return self.sampler.index if self.available else None

    async def start(self) -> None:
        await asyncio.to_thread(self._open)
        if not self.available:
            log.info("%s", self.note)
            return
        await self.sample_now()
        if self.latest is not None:
            log.info("watching GPU %d %s (%s): %d MiB free of %d MiB", self.latest.index,
                     self.latest.name, self.latest.pci_bus_id,
                     self.latest.free_bytes // MIB, self.latest.total_bytes // MIB)
        self._task = asyncio.create_task(self._run(), name="gpu-monitor")

    async def sample_now(self) -> GpuSample | None:
        if not self.available:
            return None
        try:
            sample = await asyncio.to_thread(self.sampler.sample, time.monotonic(), time.time())
            self.latest = sample
            self.history.append(sample)
            self.chart.add(self._point(sample))
            self.note = None
        except Exception as e:  # noqa: BLE001 - a lost GPU must not take the daemon down
            self.note = f"GPU sampling failed: {e}"
            log.warning("%s", self.note)
        return self.latest

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sample_now()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.available:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.sampler.close)

    def _point(self, s: GpuSample) -> MemoryPoint:
        """The sample as a chart point, each owner's processes summed under its name (read
        now, at the sample: pids change when a child restarts)."""
        children = {name: None if pids is None else
                    sum(s.process_bytes.get(pid, 0) for pid in pids)
                    for name, pids in self.owners().items()}
        return MemoryPoint(monotonic=s.monotonic, wall=s.wall, total_bytes=s.total_bytes,
                           free_bytes=s.free_bytes, used_bytes=s.used_bytes, children=children)

    def vram_before(self, moment: float) -> VramSample | None:
        """The last sample taken before `moment` (monotonic), as evidence, with its age then."""
        for s in reversed(self.history):
            if s.monotonic <= moment:
                return VramSample(free_mib=s.free_bytes / MIB, total_mib=s.total_bytes / MIB,
                                  age_s=moment - s.monotonic)
        return None

    def to_json(self, child_pids: dict[str, int | None]) -> dict[str, Any] | None:
        if self.latest is None:
            return None
        return self.latest.to_json(time.monotonic(), child_pids)
