"""Every GPU a home server has, end to end with real llama-server children: a fake AMD card and
a fake APU (fake sysfs and procfs trees, fake_gpu_tree.py) and two fake NVIDIA cards (the fake
pynvml), each behind a wrapper of the real llama-server whose `--list-devices` and load log
name ROCm or CUDA devices as a build for those cards does. On each, the status shows the
figures, and generation goes to the CPU child while a card the GPU child uses is short of
headroom, and to the GPU child again once it frees."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fake_gpu_tree import GIB, MIB, add_card, add_fd, amdgpu_fdinfo, set_memory
from harness import PATIENCE_S, Spillway, eventually, real_config, write_json
from prometheus_client.parser import text_string_to_metric_families

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]

BODY = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def backend_wrapper(tmp_path: Path, llama_server: Path, listing: list[str],
                    using: list[str]) -> Path:
    """A llama-server that lists `listing` as its devices and writes `using` at load, as a
    ROCm or CUDA build does (at -lv 4), then is the real one (a test double of the build)."""
    script = tmp_path / "llama-server-gpu-build"
    lines = "\n".join(["Available devices:", *listing])
    script.write_text(
        "#!/bin/sh\n"
        "for a in \"$@\"; do\n"
        f"  if [ \"$a\" = --list-devices ]; then printf '%s\\n' '{lines}'; exit 0; fi\n"
        "done\n"
        + "".join(f"printf '%s\\n' '{u}' >&2\n" for u in using)
        + f"exec '{llama_server}' \"$@\"\n")
    script.chmod(0o755)
    return script


async def child_now(s: Spillway) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", json=BODY) as r:
            assert r.status == 200, await r.text()
            return str(r.headers["X-Spillway-Child"])


def wait_for(s: Spillway, check: Any, timeout: float = PATIENCE_S) -> dict[str, Any]:
    """The status once `check` holds of it."""
    status = eventually(lambda: st if check(st := s.status()) else None, timeout)
    assert status, json.dumps(s.status().get("gpu"), indent=1)
    return dict(status)


def gpu_memory(s: Spillway) -> dict[tuple[str, str], float]:
    """spillway_gpu_memory_bytes by (device, kind), read with Prometheus's own parser."""
    with urllib.request.urlopen(f"{s.url}/spillway/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "spillway_gpu_memory_bytes":
            for sample in family.samples:
                out[(sample.labels["device"], sample.labels["kind"])] = sample.value
    return out


def environ(pid: int) -> dict[str, str]:
    """A child's environment, as the kernel has it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.mark.asyncio
async def test_a_fake_amd_card_keeps_its_headroom(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    sys, proc = tmp_path / "sys", tmp_path / "proc"
    card = add_card(sys, 1, "0000:03:00.0", vram_used=2 * GIB)
    add_card(sys, 0, "0000:00:02.0", vendor="0x8086", product=None, vram_total=None)  # an iGPU
    wrapper = backend_wrapper(tmp_path, llama_server, [
        "  ROCm0: AMD Radeon RX 7900 XTX (24560 MiB, 22000 MiB free)"], [
        "llama_model_load_from_file_impl: using device ROCm0 (AMD Radeon RX 7900 XTX) "
        "(0000:03:00.0) - 22000 MiB free"])
    cfg = real_config(llama_server, tiny_model, gpu={"vram_headroom_mib": 1024,
                                                     "llama_server": str(wrapper)},
                      monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, env={"SPILLWAY_SYSFS_ROOT": str(sys), "SPILLWAY_PROCFS_ROOT": str(proc)})
    gpu_pid = s.child("gpu")["pid"]
    add_fd(proc, gpu_pid, 7, amdgpu_fdinfo("0000:03:00.0", 4, vram_kib=900 * 1024))
    gpu = wait_for(s, lambda st: st["gpu"]["children_used_bytes"]["gpu"] == 900 * MIB)["gpu"]
    assert (gpu["vendor"], gpu["name"], gpu["pci_bus_id"]) == (
        "amd", "AMD Radeon RX 7900 XTX", "0000:03:00.0")
    assert gpu["source"] == "amdgpu sysfs" and gpu["memory"] == "vram"
    assert gpu["total_bytes"] == 24 * GIB and gpu["free_bytes"] == 22 * GIB
    assert gpu["gpu_child_devices"] == {"pci_bus_ids": ["0000:03:00.0"], "how": "load log",
                                        "why": "named by its load log"}
    # The Intel iGPU has no figures without a listing of it: it is not a card of this build.
    assert [d["pci_bus_id"] for d in gpu["devices"]] == ["0000:03:00.0"]
    # The CPU child sees no card of any vendor.
    cpu_env = environ(s.child("cpu")["pid"])
    assert (cpu_env["ROCR_VISIBLE_DEVICES"], cpu_env["HIP_VISIBLE_DEVICES"]) == ("-1", "-1")
    assert (cpu_env["CUDA_VISIBLE_DEVICES"], cpu_env["GGML_VK_VISIBLE_DEVICES"]) == ("", "")
    assert cpu_env["ONEAPI_DEVICE_SELECTOR"] == "!*:gpu"
    assert await child_now(s) == "gpu"
    set_memory(card, 24 * GIB, 24 * GIB - 600 * MIB, 32 * GIB, 0)  # a game took the card
    wait_for(s, lambda st: st["gpu"]["free_mib"] == 600)
    assert [await child_now(s) for _ in range(3)] == ["cpu"] * 3
    set_memory(card, 24 * GIB, 2 * GIB, 32 * GIB, 0)
    wait_for(s, lambda st: st["gpu"]["free_mib"] == 22 * 1024)
    assert await child_now(s) == "gpu"


@pytest.mark.asyncio
async def test_a_fake_apu_counts_its_gtt(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    """The lemonade-sdk/lemonade#2631 case: the 512 MiB carve-out is 99% used, the model is in
    GTT and GTT has room: the GPU child serves. Only GTT running out moves work off it."""
    sys, proc = tmp_path / "sys", tmp_path / "proc"
    apu = add_card(sys, 1, "0000:c5:00.0", device="0x1586", product="AMD Radeon(TM) Graphics",
                   vram_total=512 * MIB, vram_used=507 * MIB, gtt_total=96 * GIB,
                   gtt_used=30 * GIB)
    wrapper = backend_wrapper(tmp_path, llama_server, [
        "  ROCm0: AMD Radeon(TM) Graphics (98816 MiB, 67000 MiB free)"], [])
    cfg = real_config(llama_server, tiny_model, gpu={"vram_headroom_mib": 2048,
                                                     "llama_server": str(wrapper)},
                      monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, env={"SPILLWAY_SYSFS_ROOT": str(sys), "SPILLWAY_PROCFS_ROOT": str(proc)})
    gpu = s.status()["gpu"]
    assert gpu["memory"] == "vram+gtt" and "APU" in gpu["source"]
    assert gpu["total_bytes"] == 512 * MIB + 96 * GIB
    assert gpu["free_bytes"] == 5 * MIB + 66 * GIB
    assert gpu["gpu_child_devices"]["how"] == "config"  # one AMD card: no doubt which
    assert await child_now(s) == "gpu"
    set_memory(apu, 512 * MIB, 507 * MIB, 96 * GIB, 96 * GIB - 1 * GIB)  # GTT all but full
    wait_for(s, lambda st: st["gpu"]["free_mib"] == 1029)
    assert [await child_now(s) for _ in range(3)] == ["cpu"] * 3
    set_memory(apu, 512 * MIB, 507 * MIB, 96 * GIB, 30 * GIB)
    wait_for(s, lambda st: st["gpu"]["free_mib"] > 60 * 1024)
    assert await child_now(s) == "gpu"


@pytest.mark.asyncio
@pytest.mark.parametrize("device", ["all", None])
async def test_two_fake_nvidia_cards_one_of_them_short(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path,
        device: str | None) -> None:
    """gpu.device "all", or left unset (issue 37: as llama-server alone, every card)."""
    nvml = tmp_path / "nvml.json"

    def cards(second_free_mib: int) -> list[dict[str, Any]]:
        return [{"total_mib": 24576, "free_mib": 20000, "name": "RTX 3090", "uuid": "GPU-a",
                 "pci_bus_id": "00000000:01:00.0"},
                {"total_mib": 12288, "free_mib": second_free_mib, "name": "RTX 3060",
                 "uuid": "GPU-b", "pci_bus_id": "00000000:02:00.0"}]

    write_json(nvml, devices=cards(11000))
    wrapper = backend_wrapper(tmp_path, llama_server, [
        "  CUDA0: NVIDIA GeForce RTX 3090 (24576 MiB, 20000 MiB free)",
        "  CUDA1: NVIDIA GeForce RTX 3060 (12288 MiB, 11000 MiB free)"], [])
    cfg = real_config(llama_server, tiny_model,
                      gpu={"vram_headroom_mib": 1024, "llama_server": str(wrapper),
                           "args": ["-ngl", "99", "-ts", "1,1"],
                           **({"device": device} if device else {})},
                      monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, fake_nvml=nvml)
    gpu = s.status()["gpu"]
    assert [(d["name"], d["used_by_gpu_child"]) for d in gpu["devices"]] == [
        ("RTX 3090", True), ("RTX 3060", True)]
    assert gpu["gpu_child_devices"]["pci_bus_ids"] == ["0000:01:00.0", "0000:02:00.0"]
    assert gpu["pci_bus_id"] == "0000:02:00.0"  # the tightest, at the top
    gpu_env = environ(s.child("gpu")["pid"])
    if device == "all":
        assert "CUDA_VISIBLE_DEVICES" not in gpu_env  # both cards, as llama-server alone
    else:  # both cards by UUID, numbered as CUDA numbers them without it (PCI order)
        assert gpu_env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
        assert gpu["gpu_child_given"] == {
            "pci_bus_ids": ["0000:01:00.0", "0000:02:00.0"],
            "why": "gpu.device is not set: every NVIDIA card it can see, as llama-server alone "
                   "uses them"}
    assert gpu_env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert await child_now(s) == "gpu"
    write_json(nvml, devices=cards(700))  # the second card, not the first, runs short
    wait_for(s, lambda st: st["gpu"]["free_mib"] == 700)
    assert [await child_now(s) for _ in range(3)] == ["cpu"] * 3
    memory = gpu_memory(s)
    assert memory[("0000:02:00.0", "free")] == 700 * MIB
    assert memory[("0000:01:00.0", "total")] == 24576 * MIB
    write_json(nvml, devices=cards(11000))
    wait_for(s, lambda st: st["gpu"]["free_mib"] == 11000)  # the tightest, freed again
    assert await child_now(s) == "gpu"
