"""Images and audio through a real llama-server (issue 38): what Spillway will stand in front of.

The pinned llama-server serves the tiny text model with the tiny projector (tinymm.py: 16
tokens an image, 50 per started 30 s of audio). Every form a client sends media in is answered,
and its usage counts the media tokens; llama-server's own counting routes
(`/v1/chat/completions/input_tokens`, `/v1/responses/input_tokens`,
`/v1/messages/count_tokens`) give the same count for the same body, which is what Spillway
relies on to know a request's size before it is sent. Where llama-server does something a
proxy must know about (a per-process media marker, an answer whose usage leaves out cached
tokens, a prompt that aborts the server, a remote URL it fetches itself, errors whose status
differs between a route and its counting route), a test says exactly what.

The answers where llama-server refuses media are kept byte for byte in
tests/fixtures/multimodal/ and compared here; `SPILLWAY_CAPTURE_MULTIMODAL=1` rewrites them.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import PATIENCE_S, eventually, free_port
from llama_answers import send
from tinymm import (
    IMAGE_TOKENS,
    audio_tokens,
    b64,
    data_uri,
    png_bytes,
    png_data_uri,
    wav_bytes,
    write_tiny_projector,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "multimodal"
CAPTURE = os.environ.get("SPILLWAY_CAPTURE_MULTIMODAL") == "1"
# The lines llama-server writes about media at `-lv 4` (trace); none at the default verbosity.
# The encoder's time is the gap between the first two lines' timestamps: the server logs no
# "encoded in" line of its own (mtmd-helper's "image slice encoded in N ms" is the CLI's path).
ENCODING_LINE = re.compile(r"^(\d+(?:\.\d+)+) I slot encode_mtmd_: id +\d+ \| task \d+ \| "
                           r"encoding mtmd batch from idx = \d+, n_chunks = \d+$", re.M)
DECODING_LINE = re.compile(r"^(\d+(?:\.\d+)+) I decoding (image|audio) batch \d+/\d+, "
                           r"n_tokens_batch = (\d+)$", re.M)
DECODED_LINE = re.compile(r"^\d+(?:\.\d+)+ I (image|audio) decoded \(batch \d+/\d+\) "
                          r"in (\d+) ms$", re.M)
TEXT = "describe this"


# --- servers ---------------------------------------------------------------------------------


@dataclass
class Server:
    """A bare llama-server run from the models' folder (so that its log names files as
    `tiny.gguf`, the same on every machine)."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    args: list[str]

    def request(self, method: str, path: str, body: Any = None,
                timeout: float = 60.0) -> tuple[int, str | None, bytes]:
        req: dict[str, Any] = {"method": method, "path": path}
        if body is not None:
            req["json"] = body
        return send(self.port, req, timeout=timeout)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, _, raw = self.request("POST", path, body)
        return status, json.loads(raw)

    def get(self, path: str) -> Any:
        status, _, raw = self.request("GET", path)
        assert status == 200, raw
        return json.loads(raw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(llama_server: Path, folder: Path, name: str, args: list[str],
                 env: dict[str, str] | None = None) -> Server:
    """Start llama-server with `args` (file names relative to `folder`) and wait for its
    /health to answer 200 (about 0.1 s for the tiny pair)."""
    port = free_port()
    log_path = folder / f"{name}-{port}.log"
    argv = [str(llama_server), "--host", "127.0.0.1", "--port", str(port), *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    server = Server(proc, port, log_path, args)
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"llama-server exited {proc.returncode}:\n{server.log()}")
        with contextlib.suppress(OSError):
            if server.request("GET", "/health", timeout=2)[0] == 200:
                return server
        time.sleep(0.02)
    server.stop()
    raise AssertionError(f"llama-server not ready in {PATIENCE_S} s:\n{server.log()}")


# Each server's arguments (relative to the models' folder); the fixtures' README names them.
BASE_ARGS = ["-m", "tiny.gguf", "-c", "4096", "-np", "2", "-t", "1", "-tb", "1"]
SERVER_ARGS: dict[str, list[str]] = {
    "text-only": BASE_ARGS,
    "vision-only": [*BASE_ARGS, "--mmproj", "mmproj-vision.gguf"],
    # -lv 4: the media lines (ENCODING_LINE and the rest) are trace-level.
    "vision+audio": [*BASE_ARGS, "--mmproj", "mmproj.gguf", "-lv", "4"],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
           tiny_projector: Path) -> Path:
    """The tiny model, its projector, and a projector with a vision encoder only."""
    folder = tmp_path_factory.mktemp("mm")
    (folder / "tiny.gguf").symlink_to(tiny_model)
    (folder / "mmproj.gguf").symlink_to(tiny_projector)
    write_tiny_projector(folder / "mmproj-vision.gguf", audio=False)
    return folder


@pytest.fixture(scope="module")
def servers(llama_server: Path, folder: Path) -> Iterator[dict[str, Server]]:
    started = {name: start_server(llama_server, folder, name, args)
               for name, args in SERVER_ARGS.items()}
    yield started
    for s in started.values():
        s.stop()


@pytest.fixture(scope="module")
def mm(servers: dict[str, Server]) -> Server:
    return servers["vision+audio"]


# --- request bodies --------------------------------------------------------------------------

Part = dict[str, Any]


def image_part(seed: int, width: int = 8, height: int = 8) -> Part:
    return {"type": "image_url", "image_url": {"url": png_data_uri(width, height, seed)}}


def audio_part(seed: int, seconds: float = 1.0, as_uri: bool = False) -> Part:
    wav = wav_bytes(seconds, seed=seed)
    return {"type": "input_audio",
            "input_audio": {"data": data_uri(wav, "audio/wav") if as_uri else b64(wav),
                            "format": "wav"}}


def chat(*parts: Part) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}, *parts]}],
            "max_tokens": 1}


def responses(*image_seeds: int) -> dict[str, Any]:
    content: list[Part] = [{"type": "input_text", "text": TEXT}]
    content += [{"type": "input_image", "image_url": png_data_uri(8, 8, s)} for s in image_seeds]
    return {"input": [{"role": "user", "content": content}], "max_output_tokens": 1}


def messages(*image_seeds: int) -> dict[str, Any]:
    content: list[Part] = [{"type": "text", "text": TEXT}]
    content += [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": b64(png_bytes(8, 8, s))}}
                for s in image_seeds]
    return {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}


def chat_usage(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens"])


def responses_usage(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["input_tokens"])


def messages_usage(answer: dict[str, Any]) -> int:
    """Anthropic's `input_tokens` leaves out the tokens read from the cache (its own
    `cache_read_input_tokens`): the prompt is their sum (see test_anthropic_usage_...)."""
    usage = answer["usage"]
    return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens", 0))


@dataclass(frozen=True)
class Form:
    """A request form: its route and counting route, the body with media and without, how to
    read the prompt's tokens from the answer, and how many of them the media are."""

    route: str
    count_route: str
    body: Callable[[], dict[str, Any]]
    text_only: Callable[[], dict[str, Any]]
    usage: Callable[[dict[str, Any]], int]
    media_tokens: int


CHAT = "/v1/chat/completions"
CHAT_COUNT = "/v1/chat/completions/input_tokens"
FORMS: dict[str, Form] = {
    "chat-image-data-uri": Form(CHAT, CHAT_COUNT, lambda: chat(image_part(1)), chat,
                                chat_usage, IMAGE_TOKENS),
    "chat-two-images": Form(CHAT, CHAT_COUNT, lambda: chat(image_part(2), image_part(3)), chat,
                            chat_usage, 2 * IMAGE_TOKENS),
    # Any size is resized to the encoder's 56 px: still 16 tokens.
    "chat-image-640x480": Form(CHAT, CHAT_COUNT, lambda: chat(image_part(4, 640, 480)), chat,
                               chat_usage, IMAGE_TOKENS),
    "chat-input-audio-base64": Form(CHAT, CHAT_COUNT, lambda: chat(audio_part(5)), chat,
                                    chat_usage, audio_tokens(1.0)),
    "chat-input-audio-data-uri": Form(CHAT, CHAT_COUNT, lambda: chat(audio_part(6, as_uri=True)),
                                      chat, chat_usage, audio_tokens(1.0)),
    "chat-input-audio-31s": Form(CHAT, CHAT_COUNT, lambda: chat(audio_part(7, 31.0)), chat,
                                 chat_usage, audio_tokens(31.0)),
    "chat-image-and-audio": Form(CHAT, CHAT_COUNT, lambda: chat(image_part(8), audio_part(9)),
                                 chat, chat_usage, IMAGE_TOKENS + audio_tokens(1.0)),
    "responses-input-image": Form("/v1/responses", "/v1/responses/input_tokens",
                                  lambda: responses(10), responses, responses_usage,
                                  IMAGE_TOKENS),
    "messages-image-base64": Form("/v1/messages", "/v1/messages/count_tokens",
                                  lambda: messages(11), messages, messages_usage, IMAGE_TOKENS),
}


def count(server: Server, route: str, body: dict[str, Any]) -> int:
    status, answer = server.post(route, body)
    assert status == 200, answer
    return int(answer["input_tokens"])


# --- what the server says it can do ----------------------------------------------------------


def test_props_and_models_show_the_modalities(servers: dict[str, Server]) -> None:
    """/props `modalities` and /v1/models `capabilities` say what each server takes. `video`
    follows vision: the build has MTMD_VIDEO, whose frames come from running `ffmpeg` and
    `ffprobe` at request time, so `video: true` says nothing of whether they are installed."""
    seen = {name: s.get("/props")["modalities"] for name, s in servers.items()}
    assert seen == {"text-only": {"vision": False, "video": False, "audio": False},
                    "vision-only": {"vision": True, "video": True, "audio": False},
                    "vision+audio": {"vision": True, "video": True, "audio": True}}
    capabilities = {name: s.get("/v1/models")["models"][0]["capabilities"]
                    for name, s in servers.items()}
    assert capabilities == {"text-only": ["completion"],
                            "vision-only": ["completion", "multimodal"],
                            "vision+audio": ["completion", "multimodal"]}


def test_the_media_marker_is_each_servers_own(llama_server: Path, folder: Path,
                                              servers: dict[str, Server]) -> None:
    """/completion's `prompt_string` must hold the server's marker, which /props gives: a
    random one per process (`<__media_` + 32 letters and digits + `__>`), not mtmd's documented
    `<__media__>`, unless LLAMA_MEDIA_MARKER pins it (Spillway starts its children and can)."""
    markers = {name: s.get("/props")["media_marker"] for name, s in servers.items()}
    for marker in markers.values():
        assert re.fullmatch(r"<__media_[A-Za-z0-9]{32}__>", marker), marker
    assert len(set(markers.values())) == len(markers)
    pinned = start_server(llama_server, folder, "pinned",
                          [*BASE_ARGS, "--mmproj", "mmproj.gguf"],
                          env={"LLAMA_MEDIA_MARKER": "<__media__>"})
    try:
        assert pinned.get("/props")["media_marker"] == "<__media__>"
        status, answer = pinned.post("/completion", {
            "prompt": {"prompt_string": f"{TEXT} <__media__> please",
                       "multimodal_data": [b64(png_bytes(8, 8, 30))]}, "n_predict": 1})
        assert status == 200, answer
    finally:
        pinned.stop()


# --- every form a client sends media in ------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMS))
def test_each_form_is_answered_and_counted(mm: Server, name: str) -> None:
    """200, the media's tokens in the answer's usage, and the counting route's count equal to
    it for the same body."""
    form = FORMS[name]
    body = form.body()
    status, answer = mm.post(form.route, body)
    assert status == 200, answer
    prompt_tokens = form.usage(answer)
    assert count(mm, form.count_route, body) == prompt_tokens
    assert prompt_tokens - count(mm, form.count_route, form.text_only()) == form.media_tokens


def test_the_openai_client_sends_an_image(mm: Server) -> None:
    """The real OpenAI client, a data-URI image, plain and streamed (its usage in the last
    chunk): prompt_tokens as the counting route says."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{mm.port}/v1", api_key="unused")
    body = chat(image_part(20))
    expected = count(mm, CHAT_COUNT, body)
    assert expected == count(mm, CHAT_COUNT, chat()) + IMAGE_TOKENS
    answer = client.chat.completions.create(model="tiny", messages=body["messages"],
                                            max_tokens=1)
    assert answer.usage is not None and answer.usage.prompt_tokens == expected
    stream = client.chat.completions.create(model="tiny", messages=body["messages"],
                                            max_tokens=1, stream=True,
                                            stream_options={"include_usage": True})
    usages = [c.usage for c in stream if c.usage is not None]
    assert [u.prompt_tokens for u in usages] == [expected]


def test_anthropic_usage_leaves_out_cached_tokens(mm: Server) -> None:
    """/v1/messages' `usage.input_tokens` is the prompt less the tokens its slot had cached
    (`cache_read_input_tokens`): asked twice, the second answer's input_tokens is far below
    /v1/messages/count_tokens; their sum is equal to it both times."""
    body = messages(21)
    expected = count(mm, "/v1/messages/count_tokens", body)
    for _ in range(2):
        status, answer = mm.post("/v1/messages", body)
        assert status == 200, answer
        assert messages_usage(answer) == expected
    assert answer["usage"]["cache_read_input_tokens"] > 0
    assert answer["usage"]["input_tokens"] < expected


def test_completion_takes_multimodal_data(mm: Server) -> None:
    """/completion takes `{"prompt_string", "multimodal_data": [base64]}` with the server's
    marker in the string. There is no counting route for it: its tokens are the text around
    each marker, tokenized piece by piece (/tokenize, the first piece with BOS), plus the
    media's. /tokenize itself refuses the object, and so does /v1/completions."""
    marker = mm.get("/props")["media_marker"]
    prompt = {"prompt_string": f"describe {marker} this",
              "multimodal_data": [b64(png_bytes(8, 8, 22))]}
    status, answer = mm.post("/completion", {"prompt": prompt, "n_predict": 1})
    assert status == 200, answer

    def tokens(text: str, add_special: bool) -> int:
        status, answer = mm.post("/tokenize", {"content": text, "add_special": add_special})
        assert status == 200, answer
        return len(answer["tokens"])

    text_tokens = tokens("describe ", True) + tokens(" this", False)
    assert answer["tokens_evaluated"] == text_tokens + IMAGE_TOKENS
    assert mm.post("/tokenize", {"content": prompt})[0] == 400
    assert mm.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})[0] == 400


def test_a_completion_ending_with_media_aborts_the_server(llama_server: Path,
                                                          folder: Path) -> None:
    """A /completion prompt whose last chunk is media (`prompt_string` ending with the marker)
    kills llama-server: no answer, SIGABRT, `GGML_ASSERT(batch.size() > 0) failed` (the slot's
    prompt is done with no text token in its last batch). The chat routes never end a prompt
    with media (the template's generation prompt follows), so it is /completion's alone, and
    one client can crash a child with it."""
    server = start_server(llama_server, folder, "doomed", [*BASE_ARGS, "--mmproj", "mmproj.gguf"])
    try:
        marker = server.get("/props")["media_marker"]
        with pytest.raises((ConnectionError, OSError)):
            server.request("POST", "/completion", {
                "prompt": {"prompt_string": f"{TEXT}{marker}",
                           "multimodal_data": [b64(png_bytes(8, 8, 23))]},
                "n_predict": 1}, timeout=30)
        assert server.proc.wait(30) == -signal.SIGABRT
    finally:
        server.stop()
    log = server.log()
    assert "server-context.cpp:3865: GGML_ASSERT(batch.size() > 0) failed" in log
    if CAPTURE:
        lines = log.splitlines(keepends=True)
        # Up to the abort line and the backtrace's first frames; the rest is gdb's.
        abort = next(i for i, line in enumerate(lines) if "GGML_ASSERT" in line)
        (FIXTURES / "completion-ending-with-media-abort.log").write_text(
            "".join(lines[:abort + 1]))
    kept = (FIXTURES / "completion-ending-with-media-abort.log").read_text()
    assert kept.endswith("server-context.cpp:3865: GGML_ASSERT(batch.size() > 0) failed\n")


# --- remote URLs -----------------------------------------------------------------------------


class _MediaHandler(http.server.BaseHTTPRequestHandler):
    """Serves /a.png (a tiny PNG); anything else is a 404. Counts what it was asked."""

    asked: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        self.asked.append(self.path)
        if self.path == "/a.png":
            body, status = png_bytes(8, 8, 24), 200
        else:
            body, status = b"not here", 404
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def test_remote_image_urls_are_fetched_by_llama_server(mm: Server) -> None:
    """An `http(s)://` image URL is downloaded by llama-server itself, for the counting route
    as well as for the answer (10 s timeout, 10 MB limit): a proxy that lets them through
    lets its clients make the child fetch any URL. Unreachable: 500 "error: cannot make GET
    request" at once (this machine is offline); a 404: 500 "Failed to download image"."""
    _MediaHandler.asked = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MediaHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        body = chat({"type": "image_url", "image_url": {"url": f"{base}/a.png"}})
        status, answer = mm.post(CHAT, body)
        assert status == 200, answer
        assert chat_usage(answer) == count(mm, CHAT_COUNT, body)
        assert chat_usage(answer) == count(mm, CHAT_COUNT, chat()) + IMAGE_TOKENS
        assert _MediaHandler.asked == ["/a.png", "/a.png"]
        body = chat({"type": "image_url", "image_url": {"url": f"{base}/missing.png"}})
        for route in (CHAT, CHAT_COUNT):
            assert mm.post(route, body) == (500, {"error": {
                "code": 500, "message": "Failed to download image", "type": "server_error"}})
    finally:
        httpd.shutdown()
        httpd.server_close()


# --- the answers kept byte for byte ----------------------------------------------------------


@dataclass(frozen=True)
class Capture:
    situation: str
    server: str
    method: str
    path: str
    body: dict[str, Any]


# Stands for the server's own media marker in a capture's request (it is random per process).
MARKER = "<SERVERS_MEDIA_MARKER>"


def _completion(data: bytes, marker: str = MARKER) -> dict[str, Any]:
    return {"prompt": {"prompt_string": f"{TEXT} {marker} please",
                       "multimodal_data": [b64(data)]}, "n_predict": 1}


NOT_AN_IMAGE = b"this is text, not an image"
CAPTURES: dict[str, Capture] = {
    "text-only-chat-image": Capture(
        "an image_url part sent to a server without --mmproj", "text-only", "POST", CHAT,
        chat(image_part(40))),
    "text-only-chat-audio": Capture(
        "an input_audio part sent to a server without --mmproj", "text-only", "POST", CHAT,
        chat(audio_part(41))),
    "text-only-completion-multimodal-data": Capture(
        "/completion's multimodal_data sent to a server without --mmproj", "text-only", "POST",
        "/completion", _completion(png_bytes(8, 8, 42))),
    "text-only-count-image": Capture(
        "the counting route, an image, a server without --mmproj", "text-only", "POST",
        CHAT_COUNT, chat(image_part(40))),
    "vision-only-chat-audio": Capture(
        "an input_audio part sent to a server whose projector has no audio encoder",
        "vision-only", "POST", CHAT, chat(audio_part(43))),
    "vision-only-completion-audio": Capture(
        "a WAV in /completion's multimodal_data, a projector without an audio encoder",
        "vision-only", "POST", "/completion", _completion(wav_bytes(1.0, seed=44))),
    "corrupt-image-not-an-image": Capture(
        "an image_url data URI whose bytes are not an image", "vision+audio", "POST", CHAT,
        chat({"type": "image_url", "image_url": {"url": data_uri(NOT_AN_IMAGE)}})),
    "corrupt-image-not-an-image-count": Capture(
        "the same, to the counting route: 500 server_error where the answer is 400",
        "vision+audio", "POST", CHAT_COUNT,
        chat({"type": "image_url", "image_url": {"url": data_uri(NOT_AN_IMAGE)}})),
    "corrupt-image-bad-base64": Capture(
        "an image_url data URI whose base64 is broken", "vision+audio", "POST", CHAT,
        chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!not*base64"}})),
    "corrupt-image-bad-uri": Capture(
        "an image_url data URI with no comma", "vision+audio", "POST", CHAT,
        chat({"type": "image_url", "image_url": {"url": "data:image/png;base64"}})),
    "corrupt-image-not-base64-uri": Capture(
        "an image_url data URI that is not base64", "vision+audio", "POST", CHAT,
        chat({"type": "image_url", "image_url": {"url": "data:image/png,abc"}})),
    "corrupt-audio-not-a-wav": Capture(
        "an input_audio part whose bytes are not audio", "vision+audio", "POST", CHAT,
        chat({"type": "input_audio", "input_audio": {"data": b64(NOT_AN_IMAGE),
                                                     "format": "wav"}})),
    "remote-image-unreachable": Capture(
        "an http:// image URL nobody answers (this machine is offline)", "vision+audio",
        "POST", CHAT, chat({"type": "image_url",
                            "image_url": {"url": "http://127.0.0.1:9/cat.png"}})),
    "file-url-without-media-path": Capture(
        "a file:// image URL, the server started without --media-path", "vision+audio",
        "POST", CHAT, chat({"type": "image_url", "image_url": {"url": "file:///etc/hosts"}})),
    "responses-input-audio": Capture(
        "audio in the Responses API: not a type it takes", "vision+audio", "POST",
        "/v1/responses", {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": TEXT},
            {"type": "input_audio", "input_audio": {"data": b64(wav_bytes(1.0, seed=45)),
                                                    "format": "wav"}}]}],
            "max_output_tokens": 1}),
    "completion-documented-marker": Capture(
        "/completion with mtmd's documented `<__media__>`, not the server's random marker",
        "vision+audio", "POST", "/completion", _completion(png_bytes(8, 8, 46), "<__media__>")),
    "v1-completions-multimodal-object": Capture(
        "/v1/completions given /completion's multimodal prompt object", "vision+audio", "POST",
        "/v1/completions", {"prompt": _completion(png_bytes(8, 8, 47))["prompt"],
                            "max_tokens": 1}),
}


@pytest.mark.parametrize("name", list(CAPTURES))
def test_refusals_match_the_captures(servers: dict[str, Server], name: str) -> None:
    """Each refusal is the captured one, byte for byte (SPILLWAY_CAPTURE_MULTIMODAL=1 writes
    them: each is the same on every run). MARKER in a request stands for the server's marker."""
    c = CAPTURES[name]
    server = servers[c.server]
    body = json.loads(json.dumps(c.body).replace(MARKER, server.get("/props")["media_marker"]))
    status, content_type, raw = server.request(c.method, c.path, body)
    got = {"situation": c.situation, "server": c.server,
           "server_args": SERVER_ARGS[c.server],
           "request": {"method": c.method, "path": c.path, "json": c.body},
           "status": status, "content_type": content_type, "body": raw.decode()}
    path = FIXTURES / f"{name}.json"
    if CAPTURE:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(path.read_text())
    assert status >= 400


def test_every_capture_is_in_the_table() -> None:
    on_disk = {p.stem for p in FIXTURES.glob("*.json")}
    assert on_disk == set(CAPTURES)


# --- the log lines that say how long media took ----------------------------------------------


def test_media_lines_in_the_log(servers: dict[str, Server]) -> None:
    """At `-lv 4` llama-server logs each media batch: "encoding mtmd batch from idx = N,
    n_chunks = N", then (after the encoder ran) "decoding image|audio batch 1/1,
    n_tokens_batch = N" and "image|audio decoded (batch 1/1) in N ms" (the text model's
    decode of the embeddings, whole milliseconds). The encoder's time is the gap between the
    first two lines' timestamps. At the default verbosity none of them is written."""
    mm = servers["vision+audio"]
    before = len(mm.log())
    status, answer = mm.post(CHAT, chat(image_part(50), audio_part(51)))
    assert status == 200, answer
    # The log is written by llama-server's logging thread, a moment after the answer.
    log = eventually(lambda: (lambda t: t if len(DECODED_LINE.findall(t)) >= 2 else "")(
        mm.log()[before:]), timeout=10)
    encoding = ENCODING_LINE.findall(log)
    decoding = DECODING_LINE.findall(log)
    assert len(encoding) == 2
    assert [(kind, int(n)) for _, kind, n in decoding] == [
        ("image", IMAGE_TOKENS), ("audio", audio_tokens(1.0))]
    assert [kind for kind, _ in DECODED_LINE.findall(log)] == ["image", "audio"]

    vision = servers["vision-only"]
    status, answer = vision.post(CHAT, chat(image_part(52)))
    assert status == 200, answer
    quiet = vision.log()
    assert not (ENCODING_LINE.search(quiet) or DECODING_LINE.search(quiet)
                or DECODED_LINE.search(quiet))
