"""What a source of GPU figures gives Spillway: each card's memory, and each process's own use
of it. NVML is one source (nvml.py), amdgpu's sysfs with the kernel's DRM fdinfo another
(drm.py); the monitor (monitor.py) asks every source it has, in a worker thread, and keeps the
history, the chart and the evidence.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..policy.devices import Card

MIB = 1024 * 1024


class Unavailable(Exception):
    """No figures from this source on this machine (no driver, no such device); the message
    says why, for the status's `gpu_note`."""


@dataclass(frozen=True)
class GpuSample:
    """One card's figures at one moment."""

    monotonic: float
    wall: float
    index: int  # the source's own number for it (NVML's index, the DRM card number)
    name: str
    pci_bus_id: str  # as the kernel writes it: 0000:03:00.0
    uuid: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    process_bytes: dict[int, int] = field(default_factory=dict)  # pid -> bytes on this card
    # `process_bytes` lists every process on the card (NVML's list), not only the asked pids
    # (the DRM fdinfo): a pid missing from it holds nothing there.
    lists_every_process: bool = False
    vendor: str = "nvidia"
    source: str = "nvml"  # where the figures come from, for people
    estimated: bool = False  # the totals are not the driver's own "used" (Intel)
    memory: str = "vram"  # "vram", or "vram+gtt" for an APU whose model lives in GTT

    @property
    def card(self) -> Card:
        return Card(self.vendor, self.pci_bus_id, self.uuid, self.name)

    @property
    def label(self) -> str:
        return f"{self.pci_bus_id} {self.name}"

    def to_json(self, now: float,
                owners: Mapping[str, Collection[int] | None]) -> dict[str, Any]:
        return {
            "vendor": self.vendor,
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
            "source": self.source,
            "estimated": self.estimated,
            "memory": self.memory,
            "children_used_bytes": {
                name: None if pids is None else sum(self.process_bytes.get(p, 0) for p in pids)
                for name, pids in owners.items()
            },
            "age_s": round(max(0.0, now - self.monotonic), 3),
        }


class Sampler(Protocol):
    """Some cards' figures. Every method may block (a driver call, a file read): the monitor
    calls them in a worker thread, one at a time."""

    def open(self) -> None:
        """Find the cards; Unavailable when there are no figures to be had."""
        ...

    def sample(self, monotonic: float, wall: float, pids: Collection[int]) -> list[GpuSample]:
        """Each card's figures now (taken at the times given); `pids` are the processes
        whose own use matters (the children's), for sources that must look per process."""
        ...

    def close(self) -> None: ...
