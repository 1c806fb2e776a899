"""GPU figures: the real NVML library's no-driver path, and chosen figures from a fake pynvml."""

from __future__ import annotations

import asyncio
import time
import tomllib
from pathlib import Path

import pytest
from harness import eventually, fake_config, write_json

from conftest import SpillwayFactory
from supervisor.commands import cli
from supervisor.gpu import GpuMonitor


def test_the_real_library_without_a_driver_says_so_and_samples_nothing() -> None:
    async def run() -> GpuMonitor:
        monitor = GpuMonitor(0.1)
        await monitor.start()
        await asyncio.sleep(0.3)
        await monitor.close()
        return monitor

    monitor = asyncio.run(run())
    if monitor.available:  # a machine with a driver: the figures must make sense
        assert monitor.latest is not None
        assert 0 < monitor.latest.free_bytes <= monitor.latest.total_bytes
    else:
        assert monitor.note is not None and "NVML" in monitor.note
        assert monitor.latest is None
        assert monitor.to_json({}) is None
        assert monitor.vram_before(time.monotonic()) is None



def test_status_shows_the_gpu_figures_and_the_childs_own_use(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    figures = tmp_path / "nvml.json"
    write_json(figures, total_mib=24576, free_mib=20000, name="Fake RTX",
                  uuid="GPU-1234", pci_bus_id="00000000:2B:00.0")
    cfg = fake_config(fake_server, tiny_model, monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, fake_nvml=figures)
    gpu_pid = s.child("gpu")["pid"]
    write_json(figures, total_mib=24576, free_mib=18000, name="Fake RTX", uuid="GPU-1234",
                  pci_bus_id="00000000:2B:00.0", processes={str(gpu_pid): 3858})
    gpu = eventually(lambda: (g := s.status()["gpu"])["free_mib"] == 18000 and g)
    assert gpu, s.status()["gpu"]
    assert gpu["name"] == "Fake RTX" and gpu["vendor"] == "nvidia" and gpu["source"] == "nvml"
    assert gpu["pci_bus_id"] == "0000:2b:00.0"  # NVML's form, written as the kernel writes it
    assert gpu["total_mib"] == 24576 and gpu["used_mib"] == 24576 - 18000
    assert gpu["children_used_bytes"]["gpu"] == 3858 * 1024 * 1024
    assert gpu["children_used_bytes"]["cpu"] == 0
    [card] = gpu["devices"]
    assert card["pci_bus_id"] == "0000:2b:00.0" and card["used_by_gpu_child"]
    assert card["free_bytes"] == 18000 * 1024 * 1024
    # It holds memory there now: that is how its card is known.
    assert gpu["gpu_child_devices"]["how"] == "its own memory"
    assert s.status()["gpu_note"] is None
    # The GPU child sees only the watched card; the CPU child sees no card of any vendor.
    _, gpu_props = s.get("/props", {"X-Spillway-Child": "gpu"})
    _, cpu_props = s.get("/props", {"X-Spillway-Child": "cpu"})
    assert gpu_props["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-1234"
    assert gpu_props["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert cpu_props["env"]["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("error,words", [("LibraryNotFound", "Library Not Found"),
                                         ("DriverNotLoaded", "Driver Not Loaded")])
def test_no_driver_means_no_gpu_in_status_and_nothing_else_changes(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path,
        error: str, words: str) -> None:
    figures = tmp_path / "nvml.json"
    write_json(figures, init_error=error)
    s = spillway(fake_config(fake_server, tiny_model), fake_nvml=figures)
    status = s.status()
    assert status["gpu"] is None
    assert words in status["gpu_note"]
    assert status["children"]["gpu"]["state"] == "READY"


TWO_CARDS = [
    {"total_mib": 24576, "free_mib": 20000, "name": "First card", "uuid": "GPU-first",
     "pci_bus_id": "00000000:01:00.0"},
    {"total_mib": 16384, "free_mib": 9000, "name": "Second card", "uuid": "GPU-second",
     "pci_bus_id": "00000000:41:00.0"},
]


def test_the_card_is_chosen_by_its_pci_bus_id_and_the_child_sees_only_it(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    figures = tmp_path / "nvml.json"
    write_json(figures, devices=TWO_CARDS)
    cfg = fake_config(fake_server, tiny_model, gpu={"device": "00000000:41:00.0"})
    s = spillway(cfg, fake_nvml=figures)
    gpu = s.status()["gpu"]
    assert gpu["index"] == 1 and gpu["pci_bus_id"] == "0000:41:00.0"
    assert [(d["name"], d["used_by_gpu_child"]) for d in gpu["devices"]] == [
        ("First card", False), ("Second card", True)]
    _, props = s.get("/props", {"X-Spillway-Child": "gpu"})
    assert props["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-second"
    assert props["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_a_card_that_is_not_there_is_said_plainly(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    figures = tmp_path / "nvml.json"
    write_json(figures, total_mib=16384, free_mib=9000)
    s = spillway(fake_config(fake_server, tiny_model, gpu={"device": 3}), fake_nvml=figures)
    status = s.status()
    assert status["gpu"]["gpu_child_devices"]["pci_bus_ids"] == []
    assert "gpu.device names '3': no such card here (cards: 0000:01:00.0)" in \
        status["gpu_note"]
    assert status["children"]["gpu"]["state"] == "READY"


def test_a_split_over_cards_the_child_cannot_see_is_said(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    figures = tmp_path / "nvml.json"
    write_json(figures, devices=TWO_CARDS)
    cfg = fake_config(fake_server, tiny_model, gpu={"args": ["-ts", "3,1"], "device": 0})
    s = spillway(cfg, fake_nvml=figures)
    gpu = s.status()["gpu"]
    assert gpu["gpu_child_devices"]["pci_bus_ids"] == ["0000:01:00.0"]
    # The status tells the second card, hidden by gpu.device, from one the child leaves idle.
    assert [d["given_to_gpu_child"] for d in gpu["devices"]] == [True, False]
    assert gpu["gpu_child_given"] == {"pci_bus_ids": ["0000:01:00.0"], "why": 'gpu.device = "0"'}
    assert ("gpu.args split the layers over 2 devices (-dev/-ts) but gpu.device = '0' gives "
            "the GPU child 1 card(s): leave gpu.device unset") in s.log_path.read_text()


def test_left_unset_a_split_over_more_cards_than_there_are_is_said(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    figures = tmp_path / "nvml.json"
    write_json(figures, total_mib=16384, free_mib=9000)  # one card
    s = spillway(fake_config(fake_server, tiny_model, gpu={"args": ["-ts", "1,1"]}),
                 fake_nvml=figures)
    assert s.status()["gpu"]["gpu_child_devices"]["pci_bus_ids"] == ["0000:01:00.0"]
    assert ("gpu.args split the layers over 2 devices (-dev/-ts) but the GPU child can see 1 "
            "card(s)") in s.log_path.read_text()


def test_left_unset_a_split_gets_every_card_and_every_card_is_watched(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    """Issue 37: `-ts 3,1` over two cards, gpu.device left unset: the GPU child sees both
    (by UUID, numbered as llama-server alone numbers them), both are watched, no warning."""
    figures = tmp_path / "nvml.json"
    write_json(figures, devices=TWO_CARDS)
    s = spillway(fake_config(fake_server, tiny_model, gpu={"args": ["-ts", "3,1"]}),
                 fake_nvml=figures)
    gpu = s.status()["gpu"]
    assert gpu["gpu_child_devices"]["pci_bus_ids"] == ["0000:01:00.0", "0000:41:00.0"]
    assert [d["used_by_gpu_child"] for d in gpu["devices"]] == [True, True]
    assert gpu["pci_bus_id"] == "0000:41:00.0"  # the tightest of the two, weighed
    assert gpu["gpu_child_given"] == {
        "pci_bus_ids": ["0000:01:00.0", "0000:41:00.0"],
        "why": "gpu.device is not set: every card it can see, as llama-server alone uses them"}
    _, props = s.get("/props", {"X-Spillway-Child": "gpu"})
    assert props["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-first,GPU-second"
    assert "split the layers" not in s.log_path.read_text()


def test_the_users_own_visible_devices_say_which_card_index_0_is(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    """`gpu.env.CUDA_VISIBLE_DEVICES = "1"` (as the docs once showed) with gpu.device left
    unset: the child sees the second card, so that is the card watched and weighed."""
    figures = tmp_path / "nvml.json"
    write_json(figures, devices=TWO_CARDS)
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"CUDA_VISIBLE_DEVICES": "1"}})
    s = spillway(cfg, fake_nvml=figures)
    gpu = s.status()["gpu"]
    assert gpu["gpu_child_devices"]["pci_bus_ids"] == ["0000:41:00.0"]
    assert gpu["name"] == "Second card"
    _, props = s.get("/props", {"X-Spillway-Child": "gpu"})
    assert props["env"]["CUDA_VISIBLE_DEVICES"] == "1"  # the user's own, as given


def test_a_two_card_command_line_through_init_gives_the_gpu_child_both_cards(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 37, done when: `spillway init -- llama-server -m M -ngl 99 -ts 1,1` (a two-card
    user's command line) writes a config, with no warning, under which the GPU child sees both
    cards and Spillway watches both."""
    args = cli.build_parser().parse_args(["init", "--print", "--", str(fake_server), "-m",
                                          str(tiny_model), "-ngl", "99", "-ts", "1,1"])
    assert args.func(args) == 0
    written = capsys.readouterr()
    # (On a Xeon with AMX init warns of the host's CPU, whatever the command line: not this.)
    about_the_line = [line for line in written.err.lower().splitlines()
                      if "warning" in line and "amx" not in line]
    assert not about_the_line, written.err
    doc = tomllib.loads(written.out)
    assert "device" not in doc["gpu"] and doc["gpu"]["args"] == ["-ngl", "99", "-ts", "1,1"]
    figures = tmp_path / "nvml.json"
    write_json(figures, devices=TWO_CARDS)
    s = spillway({**doc, "server": {}}, fake_nvml=figures)
    gpu = s.status()["gpu"]
    assert gpu["gpu_child_devices"]["pci_bus_ids"] == ["0000:01:00.0", "0000:41:00.0"]
    assert [d["used_by_gpu_child"] for d in gpu["devices"]] == [True, True]
    _, props = s.get("/props", {"X-Spillway-Child": "gpu"})
    assert props["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-first,GPU-second"
    assert "split the layers" not in s.log_path.read_text()
