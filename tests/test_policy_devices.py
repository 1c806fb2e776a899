"""Which cards a GPU child uses, by PCI address (policy/devices.py): table-driven over the
evidence in its order (load log, its own memory, gpu.device and its args), the room rule on
several cards, and the parsers of llama-server's own lines."""

from __future__ import annotations

import pytest

from supervisor.policy.devices import (
    AMD, GIB, HIDE_ALL_GPUS, INTEL, MIB, NVIDIA, Card, ChildArgs, Listed, Room, cuda_visible,
    devices_of_child, given_why, is_apu, names_cards, normalize_pci, parse_listing,
    parse_using_device, pick, short_of, tightest, usable_by_build, visible,
)

N1 = Card(NVIDIA, "0000:01:00.0", "GPU-aaa", "RTX 3090")
N2 = Card(NVIDIA, "0000:02:00.0", "GPU-bbb", "RTX 3060")
A1 = Card(AMD, "0000:03:00.0", "", "Radeon RX 7900 XTX")
A2 = Card(AMD, "0000:83:00.0", "", "Radeon RX 7600")
IGPU = Card(INTEL, "0000:00:02.0", "", "Intel UHD 770")


@pytest.mark.parametrize("text,pci", [
    ("00000000:2B:00.0", "0000:2b:00.0"),  # NVML
    ("0000:03:00.0", "0000:03:00.0"),  # the kernel, drm-pdev
    ("03:00.0", "0000:03:00.0"),  # lspci's short form
    ("PCI_SLOT_NAME=0000:C3:00.0", "0000:c3:00.0"),
    ("GPU-1234", None),
    ("", None),
])
def test_a_pci_address_is_written_one_way(text: str, pci: str | None) -> None:
    assert normalize_pci(text) == pci


def test_the_listing_and_the_load_log_are_read_as_llama_server_writes_them() -> None:
    # llama-server --list-devices (common/arg.cpp), a real ROCm APU's from llama.cpp#19764.
    listed = parse_listing([
        "Available devices:",
        "  ROCm0: AMD Radeon(TM) Graphics (110511 MiB, 110357 MiB free)",
        "  Vulkan0: Intel(R) Arc(TM) A770 Graphics (16225 MiB, 15908 MiB free)",
        "  SYCL1: Intel(R) Arc(TM) B580 Graphics (11605 MiB, 11605 MiB free)",
        "  (none)",
    ])
    assert [(d.name, d.vendor, d.total_mib, d.free_mib) for d in listed] == [
        ("ROCm0", AMD, 110511, 110357), ("Vulkan0", INTEL, 16225, 15908),
        ("SYCL1", INTEL, 11605, 11605)]
    # src/llama.cpp's line at -lv 4, with the address the backend reports.
    line = ("0.00.151.101 I llama_model_load_from_file_impl: using device CUDA0 (NVIDIA H200) "
            "(0000:01:00.0) - 142617 MiB free")
    used = parse_using_device(line)
    assert used is not None and used.name == "CUDA0" and used.pci_bus_id == "0000:01:00.0"
    assert used.free_mib == 142617 and used.vendor == NVIDIA
    assert parse_using_device("using device Vulkan0 (AMD Radeon RX 6800) (unknown id) - "
                              "15000 MiB free").pci_bus_id is None  # type: ignore[union-attr]
    assert parse_using_device("load_tensors: offloaded 31/31 layers to GPU") is None


def test_gpu_device_picks_by_index_address_or_uuid_and_says_what_is_missing() -> None:
    cards = [N1, N2]
    assert pick(cards, None) == (cards, "")
    assert pick(cards, "all") == (cards, "")
    assert pick(cards, "1") == ([N2], "")
    assert pick(cards, "00000000:01:00.0") == ([N1], "")
    assert pick(cards, "GPU-bbb, 0") == ([N2, N1], "")
    assert pick(cards, "7,0000:99:00.0") == ([], "7, 0000:99:00.0")


def test_the_cards_of_the_vendors_the_build_lists() -> None:
    cards = [IGPU, N1, A1]
    cuda = [Listed("CUDA", 0, "NVIDIA GeForce RTX 3090", 24576, 24000)]
    vulkan_amd = [Listed("Vulkan", 0, "AMD Radeon RX 7900 XTX (RADV NAVI31)", 24560, 24000)]
    # An Intel iGPU first in PCI order does not become "card 0" of a CUDA build.
    assert usable_by_build(cards, cuda) == [N1]
    assert usable_by_build(cards, vulkan_amd) == [A1]
    assert usable_by_build(cards, []) == cards  # a CPU build, or not listed yet


CASES = [
    # (what, candidates, args, logged, holdings, expected ids, how)
    ("one card, nothing known", [N1], ChildArgs(), [], {},
     ("0000:01:00.0",), "config"),
    ("two NVIDIA cards split by -ts", [N1, N2], ChildArgs(tensor_split="3,1"), [], {},
     ("0000:01:00.0", "0000:02:00.0"), "config"),
    ("-ts with a zero leaves that card out", [N1, N2], ChildArgs(tensor_split="0,1"), [], {},
     ("0000:02:00.0",), "config"),
    ("-sm none with -mg 1: CUDA's order is the PCI order", [N1, N2],
     ChildArgs(split_mode="none", main_gpu="1"), [], {}, ("0000:02:00.0",), "config"),
    ("-dev CUDA1", [N1, N2], ChildArgs(device="CUDA1"), [], {}, ("0000:02:00.0",), "config"),
    ("-dev ROCm1 of two AMD cards: ROCm's order is not known, both count", [A1, A2],
     ChildArgs(device="ROCm1"), [], {}, ("0000:03:00.0", "0000:83:00.0"), "config (assumed)"),
    ("-dev Vulkan0 with one card", [A1], ChildArgs(device="Vulkan0"), [], {},
     ("0000:03:00.0",), "config"),
    ("-sm none of two AMD cards: assumed both", [A1, A2], ChildArgs(split_mode="none"), [], {},
     ("0000:03:00.0", "0000:83:00.0"), "config (assumed)"),
    ("--device none", [N1], ChildArgs(device="none"), [], {}, (), "none"),
    ("the load log names the card, whatever the args say", [A1, A2],
     ChildArgs(device="ROCm1"),
     [Listed("ROCm", 1, "AMD Radeon RX 7600", None, 7000, "0000:83:00.0")], {},
     ("0000:83:00.0",), "load log"),
    ("its own memory names the card", [A1, A2], ChildArgs(device="ROCm1"), [],
     {"0000:83:00.0": 6 * GIB}, ("0000:83:00.0",), "its own memory"),
    ("a context's worth on the other card is not a card it uses", [N1, N2], ChildArgs(), [],
     {"0000:01:00.0": 20 * GIB, "0000:02:00.0": 300 * MIB}, ("0000:01:00.0",),
     "its own memory"),
    ("a split model holds memory on both", [N1, N2], ChildArgs(), [],
     {"0000:01:00.0": 12 * GIB, "0000:02:00.0": 4 * GIB},
     ("0000:01:00.0", "0000:02:00.0"), "its own memory"),
]


@pytest.mark.parametrize("what,candidates,args,logged,holdings,ids,how", CASES,
                         ids=[c[0] for c in CASES])
def test_which_cards_the_gpu_child_uses(what: str, candidates: list[Card], args: ChildArgs,
                                        logged: list[Listed], holdings: dict[str, int],
                                        ids: tuple[str, ...], how: str) -> None:
    selection = devices_of_child(candidates, args, logged, holdings)
    assert (selection.pci_bus_ids, selection.how) == (ids, how)
    assert selection.exact == (how != "config (assumed)")


def test_ts_ratios_become_each_cards_share() -> None:
    selection = devices_of_child([N1, N2], ChildArgs(tensor_split="3,1"))
    assert selection.shares == {"0000:01:00.0": 0.75, "0000:02:00.0": 0.25}
    assert devices_of_child([N1, N2], ChildArgs()).shares is None  # by free memory


def rooms(*free_mib: int) -> list[Room]:
    return [Room(f"0000:0{i + 1}:00.0", f"card {i}", f * MIB, 24 * GIB)
            for i, f in enumerate(free_mib)]


def test_the_headroom_holds_on_every_card() -> None:
    assert tightest(rooms(9000, 500)) == rooms(9000, 500)[1]
    assert tightest([]) is None
    # 4 GiB over two cards by free memory, 1 GiB headroom on each.
    assert short_of(rooms(9000, 9000), 4 * GIB, GIB) is None
    short = short_of(rooms(9000, 1100), 4 * GIB, GIB)
    assert short is not None and short[0].label == "card 1"
    # With -ts 1,1 the second card must take half: 2 GiB + 1 GiB headroom.
    shares = {"0000:01:00.0": 0.5, "0000:02:00.0": 0.5}
    short = short_of(rooms(20000, 3000), 4 * GIB, GIB, shares)
    assert short is not None and short[1] == 3 * GIB
    assert short_of(rooms(20000, 3072), 4 * GIB, GIB, shares) is None
    assert short_of([], GIB, GIB) is None  # no figures: no rule


def test_an_apu_counts_gtt_by_ollamas_rule() -> None:
    assert is_apu(512 * MIB, 64 * GIB)  # a small carve-out, a large GTT window
    assert is_apu(4 * GIB, 16 * GIB)
    assert not is_apu(4 * GIB, 15 * GIB)
    assert not is_apu(24 * GIB, 32 * GIB)  # a discrete card
    assert not is_apu(96 * GIB, 16 * GIB)  # Strix Halo with its VRAM carve-out set high


def test_the_cpu_child_is_hidden_from_every_vendors_cards() -> None:
    assert set(HIDE_ALL_GPUS) == {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                  "ROCR_VISIBLE_DEVICES", "GGML_VK_VISIBLE_DEVICES",
                                  "ONEAPI_DEVICE_SELECTOR"}
    assert HIDE_ALL_GPUS["CUDA_VISIBLE_DEVICES"] == ""


def test_the_visible_devices_variables_narrow_what_a_process_sees() -> None:
    cards = [N1, N2, A1, A2]
    assert visible(cards, {}) == cards
    assert visible(cards, {"CUDA_VISIBLE_DEVICES": "1"}) == [N2, A1, A2]
    assert visible(cards, {"CUDA_VISIBLE_DEVICES": "GPU-bb"}) == [N2, A1, A2]  # a prefix
    assert visible(cards, {"CUDA_VISIBLE_DEVICES": ""}) == [A1, A2]
    assert visible(cards, {"CUDA_VISIBLE_DEVICES": "0,7,1"}) == [N1, A1, A2]  # ends at 7
    assert visible(cards, {"ROCR_VISIBLE_DEVICES": "-1"}) == [N1, N2]
    # ROCR first, then HIP numbers what ROCR left.
    assert visible(cards, {"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0"}) == [
        N1, N2, A2]


def test_gpu_device_left_unset_names_no_card() -> None:
    assert not names_cards(None) and not names_cards("all") and not names_cards(" ALL ")
    assert names_cards("0") and names_cards("0,1") and names_cards("GPU-aaa")


@pytest.mark.parametrize("given, device, sampled, own, expected", [
    # unset: every NVIDIA card it is given, by UUID in PCI order (CUDA's own numbering)
    ([N1, N2], None, True, None, "GPU-aaa,GPU-bbb"),
    ([N1], None, True, None, "GPU-aaa"),  # one card: as when gpu.device defaulted to 0
    ([N1, N2, A1], None, True, None, "GPU-aaa,GPU-bbb"),  # AMD's are not CUDA's to hide
    ([A1, A2], None, True, None, None),
    ([N2], None, True, "1", None),  # the user's own CUDA_VISIBLE_DEVICES, kept as given
    ([], None, False, None, None),  # no figures: it sees what llama-server alone would
    # pinned: those named, in gpu.device's order; without figures, indices as given
    ([N1], "0", True, None, "GPU-aaa"),
    ([N2, N1], "1,0", True, None, "GPU-bbb,GPU-aaa"),
    ([], "1", False, None, "1"),
    ([], "0, 1", False, None, "0,1"),
    ([], "GPU-aaa", False, None, None),
    ([N1, N2], "all", True, None, None),  # "all": nothing set
])
def test_which_nvidia_cards_the_gpu_child_sees(given: list[Card], device: str | None,
                                              sampled: bool, own: str | None,
                                              expected: str | None) -> None:
    assert cuda_visible(given, device, sampled, own) == expected


def test_why_the_gpu_child_is_given_its_cards() -> None:
    assert given_why(None, {NVIDIA}) == ("gpu.device is not set: every NVIDIA card it can see, "
                                         "as llama-server alone uses them")
    assert given_why(None, set()) == ("gpu.device is not set: every card it can see, as "
                                      "llama-server alone uses them")
    assert given_why("all", {AMD, INTEL}) == 'gpu.device = "all": every AMD/Intel card it can see'
    assert given_why(" 0 ", {NVIDIA}) == 'gpu.device = "0"'


def test_what_narrowed_the_cards_is_said() -> None:
    assert devices_of_child([N1, N2], ChildArgs()).why == "every card it is given"
    assert devices_of_child([N1, N2], ChildArgs(split_mode="none", main_gpu="1")).why == (
        "the cards it is given that its -sm none -mg 1 leaves it")
