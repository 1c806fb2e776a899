"""Hostile input: each gets a clear 4xx (or is served correctly), nothing unwanted reaches a
child, and the daemon and its children keep running. Raw sockets where a client library would
refuse to misbehave."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, Spillway, eventually, fake_config, real_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SpillwayFactory

KEY = "hostile-test-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def raw(s: Spillway, data: bytes, timeout: float = 10.0, read_all: bool = True) -> bytes:
    """Send bytes as they are; return what came back until the server closed or timed out."""
    with socket.create_connection(("127.0.0.1", s.port), timeout=timeout) as c:
        c.sendall(data)
        out = b""
        while True:
            try:
                chunk = c.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
            if not read_all:
                break
        return out


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else 0


def child_saw(state: Path) -> list[dict[str, Any]]:
    if not state.exists():
        return []
    return [r for r in (json.loads(line) for line in state.read_text().splitlines())
            if r["path"] not in ("/health", "/props")]


@pytest.fixture
def guarded(spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
            tmp_path: Path) -> tuple[Spillway, Path]:
    state = tmp_path / "child-saw.jsonl"
    cfg = fake_config(fake_server, tiny_model,
                      server={"api_key": KEY, "max_body_mib": 0.05, "idle_timeout_s": 2,
                              "body_timeout_s": 1},
                      gpu={"env": {"FAKE_STATE_FILE": str(state)}},
                      cpu={"env": {"FAKE_STATE_FILE": str(state)}})
    s = spillway(cfg, start=False)
    s.start(wait_ready=False)
    s.wait_ready(headers={"Authorization": f"Bearer {KEY}"})
    return s, state


def still_serving(s: Spillway) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _ = s.post("/v1/chat/completions", CHAT, auth)
    assert status == 200
    states = {n: c["state"] for n, c in s.status(auth)["children"].items()}
    assert states == {"gpu": "READY", "cpu": "READY"}


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: localhost"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body and not any(k.lower() in ("content-length", "transfer-encoding")
                        for k in (headers or {})):
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("name,data,expected", [
    ("malformed JSON", request("POST", "/v1/chat/completions", b'{"messages": [', AUTH), 400),
    ("JSON that is not an object", request("POST", "/v1/chat/completions", b'"hello"', AUTH),
     400),
    ("invalid UTF-8", request("POST", "/v1/chat/completions", b'{"a": "\xff\xfe"}', AUTH), 400),
    ("a form, not JSON", request("POST", "/v1/chat/completions", b"messages=hi",
                                 {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}),
     400),
    ("a body over the limit", request("POST", "/v1/chat/completions", b"x" * 60000, AUTH), 413),
    ("an unknown Spillway route", request("GET", "/spillway/secrets", b"", AUTH), 404),
    ("a GET on an operator route", request("GET", "/spillway/gpu/restart", b"", AUTH), 405),
    ("Transfer-Encoding with Content-Length",
     request("POST", "/v1/chat/completions", b"4\r\n{}  \r\n0\r\n\r\n",
             {**AUTH, "Content-Length": "40", "Transfer-Encoding": "chunked"}), 400),
    ("100 KB of headers", request("GET", "/props", b"",
                                  {**AUTH, **{f"X-Pad-{i}": "p" * 1000 for i in range(100)}}),
     431),
    ("one header of 100 KB", request("GET", "/props", b"", {**AUTH, "X-Big": "b" * 100_000}),
     431),
    ("a request line of 100 KB", request("GET", "/props?" + "q" * 100_000, b"", AUTH), 414),
])
def test_bad_requests_get_a_clear_4xx_and_reach_no_child(guarded: tuple[Spillway, Path],
                                                         name: str, data: bytes,
                                                         expected: int) -> None:
    s, state = guarded
    before = child_saw(state)
    response = raw(s, data)
    status = status_of(response)
    if expected in (431, 414):  # aiohttp says 400 for some oversized parts: a 4xx either way
        assert status in (expected, 400), (name, response[:300])
    else:
        assert status == expected, (name, response[:300])
    if status != 404 and b"application/json" in response.split(b"\r\n\r\n")[0]:
        body = json.loads(response.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["src"] == "spillway"
    assert child_saw(state) == before
    still_serving(s)


def test_a_malformed_request_costs_one_short_line_that_never_shows_the_key(
        guarded: tuple[Spillway, Path]) -> None:
    """aiohttp's parser refuses these before Spillway's handler sees them; it used to log each
    as an error with a traceback quoting the raw header line, key and all."""
    s, _ = guarded
    key = KEY.encode()
    for data in (
            b"GET /props HTTP/1.1\r\nHost: x\r\nAuthorization : Bearer " + key +  # " :"
            b"\r\nConnection: close\r\n\r\n",
            b"GET /props HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \x01" + key +  # a control
            b"\r\nConnection: close\r\n\r\n",
            b"GET /props HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + b"k" * 20_000 +
            b"\r\nConnection: close\r\n\r\n"):  # over the line limit
        assert status_of(raw(s, data)) == 400
    # A path with control characters (decoded from %1b and %0d) is passed on, and its log
    # line shows them escaped: no terminal escape, no line forged after a carriage return.
    assert status_of(raw(s, request("GET", "/v1/models%1b[2J%0dFORGED", b"", AUTH))) == 200
    assert eventually(lambda: s.log_text().count("refused a malformed request") == 3 and
                      "FORGED" in s.log_text())
    text = s.log_text()
    assert KEY not in text
    assert "Traceback" not in text and "Error handling request" not in text
    refused = [line for line in text.splitlines() if "refused a malformed request" in line]
    assert all(len(line) < 160 and "from 127.0.0.1 (400)" in line for line in refused), refused
    assert "\x1b" not in text and "\r" not in text
    assert "GET /v1/models\\x1b[2J\\x0dFORGED -> gpu 200" in text
    # A decoded %0a too: the proxy answers it (it used to miss the catch-all route and get
    # aiohttp's own plain-text 404), and its log line forges nothing.
    response = raw(s, request("GET", "/spillway/x%0aFORGED2", b"", AUTH))
    assert status_of(response) == 404 and b"application/json" in response
    response = raw(s, request("GET", "/v1/models%0aFORGED3", b"", AUTH))
    assert b"X-Spillway-Child: gpu" in response  # the child's own answer, passed on
    assert eventually(lambda: "GET /v1/models\\x0aFORGED3 -> gpu" in s.log_text())
    assert "\nFORGED3" not in s.log_text()
    still_serving(s)


def test_deep_json_and_a_body_that_is_not_its_encoding_get_an_openai_shaped_400(
        guarded: tuple[Spillway, Path]) -> None:
    """They used to get aiohttp's plain-text 500 (a RecursionError; the decoder's error) and a
    traceback in the log."""
    s, state = guarded
    before = child_saw(state)
    chat = "/v1/chat/completions"
    gzip_header = {**AUTH, "Content-Encoding": "gzip"}
    for body, headers, status, words, param in (
            (b"[" * 1000 + b"]" * 1000, AUTH, 400, "nested more than 128 levels deep", None),
            (b'{"a": ' * 1000 + b"1" + b"}" * 1000, AUTH, 400, "nested more than", None),
            (json.dumps(CHAT).encode(), gzip_header, 400,
             "not valid gzip data, as its Content-Encoding says", "Content-Encoding")):
        response = raw(s, request("POST", chat, body, headers))
        head, _, payload = response.partition(b"\r\n\r\n")
        assert status_of(response) == status, response[:300]
        assert b"Content-Type: application/json" in head
        error = json.loads(payload)["error"]
        assert words in error["message"], error
        assert (error["type"], error["code"], error["param"], error["src"]) == (
            "invalid_request_error", status, param, "spillway")
        assert error["request_id"] and error["request_id"] in head.decode()
    # The same on the resumable streams' lookup, which reads JSON too.
    response = raw(s, request("POST", "/v1/streams/lookup", b"[" * 1000 + b"]" * 1000, AUTH))
    assert status_of(response) == 400 and b"nested more than" in response
    assert child_saw(state) == before
    text = s.log_text()
    assert "Traceback" not in text and "Error handling request" not in text
    still_serving(s)


def gzip_bomb(decompressed_mib: int) -> bytes:
    """A valid gzip body of a chat request padded with `decompressed_mib` MiB of spaces, about
    1 KB a MiB: each MiB is one deflate block after a full flush (the same bytes every time, so
    it is made once and repeated), and the trailer's CRC and size are the whole text's."""
    prefix, suffix, mib = b'{"messages": [], "pad": "', b'"}', b" " * (1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    head = deflate.compress(prefix) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(mib) + deflate.flush(zlib.Z_FULL_FLUSH)
    tail = deflate.compress(suffix) + deflate.flush()
    crc = zlib.crc32(prefix)
    for _ in range(decompressed_mib):
        crc = zlib.crc32(mib, crc)
    size = len(prefix) + decompressed_mib * len(mib) + len(suffix)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + head + block * decompressed_mib
            + tail + struct.pack("<II", zlib.crc32(suffix, crc), size & 0xFFFFFFFF))


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM: the kernel's high-water mark, kept whatever
    the moment it is read)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


# A bomb's growth of the daemon's peak RSS that the limit's read (2 MiB, in aiohttp's chunks)
# stays far under, and one network read decompressed whole (64 KiB of this bomb: 64 MiB) breaks.
BOMB_PEAK_GROWTH_MIB = 48


def test_a_gzip_bomb_is_refused_at_the_limit_without_being_decompressed_whole(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """1 MB on the wire, 1 GiB once decompressed, under a 2 MiB limit (the wire's bytes fit it:
    only the decompressed ones tell). aiohttp 3.14.0 and before (3.13.2, 3.10) decompressed
    each network read whole before the reader counted a byte: the peak grew by about 505 MiB,
    against 4 MiB on 3.14.1 and later. The peak is the kernel's high-water mark, read before
    and after: what it says does not depend on when it is read, so no timing is involved."""
    s = spillway(fake_config(fake_server, tiny_model,
                             server={"api_key": KEY, "max_body_mib": 2}), start=False)
    s.start(wait_ready=False)
    s.wait_ready(headers=AUTH)
    assert s.proc is not None
    bomb = gzip_bomb(1024)
    assert len(bomb) < 2 * 1024 * 1024  # the wire's size is under the limit
    still_serving(s)  # the daemon's usual peak (a request served) is in `before`
    before = peak_rss_mib(s.proc.pid)
    response = raw(s, request("POST", "/v1/chat/completions", bomb,
                              {**AUTH, "Content-Encoding": "gzip"}))
    after = peak_rss_mib(s.proc.pid)
    head, _, payload = response.partition(b"\r\n\r\n")
    assert status_of(response) == 413, response[:300]
    error = json.loads(payload)["error"]
    assert "more than that once decompressed (Content-Encoding: gzip)" in error["message"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "body")
    assert after - before < BOMB_PEAK_GROWTH_MIB, (before, after)
    still_serving(s)


ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/completion"), ("POST", "/v1/embeddings"),
          ("GET", "/props"), ("GET", "/slots"), ("POST", "/slots/0?action=save"),
          ("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/metrics"),
          ("POST", "/lora-adapters"), ("GET", "/spillway/status"),
          ("GET", "/spillway/incidents"), ("GET", "/spillway/metrics"),
          ("POST", "/spillway/gpu/restart"), ("POST", "/spillway/drill/arm"),
          ("GET", "/health/../v1/models"), ("GET", "/x/../v1/models.js")]
# (A bare key in Authorization, without "Bearer ", is accepted: llama-server accepts it.)
# (Spaces around a header's value are not part of it, so "Bearer KEY " is the key too.)
BAD_KEYS = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
            {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
            {"X-Api-Key": "wrong"}, {"Authorization": "Bearer "},
            {"Authorization": "Bearer " + "k" * 10_000}]


def test_missing_wrong_and_malformed_keys_reach_no_child_on_any_route(
        guarded: tuple[Spillway, Path]) -> None:
    s, state = guarded
    before = child_saw(state)
    for method, path in ROUTES:
        for headers in BAD_KEYS:
            response = raw(s, request(method, path, json.dumps(CHAT).encode(), headers))
            status = status_of(response)
            assert status == 401 or (path.endswith(".js") and status in (401, 404)), \
                (method, path, headers, response[:200])
    # Two keys at once, one of them right: ambiguous, refused.
    response = raw(s, b"GET /props HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer wrong\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nConnection: close\r\n\r\n")
    assert status_of(response) == 401
    # Nothing got through with authority: what reached a child (a public-looking path) came
    # without the child's key, and the child refused it.
    assert all("Authorization" not in r["headers"] for r in child_saw(state)[len(before):])
    still_serving(s)


def test_a_childs_port_refuses_anyone_without_its_private_key(
        guarded: tuple[Spillway, Path]) -> None:
    s, _ = guarded
    port = s.status({"Authorization": f"Bearer {KEY}"})["children"]["gpu"]["port"]
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}):  # Spillway's key is not the child's
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                              headers))
            assert status_of(c.recv(65536)) == 401


def test_a_public_looking_path_is_forwarded_without_the_childs_key(
        guarded: tuple[Spillway, Path]) -> None:
    s, state = guarded
    response = raw(s, request("GET", "/index.html"))
    seen = [r for r in child_saw(state) if r["path"] == "/index.html"]
    assert seen and "Authorization" not in seen[-1]["headers"]
    assert status_of(response) == 401  # the fake child guards everything but /health


def test_http_1_0_and_pipelined_requests_are_served(guarded: tuple[Spillway, Path]) -> None:
    s, _ = guarded
    body = json.dumps(CHAT).encode()
    old = raw(s, b"POST /v1/chat/completions HTTP/1.0\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert status_of(old) == 200 and b'"choices"' in old
    one = (b"GET /props HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode() +
           b"\r\n\r\n")
    last = one.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    both = raw(s, one + one + last)
    assert both.count(b"HTTP/1.1 200") == 3


def test_a_slowloris_is_bounded_by_timeouts(guarded: tuple[Spillway, Path]) -> None:
    s, state = guarded
    before = child_saw(state)
    # Headers, a byte every half second: closed after server.idle_timeout_s (2 s here).
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        closed = False
        for _ in range(40):
            try:
                c.sendall(b"X")
                time.sleep(0.5)
                c.setblocking(False)
                try:
                    if c.recv(1024) == b"":
                        closed = True
                        break
                except BlockingIOError:
                    pass
                finally:
                    c.setblocking(True)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
    assert closed and time.monotonic() - began < 8
    # A body, trickled: 408 after server.body_timeout_s (1 s here).
    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Authorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Length: 1000\r\n\r\n{\"messages\"")
        began = time.monotonic()
        response = c.recv(65536)
    assert status_of(response) == 408 and time.monotonic() - began < 5
    assert child_saw(state) == before
    still_serving(s)


@pytest.mark.integration
@pytest.mark.parametrize("fields", [
    {"max_tokens": 10**12}, {"n_predict": -5}, {"max_tokens": -1}, {"max_tokens": "lots"},
    {"temperature": -3}, {"n_probs": 10**9}, {"messages": []},
    {"messages": [{"role": "user", "content": "x" * 200_000}]},
])
def test_absurd_numbers_are_served_or_refused_by_the_real_server(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        fields: dict[str, Any]) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    status, body = s.post("/v1/chat/completions", {**CHAT, **fields}, timeout=120)
    assert status == 200 or 400 <= status < 500, (status, body)
    if status != 200:
        assert isinstance(body, dict) and "error" in body
    assert {n: c["state"] for n, c in s.status()["children"].items()} == {
        "gpu": "READY", "cpu": "READY"}


toml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) |
    st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.text(max_size=12), children, max_size=4), max_leaves=12)
sections = st.sampled_from(["server", "model", "gpu", "cpu", "restart", "failover", "queue",
                            "incidents", "idempotency", "monitor", "sever", ""])
keys = st.sampled_from(["listen", "path", "args", "api_key", "mode", "max_body_mib",
                        "llama_server", "env", "device", "stream_hold_s", "max_waiting",
                        "backoff_initial_s", "args[0]", "typo"])


def _toml_scalar(v: Any) -> str:
    if v is None:
        return '""'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v).replace("inf", "inf").replace("nan", "nan")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_scalar(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_scalar(x)}" for k, x in v.items()) + "}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(sections, keys, toml_values), max_size=8), st.binary(max_size=40))
def test_generated_configs_never_crash_check_config(tmp_path_factory: pytest.TempPathFactory,
                                                    entries: list[tuple[str, str, Any]],
                                                    noise: bytes) -> None:
    folder = tmp_path_factory.mktemp("fuzz")
    by_section: dict[str, dict[str, Any]] = {}
    for section, key, value in entries:
        by_section.setdefault(section or "model", {})[key] = value
    text = "\n".join(f"[{sec}]\n" + "\n".join(f"{json.dumps(k)} = {_toml_scalar(v)}"
                                              for k, v in vals.items())
                     for sec, vals in by_section.items())
    path = folder / "fuzz.toml"
    path.write_bytes(text.encode() + (b"\n" + noise if noise else b""))
    result = subprocess.run([sys.executable, "-m", "supervisor", "check-config", str(path)],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
    if result.returncode == 2:
        assert "problem(s)" in result.stderr
