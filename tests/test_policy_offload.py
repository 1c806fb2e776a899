"""The offload reader (policy/offload.py): the GPU child's load log, as the pinned llama.cpp
prints it (tests/fixtures/load-logs: real captures and lines made from its format strings), its
args, and its own memory against the model's size, to full / partial / none / unknown."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.policy import offload
from supervisor.policy.offload import FULL, NONE, PARTIAL, UNKNOWN, Asked, LoadLog, Memory

LOGS = Path(__file__).parent / "fixtures" / "load-logs"
MIB = 1024 * 1024
MODEL = 92 * MIB  # SmolLM2-135M Q4_1's weights, about
N_LAYER = 30


def read(name: str) -> LoadLog:
    log = LoadLog()
    for line in (LOGS / name).read_text(encoding="utf-8").splitlines():
        log.feed(line)
    return log


@pytest.mark.parametrize("name,offloaded,total,on_gpu,no_gpu,backend", [
    ("cpu-build-ngl99.log", None, None, None, True, None),
    ("cpu-build-ngl99-lv4.log", None, None, None, True, None),
    ("cpu-build-no-ngl.log", None, None, None, False, None),
    ("cuda-h200-ngl99.log", None, None, None, False, None),
    ("cuda-full-lv4.log", 31, 31, 31, False, None),
    ("cuda-partial-lv4.log", 12, 31, 12, False, None),
    ("cuda-dev-none-lv4.log", 31, 31, 0, False, None),  # the count lies: no device buffer
    ("cuda-init-failed.log", None, None, None, True, "CUDA"),
    ("cuda-init-failed-no-ngl.log", None, None, None, False, "CUDA"),
    ("rocm-init-failed.log", None, None, None, True, "ROCm"),
])
def test_the_load_logs_read(name: str, offloaded: int | None, total: int | None,
                            on_gpu: int | None, no_gpu: bool, backend: str | None) -> None:
    log = read(name)
    assert (log.offloaded, log.total, log.layers_on_gpu) == (offloaded, total, on_gpu)
    assert (log.no_gpu is not None) == no_gpu
    assert log.backend == backend
    if backend is not None:
        assert log.init_failure is not None and log.init_failure.startswith("ggml_cuda_init:")


def test_buffers_are_told_apart_by_where_they_live() -> None:
    log = read("cuda-full-lv4.log")
    assert log.device_buffers == {"CUDA0": 71.84} and log.host_buffers == {"CPU_Mapped": 20.25}
    for host in ("CPU", "CPU_Mapped", "CPU_REPACK", "AMX", "CUDA_Host", "Vulkan_Host"):
        assert not offload.is_device_buffer(host), host
    for device in ("CUDA0", "ROCm1", "Vulkan0", "Metal", "SYCL0", "CUDA_Split"):
        assert offload.is_device_buffer(device), device


@pytest.mark.parametrize("line,backend", [
    ("ggml_cuda_init: failed to initialize MUSA: no MUSA-capable device is detected", "MUSA"),
    ("0.00.000.1 E ggml_cann_init: failed to initialize CANN: EE1001", "CANN"),
    ("SYCL: failed to initialize: ggml_sycl_init", "SYCL"),
    ("0.00.000.2 I ggml_vulkan: No devices found.", "Vulkan"),
])
def test_other_backends_failing_to_start(line: str, backend: str) -> None:
    log = LoadLog()
    log.feed(line)
    assert log.backend == backend


def test_reset_forgets_the_last_process() -> None:
    log = read("cuda-init-failed.log")
    log.reset()
    assert log == LoadLog()


@pytest.mark.parametrize("ngl,fit,device,layers,is_fit", [
    ("99", None, None, 99, False),
    ("all", "off", None, None, False),
    ("-2", "off", None, None, False),
    ("auto", "off", None, None, False),  # as Spillway runs it: fit off, so auto is all
    (None, "off", None, None, False),  # llama.cpp's default is auto
    ("auto", "on", None, None, True),
    (None, "on", None, None, True),
    ("0", None, None, 0, False),
    ("99", "off", "none", 0, False),
])
def test_what_the_args_ask(ngl: str | None, fit: str | None, device: str | None,
                           layers: int | None, is_fit: bool) -> None:
    asked = offload.asked(ngl, fit, device)
    assert (asked.layers, asked.fit) == (layers, is_fit)


ALL = offload.asked("99", "off")
NO_FIGURES = Memory(None, MODEL)


def memory(held_mib: float, others_mib: float = 0) -> Memory:
    return Memory(int(held_mib * MIB), MODEL, int(others_mib * MIB))


# (log, asked, memory, state, offloaded, short, words in why)
CASES = [
    # The real CPU build, -ngl 99: llama-server says so, whatever else is known.
    ("cpu-build-ngl99.log", ALL, NO_FIGURES, NONE, 0, True, "no usable GPU found"),
    ("cpu-build-ngl99.log", ALL, memory(0), NONE, 0, True,
     "0 of 31 layers on the GPU: it holds 0 MiB of VRAM for a 92 MiB model (llama-server: "
     "no usable GPU found)"),
    ("cpu-build-ngl99-lv4.log", ALL, NO_FIGURES, NONE, 0, True, "no usable GPU found"),
    # Silent logs (default verbosity): the memory decides.
    ("cuda-h200-ngl99.log", ALL, NO_FIGURES, UNKNOWN, None, False, "per-process"),
    ("cuda-h200-ngl99.log", ALL, memory(3858), FULL, 31, False, "holds 3858 MiB"),
    ("cuda-h200-ngl99.log", ALL, memory(0), NONE, 0, True, "holds 0 MiB"),
    ("cuda-h200-ngl99.log", ALL, memory(8), NONE, 0, True, "0 of 31"),  # under 10 %
    ("cuda-h200-ngl99.log", ALL, memory(10), PARTIAL, None, True, "under 80%"),  # 10 %
    ("cuda-h200-ngl99.log", ALL, memory(73), PARTIAL, None, True, "part of it"),
    ("cuda-h200-ngl99.log", ALL, memory(74), FULL, 31, False, "all of its layers"),  # 80 %
    ("cpu-build-no-ngl.log", offload.asked(None, "off"), memory(0), NONE, 0, True, "0 MiB"),
    # Asked for fewer than all: some held is as asked.
    ("cuda-h200-ngl99.log", offload.asked("12", "off"), memory(40), PARTIAL, None, False,
     "as asked (-ngl 12)"),
    ("cuda-h200-ngl99.log", offload.asked("12", "off"), memory(0), NONE, 0, True, "0 of 31"),
    # -fit on chooses: partial is its choice, none is still short.
    ("cuda-h200-ngl99.log", offload.asked("auto", "on"), memory(40), PARTIAL, None, False,
     "-fit chose"),
    ("cuda-h200-ngl99.log", offload.asked("auto", "on"), memory(0), NONE, 0, True, "0 of"),
    # Weights kept on the CPU on purpose: the memory cannot tell.
    ("cuda-h200-ngl99.log", Asked(None, "-ngl 99", overrides=True), memory(40), UNKNOWN,
     None, False, "-ot"),
    # Nothing held by its pid, but another process holds a model's worth: another pid
    # namespace, maybe.
    ("cuda-h200-ngl99.log", ALL, memory(0, others_mib=3858), UNKNOWN, None, False,
     "another pid"),
    # -lv 4 counts.
    ("cuda-full-lv4.log", ALL, NO_FIGURES, FULL, 31, False, "31 of 31 layers on the GPU"),
    ("cuda-full-lv4.log", ALL, memory(0), FULL, 31, False, "31 of 31"),  # the log wins
    ("cuda-partial-lv4.log", ALL, NO_FIGURES, PARTIAL, 12, True, "12 of 31 layers on the GPU, "
     "31 asked"),
    ("cuda-partial-lv4.log", offload.asked("12", "off"), NO_FIGURES, PARTIAL, 12, False,
     "as asked (-ngl 12)"),
    ("cuda-partial-lv4.log", offload.asked("auto", "on"), NO_FIGURES, PARTIAL, 12, False,
     "as -fit chose"),
    ("cuda-dev-none-lv4.log", ALL, NO_FIGURES, NONE, 0, True, "0 of 31 layers on the GPU"),
    # A backend that did not start.
    ("cuda-init-failed.log", ALL, NO_FIGURES, NONE, 0, True, "no usable GPU found"),
    ("cuda-init-failed-no-ngl.log", offload.asked(None, "off"), NO_FIGURES, NONE, 0, True,
     "0 of 31 layers on the GPU: the CUDA backend did not start: ggml_cuda_init: failed to "
     "initialize CUDA: CUDA driver version is insufficient"),
    ("cuda-init-failed-no-ngl.log", offload.asked(None, "off"), memory(1), NONE, 0, True,
     "CUDA did not start"),
    # ... but another backend of the build may hold it: its memory says so.
    ("cuda-init-failed-no-ngl.log", offload.asked(None, "off"), memory(3000), FULL, 31, False,
     "all of its layers"),
    ("rocm-init-failed.log", ALL, NO_FIGURES, NONE, 0, True, "no usable GPU found"),
    # Asked for none.
    ("cpu-build-ngl99.log", offload.asked("0"), memory(0), NONE, 0, False, "as asked (-ngl 0)"),
    ("cuda-dev-none-lv4.log", offload.asked("99", "off", "none"), NO_FIGURES, NONE, 0, False,
     "as asked (-dev none)"),
]


@pytest.mark.parametrize("name,asked,mem,state,offloaded,short,words", CASES)
def test_the_verdict(name: str, asked: Asked, mem: Memory, state: str, offloaded: int | None,
                     short: bool, words: str) -> None:
    verdict = offload.judge(read(name), asked, mem, N_LAYER)
    assert verdict.state == state, verdict
    assert verdict.offloaded == offloaded, verdict
    assert verdict.short is short, verdict
    assert words in verdict.why, verdict.why
    assert verdict.total == 31


def test_without_the_models_shape_or_size() -> None:
    silent = read("cuda-h200-ngl99.log")
    # Nothing on its cards is none whatever the model's size.
    verdict = offload.judge(silent, ALL, Memory(0, None))
    assert (verdict.state, verdict.total, verdict.short) == (NONE, None, True)
    assert verdict.why.startswith("none of its layers on the GPU: it holds 0 MiB of VRAM")
    # Something held, of a model of unknown size: not known.
    assert offload.judge(silent, ALL, Memory(500 * MIB, None)).state == UNKNOWN


def test_the_status_json_and_the_incident_kind() -> None:
    none = offload.judge(read("cpu-build-ngl99.log"), ALL, memory(0), N_LAYER)
    assert none.to_json() == {
        "state": "none", "why": none.why, "short": True, "source": "log",
        "layers": {"offloaded": 0, "total": 31, "asked": 31}}
    assert none.kind == "no_offload"
    partial = offload.judge(read("cuda-partial-lv4.log"), ALL, NO_FIGURES, N_LAYER)
    assert partial.kind == "partial_offload"
    full = offload.judge(read("cuda-full-lv4.log"), ALL, NO_FIGURES, N_LAYER)
    assert full.kind is None
    assert offload.pending("not ready").to_json() == {"state": "unknown", "why": "not ready",
                                                       "short": False, "source": None}
