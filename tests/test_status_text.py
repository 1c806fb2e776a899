"""`spillway status` as text: a line per card (the GPU child's use on its own cards, the
others marked as not its own, estimates and an APU's VRAM+GTT said), how the GPU child's cards
are known when that is assumed or none, and `GPU: none (why)` without figures. The statuses are
built by the GPU monitor itself (GpuMonitor.to_json), so that they have the daemon's shape."""

from __future__ import annotations

from typing import Any

from supervisor.commands.cli import format_status
from supervisor.gpu import MIB, GpuSample
from supervisor.gpu.monitor import GpuMonitor
from supervisor.policy.devices import Selection

GIB = 1024 * MIB
PID = 4242
APU = "0000:c4:00.0"
ARC = "0000:03:00.0"
ASSUMED = "the backend numbers its devices in its own order, so every card it may use counts"


def card(pci: str, name: str, total: int, used: int, **more: Any) -> GpuSample:
    return GpuSample(monotonic=0.0, wall=0.0, index=0, name=name, pci_bus_id=pci, uuid="",
                     total_bytes=total, free_bytes=total - used, used_bytes=used, **more)


def status(cards: list[GpuSample], selection: Selection,
           gpu_note: str | None = None) -> dict[str, Any]:
    monitor = GpuMonitor(1.0, samplers=[])
    monitor.devices = cards
    monitor.selection = selection
    return {"version": "0", "uptime_s": 1.0, "listen": ["127.0.0.1:8080"], "serving": True,
            "children": {"gpu": {"state": "READY", "pid": PID}},
            "gpu": monitor.to_json({"gpu": [PID], "cpu": None}), "gpu_note": gpu_note}


def gpu_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("GPU")]


TWO = [  # in PCI order, as the monitor keeps them
    card(ARC, "Intel Arc A770", 16 * GIB, GIB, vendor="intel", estimated=True,
         source="estimate: SYCL0's listing by llama-server, and the children's fdinfo"),
    card(APU, "AMD Radeon 780M", 32 * GIB, 20 * GIB, vendor="amd", memory="vram+gtt",
         source="amdgpu sysfs (VRAM and GTT: an APU)", process_bytes={PID: 18 * GIB}),
]


def test_two_cards_a_line_each_the_gpu_childs_use_on_its_own_and_why_it_is_assumed() -> None:
    assert gpu_lines(format_status(status(TWO, Selection((APU,), "config (assumed)",
                                                         ASSUMED)))) == [
        f"GPU {ARC} Intel Arc A770 (intel, estimate: SYCL0's listing by llama-server, and the "
        "children's fdinfo): 15.0 GiB free of 16.0 GiB (estimate); not the GPU child's",
        f"GPU {APU} AMD Radeon 780M (amd, amdgpu sysfs (VRAM and GTT: an APU)): 12.0 GiB free "
        "of 32.0 GiB VRAM+GTT; GPU child uses 18.0 GiB",
        f"GPU child's cards: {APU}, by config (assumed): {ASSUMED}",
    ]


def test_one_card_known_from_the_load_log_is_one_line() -> None:
    rtx = card("0000:01:00.0", "NVIDIA RTX 4090", 24 * GIB, 22 * GIB - 102 * MIB,
               process_bytes={PID: 18 * GIB + 300 * MIB})
    assert gpu_lines(format_status(status([rtx], Selection(
        ("0000:01:00.0",), "load log", "named by its load log")))) == [
        "GPU 0000:01:00.0 NVIDIA RTX 4090 (nvidia, nvml): 2.1 GiB free of 24.0 GiB; GPU child "
        "uses 18.3 GiB"]


def test_a_gpu_child_on_no_card_says_why_once() -> None:
    why = "--device none: it uses no GPU"
    text = format_status(status(TWO, Selection((), "none", why), gpu_note=why))
    lines = gpu_lines(text)
    assert [line.split(" ")[1] for line in lines[:2]] == [ARC, APU]
    assert all(line.endswith("; not the GPU child's") for line in lines[:2]), lines
    assert lines[2:] == [f"GPU child's cards: none ({why})"]
    # gpu.device names no card here: the note says so, besides the cards there are.
    note = "gpu.device names '7': no such card here"
    lines = gpu_lines(format_status(status(TWO, Selection((), "none", note + " (cards: …)"),
                                           gpu_note=note)))
    assert lines[-1] == f"GPU note: {note}", lines


def test_no_figures_at_all_is_one_line_with_the_note() -> None:
    text = format_status({"children": {}, "gpu": None, "gpu_note": "NVML Shared Library Not Found",
                          "serving": True})
    assert gpu_lines(text) == ["GPU: none (NVML Shared Library Not Found)"]


def test_the_small_child_says_its_model_its_mode_and_whom_it_serves() -> None:
    s = status([], Selection((), "config"))
    s["children"]["small"] = {"state": "READY", "pid": PID + 1, "runs_on": "CPU",
                              "smaller_model": "qwen2.5-1.5b.gguf", "mode": "on-demand",
                              "requests": "opt-in"}
    text = format_status(s)
    assert ("  smaller model: qwen2.5-1.5b.gguf (on-demand; for requests with "
            "X-Spillway-Fallback: smaller)") in text.splitlines()
    s["children"]["small"]["requests"] = "all"
    assert "for every request)" in format_status(s)
    del s["children"]["small"]
    assert "smaller model" not in format_status(s)


def test_two_cards_say_which_the_gpu_child_is_given_and_why() -> None:
    """Issue 37: with two cards, the status says which the GPU child has and why: all of them
    with gpu.device unset, or the one it pins (the other then not given, rather than merely
    not its own)."""
    first, second = "0000:01:00.0", "0000:02:00.0"
    cards = [card(first, "RTX 3090", 24 * GIB, 4 * GIB, process_bytes={PID: 3 * GIB}),
             card(second, "RTX 3060", 12 * GIB, 2 * GIB, process_bytes={PID: GIB})]
    unset = "gpu.device is not set: every NVIDIA card it can see, as llama-server alone uses them"
    both = Selection((first, second), "its own memory", "where its process holds memory",
                     given=(first, second), given_why=unset)
    shown = status(cards, both)
    assert shown["gpu"]["gpu_child_given"] == {"pci_bus_ids": [first, second], "why": unset}
    assert [d["given_to_gpu_child"] for d in shown["gpu"]["devices"]] == [True, True]
    assert gpu_lines(format_status(shown)) == [
        f"GPU {first} RTX 3090 (nvidia, nvml): 20.0 GiB free of 24.0 GiB; GPU child uses "
        "3.0 GiB",
        f"GPU {second} RTX 3060 (nvidia, nvml): 10.0 GiB free of 12.0 GiB; GPU child uses "
        "1.0 GiB",
        f"GPU child is given: {first}, {second} ({unset})",
    ]
    pinned = Selection((first,), "config", "every card it is given", given=(first,),
                       given_why='gpu.device = "0"')
    lines = gpu_lines(format_status(status(cards, pinned)))
    assert lines[1].endswith("; not given to the GPU child")
    assert lines[2] == f'GPU child is given: {first} (gpu.device = "0")'


def test_the_status_says_what_an_upgrade_or_a_start_after_a_crash_took_over() -> None:
    """Issue 40: the daemon's line under the header."""
    base = status(TWO, Selection((APU,), "config (assumed)", ASSUMED))
    upgraded = {**base, "daemon": {
        "pid": 20, "adopted": {"gpu": 11, "cpu": 12},
        "upgrade": {"pid": 10, "serving": "2026-01-01T00:00:00.000Z"}}}
    lines = format_status(upgraded).splitlines()
    assert lines[1] == ("upgraded at 2026-01-01T00:00:00.000Z from pid 10 (pid 20 now): kept "
                        "gpu (pid 11), cpu (pid 12)")
    crashed = {**base, "daemon": {
        "pid": 20, "started": "2026-01-01T00:00:05.000Z", "adopted": {"gpu": 11},
        "adopted_from_pid": 10, "ended": [{"child": "small", "pid": 13,
                                           "why": "the config has no such child now"}]}}
    lines = format_status(crashed).splitlines()
    assert lines[1:3] == [
        "started at 2026-01-01T00:00:05.000Z after pid 10 ended without stopping its "
        "children: adopted gpu (pid 11)",
        "ended pid 13 (small): the config has no such child now"]
    assert format_status(base).splitlines()[1] == ""  # nothing taken over: no line
