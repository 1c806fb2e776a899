"""AMD and Intel cards without a vendor library (supervisor/gpu/drm.py), on fake sysfs and
procfs trees written in the kernel's formats (fake_gpu_tree.py): amdgpu's mem_info files, an
APU whose model lives in GTT, Intel's estimate from llama-server's listing, and each process's
own use from its DRM fdinfo, a client counted once."""

from __future__ import annotations

from pathlib import Path

from fake_gpu_tree import (
    GIB, MIB, add_card, add_fd, amdgpu_fdinfo, i915_fdinfo, set_memory, xe_fdinfo,
)

from supervisor.gpu.drm import DrmSampler, find_cards, parse_fdinfo, process_memory
from supervisor.gpu.sampler import Unavailable
from supervisor.policy.devices import Listed


def test_fdinfo_is_read_in_every_drivers_words() -> None:
    amd = parse_fdinfo(amdgpu_fdinfo("0000:03:00.0", 14, vram_kib=3276800, gtt_kib=2048))
    assert amd is not None and amd.pdev == "0000:03:00.0" and amd.client_id == "14"
    assert (amd.local_bytes, amd.system_bytes) == (3276800 * 1024, 2048 * 1024)
    i915 = parse_fdinfo(i915_fdinfo("0000:00:02.0", 7, system_kib=4096))
    assert i915 is not None and (i915.local_bytes, i915.system_bytes) == (0, 4096 * 1024)
    xe = parse_fdinfo(xe_fdinfo("0000:03:00.0", 3, vram_mib=512))
    assert xe is not None and xe.local_bytes == 512 * MIB
    # Bytes without a unit; a file that is no DRM client's.
    plain = parse_fdinfo("drm-pdev:\t0000:03:00.0\ndrm-total-vram:\t4096\n")
    assert plain is not None and plain.local_bytes == 4096
    assert parse_fdinfo("pos:\t0\nflags:\t02\n") is None


def test_a_process_is_counted_once_per_client_and_only_for_dri_fds(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    fdinfo = amdgpu_fdinfo("0000:03:00.0", 14, vram_kib=1024 * 1024)
    add_fd(proc, 500, 5, fdinfo)
    add_fd(proc, 500, 6, fdinfo)  # a dup of the same client
    add_fd(proc, 500, 7, amdgpu_fdinfo("0000:03:00.0", 15, vram_kib=512 * 1024))
    add_fd(proc, 500, 8, fdinfo.replace("\t14", "\t99"), target="/tmp/not-a-gpu")
    held = process_memory(proc, [500, 501])
    assert held[500]["0000:03:00.0"].local_bytes == 1536 * MIB
    assert 501 not in held  # gone: nothing


def test_an_amd_card_a_connector_and_an_nvidia_card_in_sysfs(tmp_path: Path) -> None:
    sys = tmp_path / "sys"
    add_card(sys, 0, "0000:01:00.0", vendor="0x10de", product=None, vram_total=None)
    add_card(sys, 1, "0000:03:00.0", vram_used=20 * GIB, gtt_used=1 * GIB)
    cards = find_cards(sys)
    assert [(c.vendor, c.pci_bus_id, c.name) for c in cards] == [
        ("amd", "0000:03:00.0", "AMD Radeon RX 7900 XTX")]  # NVIDIA's come from NVML
    proc = tmp_path / "proc"
    add_fd(proc, 4242, 9, amdgpu_fdinfo("0000:03:00.0", 3, vram_kib=18 * 1024 * 1024))
    sampler = DrmSampler(sys, proc)
    sampler.open()
    [card] = sampler.sample(1.0, 2.0, [4242])
    assert (card.vendor, card.memory, card.estimated) == ("amd", "vram", False)
    assert card.total_bytes == 24 * GIB and card.used_bytes == 20 * GIB
    assert card.free_bytes == 4 * GIB  # GTT is system memory on a discrete card: not counted
    assert card.process_bytes == {4242: 18 * GIB}
    set_memory(cards[0].path, 24 * GIB, 23 * GIB, 32 * GIB, 0)
    assert sampler.sample(1.0, 2.0, [])[0].free_bytes == 1 * GIB


def test_an_apus_pool_is_its_vram_and_its_gtt(tmp_path: Path) -> None:
    """Strix Halo as llama.cpp#19764 shows it: 512 MiB carved out, the model in GTT."""
    sys = tmp_path / "sys"
    add_card(sys, 1, "0000:c5:00.0", device="0x1586", product="AMD Radeon(TM) Graphics",
             vram_total=512 * MIB, vram_used=300 * MIB, gtt_total=108 * GIB,
             gtt_used=40 * GIB)
    proc = tmp_path / "proc"
    add_fd(proc, 77, 4, amdgpu_fdinfo("0000:c5:00.0", 2, vram_kib=100 * 1024,
                                      gtt_kib=38 * 1024 * 1024))
    sampler = DrmSampler(sys, proc)
    sampler.open()
    [apu] = sampler.sample(1.0, 2.0, [77])
    assert apu.memory == "vram+gtt" and "APU" in apu.source
    assert apu.total_bytes == 512 * MIB + 108 * GIB
    assert apu.free_bytes == 212 * MIB + 68 * GIB  # not "99% of 512 MiB used"
    assert apu.process_bytes == {77: 100 * MIB + 38 * GIB}


def test_an_intel_card_is_an_estimate_from_the_listing(tmp_path: Path) -> None:
    sys = tmp_path / "sys"
    add_card(sys, 0, "0000:03:00.0", vendor="0x8086", device="0x56a0", product=None,
             vram_total=None)
    proc = tmp_path / "proc"
    add_fd(proc, 88, 3, xe_fdinfo("0000:03:00.0", 5, vram_mib=6000))
    listed: list[Listed] = []
    sampler = DrmSampler(sys, proc, listed=lambda: listed)
    sampler.open()
    assert sampler.sample(1.0, 2.0, [88]) == []  # no total before llama-server lists it
    listed.append(Listed("SYCL", 0, "Intel(R) Arc(TM) A770 Graphics", 16225, 15908))
    [arc] = sampler.sample(1.0, 2.0, [88])
    assert arc.estimated and arc.vendor == "intel" and "estimate" in arc.source
    assert arc.name == "Intel(R) Arc(TM) A770 Graphics"
    assert arc.total_bytes == 16225 * MIB
    assert arc.used_bytes == (16225 - 15908 + 6000) * MIB  # others' then, the child's now
    assert arc.process_bytes == {88: 6000 * MIB}


def test_no_card_says_where_it_looked(tmp_path: Path) -> None:
    sampler = DrmSampler(tmp_path / "empty", tmp_path / "proc")
    try:
        sampler.open()
    except Unavailable as e:
        assert str(e) == f"no AMD or Intel GPU in {tmp_path / 'empty'}/class/drm"
    else:
        raise AssertionError("a tree without cards opened")
