"""The vision and audio encoder's failures (issue 38), from users' real lines: a child that died
on an image, a child that answered an image's failure and lived, and the lines that look alike
but are the request's own doing. Each case names the report its lines come from; where a report
was cut, the comment says what was joined to what.

- an encoder that found no room on the GPU is an out-of-memory, whether the child died of it
  (runtime_oom) or answered `failed to process mtmd chunk` and lived (oom_survived);
- a lost device after an image is a gpu_fault like any other;
- a kernel that faulted on a large image (HIP's aperture violation) is neither: a crash;
- bad image bytes, or more images than the context holds, are the request's: the answer is
  passed on, and the child did not fail;
- the micro-batch too small for an image is a known crash with its remedy, and not one that
  ends the retries (text is still served).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import pytest

from supervisor.policy import sickness, signatures
from supervisor.policy.evidence import (
    MEDIA_CHUNK_FAILED, Evidence, FailureKind, VramSample, classify, classify_exit,
)
from supervisor.policy.router import classify_instance_exit

SIGABRT = -int(signal.SIGABRT)
SIGSEGV = -int(signal.SIGSEGV)
PLENTY = VramSample(free_mib=20100, total_mib=24560, age_s=0.4)

# llama-server's answer when an image's or audio's chunk failed to encode or decode, as the
# pinned source writes it (tools/server/server-context.cpp, send_error(..., ERROR_TYPE_SERVER)).
CHUNK_FAILED = ('{"error":{"code":500,"message":"failed to process mtmd chunk",'
                '"type":"server_error"}}')
# ... and when the image's bytes are not an image (server-common.cpp, process_mtmd_prompt).
NOT_AN_IMAGE = ('{"error":{"code":500,"message":"Failed to load image or audio file",'
                '"type":"server_error"}}')


@dataclass(frozen=True)
class Died:
    lines: tuple[str, ...]
    returncode: int
    kind: FailureKind
    decider: str  # text of the deciding evidence
    vram: VramSample | None = None


DEATHS = {
    # https://github.com/ollama/ollama/issues/10753 (Qwen2.5-VL 32B, a 720p image, two CUDA
    # cards): the encoder's compute buffer could not be had, then the runner's SIGSEGV.
    "cuda-720p-image-cudamalloc-then-sigsegv": Died((
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1953.40 MiB on device 1: "
        "cudaMalloc failed: out of memory",
        "ggml_gallocr_reserve_n: failed to allocate CUDA1 buffer of size 2048290048",
        "SIGSEGV: segmentation violation",
    ), SIGSEGV, FailureKind.RUNTIME_OOM, "cudaMalloc failed: out of memory"),
    # https://github.com/ollama/ollama/issues/2706 (llava 7B v1.6 on a GeForce MX150, WSL):
    # the image was encoded by CLIP, then the CUDA pool found no memory and ggml aborted.
    "cuda-llava-image-pool-abort": Died((
        "encode_image_with_clip: image embedding created: 576 tokens",
        "encode_image_with_clip: image encoded in  1236.17 ms by CLIP (    2.15 ms per image "
        "patch)",
        "CUDA error: out of memory",
        "   current device: 0, in function ggml_cuda_pool_malloc_vmm at "
        "/go/src/github.com/jmorganca/ollama/llm/llama.cpp/ggml-cuda.cu:7991",
        "   cuMemSetAccess(g_cuda_pool_addr[device] + g_cuda_pool_size[device], reserve_size, "
        "&access, 1)",
        'GGML_ASSERT: /go/src/github.com/jmorganca/ollama/llm/llama.cpp/ggml-cuda.cu:244: '
        '!"CUDA error"',
        "Aborted",
    ), SIGABRT, FailureKind.RUNTIME_OOM, "CUDA error: out of memory"),
    # https://github.com/ggml-org/llama.cpp/issues/28608 (ROCm 7.14, 2x RX 7900 XTX): the CLIP
    # encoder's HIP flash-attention kernel reads past its memory on large images. A kernel's
    # bad access with memory to spare: not an out-of-memory, not a lost device (the card
    # serves the next process), so a crash, whatever the image.
    "hip-clip-flash-attn-aperture-violation": Died((
        "HSA_STATUS_ERROR_MEMORY_APERTURE_VIOLATION: The agent attempted to access memory "
        "beyond the largest legal address. code: 0x29",
    ), SIGABRT, FailureKind.CRASH, "killed by SIGABRT", PLENTY),
    # Vulkan, an Intel iGPU on Mesa: https://github.com/ggml-org/llama.cpp/issues/17438 shows
    # the image encoded and its batch being decoded, then anv's dump of the hung batch (the
    # report is cut there); https://github.com/ggml-org/llama.cpp/issues/13248, the same
    # driver's dump at a text decode, ends with the uncaught exception its title quotes,
    # joined here. A lost device after an image is a gpu_fault like any other.
    "vulkan-image-decode-then-device-lost": Died((
        "encoding image slice...",
        "image slice encoded in 16314 ms",
        "decoding image batch 1/1, n_tokens_batch = 81",
        "Batch offset=0xc000 len=0x0 on queue 0 (aperture: 1218.7Mb, 0.0Mb VRAM only)",
        "terminate called after throwing an instance of 'vk::DeviceLostError'",
    ), SIGABRT, FailureKind.GPU_FAULT, "vk::DeviceLostError"),
}


@pytest.mark.parametrize("case", DEATHS.values(), ids=DEATHS.keys())
def test_a_child_that_died_on_an_image(case: Died) -> None:
    verdict = classify_exit(case.returncode, list(case.lines), case.vram)
    assert verdict.kind is case.kind, verdict
    assert case.decider in verdict.evidence
    # A router's instance that died so is judged the same (the router reports status 1).
    routed = classify_instance_exit(1, [f"[40007] {line}" for line in case.lines],
                                    loading=False, vram=case.vram)
    assert routed.kind is case.kind or (case.kind is FailureKind.CRASH and
                                        routed.kind is FailureKind.CRASH)


@dataclass(frozen=True)
class Answered:
    tail: tuple[str, ...]
    body: str
    kind: FailureKind
    decider: str


ANSWERS = {
    # https://github.com/ggml-org/llama.cpp/issues/18181 (Qwen3-VL 235B on five CUDA cards,
    # the fit left no room for the vision encoder): its warm-up's compute buffer could not be
    # allocated and the server started anyway; an image then fails with the pinned server's
    # 500. The child lives, its memory state is not to be trusted: oom_survived (replayed
    # elsewhere, the child drained and restarted).
    "cuda-encoder-no-room-survived": Answered((
        "warmup: warmup with image size = 1472 x 1472",
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 372.08 MiB on device 0: "
        "cudaMalloc failed: out of memory",
        "ggml_gallocr_reserve_n_impl: failed to allocate CUDA0 buffer of size 390156544",
        "alloc_compute_meta: graph splits = 1, nodes = 853",
    ), CHUNK_FAILED, FailureKind.OOM_SURVIVED, "cudaMalloc failed: out of memory"),
    # https://github.com/ggml-org/llama.cpp/issues/13250 (Qwen2.5-VL 3B on a Ryzen AI MAX 395's
    # Radeon 8060S, Vulkan, Windows): the line its title quotes is all ggml says when a Vulkan
    # buffer cannot be had (ggml_vulkan's failed allocation returns nothing and says nothing).
    # It names no out-of-memory: 4,342,230,552 bytes is over 4 GiB, more than AMD's Windows
    # driver takes in one allocation whatever is free
    # (https://github.com/Acly/krita-vision-tools/issues/43). Passed on, as a router
    # instance's lone allocation line is (tests/test_policy_router.py).
    "vulkan-encoder-buffer-over-the-allocation-limit": Answered((
        "failed to allocate Vulkan0 buffer of size 4342230552",
    ), CHUNK_FAILED, FailureKind.NONE, "HTTP 500: "),
    # https://github.com/ggml-org/llama.cpp/issues/14111 (Gemma 3 4B, the 11th image of one
    # request): "failed to decode image" there is llama_decode finding no room in the context
    # for the image's tokens, not the GPU's memory. The request's own: passed on.
    "too-many-images-for-the-context": Answered((
        "failed to decode image",
        "decode: failed to find a memory slot for batch of size 256",
        "srv  process_chun: image processed in 31744 ms",
        "mtmd_helper_eval failed with status 1slot update_slots: id  0 | task 840 | failed to "
        "process",
    ), CHUNK_FAILED, FailureKind.NONE, "HTTP 500"),
    # https://github.com/ollama/ollama/issues/2367: bytes that are no image ("failed to decode
    # image bytes"); the pinned server answers that with its own 500 before any encoder runs.
    "bad-image-bytes": Answered((
        "clip_image_load_from_bytes: failed to decode image bytes",
    ), NOT_AN_IMAGE, FailureKind.NONE, "Failed to load image or audio file"),
}


@pytest.mark.parametrize("case", ANSWERS.values(), ids=ANSWERS.keys())
def test_a_child_that_answered_an_images_failure(case: Answered) -> None:
    verdict = classify(Evidence(upstream_status=500, upstream_body=case.body,
                                stderr_tail=list(case.tail)))
    assert verdict.kind is case.kind, verdict
    assert case.decider in verdict.evidence
    assert verdict.child_failed == (case.kind is not FailureKind.NONE)


def test_the_chunk_answer_is_the_pinned_servers_word() -> None:
    assert MEDIA_CHUNK_FAILED in CHUNK_FAILED
    # Bad bytes are the request's own fault for the sick-child rule too; a failed chunk is not
    # (it may be the encoder's memory), and counts.
    assert sickness.request_fault(500, sickness.error_message(NOT_AN_IMAGE))
    assert not sickness.request_fault(500, sickness.error_message(CHUNK_FAILED))


# The micro-batch too small for an image: the assert's own line, as users saw it.
UBATCH_CASES = {
    # https://github.com/duckyshell/ComfyUI-MiniMaxH3-Prompt-Writer/issues/26 (Gemma 4 12B,
    # two reference images, llama.cpp's Windows release build)
    "two-images-windows": (
        "0.05.090.837 I slot launch_slot_: id  3 | task 0 | processing task, is_child = 0",
        "D:/a/llama.cpp/llama.cpp/src/llama-context.cpp:1724: GGML_ASSERT((cparams.causal_attn "
        '|| cparams.n_ubatch >= n_tokens_all) && "non-causal attention requires n_ubatch >= '
        'n_tokens") failed',
    ),
    # https://github.com/ggml-org/llama.cpp/issues/23409 (Gemma 4 26B, the web UI's image,
    # relayed by a router with its [port] prefix)
    "router-relayed": (
        "[40007] /mnt/kanna/Documents/llama.cpp/src/llama-context.cpp:1681: GGML_ASSERT(("
        'cparams.causal_attn || cparams.n_ubatch >= n_tokens_all) && "non-causal attention '
        'requires n_ubatch >= n_tokens") failed',
    ),
}


@pytest.mark.parametrize("lines", UBATCH_CASES.values(), ids=UBATCH_CASES.keys())
def test_an_image_over_the_micro_batch_is_a_known_crash_that_does_not_end_the_retries(
        lines: tuple[str, ...]) -> None:
    verdict = classify_exit(SIGABRT, list(lines), PLENTY)
    assert verdict.kind is FailureKind.CRASH  # no memory, no device: an assert
    found = signatures.diagnose(signatures.CrashFacts(SIGABRT, list(lines), before_ready=False))
    assert found is not None and found.name == "image_over_ubatch"
    assert "-ub" in found.signature.remedy and "--image-max-tokens" in found.signature.remedy
    assert found.signature.upstream.endswith("/issues/23409")
    assert signatures.is_marker(lines[-1])
    # An image request kills it, not its start: twice in a row is no reason for FATAL.
    assert signatures.repeats(["image_over_ubatch", "image_over_ubatch"]) == 0
