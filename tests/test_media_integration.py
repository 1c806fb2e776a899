"""Images and audio through Spillway, end to end (issue 38): real llama-server children serving
the tiny model with its tiny projector (`--mmproj`, tests/tinymm.py: 16 tokens an image, 50 per
started 30 s of audio), the real OpenAI client, the GPU's failures injected by
tests/gpu_fault_injector.py (which also records, with FAULT_BODIES_FILE, what Spillway sent a
child: the CPU child runs behind it too where a test must see its bodies; nothing triggers
there).

What is proved, one test each: every form a client sends media in is answered as llama-server
answers it and counted exactly (Spillway's figure equal to the child's, in the access log and in
spillway_prompt_count_error_tokens); an image request whose GPU child dies in its vision encoder
is replayed on the CPU child with its image, and a cut image stream goes on there with it; the
small child without a projector never sees an image, with one it does; a text-only model's
refusals of images are llama-server's own and make no child sick; a flood of large image bodies
is refused past failover.max_held_mib with Spillway's memory bounded; and one media marker for
both children, across a restart, with a /completion prompt written with it replayed and one
ending with it refused before it can abort a child.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psutil
import pytest
from harness import Spillway, eventually, real_config, settled
from prometheus_client.parser import text_string_to_metric_families
from tinymm import IMAGE_TOKENS, audio_tokens, b64, png_bytes, png_data_uri, wav_bytes

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]
MARKER = "OOM-ME"  # the injector's trigger, in a request's text
TEXT = "describe this"
SMALLER = {"X-Spillway-Fallback": "smaller"}
ALL = ("gpu", "small", "cpu")
MIB = 1024 * 1024


# --- configs ---------------------------------------------------------------------------------


def mm_config(llama_server: Path, model: Path, projector: Path | None,
              **sections: Any) -> dict[str, Any]:
    """Both children on the real llama-server with the tiny model and, given, its projector
    (model.args' --mmproj: both the GPU and the CPU child's)."""
    cfg = real_config(llama_server, model, **sections)
    if projector is not None:
        cfg["model"]["args"] = [*cfg["model"]["args"], "--mmproj", str(projector)]
    return cfg


def behind_injector(cfg: dict[str, Any], child: str, llama_server: Path, injector: Path,
                    **fault: str) -> dict[str, Any]:
    cfg[child] = {**cfg[child], "llama_server": str(injector),
                  "env": {"REAL_LLAMA_SERVER": str(llama_server), **fault}}
    return cfg


# --- bodies ----------------------------------------------------------------------------------

Part = dict[str, Any]


def image_part(seed: int, width: int = 8, height: int = 8) -> Part:
    return {"type": "image_url", "image_url": {"url": png_data_uri(width, height, seed)}}


def audio_part(seed: int, seconds: float = 1.0) -> Part:
    return {"type": "input_audio",
            "input_audio": {"data": b64(wav_bytes(seconds, seed=seed)), "format": "wav"}}


def chat(*parts: Part, text: str = TEXT, max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
            "max_tokens": max_tokens, **extra}


def responses(seed: int) -> dict[str, Any]:
    return {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": TEXT},
        {"type": "input_image", "image_url": png_data_uri(8, 8, seed)}]}],
        "max_output_tokens": 2}


def messages(seed: int) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": TEXT},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": b64(png_bytes(8, 8, seed))}}]}]}


def without_media(body: Any) -> Any:
    """The same body with its media parts taken out (what the text alone counts)."""
    if isinstance(body, list):
        return [without_media(v) for v in body
                if not (isinstance(v, dict) and v.get("type") in (
                    "image_url", "input_image", "image", "input_audio"))]
    if isinstance(body, dict):
        return {k: without_media(v) for k, v in body.items()}
    return body


# --- reading what Spillway and the children say ----------------------------------------------


def child_post(s: Spillway, child: str, path: str, body: Any) -> tuple[int, Any]:
    """POST a route outside generation (a counting route, /tokenize) to one child, pinned by
    X-Spillway-Child."""
    return s.post(path, body, headers={"X-Spillway-Child": child})


def child_count(s: Spillway, child: str, route: str, body: Any) -> int:
    status, answer = child_post(s, child, route, body)
    assert status == 200, answer
    return int(answer["input_tokens"])


def tokenize(s: Spillway, child: str, text: str, add_special: bool) -> int:
    status, answer = child_post(s, child, "/tokenize", {"content": text,
                                                        "add_special": add_special})
    assert status == 200, answer
    return len(answer["tokens"])


ACCESS = re.compile(r"rid=(\S+) POST (\S+) -> (\w+) (\d+) \S+ attempts=(\d+)"
                    r"(?: prompt_tokens=(\d+))?(?: child_prompt_tokens=(\d+))?"
                    r'(?: media="([^"]*)")?')


@dataclass(frozen=True)
class Access:
    child: str
    status: int
    attempts: int
    prompt_tokens: int | None
    child_prompt_tokens: int | None
    media: str | None


def access(s: Spillway, rid: str) -> Access:
    """The access log's line for one request (written as its answer ends, a moment after the
    client has it)."""
    def find() -> Access | None:
        for m in ACCESS.finditer(s.log_text()):
            if m[1] == rid:
                return Access(m[3], int(m[4]), int(m[5]),
                              int(m[6]) if m[6] else None, int(m[7]) if m[7] else None, m[8])
        return None
    found = eventually(find)
    assert found is not None, f"no access line for {rid}\n{s.log_tail()}"
    return found  # type: ignore[no-any-return]


def count_errors(s: Spillway, media: str = "yes") -> dict[str, float]:
    """spillway_prompt_count_error_tokens{media=...}: its count, and how many of its
    observations were exactly 0 (integers: in the bucket le=0, not in le=-1; with negative
    buckets the histogram has no _sum)."""
    status, text = s.get("/spillway/metrics")
    assert status == 200
    out: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("spillway_prompt_count_error_tokens") or \
                    sample.labels.get("media") != media:
                continue
            if sample.name.endswith("_bucket"):
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name.endswith("_count"):
                out["count"] = sample.value
    out["zero"] = buckets.get(0.0, 0.0) - buckets.get(-1.0, 0.0)
    return out


def bodies(path: Path) -> list[dict[str, Any]]:
    """What the injector recorded a child was sent: one line per generation request."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def modalities(s: Spillway) -> dict[str, list[str]]:
    """What each child's projector takes, once every child's is known: read from its /props
    as it becomes READY, a moment after the status says READY."""
    def known() -> dict[str, list[str]] | None:
        found = {n: c["modalities"] for n, c in s.status()["children"].items()}
        return found if all(m is not None for m in found.values()) else None
    found = eventually(known)
    assert found is not None, s.status()["children"]
    return found  # type: ignore[no-any-return]


def pids(s: Spillway) -> dict[str, int]:
    return {n: c["pid"] for n, c in s.status()["children"].items()}


def oai(s: Spillway, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120,
                         default_headers=headers or {})


# --- 1. every form, answered and counted -----------------------------------------------------


@dataclass(frozen=True)
class Form:
    route: str
    count_route: str
    body: Callable[[], dict[str, Any]]
    usage: Callable[[dict[str, Any]], int]
    media_tokens: int
    media_words: str


def _chat_usage(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens"])


def _messages_usage(answer: dict[str, Any]) -> int:
    # input_tokens leaves out what the slot had cached (test_multimodal_llama.py).
    usage = answer["usage"]
    return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens", 0))


CHAT = "/v1/chat/completions"
CHAT_COUNT = "/v1/chat/completions/input_tokens"
FORMS: dict[str, Form] = {
    "chat-input-audio": Form(CHAT, CHAT_COUNT, lambda: chat(audio_part(101)), _chat_usage,
                             audio_tokens(1.0), "1 audio clip"),
    "chat-two-images-and-audio": Form(
        CHAT, CHAT_COUNT, lambda: chat(image_part(102), image_part(103), audio_part(104)),
        _chat_usage, 2 * IMAGE_TOKENS + audio_tokens(1.0), "2 images, 1 audio clip"),
    "responses-input-image": Form("/v1/responses", "/v1/responses/input_tokens",
                                  lambda: responses(105),
                                  lambda a: int(a["usage"]["input_tokens"]), IMAGE_TOKENS,
                                  "1 image"),
    "messages-image": Form("/v1/messages", "/v1/messages/count_tokens", lambda: messages(106),
                           _messages_usage, IMAGE_TOKENS, "1 image"),
}


def test_every_form_is_answered_as_llama_server_answers_it_and_counted_exactly(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        tiny_projector: Path) -> None:
    """Chat image_url (a data URI, by the real OpenAI client, plain and streamed), chat
    input_audio, image and audio together, Responses input_image, an Anthropic image block and
    /completion's multimodal_data (written with the marker Spillway's /props gives): each 200,
    its media's tokens in the child's usage, and Spillway's count of it (the access log's
    prompt_tokens) equal to the child's own (child_prompt_tokens, and the answer's usage);
    every observation of spillway_prompt_count_error_tokens{media="yes"} is 0."""
    s = spillway(mm_config(llama_server, tiny_model, tiny_projector))
    assert modalities(s) == {"gpu": ["audio", "video", "vision"],
                             "cpu": ["audio", "video", "vision"]}
    client = oai(s)
    sent = 0

    # The real OpenAI client, a data-URI image: plain, then streamed with its usage.
    body = chat(image_part(100))
    text_only = child_count(s, "cpu", CHAT_COUNT, without_media(body))
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=body["messages"], max_tokens=2,
        extra_headers={"X-Request-Id": "mm-openai"})
    answer = raw.parse()
    assert raw.status_code == 200 and answer.usage is not None
    assert answer.usage.prompt_tokens == text_only + IMAGE_TOKENS
    line = access(s, "mm-openai")
    assert (line.status, line.media) == (200, "1 image")
    assert line.prompt_tokens == line.child_prompt_tokens == answer.usage.prompt_tokens
    stream = client.chat.completions.create(
        model="tiny", messages=body["messages"], max_tokens=2, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "mm-stream"})
    usages = [c.usage.prompt_tokens for c in stream if c.usage is not None]
    assert usages == [text_only + IMAGE_TOKENS]
    line = access(s, "mm-stream")
    assert line.prompt_tokens == line.child_prompt_tokens == usages[0]
    sent += 2

    # The other forms, as llama-server's own routes take them.
    for name, form in FORMS.items():
        body = form.body()
        status, answer = s.post(form.route, body, headers={"X-Request-Id": f"mm-{name}"})
        assert status == 200, (name, answer)
        usage = form.usage(answer)
        assert usage - child_count(s, "cpu", form.count_route, without_media(body)) == \
            form.media_tokens, name
        line = access(s, f"mm-{name}")
        assert (line.status, line.media) == (200, form.media_words), (name, line)
        assert line.prompt_tokens == line.child_prompt_tokens == usage, (name, line)
        sent += 1

    # /completion: the marker from Spillway's /props, the prompt object's multimodal_data.
    status, props = s.get("/props")
    assert status == 200
    marker = props["media_marker"]
    body = {"prompt": {"prompt_string": f"describe {marker} this",
                       "multimodal_data": [b64(png_bytes(8, 8, 107))]}, "n_predict": 2}
    status, answer = s.post("/completion", body, headers={"X-Request-Id": "mm-completion"})
    assert status == 200, answer
    expected = tokenize(s, "cpu", "describe ", True) + tokenize(s, "cpu", " this", False) + \
        IMAGE_TOKENS
    assert answer["tokens_evaluated"] == expected
    line = access(s, "mm-completion")
    assert (line.status, line.media) == (200, "1 image")
    assert line.prompt_tokens == line.child_prompt_tokens == expected
    sent += 1

    errors = eventually(lambda: (e := count_errors(s)).get("count") == sent and e)
    assert errors == {"count": sent, "zero": sent}, errors


# --- 2. a vision encoder's OOM: replayed with the image ---------------------------------------


def test_an_image_request_whose_gpu_child_dies_in_its_vision_encoder_is_replayed_with_it(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tiny_projector: Path,
        injector: Path, tmp_path: Path) -> None:
    """The GPU child dies as its vision encoder cannot allocate its compute buffer (a user's
    lines: cudaMalloc failed, then the failed assert; SIGABRT as the task launches): the
    client's 200 comes from the CPU child, labelled with the failover; the CPU child was sent
    the image, byte for byte, and its usage counts it (16 tokens over the text alone)."""
    cfg = mm_config(llama_server, tiny_model, tiny_projector)
    behind_injector(cfg, "gpu", llama_server, injector, FAULT_MARKER=MARKER,
                    FAULT_WHEN="launch", FAULT_LINES="vision",
                    FAULT_BODIES_FILE=str(tmp_path / "gpu.jsonl"))
    behind_injector(cfg, "cpu", llama_server, injector,
                    FAULT_BODIES_FILE=str(tmp_path / "cpu.jsonl"))
    s = spillway(cfg)
    body = chat(image_part(200), text=f"describe {MARKER} this", max_tokens=4)
    text_only = child_count(s, "cpu", CHAT_COUNT, without_media(body))
    raw = oai(s).chat.completions.with_raw_response.create(
        model="tiny", messages=body["messages"], max_tokens=4,
        extra_headers={"X-Request-Id": "vision-oom"})
    answer = raw.parse()
    assert raw.status_code == 200
    assert raw.headers["X-Spillway-Failover"] == "runtime_oom"
    assert raw.headers["X-Spillway-Child"] == "cpu"
    assert raw.headers["X-Spillway-Attempts"] == "2"
    assert answer.usage is not None
    # As a direct request's: the same body counted by the CPU child, the image's 16 tokens in it.
    assert answer.usage.prompt_tokens == child_count(s, "cpu", CHAT_COUNT, body) == \
        text_only + IMAGE_TOKENS
    # What each child was sent: the same image, the GPU child's first, then the CPU child's.
    url = body["messages"][0]["content"][1]["image_url"]["url"]
    [lost] = bodies(tmp_path / "gpu.jsonl")
    [replayed] = bodies(tmp_path / "cpu.jsonl")
    for sent in (lost, replayed):
        assert sent["path"] == CHAT
        assert sent["body"]["messages"][0]["content"][1]["image_url"]["url"] == url
    line = access(s, "vision-oom")
    assert (line.child, line.attempts, line.media) == ("cpu", 2, "1 image")
    assert line.prompt_tokens == line.child_prompt_tokens == answer.usage.prompt_tokens
    [record] = s.wait_incidents(1)
    assert record["decision"] == "replayed" and record["replay_child"] == "cpu"
    assert record["kind"] == "runtime_oom"
    assert "cudaMalloc failed: out of memory" in record["evidence"]
    assert record["status"] == 200
    status = s.wait_state(("gpu",), ("READY",))
    assert status["children"]["gpu"]["last_exit"]["signal"] == "SIGABRT"


# --- 3. a cut image stream goes on with its image ---------------------------------------------


def test_a_cut_image_stream_is_continued_on_the_cpu_child_with_its_image(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tiny_projector: Path,
        injector: Path, tmp_path: Path) -> None:
    """The GPU child dies three tokens into a stream about an image: the stream goes on from
    the CPU child, whose continuation carries the image (its prompt counts the 16 image
    tokens, beside the text and what was already relayed)."""
    cfg = mm_config(llama_server, tiny_model, tiny_projector)
    behind_injector(cfg, "gpu", llama_server, injector, FAULT_MARKER=MARKER,
                    FAULT_WHEN="tokens:3", FAULT_LINES="vision")
    behind_injector(cfg, "cpu", llama_server, injector,
                    FAULT_BODIES_FILE=str(tmp_path / "cpu.jsonl"))
    s = spillway(cfg)
    body = chat(image_part(300), text=f"describe {MARKER} this", max_tokens=24)
    stream = oai(s).chat.completions.create(
        model="tiny", messages=body["messages"], max_tokens=24, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "cut-image"})
    chunks = list(stream)
    final = next(ch for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    note = (final.model_extra or {})["spillway_continuation"]
    assert note["from_child"] == "gpu" and note["child"] == "cpu"
    assert note["kind"] == "runtime_oom" and note["tokens_before"] > 0
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    [record] = s.wait_incidents(1)
    assert record["decision"] == "continued" and record["replay_child"] == "cpu"
    assert record["status"] == 200
    # The continuation the CPU child was sent: the image, and the text already relayed.
    [continued] = bodies(tmp_path / "cpu.jsonl")
    sent = continued["body"]
    url = body["messages"][0]["content"][1]["image_url"]["url"]
    assert sent["messages"][0]["content"][1]["image_url"]["url"] == url
    assert sent["messages"][-1]["role"] == "assistant" and sent["messages"][-1]["content"]
    with_image = child_count(s, "cpu", CHAT_COUNT, sent)
    assert with_image - child_count(s, "cpu", CHAT_COUNT, without_media(sent)) == IMAGE_TOKENS


# --- 4. the small child and its projector ----------------------------------------------------


def _gpu_down(s: Spillway) -> None:
    """The GPU child killed; its back-off long enough that it stays down for the test."""
    os.kill(s.status()["children"]["gpu"]["pid"], signal.SIGKILL)
    eventually(lambda: s.child("gpu")["state"] in ("EXITED", "BACKOFF"), timeout=30)


def _ask_smaller(s: Spillway, body: dict[str, Any], rid: str) -> tuple[int, Any, str]:
    raw = oai(s, SMALLER).chat.completions.with_raw_response.create(
        model="tiny", messages=body["messages"], max_tokens=body["max_tokens"],
        extra_headers={"X-Request-Id": rid})
    answer = raw.parse()
    return raw.status_code, answer, raw.headers["X-Spillway-Child"]


def test_an_opted_in_image_never_reaches_a_small_child_without_a_projector(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        tiny_projector: Path) -> None:
    """small.path without small.mmproj: model.args' --mmproj is the large model's, kept from
    the small child. With the GPU child down, an opted-in text request is the small child's,
    an opted-in image request the CPU child's (which has the projector), never the small
    child's."""
    s = spillway(mm_config(llama_server, tiny_model, tiny_projector,
                           small={"path": str(tiny_model)},
                           restart={"backoff_initial_s": 60.0, "backoff_max_s": 60.0}))
    s.wait_ready(children=ALL)
    assert modalities(s) == {"gpu": ["audio", "video", "vision"], "small": [],
                             "cpu": ["audio", "video", "vision"]}
    _gpu_down(s)
    status, _, child = _ask_smaller(s, chat(text="hello"), "small-text")
    assert (status, child) == (200, "small")
    small_tasks = s.child("small")["tasks_started"]
    for i in range(3):
        body = chat(image_part(400 + i))
        status, answer, child = _ask_smaller(s, body, f"small-image-{i}")
        assert (status, child) == (200, "cpu")
        assert answer.usage.prompt_tokens == \
            child_count(s, "cpu", CHAT_COUNT, without_media(body)) + IMAGE_TOKENS
    assert settled(lambda: s.child("small")["tasks_started"]) == small_tasks
    assert s.child("gpu")["state"] in ("EXITED", "BACKOFF")  # down all along


def test_with_small_mmproj_an_opted_in_image_is_the_small_childs(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        tiny_projector: Path) -> None:
    """small.mmproj given: the small child's projector takes images, and with the GPU child
    down an opted-in image request is answered by it, its image counted."""
    s = spillway(mm_config(llama_server, tiny_model, tiny_projector,
                           small={"path": str(tiny_model), "mmproj": str(tiny_projector)},
                           restart={"backoff_initial_s": 60.0, "backoff_max_s": 60.0}))
    s.wait_ready(children=ALL)
    assert modalities(s)["small"] == ["audio", "video", "vision"]
    _gpu_down(s)
    body = chat(image_part(410))
    status, answer, child = _ask_smaller(s, body, "small-mmproj-image")
    assert (status, child) == (200, "small")
    assert answer.usage.prompt_tokens == \
        child_count(s, "small", CHAT_COUNT, without_media(body)) + IMAGE_TOKENS
    line = access(s, "small-mmproj-image")
    assert line.prompt_tokens == line.child_prompt_tokens == answer.usage.prompt_tokens


# --- 5. a text-only model: llama-server's refusals, no sick child -----------------------------


def test_images_to_a_text_only_model_get_llama_servers_500_and_no_child_is_ended(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    """No --mmproj anywhere: each image request (different bodies, more than
    restart.sick_after_errors of them in a row) gets llama-server's own 500 "image input is
    not supported", and every child keeps running: a request the model cannot take says
    nothing of the child's health."""
    s = spillway(mm_config(llama_server, tiny_model, None))
    assert modalities(s) == {"gpu": [], "cpu": []}
    before = pids(s)
    expected = json.loads(json.loads((Path(__file__).parent / "fixtures" / "multimodal" /
                                      "text-only-chat-image.json").read_text())["body"])
    for i in range(5):
        status, answer = s.post(CHAT, chat(image_part(500 + i)))
        assert status == 500, answer
        assert answer["error"]["message"] == expected["error"]["message"]
        assert answer["error"]["type"] == expected["error"]["type"] == "server_error"
    status, answer = s.post("/v1/responses", responses(510))
    assert status == 500 and answer["error"]["message"].startswith(
        "image input is not supported"), answer
    # The sick verdict would be taken as the third answer ended, and said in the log.
    assert settled(lambda: pids(s), quiet_s=0.5) == before
    assert "] sick (" not in s.log_text()
    children = s.status()["children"]
    assert {n: (c["state"], c["restarts"]) for n, c in children.items()} == {
        "gpu": ("READY", 0), "cpu": ("READY", 0)}
    status, answer = s.post(CHAT, chat(text="and text still works"))
    assert status == 200, answer


# --- 6. a flood of large image bodies ---------------------------------------------------------


class RssSampler:
    """The daemon's resident memory, sampled every few milliseconds in a thread."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.baseline = self.proc.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.proc.memory_info().rss)
            if self._stop.wait(0.005):  # a sample every 5 ms, until told to stop
                return

    @contextlib.contextmanager
    def sampling(self) -> Iterator[RssSampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(5)


def test_a_flood_of_large_image_bodies_gets_controlled_503s_and_bounded_memory(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        tiny_projector: Path) -> None:
    """20 concurrent requests, each a 1400 x 1000 noise PNG (about 5.6 MB of base64), with
    failover.max_held_mib = 16: those past the bound get Spillway's 503 (Retry-After,
    queue_position) before their bodies are read, the others are answered 200; the daemon's
    RSS grows by far less than the bytes sent."""
    s = spillway(mm_config(llama_server, tiny_model, tiny_projector,
                           failover={"max_held_mib": 16}))
    png = png_bytes(1400, 1000, seed=600)
    url = f"data:image/png;base64,{b64(png)}"
    payloads = [json.dumps(chat({"type": "image_url", "image_url": {"url": url}},
                                text=f"picture {i}", max_tokens=1)).encode()
                for i in range(20)]
    size = len(payloads[0])
    assert 5 * MIB < size < 6 * MIB
    # Warm: one small image, so that the first use of the media paths is not the figure.
    assert s.post(CHAT, chat(image_part(601)))[0] == 200
    assert s.proc is not None
    sampler = RssSampler(s.proc.pid)

    async def one(http: aiohttp.ClientSession, data: bytes) -> tuple[int, Any, dict[str, str]]:
        async with http.post(f"{s.url}{CHAT}", data=data,
                             headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json(content_type=None), dict(r.headers)

    async def flood() -> list[tuple[int, Any, dict[str, str]]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            return await asyncio.gather(*(one(http, p) for p in payloads))

    started = time.monotonic()
    with sampler.sampling():
        answers = asyncio.run(flood())
    elapsed = time.monotonic() - started
    statuses = sorted(status for status, _, _ in answers)
    refused = [(body, headers) for status, body, headers in answers if status == 503]
    answered = [body for status, body, _ in answers if status == 200]
    assert len(refused) + len(answered) == 20, statuses
    assert answered and refused, statuses
    for body, headers in refused:
        assert int(headers["Retry-After"]) >= 1
        error = body["error"]
        assert error["type"] == "unavailable_error" and error["queue_position"] >= 1
        assert "failover.max_held_mib" in error["message"]
    for body in answered:
        assert body["usage"]["prompt_tokens"] > IMAGE_TOKENS
    growth = sampler.peak - sampler.baseline
    sent = size * len(payloads)
    print(f"\nflood: {len(answered)} answered, {len(refused)} refused, {sent / MIB:.1f} MiB "
          f"sent in {elapsed:.2f} s; RSS {sampler.baseline / MIB:.1f} MiB before, peak "
          f"{sampler.peak / MIB:.1f} MiB (+{growth / MIB:.1f} MiB)")
    # Measured on 2 cores before issue 47: +37 MiB (two bodies held, each in memory as its
    # bytes and as its parsed JSON, and a decode's worth while it is parsed); without the bound
    # (0), all 20 answered, +287 MiB. A held body's parsed JSON is now let go before it is
    # counted (the next test).
    assert growth < 4 * 16 * MIB and growth < sent / 2, (growth, sent)
    # Every place given back once the answers are out.
    held = eventually(lambda: (h := s.status()["caches"]["held_bodies"])["bytes"] == 0 and h)
    assert held and held["entries"] == 0 and held["max_bytes"] == 16 * MIB, held


def test_a_flood_of_image_bodies_holds_each_body_about_once(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        tiny_projector: Path) -> None:
    """8 concurrent requests, each a 4 MiB body with one noise PNG, none refused
    (failover.max_held_mib = 0): the daemon's peak RSS grows by less than 1.6 bytes per byte
    of the bodies in flight. Each body is held as its bytes alone while it is counted, waits
    and is sent (in slices, not joined to its head): its parsed JSON is let go once admission
    has read it. Before issue 47 it was 2.2 (the bytes, the parsed JSON, the copies being sent
    for the count and the attempt); bench/bodies.py measures both.

    With glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_, 128 KiB), every block of a body
    is mapped and given back when freed, so the peak is the copies alive at once, not what the
    heap kept of transient ones by chance of their order (1.2 and 2.2, round after round,
    against 1.6-1.9 and 2.4-2.6 with the threshold free to rise)."""
    s = spillway(mm_config(llama_server, tiny_model, tiny_projector,
                           failover={"max_held_mib": 0}, queue={"max_waiting": 64}),
                 env={"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    side = 1024  # 1024 x 1024 RGB noise: 3 MiB of PNG, 4 MiB once in base64
    payloads = [json.dumps(chat({"type": "image_url", "image_url": {
        "url": f"data:image/png;base64,{b64(png_bytes(side, side, seed=610 + i))}"}},
        text=f"picture {i}", max_tokens=1)).encode() for i in range(8)]
    assert all(3.5 * MIB < len(p) < 4.5 * MIB for p in payloads)
    assert s.post(CHAT, chat(image_part(609)))[0] == 200  # warm: the media paths' first use
    assert s.proc is not None
    sampler = RssSampler(s.proc.pid)

    async def one(http: aiohttp.ClientSession, data: bytes) -> int:
        async with http.post(f"{s.url}{CHAT}", data=data,
                             headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return r.status

    async def flood() -> list[int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            return await asyncio.gather(*(one(http, p) for p in payloads))

    with sampler.sampling():
        statuses = asyncio.run(flood())
    assert statuses == [200] * len(payloads), statuses
    sent = sum(len(p) for p in payloads)
    per_byte = (sampler.peak - sampler.baseline) / sent
    print(f"\nflood of {len(payloads)} image bodies, {sent / MIB:.1f} MiB: RSS +"
          f"{(sampler.peak - sampler.baseline) / MIB:.1f} MiB, {per_byte:.2f} per body byte")
    assert per_byte < 1.6, per_byte


# --- 7. one media marker ---------------------------------------------------------------------


def test_one_media_marker_for_both_children_across_a_restart_and_its_prompts(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tiny_projector: Path,
        injector: Path, tmp_path: Path) -> None:
    """/props' media_marker is the same on both children, and still after the GPU child's
    restart; a /completion prompt written with it survives the GPU child's death (replayed on
    the CPU child, 200, its image counted); one ending with it gets Spillway's 400 and no child
    dies."""
    cfg = mm_config(llama_server, tiny_model, tiny_projector)
    behind_injector(cfg, "gpu", llama_server, injector, FAULT_MARKER=MARKER,
                    FAULT_WHEN="launch", FAULT_LINES="vision",
                    FAULT_ONCE_FILE=str(tmp_path / "fired"))
    s = spillway(cfg)

    def markers() -> dict[str, str]:
        out = {}
        for child in ("gpu", "cpu"):
            status, props = s.get("/props", headers={"X-Spillway-Child": child})
            assert status == 200, props
            out[child] = props["media_marker"]
        return out

    first = markers()
    marker = first["gpu"]
    assert first == {"gpu": marker, "cpu": marker}
    assert re.fullmatch(r"<__media_[0-9a-f]{32}__>", marker), marker
    gpu_pid = s.child("gpu")["pid"]

    body = {"prompt": {"prompt_string": f"{MARKER} describe {marker} this",
                       "multimodal_data": [b64(png_bytes(8, 8, 700))]}, "n_predict": 4}
    request = urllib.request.Request(f"{s.url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200
        assert r.headers["X-Spillway-Child"] == "cpu"
        assert r.headers["X-Spillway-Attempts"] == "2"
        answer = json.loads(r.read())
    assert (tmp_path / "fired").exists()
    expected = tokenize(s, "cpu", f"{MARKER} describe ", True) + \
        tokenize(s, "cpu", " this", False) + IMAGE_TOKENS
    assert answer["tokens_evaluated"] == expected
    [record] = s.wait_incidents(1)
    assert record["decision"] == "replayed" and record["route"] == "/completion"

    s.wait_state(("gpu",), ("READY",))
    assert s.child("gpu")["pid"] != gpu_pid and s.child("gpu")["restarts"] == 1
    assert markers() == first  # the restarted child has the same marker

    before = pids(s)
    tasks = {n: c["tasks_started"] for n, c in s.status()["children"].items()}
    doomed = {"prompt": {"prompt_string": f"describe this {marker}",
                         "multimodal_data": [b64(png_bytes(8, 8, 701))]}, "n_predict": 4}
    status, refused = s.post("/completion", doomed)
    assert status == 400, refused
    assert refused["error"]["type"] == "invalid_request_error"
    assert "ends with a media marker" in refused["error"]["message"]
    assert settled(lambda: pids(s)) == before
    assert {n: c["tasks_started"] for n, c in s.status()["children"].items()} == tasks
    assert {n: c["state"] for n, c in s.status()["children"].items()} == {
        "gpu": "READY", "cpu": "READY"}
