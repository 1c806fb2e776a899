"""Evidence -> failure kind: what happened to a child, and the line that decided it.

Pure: the caller gathers the exit status, the child's last stderr lines, the upstream status and
body, and the last GPU memory sample, and this module decides. On a real H200 the only line that
got out before a runtime OOM abort was `ggml-cuda.cu:109: CUDA error` (the `out of memory` lines
were lost in llama.cpp's asynchronous logger), so the exit status and the free-memory sample weigh
as much as the text: exit status first, an out-of-memory or lost-device line second, a backend's
terse error line third (with the memory sample deciding between OOM and the backend's error), the
GPU sample last. The lines are those of every llama.cpp GPU backend (CUDA, ROCm/HIP, MUSA,
Vulkan, SYCL, Metal); tests/fixtures/backend-lines/cases.json holds users' real ones.
"""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass


class FailureKind(enum.StrEnum):
    RUNTIME_OOM = "runtime_oom"
    LOAD_OOM = "load_oom"
    OOM_SURVIVED = "oom_survived"
    CUDA_ERROR = "cuda_error"  # a GPU backend's error (CUDA, ROCm, MUSA, SYCL, ...), not memory
    GPU_FAULT = "gpu_fault"  # the device was lost or reset under the child
    HANG = "hang"  # alive but making no progress: /health unanswered, or stalled with work
    SICK = "sick"  # answers /health but fails request after request with a 5xx
    NO_OFFLOAD = "no_offload"  # the GPU child loaded with fewer layers on the GPU than asked
    # (none or some: offload.py), ended as a failed start under gpu.require_offload
    CRASH = "crash"
    # Ended by a stop Spillway asked for (a restart, a pause, the GPU lent) with answers still
    # in flight: cut as by a death, and taken on by the same rules.
    STOPPED = "stopped"
    CONTEXT_EXCEEDED = "context_exceeded"
    NOT_READY = "not_ready"
    CLIENT_ERROR = "client_error"
    NONE = "none"


# Kinds after which the child did not complete the request (replay may be allowed).
CHILD_FAILED = frozenset({
    FailureKind.RUNTIME_OOM, FailureKind.OOM_SURVIVED, FailureKind.CUDA_ERROR,
    FailureKind.GPU_FAULT, FailureKind.HANG, FailureKind.CRASH, FailureKind.LOAD_OOM,
    FailureKind.NOT_READY, FailureKind.NO_OFFLOAD, FailureKind.STOPPED,
})

# Out-of-memory lines from the GPU backends, as llama.cpp and the drivers print them. ggml-cuda
# is also the ROCm and MUSA backend: ggml_cuda_error() prints GGML_CUDA_NAME " error: %s" with
# GGML_CUDA_NAME "CUDA", "ROCm" or "MUSA" (ggml/include/ggml-cuda.h), and hipGetErrorString's
# "out of memory"; its buffer allocation prints the literal "cudaMalloc failed: " on every build.
_OOM_PATTERNS = [
    re.compile(p, re.IGNORECASE) for p in (
        r"CUDA error: out of memory",
        r"cudaMalloc failed: out of memory",
        r"ROCm error: out of memory",                           # ggml-cuda.cu built for HIP
        r"MUSA error: out of memory",                           # ggml-cuda.cu built for MUSA
        r"hipMalloc failed: out of memory",                     # ROCm
        r"HIP error: out of memory",
        r"ErrorOutOfDeviceMemory",                              # Vulkan (vulkan.hpp's what())
        r"VK_ERROR_OUT_OF_DEVICE_MEMORY",                       # Vulkan (C API spelling)
        r"vk::OutOfDeviceMemoryError",                          # Vulkan, uncaught (std::terminate)
        r"Device memory allocation of size \d+ failed",         # ggml_vulkan
        r"UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY",                # SYCL (Unified Runtime)
        r"ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY",                # SYCL (Level Zero)
        r"can't allocate \d+ Bytes of memory on device",        # ggml-sycl
        r"kIOGPUCommandBufferCallbackErrorOutOfMemory",         # Metal
        r"failed to allocate Metal buffer of \d+ bytes \(out of memory\)",  # ggml-metal
    )
]
# A lost or reset device: the child's GPU context is gone; only a new process can use the GPU.
# Only lines that reports show to mean that. Not here, on purpose: CUDA's "an illegal memory
# access was encountered" and "unspecified launch failure", HIP's hipErrorLaunchFailure, HSA's
# MEMORY_APERTURE_VIOLATION and "Memory access fault by GPU" (a kernel that faulted: a bug or a
# broken build, which the terse-line rule names `cuda_error`), and Metal's
# kIOGPUCommandBufferCallbackErrorTimeout / ImpactingInteractivity (the watchdog ended one long
# command buffer; the device is fine).
_GPU_FAULT_PATTERNS = [
    re.compile(p, re.IGNORECASE) for p in (
        # Vulkan: vulkan.hpp's exception for VK_ERROR_DEVICE_LOST, uncaught by ggml_vulkan
        # (llama.cpp #17334, #13248); ggml_vk_print_device_lost_info's own line.
        r"ErrorDeviceLost",
        r"VK_ERROR_DEVICE_LOST",
        r"vk::DeviceLostError",
        r"ggml_vulkan: device lost on",
        # SYCL: Unified Runtime and Level Zero (llama.cpp #25286, #11812; the SYCL guide names
        # DEVICE_LOST as what a GPU driver watchdog reset gives).
        r"UR_RESULT_ERROR_DEVICE_LOST",
        r"ZE_RESULT_ERROR_DEVICE_LOST",
        # ROCm: the HSA runtime's line when amdgpu finds the GPU hung and resets it
        # ("HW Exception by GPU node-1 (Agent handle: 0x...) reason :GPU Hang"), then abort().
        r"HW Exception by GPU node-\d+ .*reason ?:GPU Hang",
        # Metal: the GPU hung and macOS recovered it; a command buffer discarded by that
        # recovery; the process barred from the GPU after causing GPU errors (llama.cpp #8886).
        r"kIOGPUCommandBufferCallbackErrorHang",
        r"kIOGPUCommandBufferCallbackErrorInnocentVictim",
        r"kIOAccelCommandBufferCallbackErrorSubmissionsIgnored",
        # NVIDIA Xid 79 (a kernel log line; it reaches the tail only where a wrapper merges the
        # kernel log into the child's output).
        r"GPU has fallen off the bus",
    )
]
# The terse abort line that is often all that gets out (ggml_cuda_error -> GGML_ABORT), and its
# equivalents in the other backends: ggml-cuda.cu:N: ROCm error / MUSA error (the same code
# built for HIP or MUSA), HipVMM Failure (the HIP build's CU_CHECK), SYCL error (ggml_sycl_error
# -> GGML_ABORT("SYCL error")), an uncaught Vulkan or SYCL exception (std::terminate), and a
# newer ggml-metal's abort on a failed command buffer (ggml-metal-context.m:N: fatal error).
_CUDA_ERROR_LINE = re.compile(
    r"ggml-cuda\.cu:\d+: (?:CUDA|ROCm|MUSA) error|\b(?:CUDA|ROCm|MUSA|SYCL) error\b"
    r"|HipVMM Failure"
    r"|terminate called after throwing an instance of '(?:vk|sycl)::"
    r"|ggml-metal[\w-]*\.m:\d+: fatal error")
# A model or KV cache that could not be allocated while loading (exit code 1).
_LOAD_FAILURE = [
    re.compile(p) for p in (
        r"unable to allocate \w+ buffer",
        r"failed to allocate \w+ buffer",
        r"failed to allocate buffer for kv cache",
        r"cudaMalloc failed",
        r"insufficient memory",
        r"can't allocate \d+ Bytes of memory on device",        # ggml-sycl
    )
]
_LOAD_ERROR_LINE = re.compile(r"exiting due to model loading error|failed to load model")

# Public names for the other policy modules (router.py) that read the same lines.
OOM_PATTERNS = _OOM_PATTERNS
GPU_FAULT_PATTERNS = _GPU_FAULT_PATTERNS
CUDA_ERROR_LINE = _CUDA_ERROR_LINE  # every backend's terse error line, CUDA's included
LOAD_FAILURE = _LOAD_FAILURE

# The 500 llama-server answers when an image's or audio's chunk failed to encode or decode.
MEDIA_CHUNK_FAILED = "failed to process mtmd chunk"

SIGABRT = int(signal.SIGABRT)
# A shell wrapper reports a signal death as 128 + the signal number.
_SHELL_SIGNAL_OFFSET = 128


@dataclass(frozen=True)
class VramSample:
    """The last GPU memory sample of the GPU child's device, taken before the failure."""

    free_mib: float
    total_mib: float
    age_s: float  # how old the sample was when the failure was seen
    device: str = ""  # which device, when known: "0000:03:00.0 AMD Radeon RX 7900 XTX"


@dataclass(frozen=True)
class Evidence:
    returncode: int | None = None  # None: the process is still running (or never started)
    stderr_tail: Sequence[str] = ()
    upstream_status: int | None = None
    upstream_body: str = ""
    closed_before_response: bool = False  # the connection ended with no response at all
    connect_failed: bool = False  # nothing was listening
    vram: VramSample | None = None
    vram_short_mib: float = 512.0  # free memory under this counts as "short"
    vram_max_age_s: float = 10.0  # an older sample says nothing about the moment of death


@dataclass(frozen=True)
class Verdict:
    kind: FailureKind
    evidence: str  # the line (or fact) that decided it
    known_crash: str = ""  # a known crash signature's verdict and fix (signatures.py), or ""

    @property
    def child_failed(self) -> bool:
        return self.kind in CHILD_FAILED


# The exit status of a process Spillway adopted (another Spillway started it): not its child,
# it cannot be told how it ended; its output judges.
EXIT_UNKNOWN = -1000


def exit_signal(returncode: int | None) -> int | None:
    """The signal that ended the process: -6 (Python's way) and 134 (a shell's) are SIGABRT."""
    if returncode is None or returncode == EXIT_UNKNOWN:
        return None
    if returncode < 0:
        return -returncode
    if _SHELL_SIGNAL_OFFSET < returncode < _SHELL_SIGNAL_OFFSET + 65:
        return returncode - _SHELL_SIGNAL_OFFSET
    return None


def describe_exit(returncode: int) -> str:
    if returncode == EXIT_UNKNOWN:
        return "exit status unknown: adopted"
    sig = exit_signal(returncode)
    if sig is not None:
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with code {returncode}"


def _last_match(lines: Sequence[str], patterns: Sequence[re.Pattern[str]]) -> str | None:
    for line in reversed(lines):
        for p in patterns:
            if p.search(line):
                return line.strip()
    return None


def _vram_short(ev: Evidence) -> bool:
    v = ev.vram
    return v is not None and v.age_s <= ev.vram_max_age_s and v.free_mib < ev.vram_short_mib


def _vram_note(ev: Evidence) -> str:
    v = ev.vram
    assert v is not None
    on = f" on {v.device}" if v.device else ""
    return (f"free VRAM {v.free_mib:.0f} MiB of {v.total_mib:.0f} MiB{on}, "
            f"{v.age_s:.1f} s before")


def gpu_line(lines: Sequence[str]) -> tuple[FailureKind, str] | None:
    """The last out-of-memory or lost-device line (stripped) and what it means: RUNTIME_OOM or
    GPU_FAULT. The latest of the two decides when both are there."""
    for line in reversed(lines):
        if any(p.search(line) for p in _GPU_FAULT_PATTERNS):
            return FailureKind.GPU_FAULT, line.strip()
        if any(p.search(line) for p in _OOM_PATTERNS):
            return FailureKind.RUNTIME_OOM, line.strip()
    return None


def last_match(lines: Sequence[str], patterns: Sequence[re.Pattern[str]]) -> str | None:
    """The last line (stripped) that one of the patterns finds, or None."""
    return _last_match(lines, patterns)


def vram_short(ev: Evidence) -> bool:
    """The sample is fresh (`vram_max_age_s`) and shows less free than `vram_short_mib`."""
    return _vram_short(ev)


def vram_note(ev: Evidence) -> str:
    """`free VRAM 61 MiB of 143771 MiB, 0.4 s before`, or with the sample's device
    `free VRAM 61 MiB of 24560 MiB on 0000:03:00.0 AMD Radeon RX 7900 XTX, 0.4 s before`
    (the sample must be present)."""
    return _vram_note(ev)


def classify_response(status: int, body: str, stderr_tail: Sequence[str] = ()) -> Verdict:
    """A response the child sent while alive. `stderr_tail`, when given, tells a `Compute
    error.` after a lost device (Metal's barred or recovered GPU) from one after an OOM."""
    first = body.strip().splitlines()[0][:300] if body.strip() else ""
    line = f"HTTP {status}: {first}" if first else f"HTTP {status}"
    if status < 400:
        return Verdict(FailureKind.NONE, line)
    if status == 503 and "Loading model" in body:
        return Verdict(FailureKind.NOT_READY, line)
    if any(p.search(body) for p in _GPU_FAULT_PATTERNS):
        return Verdict(FailureKind.GPU_FAULT, line)
    if status >= 500 and "Compute error" in body:
        # llama-server's words for any failed decode: the child's own lines say why.
        seen = gpu_line(stderr_tail)
        if seen is not None and seen[0] is FailureKind.GPU_FAULT:
            return Verdict(FailureKind.GPU_FAULT, f"{seen[1]} ({line})")
        return Verdict(FailureKind.OOM_SURVIVED, line)
    if status >= 500 and MEDIA_CHUNK_FAILED in body:
        # llama-server's words for an image or audio chunk it could not encode or decode
        # (server-context.cpp). An encoder whose graph found no room on the GPU says so in
        # the child's own lines (cudaMalloc's out of memory, then `failed to encode image
        # slice`); with no such line the cause may be the request's (more images than the
        # context holds: `failed to find a memory slot`) or a buffer over the driver's
        # per-allocation limit, and the answer is passed on as it is.
        seen = gpu_line(stderr_tail)
        if seen is not None:
            kind = FailureKind.GPU_FAULT if seen[0] is FailureKind.GPU_FAULT \
                else FailureKind.OOM_SURVIVED
            return Verdict(kind, f"{seen[1]} ({line})")
    if any(p.search(body) for p in _OOM_PATTERNS):
        return Verdict(FailureKind.OOM_SURVIVED, line)
    if "exceed_context_size_error" in body or "Context size has been exceeded" in body:
        return Verdict(FailureKind.CONTEXT_EXCEEDED, line)
    if 400 <= status < 500:
        return Verdict(FailureKind.CLIENT_ERROR, line)
    # Any other 5xx is a complete answer from a live child: passed on as it is.
    return Verdict(FailureKind.NONE, line)


def classify_exit(returncode: int, stderr_tail: Sequence[str], vram: VramSample | None = None,
                  vram_short_mib: float = 512.0, vram_max_age_s: float = 10.0) -> Verdict:
    """A process that ended: exit status first, then the CUDA line, then the GPU sample."""
    ev = Evidence(returncode=returncode, stderr_tail=stderr_tail, vram=vram,
                  vram_short_mib=vram_short_mib, vram_max_age_s=vram_max_age_s)
    return _classify_exit(ev, returncode)


def _classify_exit(ev: Evidence, returncode: int) -> Verdict:
    lines = ev.stderr_tail
    how = describe_exit(returncode)
    seen = gpu_line(lines)  # the last out-of-memory or lost-device line
    sig = exit_signal(returncode)

    if seen is not None and seen[0] is FailureKind.GPU_FAULT:
        # A lost device outranks everything else: no allocation or memory figure explains it.
        return Verdict(FailureKind.GPU_FAULT, seen[1])
    if returncode == 1 and (load := _last_match(lines, _LOAD_FAILURE)) is not None:
        return Verdict(FailureKind.LOAD_OOM, load)
    if sig is not None or returncode == EXIT_UNKNOWN:  # (unknown: it may have been a signal)
        if seen is not None:
            return Verdict(FailureKind.RUNTIME_OOM, seen[1])
        cuda_line = _last_match(lines, [_CUDA_ERROR_LINE])
        if cuda_line is not None:
            if _vram_short(ev):
                return Verdict(FailureKind.RUNTIME_OOM, f"{cuda_line} ({how}, {_vram_note(ev)})")
            return Verdict(FailureKind.CUDA_ERROR, f"{cuda_line} ({how})")
        if sig == SIGABRT and _vram_short(ev):
            # Every line was lost in the asynchronous logger; the memory figure still speaks.
            return Verdict(FailureKind.RUNTIME_OOM, f"{how} with {_vram_note(ev)}")
        return Verdict(FailureKind.CRASH, how)
    if seen is not None:
        return Verdict(FailureKind.RUNTIME_OOM, seen[1])
    load_error = _last_match(lines, [_LOAD_ERROR_LINE])
    if load_error is not None:
        return Verdict(FailureKind.CRASH, f"{load_error} ({how})")
    return Verdict(FailureKind.CRASH, how)


def classify(ev: Evidence) -> Verdict:
    """The failure kind of one attempt, from everything that was seen."""
    if ev.returncode is not None:
        return _classify_exit(ev, ev.returncode)
    if ev.upstream_status is not None:
        return classify_response(ev.upstream_status, ev.upstream_body, ev.stderr_tail)
    if ev.connect_failed:
        return Verdict(FailureKind.NOT_READY, "connection refused: the child is not listening")
    if ev.closed_before_response:
        seen = gpu_line(ev.stderr_tail)
        if seen is not None:
            return Verdict(seen[0], seen[1])
        return Verdict(FailureKind.CRASH, "connection closed before a response; the child "
                                          "is still running")
    return Verdict(FailureKind.NONE, "")
