"""GPU figures from NVML (NVIDIA's management library): the only module that imports pynvml.

Without a driver (`NVMLError_LibraryNotFound`, `NVMLError_DriverNotLoaded`, ...) `open` says so
and the monitor samples nothing. The device is chosen by index, PCI bus id or UUID
(`gpu.device`).
"""

from __future__ import annotations

from typing import Any

from .sampler import GpuSample, Unavailable


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSampler:
    def __init__(self, device: str) -> None:
        self.device = device
        self.index = -1
        self._nvml: Any = None
        self._handle: Any = None

    def open(self) -> None:
        try:
            import pynvml
        except ImportError as e:  # nvidia-ml-py is a dependency; an odd install still runs
            raise Unavailable(f"no GPU figures: pynvml cannot be imported ({e})") from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise Unavailable(f"no GPU: NVML says {_text(e)!r} (no NVIDIA driver on this "
                              "machine?)") from e
        try:
            self._handle, self.index = self._find_device(pynvml)
        except (pynvml.NVMLError, ValueError) as e:
            raise Unavailable(f"no GPU: device {self.device!r} not found ({_text(e)})") from e
        self._nvml = pynvml

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

    def sample(self, monotonic: float, wall: float) -> GpuSample:
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
            monotonic=monotonic,
            wall=wall,
            index=self.index,
            name=_text(nv.nvmlDeviceGetName(h)),
            pci_bus_id=_text(nv.nvmlDeviceGetPciInfo(h).busId),
            uuid=_text(nv.nvmlDeviceGetUUID(h)),
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            used_bytes=int(mem.used),
            process_bytes=processes,
        )

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
