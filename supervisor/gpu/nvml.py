"""GPU figures from NVML (NVIDIA's management library): the only module that imports pynvml.

Every NVIDIA card of the machine is sampled; which of them the GPU child uses is decided by
the PCI address (policy/devices.py), never by NVML's index. Without a driver
(`NVMLError_LibraryNotFound`, `NVMLError_DriverNotLoaded`, ...) `open` says so.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ..policy.devices import normalize_pci
from .sampler import GpuSample, Unavailable


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSampler:
    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []

    def open(self) -> None:
        try:
            import pynvml
        except ImportError as e:  # nvidia-ml-py is a dependency; an odd install still runs
            raise Unavailable(f"no NVIDIA figures: pynvml cannot be imported ({e})") from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise Unavailable(f"no NVIDIA GPU: NVML says {_text(e)!r} (no NVIDIA driver on "
                              "this machine?)") from e
        try:
            count = int(pynvml.nvmlDeviceGetCount())
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except pynvml.NVMLError as e:
            raise Unavailable(f"no NVIDIA GPU: NVML lists none ({_text(e)})") from e
        if not self._handles:
            raise Unavailable("no NVIDIA GPU: NVML lists none")
        self._nvml = pynvml

    def sample(self, monotonic: float, wall: float, pids: Collection[int]) -> list[GpuSample]:
        return [self._one(i, h, monotonic, wall) for i, h in enumerate(self._handles)]

    def _one(self, index: int, h: Any, monotonic: float, wall: float) -> GpuSample:
        nv = self._nvml
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        processes: dict[int, int] = {}
        listed = True
        try:
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory
                processes[int(p.pid)] = int(used) if used is not None else 0
        except nv.NVMLError:
            listed = False  # per-process figures are not available everywhere (MIG, ...)
        bus_id = _text(nv.nvmlDeviceGetPciInfo(h).busId)
        return GpuSample(
            monotonic=monotonic,
            wall=wall,
            index=index,
            name=_text(nv.nvmlDeviceGetName(h)),
            pci_bus_id=normalize_pci(bus_id) or bus_id.lower(),
            uuid=_text(nv.nvmlDeviceGetUUID(h)),
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            used_bytes=int(mem.used),
            process_bytes=processes,
            lists_every_process=listed,
        )

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
