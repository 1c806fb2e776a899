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
