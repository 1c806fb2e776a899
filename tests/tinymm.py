"""A tiny random-weight multimodal projector (llama.cpp's "mmproj") in GGUF, and tiny media.

Passed to llama-server with `--mmproj` beside the tiny text model (tinymodel.py), it makes a
real vision and audio model: every server code path for images and audio is real (decoding,
preprocessing, encoding, the prompt's media chunks and their token counts), only the answers
are noise. One file holds both encoders, as an omni model's mmproj does (clip.cpp reads
`clip.has_vision_encoder` / `clip.has_audio_encoder` and a projector type per modality):

- vision: a 2-block CLIP ViT under a LLaVA "mlp" projector; images are resized to 56 px and cut
  into 14 px patches, so every image is 16 tokens, whatever its size;
- audio: a 1-block whisper encoder (16 mel bins) under an "ultravox" projector with stack
  factor 30: 3,000 mel frames a 30 s chunk, halved by the stride-2 convolution, stacked by 30,
  so 50 tokens per started 30 s.

The projector's output width must equal the text model's embedding width (`n_embd_text`), or
llama-server exits 1 while loading ("mismatch between text model ... and mmproj").

The media makers use the standard library only (zlib, struct, wave), so that tests need no
imaging or audio package.
"""

from __future__ import annotations

import argparse
import base64
import io
import random
import struct
import wave
import zlib
from pathlib import Path

import gguf
import numpy as np

# Vision: 56 px / 14 px patches = 4 x 4 = 16 tokens an image.
IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
# Audio: whisper's 30 s chunks of 100 mel frames a second, halved by the second convolution's
# stride, stacked by the ultravox projector.
AUDIO_CHUNK_S = 30
STACK_FACTOR = 30
AUDIO_POSITIONS = AUDIO_CHUNK_S * 100 // 2  # 1,500: whisper's learned positions
AUDIO_TOKENS_PER_CHUNK = AUDIO_POSITIONS // STACK_FACTOR  # 50
N_MEL = 16


def audio_tokens(seconds: float) -> int:
    """Tokens the tiny projector gives a clip: 50 per started 30 s chunk (at least one)."""
    chunks = max(1, -(-int(seconds * 1000) // (AUDIO_CHUNK_S * 1000)))
    return chunks * AUDIO_TOKENS_PER_CHUNK


def write_tiny_projector(path: Path, *, n_embd_text: int = 256, vision: bool = True,
                         audio: bool = True, seed: int = 0) -> Path:
    """Write one mmproj GGUF with a vision encoder, an audio encoder, or both.

    The per-modality projector keys (`clip.vision.projector_type`, `clip.audio.projector_type`)
    are used rather than `clip.projector_type`, which clip.cpp would apply to both encoders.
    Weights are seeded noise, small enough (F32, convolutions F16 as llama.cpp's converter
    writes them) that the file is under 2 MB and loads in milliseconds."""
    if not (vision or audio):
        raise ValueError("a projector needs a vision encoder, an audio encoder, or both")
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name("spillway-tiny-mmproj")
    w.add_description("random weights for tests: " + "+".join(
        m for m, on in (("vision", vision), ("audio", audio)) if on))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_bool("clip.has_vision_encoder", vision)
    w.add_bool("clip.has_audio_encoder", audio)

    def tensor(name: str, *shape: int, scale: float = 0.05, f16: bool = False) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float16 if f16 else np.float32)
        w.add_tensor(name, data)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    def zeros(name: str, *shape: int) -> None:
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))

    def block(prefix: str, i: int, n_embd: int, n_ff: int, k_bias: bool) -> None:
        """One pre-norm transformer block, as clip.cpp names its tensors."""
        b = f"{prefix}.blk.{i}"
        ones(f"{b}.ln1.weight", n_embd)
        zeros(f"{b}.ln1.bias", n_embd)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensor(f"{b}.{proj}.weight", n_embd, n_embd)
            if proj != "attn_k" or k_bias:  # whisper's key projection has no bias
                zeros(f"{b}.{proj}.bias", n_embd)
        ones(f"{b}.ln2.weight", n_embd)
        zeros(f"{b}.ln2.bias", n_embd)
        tensor(f"{b}.ffn_up.weight", n_ff, n_embd)
        zeros(f"{b}.ffn_up.bias", n_ff)
        tensor(f"{b}.ffn_down.weight", n_embd, n_ff)
        zeros(f"{b}.ffn_down.bias", n_embd)

    if vision:
        # n_ff must differ from n_embd: clip.cpp swaps a LLaVA model's up and down weights when
        # ffn_down's input width equals n_embd (old converters wrote them swapped).
        n_embd, n_ff, n_head, n_layer, hidden = 32, 64, 2, 2, 64
        w.add_string("clip.vision.projector_type", "mlp")
        w.add_uint32("clip.vision.embedding_length", n_embd)
        w.add_uint32("clip.vision.feed_forward_length", n_ff)
        w.add_uint32("clip.vision.block_count", n_layer)
        w.add_uint32("clip.vision.projection_dim", n_embd_text)
        w.add_uint32("clip.vision.attention.head_count", n_head)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
        w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
        w.add_uint32("clip.vision.patch_size", PATCH_SIZE)
        w.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
        w.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
        tensor("v.patch_embd.weight", n_embd, 3, PATCH_SIZE, PATCH_SIZE, f16=True)
        tensor("v.position_embd.weight", IMAGE_TOKENS, n_embd)
        ones("v.pre_ln.weight", n_embd)
        zeros("v.pre_ln.bias", n_embd)
        for i in range(n_layer):
            block("v", i, n_embd, n_ff, k_bias=True)
        tensor("mm.0.weight", hidden, n_embd)
        zeros("mm.0.bias", hidden)
        tensor("mm.2.weight", n_embd_text, hidden)
        zeros("mm.2.bias", n_embd_text)

    if audio:
        n_embd, n_ff, n_head, n_layer, hidden = 32, 64, 2, 1, 64
        w.add_string("clip.audio.projector_type", "ultravox")
        w.add_uint32("clip.audio.embedding_length", n_embd)
        w.add_uint32("clip.audio.feed_forward_length", n_ff)
        w.add_uint32("clip.audio.block_count", n_layer)
        w.add_uint32("clip.audio.projection_dim", n_embd_text)
        w.add_uint32("clip.audio.attention.head_count", n_head)
        w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
        w.add_uint32("clip.audio.num_mel_bins", N_MEL)
        w.add_uint32("clip.audio.projector.stack_factor", STACK_FACTOR)
        # Convolution biases are (n_embd, 1): the converter unsqueezes them so that they add
        # to a (frames, channels) result.
        tensor("a.conv1d.1.weight", n_embd, N_MEL, 3, f16=True)
        zeros("a.conv1d.1.bias", n_embd, 1)
        tensor("a.conv1d.2.weight", n_embd, n_embd, 3, f16=True)
        zeros("a.conv1d.2.bias", n_embd, 1)
        tensor("a.position_embd.weight", AUDIO_POSITIONS, n_embd)
        for i in range(n_layer):
            block("a", i, n_embd, n_ff, k_bias=False)
        ones("a.post_ln.weight", n_embd)
        zeros("a.post_ln.bias", n_embd)
        # Ultravox: RMS norm, a SwiGLU (2 x hidden in, hidden out), RMS norm, out to the text.
        ones("mm.a.norm_pre.weight", n_embd * STACK_FACTOR)
        tensor("mm.a.mlp.1.weight", 2 * hidden, n_embd * STACK_FACTOR)
        ones("mm.a.norm_mid.weight", hidden)
        tensor("mm.a.mlp.2.weight", n_embd_text, hidden)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- media ---------------------------------------------------------------------------------


def png_bytes(width: int = 8, height: int = 8, seed: int = 0) -> bytes:
    """An RGB PNG of seeded noise: each seed gives other bytes, so that llama-server's media
    cache (keyed by the file's hash) never mistakes one test image for another."""
    if width < 1 or height < 1:
        raise ValueError("a PNG needs at least one pixel")
    rnd = random.Random(seed)
    raw = b"".join(b"\x00" + rnd.randbytes(3 * width) for _ in range(height))  # filter 0

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def wav_bytes(seconds: float = 1.0, rate: int = 16000, seed: int = 0) -> bytes:
    """A mono 16-bit PCM WAV of seeded quiet noise (llama-server resamples it to 16 kHz)."""
    n = int(seconds * rate)
    rnd = random.Random(seed)
    samples = struct.pack(f"<{n}h", *(rnd.randint(-3000, 3000) for _ in range(n)))
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(samples)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_uri(data: bytes, mime: str = "image/png") -> str:
    """`data:<mime>;base64,...`, the form an OpenAI client sends an image in."""
    return f"data:{mime};base64,{b64(data)}"


def png_data_uri(width: int = 8, height: int = 8, seed: int = 0) -> str:
    return data_uri(png_bytes(width, height, seed), "image/png")


def wav_data_uri(seconds: float = 1.0, rate: int = 16000, seed: int = 0) -> str:
    return data_uri(wav_bytes(seconds, rate, seed), "audio/wav")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--n-embd-text", type=int, default=256,
                        help="the text model's embedding width (tinymodel.py's --n-embd)")
    parser.add_argument("--no-vision", action="store_true")
    parser.add_argument("--no-audio", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(write_tiny_projector(a.path, n_embd_text=a.n_embd_text, vision=not a.no_vision,
                               audio=not a.no_audio, seed=a.seed))
