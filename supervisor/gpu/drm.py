"""GPU figures without a vendor library, read the way nvtop and Ollama read them: AMD and Intel
cards from the kernel's sysfs, each process's own use from its DRM fdinfo.

- A card: `/sys/class/drm/cardN/device` (its PCI address is the link's target), `vendor`
  (0x1002 AMD, 0x8086 Intel), and for amdgpu `mem_info_vram_{total,used}` and
  `mem_info_gtt_{total,used}` in bytes. An APU whose VRAM is a small carve-out and whose GTT
  is at least four times as large (Ollama's rule) keeps its model in GTT: its pool is both.
- Intel's kernel drivers give no "used" to an unprivileged reader (i915's and xe's need
  CAP_PERFMON or debugfs), so an Intel card's total and the memory others held come from
  llama-server's own listing (`--list-devices`: `SYCL0: Intel(R) Arc(TM) A770 Graphics (16225
  MiB, 15908 MiB free)`), and the children's own use from their fdinfo: those figures are
  marked as estimates.
- A process's use: the fds of `/proc/PID/fd` that point into `/dev/dri/`, and for each
  `/proc/PID/fdinfo/FD` in the kernel's drm-usage-stats format (`drm-pdev`, `drm-client-id`,
  `drm-total-<region>` or the older `drm-memory-<region>`, in bytes, KiB or MiB). Several fds
  of one client are counted once.

The roots are a seam for tests: SPILLWAY_SYSFS_ROOT and SPILLWAY_PROCFS_ROOT (`/sys`, `/proc`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..policy.devices import AMD, INTEL, PCI_VENDORS, Listed, is_apu, normalize_pci
from .sampler import MIB, GpuSample, Unavailable

_UNITS = {"": 1, "B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}
_VALUE = re.compile(r"^\s*(\d+)\s*([KMG]iB|B)?\s*$")
_CARD = re.compile(r"^card(\d+)$")


def sysfs_root() -> Path:
    return Path(os.environ.get("SPILLWAY_SYSFS_ROOT", "/sys"))


def procfs_root() -> Path:
    return Path(os.environ.get("SPILLWAY_PROCFS_ROOT", "/proc"))


@dataclass(frozen=True)
class FdInfo:
    """One DRM client's memory, from one fdinfo file."""

    pdev: str
    client_id: str
    local_bytes: int  # on the card itself: vram, local0 (i915), vram0 (xe)
    system_bytes: int  # in system memory mapped for the card: gtt, system0


def parse_fdinfo(text: str) -> FdInfo | None:
    """The kernel's drm-usage-stats keys of one fdinfo file; None if it is not a DRM client
    or names no device."""
    keys: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            keys[name.strip()] = value.strip()
    pdev = normalize_pci(keys.get("drm-pdev", ""))
    if pdev is None:
        return None
    totals: dict[str, int] = {}
    legacy: dict[str, int] = {}
    for key, value in keys.items():
        for prefix, into in (("drm-total-", totals), ("drm-memory-", legacy)):
            if key.startswith(prefix):
                amount = _bytes(value)
                if amount is not None:
                    into[key[len(prefix):]] = amount
    regions = {**legacy, **totals}  # drm-total-* where the kernel prints both
    local = sum(n for r, n in regions.items() if r.startswith(("vram", "local")))
    system = sum(n for r, n in regions.items() if r.startswith(("gtt", "system")))
    return FdInfo(pdev, keys.get("drm-client-id", ""), local, system)


def _bytes(value: str) -> int | None:
    m = _VALUE.match(value)
    if m is None:
        return None
    return int(m.group(1)) * _UNITS[m.group(2) or ""]


def process_memory(proc: Path, pids: Collection[int]) -> dict[int, dict[str, FdInfo]]:
    """Each process's DRM clients by card address (summed over its clients on that card);
    a process that is gone or unreadable has none."""
    out: dict[int, dict[str, FdInfo]] = {}
    for pid in pids:
        seen: set[tuple[str, str]] = set()
        cards: dict[str, FdInfo] = {}
        try:
            fds = os.listdir(proc / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if not os.readlink(proc / str(pid) / "fd" / fd).startswith("/dev/dri/"):
                    continue
                info = parse_fdinfo((proc / str(pid) / "fdinfo" / fd).read_text())
            except OSError:
                continue
            if info is None or (info.pdev, info.client_id) in seen:
                continue
            seen.add((info.pdev, info.client_id))
            had = cards.get(info.pdev)
            cards[info.pdev] = info if had is None else FdInfo(
                info.pdev, had.client_id, had.local_bytes + info.local_bytes,
                had.system_bytes + info.system_bytes)
        out[pid] = cards
    return out


@dataclass(frozen=True)
class DrmCard:
    index: int  # N of cardN
    vendor: str
    pci_bus_id: str
    path: Path  # .../device
    name: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _number(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text is not None and text.isdigit() else None


def find_cards(sys: Path) -> list[DrmCard]:
    """The AMD and Intel cards under `sys`/class/drm, in PCI order (NVIDIA's come from NVML)."""
    cards: dict[str, DrmCard] = {}
    try:
        entries = sorted(os.listdir(sys / "class" / "drm"))
    except OSError:
        return []
    for entry in entries:
        m = _CARD.match(entry)
        if m is None:
            continue  # connectors (card0-DP-1), render nodes
        device = sys / "class" / "drm" / entry / "device"
        vendor = PCI_VENDORS.get((_read(device / "vendor") or "").lower())
        if vendor not in (AMD, INTEL):
            continue
        pci = normalize_pci(os.path.basename(os.path.realpath(device))) or _slot(device)
        if pci is None or pci in cards:
            continue
        name = _read(device / "product_name") or \
            f"{'AMD' if vendor == AMD else 'Intel'} GPU {_read(device / 'device') or '?'}"
        cards[pci] = DrmCard(int(m.group(1)), vendor, pci, device, name)
    return [cards[pci] for pci in sorted(cards)]


def _slot(device: Path) -> str | None:
    for line in (_read(device / "uevent") or "").splitlines():
        if line.startswith("PCI_SLOT_NAME="):
            return normalize_pci(line.split("=", 1)[1])
    return None


class DrmSampler:
    """AMD cards from amdgpu's sysfs, Intel cards from llama-server's listing (estimates), and
    each child's own use from its fdinfo."""

    def __init__(self, sys: Path | None = None, proc: Path | None = None,
                 listed: Callable[[], Sequence[Listed]] = lambda: ()) -> None:
        self.sys = sys if sys is not None else sysfs_root()
        self.proc = proc if proc is not None else procfs_root()
        self.listed = listed  # the GPU child's llama-server's listing, once known
        self.cards: list[DrmCard] = []

    def open(self) -> None:
        self.cards = find_cards(self.sys)
        if not self.cards:
            raise Unavailable(f"no AMD or Intel GPU in {self.sys}/class/drm")

    def sample(self, monotonic: float, wall: float, pids: Collection[int]) -> list[GpuSample]:
        held = process_memory(self.proc, pids)
        intel_listed = [d for d in self.listed() if d.vendor == INTEL]
        out = []
        intel_seen = 0
        for card in self.cards:
            own = {pid: cards[card.pci_bus_id] for pid, cards in held.items()
                   if card.pci_bus_id in cards}
            if card.vendor == AMD:
                sample = self._amd(card, own, monotonic, wall)
            else:
                listed = intel_listed[intel_seen] if intel_seen < len(intel_listed) else None
                intel_seen += 1
                sample = self._intel(card, listed, own, monotonic, wall)
            if sample is not None:
                out.append(sample)
        return out

    def _amd(self, card: DrmCard, own: dict[int, FdInfo], monotonic: float,
             wall: float) -> GpuSample | None:
        vram_total = _number(card.path / "mem_info_vram_total")
        vram_used = _number(card.path / "mem_info_vram_used")
        if vram_total is None or vram_used is None:
            return None  # not amdgpu, or too old a kernel
        gtt_total = _number(card.path / "mem_info_gtt_total") or 0
        gtt_used = _number(card.path / "mem_info_gtt_used") or 0
        apu = is_apu(vram_total, gtt_total)
        total = vram_total + (gtt_total if apu else 0)
        used = vram_used + (gtt_used if apu else 0)
        return GpuSample(
            monotonic=monotonic, wall=wall, index=card.index, name=card.name,
            pci_bus_id=card.pci_bus_id, uuid=_read(card.path / "unique_id") or "",
            total_bytes=total, free_bytes=max(0, total - used), used_bytes=used,
            process_bytes={pid: f.local_bytes + (f.system_bytes if apu else 0)
                           for pid, f in own.items()},
            vendor=AMD, source="amdgpu sysfs" + (" (VRAM and GTT: an APU)" if apu else ""),
            memory="vram+gtt" if apu else "vram")

    def _intel(self, card: DrmCard, listed: Listed | None, own: dict[int, FdInfo],
               monotonic: float, wall: float) -> GpuSample | None:
        if listed is None or listed.total_mib is None or listed.free_mib is None:
            return None  # no total without the listing
        mine = {pid: f.local_bytes or f.system_bytes for pid, f in own.items()}
        total = listed.total_mib * MIB
        # What others held when llama-server listed it, and what the children hold now.
        used = min(total, (listed.total_mib - listed.free_mib) * MIB + sum(mine.values()))
        return GpuSample(
            monotonic=monotonic, wall=wall, index=card.index,
            name=listed.description or card.name, pci_bus_id=card.pci_bus_id, uuid="",
            total_bytes=total, free_bytes=total - used, used_bytes=used, process_bytes=mine,
            vendor=INTEL, estimated=True,
            source=f"estimate: {listed.name}'s listing by llama-server, and the children's "
                   "fdinfo")

    def close(self) -> None:
        pass
