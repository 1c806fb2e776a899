"""Fake sysfs and procfs trees (test doubles) in the kernel's documented formats, for the DRM
sampler: SPILLWAY_SYSFS_ROOT and SPILLWAY_PROCFS_ROOT point at them.

- A card: `class/drm/cardN/device` a link to its PCI device folder (as on a real machine, so
  the address is the link's target), with `vendor`, `device`, and for amdgpu
  `mem_info_{vram,gtt}_{total,used}` in bytes; a connector (`cardN-DP-1`) and a render node
  beside it, as sysfs has them.
- A process: `PID/fd/N` a link to `/dev/dri/renderD128` (dangling here, as readlink does not
  care) and `PID/fdinfo/N` in the drm-usage-stats format (Documentation/gpu/drm-usage-stats.rst),
  amdgpu's older `drm-memory-*` keys with their space before the tab included.
"""

from __future__ import annotations

import os
from pathlib import Path

MIB = 1024 * 1024
GIB = 1024 * MIB


def add_card(sys: Path, card: int, pci: str, vendor: str = "0x1002", device: str = "0x744c",
             product: str | None = "AMD Radeon RX 7900 XTX", vram_total: int | None = 24 * GIB,
             vram_used: int = 0, gtt_total: int = 32 * GIB, gtt_used: int = 0) -> Path:
    """One card; returns its device folder (write its mem_info_* again to change them)."""
    folder = sys / "devices" / "pci0000:00" / "0000:00:01.1" / pci
    folder.mkdir(parents=True, exist_ok=True)
    drm = sys / "class" / "drm"
    drm.mkdir(parents=True, exist_ok=True)
    link = drm / f"card{card}"
    link.mkdir(exist_ok=True)
    if not (link / "device").is_symlink():
        os.symlink(os.path.relpath(folder, link), link / "device")
    (drm / f"card{card}-DP-1").mkdir(exist_ok=True)  # a connector: not a card
    (drm / f"renderD{128 + card}").mkdir(exist_ok=True)
    (folder / "vendor").write_text(vendor + "\n")
    (folder / "device").write_text(device + "\n")
    (folder / "uevent").write_text(f"DRIVER=amdgpu\nPCI_SLOT_NAME={pci}\n")
    if product is not None:
        (folder / "product_name").write_text(product + "\n")
    if vram_total is not None:
        set_memory(folder, vram_total, vram_used, gtt_total, gtt_used)
    return folder


def set_memory(folder: Path, vram_total: int, vram_used: int, gtt_total: int,
               gtt_used: int) -> None:
    for name, value in (("mem_info_vram_total", vram_total), ("mem_info_vram_used", vram_used),
                        ("mem_info_gtt_total", gtt_total), ("mem_info_gtt_used", gtt_used)):
        tmp = folder / f".{name}"
        tmp.write_text(f"{value}\n")
        tmp.replace(folder / name)  # a reader never sees half a number


def amdgpu_fdinfo(pci: str, client: int, vram_kib: int, gtt_kib: int = 0) -> str:
    """amdgpu's fdinfo (kernel 6.x): the older drm-memory-* keys and the drm-total-* ones."""
    return (f"pos:\t0\nflags:\t02100002\nmnt_id:\t26\nino:\t1098\n"
            f"drm-driver:\tamdgpu\ndrm-client-id:\t{client}\ndrm-pdev:\t{pci}\npasid:\t32789\n"
            f"drm-memory-vram:\t{vram_kib} KiB\ndrm-memory-gtt: \t{gtt_kib} KiB\n"
            f"drm-memory-cpu: \t0 KiB\ndrm-total-vram:\t{vram_kib} KiB\n"
            f"drm-total-gtt:\t{gtt_kib} KiB\ndrm-shared-vram:\t0\ndrm-resident-vram:\t"
            f"{vram_kib} KiB\ndrm-engine-gfx:\t1234567 ns\n")


def i915_fdinfo(pci: str, client: int, system_kib: int, local_kib: int = 0) -> str:
    return (f"pos:\t0\nflags:\t02100002\ndrm-driver:\ti915\ndrm-client-id:\t{client}\n"
            f"drm-pdev:\t{pci}\ndrm-total-system0:\t{system_kib} KiB\ndrm-shared-system0:\t0\n"
            f"drm-total-stolen-system0:\t0\ndrm-total-local0:\t{local_kib} KiB\n"
            f"drm-engine-render:\t2134 ns\n")


def xe_fdinfo(pci: str, client: int, vram_mib: int) -> str:
    return (f"drm-driver:\txe\ndrm-client-id:\t{client}\ndrm-pdev:\t{pci}\n"
            f"drm-total-system:\t0\ndrm-total-gtt:\t4 KiB\ndrm-total-vram0:\t{vram_mib} MiB\n"
            f"drm-resident-vram0:\t{vram_mib} MiB\n")


def add_fd(proc: Path, pid: int, fd: int, fdinfo: str, target: str = "/dev/dri/renderD128") -> None:
    """One open fd of a process, pointing into /dev/dri (or elsewhere), with its fdinfo."""
    (proc / str(pid) / "fd").mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "fdinfo").mkdir(parents=True, exist_ok=True)
    link = proc / str(pid) / "fd" / str(fd)
    if link.is_symlink():
        link.unlink()
    os.symlink(target, link)
    (proc / str(pid) / "fdinfo" / str(fd)).write_text(fdinfo)
