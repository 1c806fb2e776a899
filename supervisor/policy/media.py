"""The images, audio and video a request carries, in every form a client sends them, as the
pinned llama-server reads them (tools/server/server-common.cpp, server-chat.cpp):

- chat (`/v1/chat/completions`): content parts `image_url` (`{"url": ...}`), `input_audio`
  (`{"data": ...}` or `{"url": ...}`), `input_video` / `video_url`;
- the Responses API: content parts (and tool outputs) `input_image` with an `image_url` string;
- Anthropic's `/v1/messages`: `image` blocks, with a `source` of type `base64` or `url`, in a
  message's content or inside a `tool_result`;
- `/completion` and the other completion routes, and the embeddings: a prompt object
  `{"prompt_string": ..., "multimodal_data": [base64, ...]}`, its media marked in the string by
  the child's media marker; embeddings also take `{"content": [chat content parts]}`.

A part's type says what it needs of the child's projector: `image_url` an image encoder, even
when its data is audio (llama-server checks the type, not the bytes). `multimodal_data` is
checked by nothing but its bytes, so its modality is read from them (the magic numbers
libmtmd reads: RIFF/WAVE, ID3, MP3 and FLAC frames are audio; anything else an image).

Pure: what Spillway needs of the media before forwarding (which projector it needs, how many
bytes are held for a replay, what to count) without decoding a pixel.
"""

from __future__ import annotations

import base64
import binascii
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .prompts import COMPLETION_ROUTES, EMBEDDING_ROUTES


class Modality(enum.StrEnum):
    """As /props names them (`modalities`)."""

    VISION = "vision"
    AUDIO = "audio"
    VIDEO = "video"


# The keys under which a request's prompt (and its media) may be found: a tool's JSON schema
# or a response_format elsewhere in the body may hold {"type": "image"} without being one.
_PROMPT_KEYS = ("messages", "input", "prompt", "content", "instances")

_PART_TYPES = {
    "image_url": Modality.VISION,  # chat
    "input_image": Modality.VISION,  # Responses
    "image": Modality.VISION,  # Anthropic
    "input_audio": Modality.AUDIO,  # chat
    "input_video": Modality.VIDEO,
    "video_url": Modality.VIDEO,
}


@dataclass(frozen=True)
class MediaItem:
    modality: Modality
    inline_bytes: int  # characters of base64 (or data URI) carried in the body
    remote: bool = False  # an http(s) URL llama-server downloads itself (up to 10 MB)


@dataclass(frozen=True)
class Media:
    items: tuple[MediaItem, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def modalities(self) -> frozenset[Modality]:
        return frozenset(i.modality for i in self.items)

    @property
    def inline_bytes(self) -> int:
        """Bytes of the body that are media: held in memory for as long as a replay may need
        them."""
        return sum(i.inline_bytes for i in self.items)

    def count(self, modality: Modality) -> int:
        return sum(1 for i in self.items if i.modality is modality)

    def describe(self) -> str:
        """`2 images, 1 audio clip`, for logs and records."""
        words = {Modality.VISION: ("image", "images"), Modality.AUDIO: ("audio clip",
                                                                        "audio clips"),
                 Modality.VIDEO: ("video", "videos")}
        parts = []
        for modality, (one, many) in words.items():
            n = self.count(modality)
            if n:
                parts.append(f"{n} {one if n == 1 else many}")
        return ", ".join(parts)


NO_MEDIA = Media()


# Every media form names one of these in its JSON: a body without any has no media, and is not
# walked (the common text request pays a few substring searches in C, not a Python walk).
_MARKERS = (b"image", b"audio", b"video", b"multimodal_data")


def find(path: str, payload: dict[str, Any] | None, body: bytes | None = None) -> Media:
    """The media of a request to `path` (its `body`, when given, is looked at first); NO_MEDIA
    when it has none (or is not JSON)."""
    if not payload or (body is not None and not any(m in body for m in _MARKERS)):
        return NO_MEDIA
    items: list[MediaItem] = []
    completion = path in COMPLETION_ROUTES or path in EMBEDDING_ROUTES
    for key in _PROMPT_KEYS:
        if key in payload:
            items.extend(_walk(payload[key], completion))
    return Media(tuple(items)) if items else NO_MEDIA


def _walk(value: Any, completion: bool) -> Iterator[MediaItem]:
    if isinstance(value, list):
        for v in value:
            yield from _walk(v, completion)
        return
    if not isinstance(value, dict):
        return
    kind = value.get("type")
    modality = _PART_TYPES.get(kind) if isinstance(kind, str) else None
    if modality is not None and isinstance(kind, str):
        item = _part(kind, modality, value)
        if item is not None:
            yield item
            return
    if completion and "multimodal_data" in value:
        data = value["multimodal_data"]
        for entry in data if isinstance(data, list) else [data]:
            if isinstance(entry, str):
                yield MediaItem(sniff(entry), len(entry))
        return
    # Nested places: a message's content, a tool_result's content, a Responses tool output.
    for key in ("content", "output"):
        if key in value:
            yield from _walk(value[key], completion)


def _part(kind: str, modality: Modality, part: dict[str, Any]) -> MediaItem | None:
    if kind == "image":  # Anthropic: {"source": {"type": "base64", "data": ...} | url}
        source = part.get("source")
        if not isinstance(source, dict):
            return None
        if source.get("type") == "url":
            return _item(modality, source.get("url"))
        return _item(modality, source.get("data"))
    if kind == "input_image":  # Responses: "image_url" is the URL itself
        return _item(modality, part.get("image_url"))
    inner = part.get(kind)
    if isinstance(inner, str):
        return _item(modality, inner)
    if isinstance(inner, dict):
        return _item(modality, inner.get("data", inner.get("url")))
    return _item(modality, None)


def _item(modality: Modality, url: Any) -> MediaItem:
    if isinstance(url, str) and url.startswith("http"):
        return MediaItem(modality, len(url), remote=True)
    return MediaItem(modality, len(url) if isinstance(url, str) else 0)


# libmtmd's audio check (mtmd-helper.cpp, is_audio_file): WAV, MP3 (ID3 or a frame sync),
# FLAC. Everything else is decoded as an image.
def sniff(data: str) -> Modality:
    """The modality of a base64 blob from its first bytes."""
    # Its first characters after a data URI's comma (a slice: not a copy of the whole blob).
    start = data.find(",") + 1 if data.startswith("data:") else 0
    head = data[start:start + 24]
    try:
        raw = base64.b64decode(head + "=" * (-len(head) % 4), validate=False)
    except (binascii.Error, ValueError):
        return Modality.VISION
    if raw[:4] == b"RIFF" and raw[8:12] == b"WAVE":
        return Modality.AUDIO
    if raw[:3] == b"ID3" or raw[:4] == b"fLaC":
        return Modality.AUDIO
    if len(raw) >= 2 and raw[0] == 0xFF and (raw[1] & 0xE0) == 0xE0:
        return Modality.AUDIO
    return Modality.VISION


def takes(modalities: frozenset[Modality] | None, media: Media) -> bool:
    """Whether a child whose projector takes `modalities` (None: not known yet, taken as
    able) can serve the request's media."""
    return not media or modalities is None or media.modalities <= modalities


def from_props(props: Any) -> frozenset[Modality] | None:
    """/props `modalities` -> what the child's projector takes; None when it does not say."""
    found = props.get("modalities") if isinstance(props, dict) else None
    if not isinstance(found, dict):
        return None
    return frozenset(m for m in Modality if found.get(m.value) is True)


def takes_words(modalities: frozenset[Modality] | None) -> str:
    """What a child takes, as its log line and the status say it."""
    if modalities is None:
        return "its projector not known yet"
    if not modalities:
        return ("no projector: image and audio requests are not sent to it while a child "
                "that takes them serves")
    return "its projector takes " + " and ".join(m.value for m in Modality if m in modalities)



# An encoder's time per item, learned from the child's own `timings`: llama-server folds the
# encoder's runs into `prompt_ms` (it logs no time of its own for them at the default
# verbosity), so the part of a media request's prompt time beyond its tokens at the child's
# text speed is the encoder's.
ENCODE_ALPHA = 0.3  # the newest sample's weight
# Before a child has encoded anything: a CPU encoder takes seconds an image (a 400M-parameter
# ViT at 336 px is 5-20 s on 4-8 cores); the GPU's is well under one.
DEFAULT_ENCODE_S = {True: 0.5, False: 10.0}  # on a GPU?


def encode_sample(timings: Mapping[str, Any], prompt_tps: float | None,
                  items: int) -> float | None:
    """One answer's encoder seconds per item; None without the child's text speed (or
    timings that say nothing)."""
    try:
        n, ms = float(timings.get("prompt_n", 0)), float(timings.get("prompt_ms", 0))
    except (TypeError, ValueError):
        return None
    if not prompt_tps or items <= 0 or ms <= 0:
        return None
    return max(0.0, ms / 1000 - n / prompt_tps) / items


def fold_encode(old: float | None, seconds: float) -> float:
    return seconds if old is None else (1 - ENCODE_ALPHA) * old + ENCODE_ALPHA * seconds


def encode_seconds(media: Media, per_item_s: float | None, on_gpu: bool) -> float:
    """The encoder's time for a request's media on one child: each item at the child's own
    measured time, else the cautious default."""
    each = per_item_s if per_item_s is not None else DEFAULT_ENCODE_S[on_gpu]
    return each * len(media.items)


def aborts_child(path: str, payload: dict[str, Any] | None, marker: str | None) -> str | None:
    """A request the pinned llama-server cannot survive, said why; None for any other. A
    prompt object whose `prompt_string` ends with the media marker leaves the child no text
    token to decode after its last media item: it aborts (`GGML_ASSERT(batch.size() > 0)` in
    tools/server/server-context.cpp), taking every request in flight with it, and a replay
    would take the other child down the same way (tests/fixtures/multimodal)."""
    if not payload or marker is None or path not in COMPLETION_ROUTES:
        return None
    prompt = payload.get("prompt")
    for entry in prompt if isinstance(prompt, list) else [prompt]:
        if isinstance(entry, dict) and "multimodal_data" in entry and \
                isinstance(entry.get("prompt_string"), str) and \
                entry["prompt_string"].endswith(marker):
            return ("prompt_string ends with a media marker: llama-server aborts on a prompt "
                    "whose last piece is media (GGML_ASSERT(batch.size() > 0)), taking every "
                    "request in flight with it; put text after the last marker")
    return None


# The vision (or audio) encoder's compute buffer is allocated at each encode
# (ggml_backend_sched_alloc_graph), so an image request grows the GPU child's memory while it
# is encoded: the headroom must keep room for it on top of the usual margin.
@dataclass(frozen=True)
class EncoderMemory:
    """What the GPU child's samples taught of its encoder's memory."""

    baseline_bytes: int | None = None  # its use with no media in flight (the latest such)
    per_item_bytes: int = 0  # the most seen above the baseline, per media item in flight
    samples: int = 0  # samples taken with media in flight


def observe_memory(m: EncoderMemory, used_bytes: int, items_in_flight: int) -> EncoderMemory:
    """One sample of the GPU child's own memory, with the media items it was working on."""
    if items_in_flight <= 0:
        return EncoderMemory(used_bytes, m.per_item_bytes, m.samples)
    if m.baseline_bytes is None:
        return m
    above = max(0, used_bytes - m.baseline_bytes) // items_in_flight
    return EncoderMemory(m.baseline_bytes, max(m.per_item_bytes, above), m.samples + 1)


def reserve_bytes(m: EncoderMemory, items: int) -> int:
    """VRAM to keep free, beyond the headroom, for `items` media items being encoded at once
    (those in flight and the one asking): none until a sample showed what one takes."""
    return m.per_item_bytes * max(0, items)
