"""policy/media.py: the media of a request in every form a client sends, as llama-server reads
them, without decoding a pixel."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from supervisor.policy import media
from supervisor.policy.media import Modality

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode()
WAV = base64.b64encode(b"RIFF" + struct.pack("<I", 36) + b"WAVEfmt " + b"\0" * 30).decode()
MP3 = base64.b64encode(b"ID3\x03\0\0\0\0\0\0" + b"\0" * 20).decode()
FLAC = base64.b64encode(b"fLaC" + b"\0" * 20).decode()
WEBP = base64.b64encode(b"RIFF" + struct.pack("<I", 36) + b"WEBPVP8 " + b"\0" * 20).decode()


def chat(*parts: dict) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                      *parts]}]}


def test_chat_image_url_data_uri_and_remote() -> None:
    found = media.find("/v1/chat/completions", chat(
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}))
    assert [i.modality for i in found.items] == [Modality.VISION, Modality.VISION]
    assert found.items[0].inline_bytes == len(f"data:image/png;base64,{PNG}")
    assert not found.items[0].remote and found.items[1].remote
    assert found.modalities == {Modality.VISION}
    assert found.describe() == "2 images"


def test_chat_input_audio_and_video() -> None:
    found = media.find("/v1/chat/completions", chat(
        {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}))
    assert found.modalities == {Modality.AUDIO, Modality.VIDEO}
    assert found.count(Modality.AUDIO) == 1
    assert found.inline_bytes == len(WAV) + len("data:video/mp4;base64,AAAA")
    assert found.describe() == "1 audio clip, 1 video"


def test_image_url_part_needs_vision_even_with_audio_bytes() -> None:
    """llama-server checks the part's type (allow_image), not its bytes."""
    found = media.find("/v1/chat/completions", chat(
        {"type": "image_url", "image_url": {"url": f"data:audio/wav;base64,{WAV}"}}))
    assert found.modalities == {Modality.VISION}


def test_history_images_count_too() -> None:
    payload = chat({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}})
    payload["messages"] += [{"role": "assistant", "content": "a cat"},
                            {"role": "user", "content": "and this?"}]
    assert media.find("/v1/chat/completions", payload).count(Modality.VISION) == 1


def test_responses_input_image_and_tool_output() -> None:
    payload = {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what is it"},
                                     {"type": "input_image",
                                      "image_url": f"data:image/png;base64,{PNG}"}]},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}
    found = media.find("/v1/responses", payload)
    assert found.count(Modality.VISION) == 2
    assert [i.remote for i in found.items] == [False, True]


def test_anthropic_image_blocks_and_tool_result() -> None:
    payload = {"messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}},
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://x/y.jpg"}}]}]}]}
    found = media.find("/v1/messages", payload)
    assert found.count(Modality.VISION) == 2
    assert found.items[0].inline_bytes == len(PNG)
    assert found.items[1].remote


@pytest.mark.parametrize("blob, modality", [(PNG, Modality.VISION), (WAV, Modality.AUDIO),
                                            (MP3, Modality.AUDIO), (FLAC, Modality.AUDIO),
                                            (WEBP, Modality.VISION),
                                            ("!!notbase64", Modality.VISION)])
def test_completion_multimodal_data_by_magic(blob: str, modality: Modality) -> None:
    payload = {"prompt": {"prompt_string": "look <__media__>", "multimodal_data": [blob]}}
    found = media.find("/completion", payload)
    assert found.modalities == {modality}
    assert found.inline_bytes == len(blob)


def test_completion_list_of_prompt_objects_and_embeddings_content() -> None:
    payload = {"prompt": [{"prompt_string": "a <m>", "multimodal_data": [PNG]},
                          {"prompt_string": "b <m> <m>", "multimodal_data": [PNG, WAV]}]}
    assert media.find("/v1/completions", payload).describe() == "2 images, 1 audio clip"
    emb = {"input": [{"content": [{"type": "image_url",
                                   "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]}
    assert media.find("/v1/embeddings", emb).count(Modality.VISION) == 1


def test_no_media_and_schema_lookalikes() -> None:
    """A tool's schema or a response format with {"type": "image"} is not media."""
    payload = {"messages": [{"role": "user", "content": "hello"}],
               "tools": [{"type": "function", "function": {
                   "name": "f", "parameters": {"type": "image"}}}],
               "response_format": {"type": "image_url"}}
    assert not media.find("/v1/chat/completions", payload)
    assert not media.find("/v1/chat/completions", None)
    # multimodal_data counts only on the routes that read it
    assert not media.find("/v1/chat/completions",
                          {"prompt": {"prompt_string": "x", "multimodal_data": [PNG]}})


def test_takes_and_from_props() -> None:
    vision = media.from_props({"modalities": {"vision": True, "audio": False, "video": False}})
    assert vision == {Modality.VISION}
    assert media.from_props({"total_slots": 1}) is None
    image = media.find("/v1/chat/completions", chat(
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}))
    audio = media.find("/v1/chat/completions", chat(
        {"type": "input_audio", "input_audio": {"data": WAV}}))
    assert media.takes(vision, image) and not media.takes(vision, audio)
    assert media.takes(None, audio)  # not known yet: taken as able
    assert media.takes(frozenset(), media.NO_MEDIA)
    assert not media.takes(frozenset(), image)


def test_a_prompt_ending_with_the_marker_is_refused_before_it_aborts_a_child() -> None:
    m = "<__media_abc__>"
    ending = {"prompt": {"prompt_string": f"look {m}", "multimodal_data": [PNG]}}
    assert "aborts" in (media.aborts_child("/completion", ending, m) or "")
    listed = {"prompt": [{"prompt_string": "fine", "multimodal_data": []},
                         {"prompt_string": m, "multimodal_data": [PNG]}]}
    assert media.aborts_child("/v1/completions", listed, m) is not None
    text_after = {"prompt": {"prompt_string": f"look {m} now", "multimodal_data": [PNG]}}
    assert media.aborts_child("/completion", text_after, m) is None
    assert media.aborts_child("/completion", ending, None) is None  # marker not known
    assert media.aborts_child("/v1/chat/completions", ending, m) is None


def test_the_encoders_time_is_the_prompt_time_beyond_its_tokens() -> None:
    # 116 prompt tokens at 100 tokens/s is 1.16 s; 3.16 s measured: 2 s of encoder, 1 s each.
    timings = {"prompt_n": 116, "prompt_ms": 3160.0}
    assert media.encode_sample(timings, 100.0, 2) == pytest.approx(1.0)
    assert media.encode_sample(timings, None, 2) is None  # text speed unknown yet
    assert media.encode_sample({"prompt_n": 10, "prompt_ms": 50.0}, 100.0, 1) == 0.0
    assert media.fold_encode(None, 2.0) == 2.0
    assert media.fold_encode(2.0, 1.0) == pytest.approx(1.7)
    two = media.find("/v1/chat/completions", chat(
        {"type": "image_url", "image_url": {"url": PNG}},
        {"type": "input_audio", "input_audio": {"data": WAV}}))
    assert media.encode_seconds(two, 1.5, on_gpu=False) == 3.0
    assert media.encode_seconds(two, None, on_gpu=False) == 2 * media.DEFAULT_ENCODE_S[False]
    assert media.encode_seconds(media.NO_MEDIA, 1.5, on_gpu=True) == 0.0


def test_the_encoders_memory_is_learned_from_samples_above_the_baseline() -> None:
    mib = 1 << 20
    m = media.EncoderMemory()
    m = media.observe_memory(m, 900 * mib, 1)  # no baseline yet: nothing learned
    assert m.per_item_bytes == 0 and media.reserve_bytes(m, 3) == 0
    m = media.observe_memory(m, 1000 * mib, 0)  # idle of media: the baseline
    m = media.observe_memory(m, 1300 * mib, 1)  # one image encoding: 300 MiB above
    assert m.per_item_bytes == 300 * mib
    m = media.observe_memory(m, 1400 * mib, 2)  # two at once, 200 each: the most stays
    assert m.per_item_bytes == 300 * mib and m.samples == 2
    assert media.reserve_bytes(m, 2) == 600 * mib
    m = media.observe_memory(m, 1100 * mib, 0)  # a new baseline (a larger KV in use)
    assert m.baseline_bytes == 1100 * mib and m.per_item_bytes == 300 * mib


def test_a_body_that_names_no_media_is_not_walked() -> None:
    payload = chat({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}})
    body = json.dumps(payload).encode()
    assert media.find("/v1/chat/completions", payload, body).count(Modality.VISION) == 1
    # The same payload with a body that does not name it (a stand-in for a text request's
    # body): the bytes say no media, and nothing is walked.
    assert not media.find("/v1/chat/completions", payload, b'{"messages": []}')
