"""What a source of GPU figures gives Spillway: one device's memory, and each process's own use
of it. NVML is one source (nvml.py); the monitor (monitor.py) asks whichever it was given, in a
worker thread, and keeps the history, the chart and the evidence. A source for another vendor
(amdgpu's sysfs, the kernel's DRM fdinfo) is another class with these three methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

MIB = 1024 * 1024


class Unavailable(Exception):
    """No figures from this source on this machine (no driver, no such device); the message
    says why, for the status's `gpu_note`."""


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


class Sampler(Protocol):
    """One device's figures. Every method may block (a driver call): the monitor calls them
    in a worker thread, one at a time."""

    @property
    def index(self) -> int:
        """The device's index as its driver numbers it (CUDA's under PCI_BUS_ID order)."""
        ...

    def open(self) -> None:
        """Find the device; Unavailable when there are no figures to be had."""
        ...

    def sample(self, monotonic: float, wall: float) -> GpuSample:
        """The device's figures now (taken at the times given)."""
        ...

    def close(self) -> None: ...
