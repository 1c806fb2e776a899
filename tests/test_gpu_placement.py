"""Which cards the GPU child is given and which of them it uses (gpu/placement.py), with
`gpu.device` left unset, pinned, or "all", on one card, two cards, and a machine of two
vendors: the cards it sees (its CUDA_VISIBLE_DEVICES) and the cards Spillway watches."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.config.schema import build
from supervisor.gpu import MIB, GpuSample
from supervisor.gpu.placement import Placement
from supervisor.policy.devices import Listed

CUDA_BUILD = [Listed("CUDA", 0, "NVIDIA GeForce RTX 3090", 24576, 20000),
              Listed("CUDA", 1, "NVIDIA GeForce RTX 3060", 12288, 11000)]


def card(pci: str, uuid: str, vendor: str = "nvidia") -> GpuSample:
    return GpuSample(monotonic=0.0, wall=0.0, index=0, name=f"card {pci}", pci_bus_id=pci,
                     uuid=uuid, total_bytes=24000 * MIB, free_bytes=20000 * MIB,
                     used_bytes=4000 * MIB, vendor=vendor)


ONE = [card("0000:01:00.0", "GPU-a")]
TWO = [card("0000:01:00.0", "GPU-a"), card("0000:02:00.0", "GPU-b")]
WITH_AMD = [*TWO, card("0000:83:00.0", "", vendor="amd")]


def placement(listed: list[Listed] | None = None, **gpu: Any) -> Placement:
    cfg = build({"model": {"path": "/m.gguf"}, "gpu": gpu}, check_paths=False)
    return Placement(cfg.gpu_settings, lambda: None,
                     lambda: CUDA_BUILD if listed is None else listed)


@pytest.fixture(autouse=True)
def no_visible_devices_of_our_own(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)


def watched(p: Placement, samples: list[GpuSample]) -> tuple[str, ...]:
    return p.choose(samples).pci_bus_ids


def test_left_unset_the_gpu_child_gets_both_cards_and_both_are_watched() -> None:
    p = placement(args=["-ngl", "99", "-ts", "1,1"])
    assert p.settings.device is None
    assert p.env(TWO)["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"  # numbered as without it
    assert watched(p, TWO) == ("0000:01:00.0", "0000:02:00.0")
    selection = p.choose(TWO)
    assert selection.shares == {"0000:01:00.0": 0.5, "0000:02:00.0": 0.5}
    assert selection.given == ("0000:01:00.0", "0000:02:00.0")
    assert selection.given_why.startswith("gpu.device is not set: every NVIDIA card it can see")


def test_left_unset_with_no_flags_every_card_as_llama_server_uses_them() -> None:
    p = placement()
    assert watched(p, TWO) == ("0000:01:00.0", "0000:02:00.0")
    # Only the build's vendor: a CUDA build does not use the AMD card.
    assert watched(p, WITH_AMD) == ("0000:01:00.0", "0000:02:00.0")
    assert p.env(WITH_AMD)["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"


@pytest.mark.parametrize("args, ids", [
    (["-dev", "CUDA1"], ("0000:02:00.0",)),
    (["-dev", "CUDA0,CUDA1"], ("0000:01:00.0", "0000:02:00.0")),
    (["-sm", "none", "-mg", "1"], ("0000:02:00.0",)),
    (["-sm", "none"], ("0000:01:00.0",)),
    (["-ts", "0,1"], ("0000:02:00.0",)),
    (["-sm", "row", "-mg", "1"], ("0000:01:00.0", "0000:02:00.0")),
    (["-mg", "1"], ("0000:01:00.0", "0000:02:00.0")),  # -mg alone: a layer split, both
])
def test_left_unset_its_own_flags_narrow_what_is_watched(args: list[str],
                                                        ids: tuple[str, ...]) -> None:
    p = placement(args=["-ngl", "99", *args])
    assert watched(p, TWO) == ids
    # It sees both, numbered as llama-server alone would: its -dev, -mg, -ts say the same.
    assert p.env(TWO)["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"


def test_a_single_card_machine_is_as_before() -> None:
    for p in (placement(), placement(device=0)):
        assert p.env(ONE) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "GPU-a"}
        assert watched(p, ONE) == ("0000:01:00.0",)


def test_a_pinned_card_stays_pinned() -> None:
    p = placement(device=0, args=["-ngl", "99", "-ts", "1,1"])
    assert p.env(TWO)["CUDA_VISIBLE_DEVICES"] == "GPU-a"
    assert watched(p, TWO) == ("0000:01:00.0",)
    assert p.choose(TWO).given_why == 'gpu.device = "0"'
    both = placement(device="1,0")
    assert both.env(TWO)["CUDA_VISIBLE_DEVICES"] == "GPU-b,GPU-a"  # CUDA0 is the first named
    assert watched(both, TWO) == ("0000:02:00.0", "0000:01:00.0")
    everything = placement(device="all")
    assert "CUDA_VISIBLE_DEVICES" not in everything.env(TWO)  # hides nothing, as before
    assert watched(everything, TWO) == ("0000:01:00.0", "0000:02:00.0")


def test_without_figures_nothing_is_hidden_unless_indices_are_pinned() -> None:
    assert placement().env([]) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert placement(device=1).env([])["CUDA_VISIBLE_DEVICES"] == "1"
    assert placement(device="0, 1").env([])["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_the_users_own_cuda_visible_devices_is_kept_when_left_unset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    p = placement()
    assert "CUDA_VISIBLE_DEVICES" not in p.env(TWO)  # its own, inherited as it is
    assert watched(p, TWO) == ("0000:02:00.0",)
    assert placement(env={"CUDA_VISIBLE_DEVICES": "0"}).choose(TWO).pci_bus_ids == (
        "0000:01:00.0",)
