"""GPU memory figures from NVML: the only module that imports pynvml.

NVML calls block, so sampling runs in a worker thread on an interval. Without a driver
(`NVMLError_LibraryNotFound`, `NVMLError_DriverNotLoaded`, ...) the monitor says so in `note` and
samples nothing; nothing else changes. The samples feed the status, the VRAM headroom rule of
admission, the evidence of a GPU child's death and the status page's chart (the last minutes,
kept here: gpu_history.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .gpu_history import GpuHistory, MemoryPoint
from .policy.evidence import VramSample

log = logging.getLogger("spillway.gpu")

MIB = 1024 * 1024

# Who is on the card: child name -> the pids that are its own (a router's instances count as
# the router's), or None while it has no process. Asked on the event loop at each sample.
Owners = Callable[[], Mapping[str, Iterable[int] | None]]


@dataclass(frozen=True)
class GpuSample:
    monotonic: float
    wall: float
    index: int
    name: str
    pci_bus_id: str
    uuid: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    process_bytes: dict[int, int] = field(default_factory=dict)  # pid -> bytes on this device

    def to_json(self, now: float, child_pids: dict[str, int | None]) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "pci_bus_id": self.pci_bus_id,
            "uuid": self.uuid,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "used_bytes": self.used_bytes,
            "total_mib": round(self.total_bytes / MIB),
            "free_mib": round(self.free_bytes / MIB),
            "used_mib": round(self.used_bytes / MIB),
            "children_used_bytes": {
                name: self.process_bytes.get(pid, 0) if pid is not None else None
                for name, pid in child_pids.items()
            },
            "age_s": round(max(0.0, now - self.monotonic), 3),
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuMonitor:
    """Samples one device, chosen by index, PCI bus id or UUID (`gpu.device`)."""

    def __init__(self, device: str | None, interval_s: float) -> None:
        self.device = device if device is not None else "0"
        self.interval_s = interval_s
        self.latest: GpuSample | None = None
        # A short history, so the evidence of a death is the sample from just *before* it (after
        # the death the child's own memory is free again and the figure says nothing).
        self.history: deque[GpuSample] = deque(maxlen=64)
        # The last minutes of memory figures, each child's own among them, for the status page.
        self.chart = GpuHistory()
        self.owners: Owners = lambda: {}  # set by the daemon once the children exist
        self.note: str | None = "GPU monitor not started"
        self._nvml: Any = None
        self._handle: Any = None
        self._index: int = -1
        self._task: asyncio.Task[None] | None = None

    # --- worker thread --------------------------------------------------------------------------


    def configure(self, interval_s: float) -> None:
        """A reload: the new sampling interval (the device stays: gpu.device needs a
        restart)."""
        self.interval_s = interval_s

    def _init(self) -> None:
        try:
            import pynvml
        except ImportError as e:  # nvidia-ml-py is a dependency; an odd install still runs
            self.note = f"no GPU figures: pynvml cannot be imported ({e})"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self.note = f"no GPU: NVML says {_text(e)!r} (no NVIDIA driver on this machine?)"
            return
        try:
            self._handle, self._index = self._find_device(pynvml)
        except (pynvml.NVMLError, ValueError) as e:
            self.note = f"no GPU: device {self.device!r} not found ({_text(e)})"
            return
        self._nvml = pynvml
        self.note = None

    def _find_device(self, pynvml: Any) -> tuple[Any, int]:
        d = self.device.strip()
        if d.isdigit():
            index = int(d)
            return pynvml.nvmlDeviceGetHandleByIndex(index), index
        if d.upper().startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(d.encode())
        else:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(d.encode())
        return handle, int(pynvml.nvmlDeviceGetIndex(handle))

    def _sample(self) -> GpuSample:
        nv = self._nvml
        h = self._handle
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        processes: dict[int, int] = {}
        try:
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory
                processes[int(p.pid)] = int(used) if used is not None else 0
        except nv.NVMLError:
            pass  # per-process figures are not available everywhere (MIG, containers)
        return GpuSample(
            monotonic=time.monotonic(),
            wall=time.time(),
            index=self._index,
            name=_text(nv.nvmlDeviceGetName(h)),
            pci_bus_id=_text(nv.nvmlDeviceGetPciInfo(h).busId),
            uuid=_text(nv.nvmlDeviceGetUUID(h)),
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            used_bytes=int(mem.used),
            process_bytes=processes,
        )

    # --- event loop side ------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._nvml is not None

    @property
    def index(self) -> int | None:
        """The NVML index of the watched device (the CUDA index under PCI_BUS_ID order)."""
        return self._index if self.available else None

    async def start(self) -> None:
        await asyncio.to_thread(self._init)
        if not self.available:
            log.info("%s", self.note)
            return
        await self.sample_now()
        if self.latest is not None:
            log.info("watching GPU %d %s (%s): %d MiB free of %d MiB", self._index,
                     self.latest.name, self.latest.pci_bus_id,
                     self.latest.free_bytes // MIB, self.latest.total_bytes // MIB)
        self._task = asyncio.create_task(self._run(), name="gpu-monitor")

    async def sample_now(self) -> GpuSample | None:
        if not self.available:
            return None
        try:
            sample = await asyncio.to_thread(self._sample)
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
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._nvml is not None:
            try:
                await asyncio.to_thread(self._nvml.nvmlShutdown)
            except Exception:  # noqa: BLE001
                pass

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
