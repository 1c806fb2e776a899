"""Evidence -> failure kind, table-driven over captured llama-server output and the CUDA,
Vulkan and Metal strings the backends print."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.policy.evidence import (
    Evidence, FailureKind, VramSample, classify, classify_exit, classify_response,
)

FIXTURES = Path(__file__).parent / "fixtures" / "llama-server"
K = FailureKind


def log_lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


def body(name: str) -> tuple[int, str]:
    data = json.loads((FIXTURES / name).read_text())
    return data["status"], json.dumps(data["json"])


LOW = VramSample(free_mib=61, total_mib=143771, age_s=0.4)  # as measured before the H200 abort
PLENTY = VramSample(free_mib=138765, total_mib=143771, age_s=0.4)
STALE_LOW = VramSample(free_mib=61, total_mib=143771, age_s=120.0)


@pytest.mark.parametrize("log,returncode,vram,kind,decider", [
    # The real H200 runtime OOMs: only the terse line got out; the exit status and the GPU
    # sample decide between runtime_oom and cuda_error.
    ("gpu/B-runtime-oom.log", -6, LOW, K.RUNTIME_OOM, "ggml-cuda.cu:109: CUDA error"),
    ("gpu/B-runtime-oom.log", -6, None, K.CUDA_ERROR, "ggml-cuda.cu:109: CUDA error"),
    ("gpu/B-runtime-oom.log", -6, PLENTY, K.CUDA_ERROR, "ggml-cuda.cu:109: CUDA error"),
    ("gpu/B-runtime-oom.log", -6, STALE_LOW, K.CUDA_ERROR, "ggml-cuda.cu:109: CUDA error"),
    ("gpu/E-stream-oom.log", -6, LOW, K.RUNTIME_OOM, "ggml-cuda.cu:109: CUDA error"),
    ("gpu/E-stream-oom.log", -6, None, K.CUDA_ERROR, "ggml-cuda.cu:109: CUDA error"),
    # A shell wrapper reports SIGABRT as 134.
    ("gpu/B-runtime-oom.log", 134, LOW, K.RUNTIME_OOM, "ggml-cuda.cu:109: CUDA error"),
    # Load-time OOMs exit with code 1 after the allocation chain, on CUDA and on the CPU.
    ("gpu/A-load-oom.log", 1, None, K.LOAD_OOM, "failed to allocate buffer for kv cache"),
    ("cpu/load-oom-cpu.log", 1, None, K.LOAD_OOM, "failed to allocate buffer for kv cache"),
    # Killed with no CUDA line and memory to spare: a crash.
    ("cpu/server-SIGABRT.log", -6, PLENTY, K.CRASH, "killed by SIGABRT"),
    ("cpu/server-SIGKILL.log", -9, None, K.CRASH, "killed by SIGKILL"),
    # Every line lost, but SIGABRT with the GPU full just before: still an OOM.
    ("cpu/server-SIGABRT.log", -6, LOW, K.RUNTIME_OOM, "SIGABRT with free VRAM 61 MiB"),
])
def test_exit_evidence_from_captured_logs(log: str, returncode: int, vram: VramSample | None,
                                          kind: FailureKind, decider: str) -> None:
    verdict = classify_exit(returncode, log_lines(log), vram)
    assert verdict.kind is kind
    assert decider in verdict.evidence


@pytest.mark.parametrize("line,kind", [
    # CUDA, when the out-of-memory lines did get out
    ("CUDA error: out of memory", K.RUNTIME_OOM),
    ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 512.00 MiB on device 0: "
     "cudaMalloc failed: out of memory", K.RUNTIME_OOM),
    # Vulkan
    ("ggml_vulkan: Device memory allocation of size 960581632 failed.", K.RUNTIME_OOM),
    ("ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory", K.RUNTIME_OOM),
    # Metal
    ("error: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
     K.RUNTIME_OOM),
    # nothing of the kind
    ("ggml_metal_graph_compute: command buffer 0 failed with status 5", K.CRASH),
])
def test_backend_oom_lines_before_an_abort(line: str, kind: FailureKind) -> None:
    lines = ["I srv  llama_server: model loaded", line, "llama.cpp/ggml/src/ggml.c:1: fatal"]
    assert classify_exit(-6, lines).kind is kind


@pytest.mark.parametrize("status,text,kind", [
    (500, '{"error":{"code":500,"message":"Compute error.","type":"server_error"}}',
     K.OOM_SURVIVED),
    (500, '{"error":{"code":500,"message":"decode() failed: ErrorOutOfDeviceMemory"}}',
     K.OOM_SURVIVED),
    (500, '{"error":{"code":500,"message":"kIOGPUCommandBufferCallbackErrorOutOfMemory"}}',
     K.OOM_SURVIVED),
    (500, '{"error":{"code":500,"message":"Context size has been exceeded."}}',
     K.CONTEXT_EXCEEDED),
    (500, '{"error":{"code":500,"message":"template error"}}', K.NONE),
    (200, '{"choices":[]}', K.NONE),
])
def test_upstream_bodies(status: int, text: str, kind: FailureKind) -> None:
    assert classify_response(status, text).kind is kind


@pytest.mark.parametrize("fixture,kind", [
    ("cpu/health-loading.json", K.NOT_READY),
    ("cpu/error-exceed-context-400.json", K.CONTEXT_EXCEEDED),
    ("cpu/error-bad-messages-400.json", K.CLIENT_ERROR),
    ("cpu/error-invalid-json-400.json", K.CLIENT_ERROR),
    ("cpu/chat-completions-200.json", K.NONE),
])
def test_captured_response_bodies(fixture: str, kind: FailureKind) -> None:
    status, text = body(fixture)
    verdict = classify_response(status, text)
    assert verdict.kind is kind
    assert verdict.evidence.startswith(f"HTTP {status}")


def test_a_vulkan_oom_the_child_survived_is_read_from_the_body() -> None:
    verdict = classify(Evidence(upstream_status=500,
                                upstream_body="decode() failed: ErrorOutOfDeviceMemory"))
    assert verdict.kind is K.OOM_SURVIVED
    assert verdict.child_failed


def test_connection_evidence_without_an_exit() -> None:
    assert classify(Evidence(connect_failed=True)).kind is K.NOT_READY
    closed = classify(Evidence(closed_before_response=True))
    assert closed.kind is K.CRASH and "still running" in closed.evidence
    assert not classify(Evidence(upstream_status=400, upstream_body="bad")).child_failed


def test_exit_status_outranks_everything_else() -> None:
    ev = Evidence(returncode=-6, stderr_tail=["ggml-cuda.cu:109: CUDA error"],
                  upstream_status=500, upstream_body="Compute error.", vram=LOW)
    assert classify(ev).kind is K.RUNTIME_OOM


def test_the_vram_note_names_the_device_when_the_sample_does() -> None:
    amd = VramSample(free_mib=61, total_mib=24560, age_s=0.4,
                     device="0000:03:00.0 AMD Radeon RX 7900 XTX")
    verdict = classify_exit(-6, ["/app/ggml/src/ggml-cuda/ggml-cuda.cu:115: ROCm error"], amd)
    assert verdict.kind is K.RUNTIME_OOM
    assert verdict.evidence.endswith("(killed by SIGABRT, free VRAM 61 MiB of 24560 MiB on "
                                     "0000:03:00.0 AMD Radeon RX 7900 XTX, 0.4 s before)")
    # Without a device the note reads as before.
    assert "143771 MiB, 0.4 s before" in classify_exit(-6, [], LOW).evidence


# Each backend's terse abort line, as its source prints it (llama.cpp 11434.0.0): the same rule
# as CUDA's: an OOM when the card was nearly full just before, else the backend's error.
@pytest.mark.parametrize("line", [
    "/src/ggml/src/ggml-cuda/ggml-cuda.cu:109: MUSA error",       # ggml_cuda_error, MUSA build
    "/src/ggml/src/ggml-sycl/common.hpp:146: SYCL error",         # ggml_sycl_error
    "/src/ggml/src/ggml-cuda/vendors/hip.h:31: HipVMM Failure: out of memory",
    "terminate called after throwing an instance of 'sycl::_V1::exception'",
    "/src/ggml/src/ggml-metal/ggml-metal-context.m:235: fatal error",
])
def test_every_backends_terse_line_is_read_like_cudas(line: str) -> None:
    assert classify_exit(-6, [line], LOW).kind is K.RUNTIME_OOM
    assert classify_exit(-6, [line], PLENTY).kind is K.CUDA_ERROR
    assert classify_exit(-6, [line], None).kind is K.CUDA_ERROR


@pytest.mark.parametrize("line", [
    "ggml_vulkan: device lost on Vulkan0",                       # ggml_vk_print_device_lost_info
    "ggml_vulkan: vk::Queue::submit: VK_ERROR_DEVICE_LOST",
    "zeCommandQueueSynchronize: ZE_RESULT_ERROR_DEVICE_LOST",
    "NVRM: Xid (PCI:0000:01:00): 79, pid=1234, GPU has fallen off the bus.",
])
def test_a_lost_device_is_a_gpu_fault_whatever_the_memory_says(line: str) -> None:
    for vram in (None, LOW, PLENTY):
        verdict = classify_exit(-6, ["I srv  llama_server: model loaded", line], vram)
        assert verdict.kind is K.GPU_FAULT and verdict.evidence == line and verdict.child_failed
    # Also on a load that failed with exit code 1, and with the process still running.
    assert classify_exit(1, [line, "failed to allocate buffer for kv cache"]).kind is K.GPU_FAULT
    assert classify(Evidence(closed_before_response=True, stderr_tail=[line])).kind is K.GPU_FAULT


def test_the_latest_of_an_oom_and_a_lost_device_decides() -> None:
    oom = "ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory"
    lost = "  what():  vk::Queue::submit: ErrorDeviceLost"
    assert classify_exit(-6, [oom, lost]).kind is K.GPU_FAULT
    assert classify_exit(-6, [lost, oom]).kind is K.RUNTIME_OOM
    assert classify(Evidence(closed_before_response=True, stderr_tail=[lost, oom])).kind \
        is K.RUNTIME_OOM


def test_a_compute_error_after_a_lost_device_is_a_gpu_fault() -> None:
    compute = '{"error":{"code":500,"message":"Compute error.","type":"server_error"}}'
    ignored = ("error: Ignored (for causing prior/excessive GPU errors) "
               "(00000004:kIOAccelCommandBufferCallbackErrorSubmissionsIgnored)")
    verdict = classify_response(500, compute, [ignored])
    assert verdict.kind is K.GPU_FAULT and verdict.evidence.startswith(ignored)
    assert classify_response(500, compute).kind is K.OOM_SURVIVED  # no lines: as before
    assert classify_response(500, '{"error":{"message":"decode() failed: ErrorDeviceLost"}}') \
        .kind is K.GPU_FAULT
    # A 4xx or a complete answer is never a failure of the child, whatever the tail says.
    assert classify_response(400, "bad", [ignored]).kind is K.CLIENT_ERROR
    assert classify_response(200, "{}", [ignored]).kind is K.NONE


@pytest.mark.parametrize("line", [
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: unspecified launch failure",
    "Memory access fault by GPU node-1 (Agent handle: 0x5e7ff2a0) on address 0x7f0c00000000. "
    "Reason: Page not present or supervisor privilege.",
    "error: Caused GPU Timeout Error (00000002:kIOAccelCommandBufferCallbackErrorTimeout)",
])
def test_a_faulting_kernel_is_not_a_lost_device(line: str) -> None:
    assert classify_exit(-6, [line], PLENTY).kind is not K.GPU_FAULT
