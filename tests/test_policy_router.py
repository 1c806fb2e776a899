"""Router mode, read: GET /models, /models/sse, the router's log and its answers when an
instance dies, table-driven over what the pinned llama-server router printed and answered
(tests/fixtures/llama-server/router/), and why an instance died."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.policy.evidence import FailureKind, VramSample
from supervisor.policy.router import (
    PROXY_ERROR, ModelInfo, RouterLine, StatusChange, classify_instance_exit, is_load_failure_body,
    is_proxy_error, parse_models, parse_router_line, parse_sse_data, stream_tail_is_proxy_error,
)

FIXTURES = Path(__file__).parent / "fixtures" / "llama-server"
ROUTER = FIXTURES / "router"
OBS: dict[str, Any] = json.loads((ROUTER / "observations.json").read_text())
ROUTER_LOG = (ROUTER / "router.log").read_text().splitlines()
K = FailureKind

ALPHA_ARGS = (
    "/opt/llama.cpp/bin/llama-server", "--host", "127.0.0.1", "--log-colors", "off",
    "--port", "52251", "--alias", "alpha", "--ctx-size", "2048", "--device", "none",
    "--model", "/srv/models/alpha.gguf", "--n-gpu-layers", "0", "--parallel", "2",
)
ALPHA_LOADED = ModelInfo(name="alpha", status="loaded", failed=False, exit_code=None,
                         args=ALPHA_ARGS, path="/srv/models/alpha.gguf", port=52251,
                         n_ctx=1024, size=13077504, aliases=())
LOAD_FAILED_BODY = ('{"error":{"code":500,"message":"model name=alpha failed to load",'
                    '"type":"server_error"}}')

# The one line that got out of the real H200 runtime OOM abort (gpu/B-runtime-oom.log).
H200_CUDA_LINE = "llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error"
LOW = VramSample(free_mib=61, total_mib=143771, age_s=0.4)  # as measured before that abort
PLENTY = VramSample(free_mib=138765, total_mib=143771, age_s=0.4)
STALE_LOW = VramSample(free_mib=61, total_mib=143771, age_s=120.0)


def relayed(port: int) -> list[str]:
    """The lines the router relayed from the instance on `port`, prefix and all."""
    return [line for line in ROUTER_LOG if line.startswith(f"[{port}] ")]


# --- GET /models ---------------------------------------------------------------------------

@pytest.mark.parametrize("key,name,status,failed,exit_code,port,n_ctx,size", [
    ("models_before", "alpha", "unloaded", False, None, None, None, None),  # --port 0
    ("models_before", "beta", "unloaded", False, None, None, None, None),
    ("models_alpha_loaded", "alpha", "loaded", False, None, 52251, 1024, 13077504),
    ("models_alpha_loaded", "beta", "unloaded", False, None, None, None, None),
    # SIGABRT under a request: unloaded, failed, and the signal lost (exit_code 1).
    ("models_after_kill", "alpha", "unloaded", True, 1, 52251, None, None),
    ("models_after_kill", "beta", "unloaded", False, None, None, None, None),
    # Autoloaded again by the next request, on a new port.
    ("models_after_next", "alpha", "loaded", False, None, 53723, 1024, 13077504),
    # beta force-killed while loading: exit_code 1 too.
    ("models_end", "beta", "unloaded", True, 1, 45587, None, None),
])
def test_parse_models_on_captured_lists(key: str, name: str, status: str, failed: bool,
                                        exit_code: int | None, port: int | None,
                                        n_ctx: int | None, size: int | None) -> None:
    models = {m.name: m for m in parse_models(OBS[key])}
    assert sorted(models) == ["alpha", "beta"]
    m = models[name]
    assert (m.status, m.failed, m.exit_code, m.port, m.n_ctx, m.size) == (
        status, failed, exit_code, port, n_ctx, size)
    assert m.path == f"/srv/models/{name}.gguf"
    assert m.aliases == ()
    # The router passes its own -c/-np/--device/-ngl on to every instance.
    assert m.args[0] == "/opt/llama.cpp/bin/llama-server"
    assert ("--device", "none") in zip(m.args, m.args[1:])


def test_parse_models_a_loaded_model_whole() -> None:
    assert parse_models(OBS["models_alpha_loaded"])[0] == ALPHA_LOADED


@pytest.mark.parametrize("doc,names", [
    (None, []),
    ("data", []),
    ([{"id": "alpha"}], []),
    ({}, []),
    ({"data": "x"}, []),
    ({"data": [{"id": 7}, {"name": "no id"}, "x", None, {"id": "ok"}]}, ["ok"]),
])
def test_parse_models_skips_what_it_cannot_read(doc: object, names: list[str]) -> None:
    assert [m.name for m in parse_models(doc)] == names


@pytest.mark.parametrize("entry,field,value", [
    # A bare entry: nothing known.
    ({"id": "a"}, "status", "unknown"),
    ({"id": "a"}, "port", None),
    ({"id": "a", "status": {"value": "sleeping"}}, "status", "sleeping"),  # kept as is
    ({"id": "a", "status": "loaded"}, "status", "loaded"),
    ({"id": "a", "status": {"failed": "yes"}}, "failed", False),  # only JSON true is true
    ({"id": "a", "status": {"exit_code": True}}, "exit_code", None),  # a bool is no code
    ({"id": "a", "status": {"args": ["-m", "/m.gguf", "--port", "8"]}}, "path", "/m.gguf"),
    ({"id": "a", "status": {"args": ["-m", "/m.gguf", "--port", "8"]}}, "port", 8),
    ({"id": "a", "status": {"args": ["--model=/m.gguf"]}}, "path", "/m.gguf"),
    ({"id": "a", "status": {"args": ["--port", "x"]}}, "port", None),
    ({"id": "a", "status": {"args": ["--port"]}}, "port", None),  # no value after it
    ({"id": "a", "status": {"args": "--port 8"}}, "args", ()),
    ({"id": "a", "meta": {"n_ctx": "1024", "size": 5}}, "n_ctx", None),
    ({"id": "a", "meta": {"n_ctx": "1024", "size": 5}}, "size", 5),
    ({"id": "a", "aliases": ["b", 3, "c"]}, "aliases", ("b", "c")),
])
def test_parse_models_reads_odd_entries_field_by_field(entry: dict[str, Any], field: str,
                                                       value: object) -> None:
    (m,) = parse_models({"data": [entry], "object": "list"})
    assert getattr(m, field) == value


# --- /models/sse ---------------------------------------------------------------------------

def _change(model: str, status: str, exit_code: int | None = None,
            progress: float | None = None, loaded: bool = False) -> StatusChange:
    return StatusChange(model, status, exit_code, progress,
                        1024 if loaded else None, 13077504 if loaded else None)


SSE_EXPECTED = [
    _change("alpha", "loading"),  # event "model_status"
    _change("alpha", "loading", progress=0.0),
    _change("alpha", "loading", progress=1.0),
    _change("alpha", "loaded", loaded=True),
    _change("alpha", "unloaded", exit_code=1),  # SIGABRT under the non-streaming request
    _change("alpha", "loading"),
    _change("alpha", "loading", progress=0.0),
    _change("alpha", "loading", progress=1.0),
    _change("alpha", "loaded", loaded=True),
    _change("alpha", "unloaded", exit_code=1),  # SIGABRT under the stream
    _change("beta", "loading"),
    _change("beta", "loading", progress=0.0),
    _change("beta", "loading", progress=0.0),
    _change("beta", "loading", progress=1.0),
    _change("beta", "unloaded", exit_code=1),  # force-killed while loading
]


def test_every_captured_sse_event_has_a_row() -> None:
    assert len(OBS["sse"]) == len(SSE_EXPECTED)


@pytest.mark.parametrize("index", range(len(SSE_EXPECTED)))
def test_parse_sse_data_on_captured_events(index: int) -> None:
    seconds, line = OBS["sse"][index]
    assert isinstance(seconds, float)
    assert line.startswith("data: ")
    payload = line.removeprefix("data: ")
    assert parse_sse_data(payload) == SSE_EXPECTED[index]
    assert parse_sse_data(payload.encode()) == SSE_EXPECTED[index]


@pytest.mark.parametrize("payload,expected", [
    ('{"model":"a","event":"model_status","data":{"status":"loading"}}',
     _change("a", "loading")),
    ('data: {"model":"a","event":"status_change","data":{"status":"unloaded","exit_code":1}}',
     _change("a", "unloaded", exit_code=1)),  # the whole line, tolerated
    ('{"model":"a","event":"status_change","data":{"status":"loading","progress":{"value":1}}}',
     _change("a", "loading", progress=1.0)),
    ('{"model":"a","event":"status_change","data":{"status":"sleeping"}}',
     _change("a", "sleeping")),
    ('{"model":"a","event":"other","data":{"status":"loaded"}}', None),
    ('{"model":"a","data":{"status":"loaded"}}', None),
    ('{"event":"status_change","data":{"status":"loaded"}}', None),
    ('{"model":"a","event":"status_change","data":{}}', None),
    ('{"model":"a","event":"status_change","data":"loaded"}', None),
    ('{"model":"a","event":"status_change","data":{"status":"loaded"', None),
    ("[DONE]", None),
    ("", None),
    ("[1, 2]", None),
    (b"\xff\xfe", None),
])
def test_parse_sse_data_other_payloads(payload: str | bytes,
                                       expected: StatusChange | None) -> None:
    assert parse_sse_data(payload) == expected


# --- the router's log ----------------------------------------------------------------------

@pytest.mark.parametrize("line,expected", [
    ("0.00.117.644 I srv          load: spawning server instance with name=alpha on port 52251",
     RouterLine("spawn", "alpha", 52251, None,
                "0.00.117.644 I srv          load: spawning server instance with name=alpha "
                "on port 52251")),
    ("load: spawning server instance with name=my model on port 9\n",  # no timestamp
     RouterLine("spawn", "my model", 9, None,
                "load: spawning server instance with name=my model on port 9")),
    ("0.04.775.847 I srv           run: instance name=alpha exited with status 1",
     RouterLine("exit", "alpha", None, 1,
                "0.04.775.847 I srv           run: instance name=alpha exited with status 1")),
    ("run: instance name=beta exited with status -6",
     RouterLine("exit", "beta", None, -6, "run: instance name=beta exited with status -6")),
    ("[52251] 0.00.058.482 I srv  llama_server: model loaded",
     RouterLine("instance", None, 52251, None, "0.00.058.482 I srv  llama_server: model loaded")),
    ("[52251] llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error\r\n",
     RouterLine("instance", None, 52251, None,
                "llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error")),
    # An instance's line is its own even when it reads like the router's.
    ("[1] run: instance name=x exited with status 1",
     RouterLine("instance", None, 1, None, "run: instance name=x exited with status 1")),
    ("0.00.117.657 I srv          load: spawning server instance with args:",
     RouterLine("other", None, None, None,
                "0.00.117.657 I srv          load: spawning server instance with args:")),
    ("0.00.050.666 I srv    operator():   [models_dir] alpha",
     RouterLine("other", None, None, None,
                "0.00.050.666 I srv    operator():   [models_dir] alpha")),
    ("", RouterLine("other", None, None, None, "")),
])
def test_parse_router_line(line: str, expected: RouterLine) -> None:
    assert parse_router_line(line) == expected


def test_router_log_spawns_and_exits() -> None:
    parsed = [parse_router_line(line) for line in ROUTER_LOG]
    assert [(p.model, p.port) for p in parsed if p.kind == "spawn"] == [
        ("alpha", 52251), ("alpha", 53723), ("beta", 45587)]
    assert [(p.model, p.status) for p in parsed if p.kind == "exit"] == [
        ("alpha", 1), ("alpha", 1), ("beta", 1)]
    exits = [p.text for p in parsed if p.kind == "exit"]
    assert exits[0].endswith("instance name=alpha exited with status 1")


@pytest.mark.parametrize("index", range(len(ROUTER_LOG)))
def test_parse_router_line_on_every_captured_line(index: int) -> None:
    line = ROUTER_LOG[index]
    p = parse_router_line(line)
    if line.startswith("["):
        port, _, rest = line.partition("] ")
        assert (p.kind, p.port, p.model, p.status) == ("instance", int(port[1:]), None, None)
        assert p.port in (52251, 53723, 45587)
        assert p.text == rest
        assert not p.text.startswith("[")
    elif "spawning server instance with name=" in line:
        assert p.kind == "spawn" and p.text == line
    elif " exited with status " in line:
        assert p.kind == "exit" and p.text == line
    else:
        assert p == RouterLine("other", None, None, None, line)


def test_relayed_lines_per_instance() -> None:
    ports = [parse_router_line(line).port for line in ROUTER_LOG
             if parse_router_line(line).kind == "instance"]
    assert {port: ports.count(port) for port in set(ports)} == {52251: 23, 53723: 23,
                                                               45587: 9}


# --- the router's answers when an instance dies ------------------------------------------

@pytest.mark.parametrize("status,body,expected", [
    (OBS["nonstream_killed"]["status"], OBS["nonstream_killed"]["body"], True),
    (500, OBS["nonstream_killed"]["body"].encode(), True),
    (502, "\n proxy error: Connection refused\n", True),
    (500, LOAD_FAILED_BODY, False),
    (500, '{"error":{"code":500,"message":"Compute error.","type":"server_error"}}', False),
    (500, '{"error":{"message":"proxy error: Failed to read connection"}}', False),
    (500, "", False),
    (200, "proxy error: Failed to read connection", False),
    (400, "proxy error: Failed to read connection", False),
    (200, OBS["next_request_after_kill"]["body"], False),
])
def test_is_proxy_error(status: int, body: str | bytes, expected: bool) -> None:
    assert is_proxy_error(status, body) is expected


def test_the_captured_answer_is_plain_text_despite_its_content_type() -> None:
    killed = OBS["nonstream_killed"]
    assert killed["headers"]["Content-Type"].startswith("application/json")
    assert killed["body"].startswith(PROXY_ERROR)
    with pytest.raises(ValueError):
        json.loads(killed["body"])


# On the wire: each event is "data: {...}\n\n"; the router then wrote the proxy error text with
# no newline and closed. stream_killed_tail is those bytes split on "\n" (it starts with the
# empty line that ended the event before).
KILLED_WIRE = "\n".join(OBS["stream_killed_tail"]).encode()
NORMAL_WIRE = (FIXTURES / "cpu" / "chat-completions-stream.sse").read_bytes()


@pytest.mark.parametrize("tail,expected", [
    (KILLED_WIRE, True),
    (KILLED_WIRE.rpartition(b"\n\n")[2], True),  # what follows the last complete event
    (b"proxy error: Failed to read connection", True),
    (b"proxy error: Failed to read connection\r\n", True),
    (KILLED_WIRE.rpartition(b"\n\n")[0] + b"\n\n", False),  # the same stream without it
    (NORMAL_WIRE, False),
    (NORMAL_WIRE[-200:], False),
    (b"data: [DONE]\n\n", False),
    (b'data: {"choices":[{"delta":{"content":"proxy error: no"}}]}\n\n', False),
    (b"", False),
])
def test_stream_tail_is_proxy_error(tail: bytes, expected: bool) -> None:
    assert stream_tail_is_proxy_error(tail) is expected


def test_the_killed_stream_wire_shape() -> None:
    assert KILLED_WIRE.startswith(b"\ndata: {")
    assert KILLED_WIRE.endswith(b"\n\nproxy error: Failed to read connection")
    assert b"[DONE]" not in KILLED_WIRE
    assert NORMAL_WIRE.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("status,body,expected", [
    (500, LOAD_FAILED_BODY, True),
    (500, LOAD_FAILED_BODY.encode(), True),
    (503, '{"error":{"message":"model name=my model failed to load"}}', True),
    (200, LOAD_FAILED_BODY, False),
    (500, OBS["nonstream_killed"]["body"], False),
    (500, '{"error":{"code":500,"message":"Compute error.","type":"server_error"}}', False),
    (500, '{"error":"model name=alpha failed to load"}', False),
    (500, '{"error":{"message":"failed to load model"}}', False),
    (500, '["model name=alpha failed to load"]', False),
    (500, LOAD_FAILED_BODY[:-1], False),
])
def test_is_load_failure_body(status: int, body: str | bytes, expected: bool) -> None:
    assert is_load_failure_body(status, body) is expected


# --- why an instance died ------------------------------------------------------------------

def test_the_h200_line_is_the_captured_one() -> None:
    assert H200_CUDA_LINE in (FIXTURES / "gpu" / "B-runtime-oom.log").read_text().splitlines()


A_LOAD_OOM = [f"[52251] {line}"
              for line in (FIXTURES / "gpu" / "A-load-oom.log").read_text().splitlines()]
ALPHA_RUN = relayed(52251)  # SIGABRT on a CPU instance: nothing of memory
BETA_LOADING = relayed(45587)  # force-killed by an unload while loading
assert ALPHA_RUN and BETA_LOADING


@pytest.mark.parametrize("exit_code,lines,loading,vram,kind,evidence", [
    # Loading and a load-failure line (the H200 load OOM, relayed): the model does not fit.
    (1, A_LOAD_OOM, True, None, K.LOAD_OOM,
     "llama_init_from_model: failed to initialize the context: failed to allocate buffer for "
     "kv cache"),
    (1, ["failed to allocate CUDA0 buffer of size 4294967296"], True, None, K.LOAD_OOM,
     "failed to allocate CUDA0 buffer of size 4294967296"),
    (1, ["ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory"], True, None,
     K.LOAD_OOM, "ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory"),
    # An out-of-memory line after the load: a runtime OOM.
    (1, A_LOAD_OOM, False, None, K.RUNTIME_OOM,
     "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device 0: "
     "cudaMalloc failed: out of memory"),
    (1, ["[52251] CUDA error: out of memory", H200_CUDA_LINE], False, PLENTY, K.RUNTIME_OOM,
     "CUDA error: out of memory"),
    # An allocation line that names no out-of-memory, after the load: no memory verdict.
    (1, ["failed to allocate CUDA0 buffer of size 4294967296"], False, None, K.CRASH,
     "exited with status 1 (the router reports every death so; no CUDA or out-of-memory line)"),
    # The terse H200 abort line, relayed: NVML decides.
    (1, ALPHA_RUN + [f"[52251] {H200_CUDA_LINE}"], False, LOW, K.RUNTIME_OOM,
     f"{H200_CUDA_LINE} (instance exited with status 1, free VRAM 61 MiB of 143771 MiB, "
     "0.4 s before)"),
    (1, [f"[52251] {H200_CUDA_LINE}"], False, None, K.CUDA_ERROR,
     f"{H200_CUDA_LINE} (instance exited with status 1)"),
    (1, [H200_CUDA_LINE], False, PLENTY, K.CUDA_ERROR,
     f"{H200_CUDA_LINE} (instance exited with status 1)"),
    (1, [H200_CUDA_LINE], False, STALE_LOW, K.CUDA_ERROR,
     f"{H200_CUDA_LINE} (instance exited with status 1)"),
    (None, [H200_CUDA_LINE], False, None, K.CUDA_ERROR,
     f"{H200_CUDA_LINE} (instance exit status unknown)"),
    # No line at all, but the GPU was full just before.
    (1, ALPHA_RUN, False, LOW, K.RUNTIME_OOM,
     "the model's instance died with free VRAM 61 MiB of 143771 MiB, 0.4 s before"),
    (None, [], False, LOW, K.RUNTIME_OOM,
     "the model's instance died with free VRAM 61 MiB of 143771 MiB, 0.4 s before"),
    # Nothing: a crash (the captured SIGABRT, reported as 1; an unload killing a load).
    (1, ALPHA_RUN, False, PLENTY, K.CRASH,
     "the model's instance exited with status 1 (the router reports every death so; "
     "no CUDA or out-of-memory line)"),
    (1, ALPHA_RUN, False, STALE_LOW, K.CRASH, "exited with status 1 (the router reports"),
    (1, BETA_LOADING, True, None, K.CRASH,
     "the model's instance exited with status 1 while loading (the router reports every "
     "death so; no CUDA or out-of-memory line)"),
    (139, [], False, None, K.CRASH,
     "the model's instance exited with status 139 (no CUDA or out-of-memory line)"),
    (None, [], False, None, K.CRASH, "exit status unknown"),
])
def test_classify_instance_exit(exit_code: int | None, lines: list[str], loading: bool,
                                vram: VramSample | None, kind: FailureKind,
                                evidence: str) -> None:
    verdict = classify_instance_exit(exit_code, lines, loading=loading, vram=vram)
    assert verdict.kind is kind
    assert evidence in verdict.evidence
    assert "[52251]" not in verdict.evidence
    assert verdict.child_failed


@pytest.mark.parametrize("vram,short_mib,max_age_s,kind", [
    (VramSample(free_mib=600, total_mib=24576, age_s=1.0), 512.0, 10.0, K.CUDA_ERROR),
    (VramSample(free_mib=600, total_mib=24576, age_s=1.0), 1024.0, 10.0, K.RUNTIME_OOM),
    (STALE_LOW, 512.0, 10.0, K.CUDA_ERROR),
    (STALE_LOW, 512.0, 300.0, K.RUNTIME_OOM),
])
def test_classify_instance_exit_vram_thresholds(vram: VramSample, short_mib: float,
                                                max_age_s: float, kind: FailureKind) -> None:
    verdict = classify_instance_exit(1, [H200_CUDA_LINE], loading=False, vram=vram,
                                     vram_short_mib=short_mib, vram_max_age_s=max_age_s)
    assert verdict.kind is kind


def test_a_lost_device_kills_an_instance_as_a_gpu_fault_loading_or_not() -> None:
    lines = ["[52251] terminate called after throwing an instance of 'vk::DeviceLostError'",
             "[52251]   what():  vk::Queue::submit: ErrorDeviceLost"]
    for loading in (False, True):
        for vram in (None, LOW, PLENTY):
            verdict = classify_instance_exit(1, lines, loading=loading, vram=vram)
            assert verdict.kind is K.GPU_FAULT
            assert verdict.evidence == "what():  vk::Queue::submit: ErrorDeviceLost"
