"""The captured answers of the pinned llama-server (tests/fixtures/llama-server/answers), and
the one way their requests are sent, to llama-server by scripts/capture_errors.py and to
Spillway by tests/test_llama_fidelity.py: byte for byte the same request."""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import socket
from pathlib import Path
from typing import Any

ANSWERS = Path(__file__).resolve().parent / "fixtures" / "llama-server" / "answers"


def captures() -> dict[str, dict[str, Any]]:
    """Every captured situation by name (its file's name)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(ANSWERS.glob("*.json"))
            if p.name != "servers.json"}


def body_of(request: dict[str, Any]) -> bytes | None:
    if "json" in request:
        return json.dumps(request["json"]).encode()
    if "body_base64" in request:
        return base64.b64decode(request["body_base64"])
    return None


def send(port: int, request: dict[str, Any], body_size: int | None = None,
         timeout: float = 60.0) -> tuple[int, str | None, bytes]:
    """Status, Content-Type and body of the answer to `request` (a capture's `request`).
    `body_size` stands in for the request's own (a limit differs between the servers)."""
    size = body_size if body_size is not None else request.get("body_size")
    if size is not None:
        return _send_sized(port, request, size, timeout)
    body = body_of(request)
    headers = dict(request.get("headers", {}))
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(request["method"], request["path"], body=body, headers=headers)
        r = c.getresponse()
        return r.status, r.getheader("Content-Type"), r.read()
    finally:
        c.close()


def _send_sized(port: int, request: dict[str, Any], size: int,
                timeout: float) -> tuple[int, str | None, bytes]:
    """A body of `size` bytes, whole, or (`trickle`) only its first byte and then nothing; the
    answer read whenever the server gives it (it may answer before the body is all sent)."""
    head = (f"{request['method']} {request['path']} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in request.get("headers", {}).items())
            + "\r\n").encode()
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        with contextlib.suppress(OSError):  # a server that answers early closes on the rest
            if request.get("trickle"):
                sock.sendall(b"{")
            else:
                chunk = b" " * (1024 * 1024)
                left = size
                while left > 0:
                    sock.sendall(chunk[:left])
                    left -= min(left, len(chunk))
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                answer += data
    response = http.client.HTTPResponse(_Received(answer))  # type: ignore[arg-type]
    response.begin()
    return response.status, response.getheader("Content-Type"), response.read()


class _Received:
    """What http.client reads a response from: the bytes already received."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def makefile(self, *_: Any) -> io.BytesIO:
        return io.BytesIO(self.data)


def parsed(raw: bytes) -> Any:
    """A body as JSON when it is JSON, else as text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
