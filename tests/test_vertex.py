"""Vertex AI's custom-container contract (issue 37): Spillway takes it, as the pinned
llama-server does, and keeps it from its children.

The rules (policy/vertex.py) table-driven; the config's listen addresses under it; a daemon with
fake children that follow the contract as llama-server does (tests/fake_llama_server.py), which
would leave their ports for Spillway's if they were given it; and the real llama-server beside
Spillway, both under the same contract, answering the same predictions.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Spillway, eventually, fake_config, free_port, real_config, toml_dumps

from conftest import SpillwayFactory
from supervisor.config.schema import ConfigError, build
from supervisor.policy import vertex
from supervisor.policy.vertex import Contract, Dispatch, Refused

ON = {"AIP_MODE": "PREDICTION"}


# --- the contract -----------------------------------------------------------------------------

@pytest.mark.parametrize(("environ", "contract"), [
    ({}, None),
    ({"AIP_HTTP_PORT": "9000"}, None),  # no AIP_MODE: nothing moves (llama-server's test)
    ({"AIP_MODE": "prediction", "AIP_HTTP_PORT": "9000"}, None),  # exactly PREDICTION
    ({"AIP_MODE": ""}, None),
    (ON, Contract(8080, "/predict", None)),  # llama-server's defaults
    ({**ON, "AIP_HTTP_PORT": "", "AIP_PREDICT_ROUTE": "", "AIP_HEALTH_ROUTE": ""},
     Contract(8080, "/predict", None)),  # empty is unset
    ({**ON, "AIP_HTTP_PORT": " 9000 ", "AIP_PREDICT_ROUTE": "v1/x:predict",
      "AIP_HEALTH_ROUTE": "hc"}, Contract(9000, "/v1/x:predict", "/hc")),  # "/" added
    ({**ON, "AIP_PREDICT_ROUTE": "/v1/endpoints/7/deployedModels/8:predict",
      "AIP_HEALTH_ROUTE": "/v1/endpoints/7/deployedModels/8"},
     Contract(8080, "/v1/endpoints/7/deployedModels/8:predict",
              "/v1/endpoints/7/deployedModels/8")),  # what Vertex AI sets by default
])
def test_the_contract_is_read_as_llama_server_reads_it(environ: dict[str, str],
                                                        contract: Contract | None) -> None:
    assert vertex.read(environ) == contract


@pytest.mark.parametrize(("environ", "words"), [
    ({**ON, "AIP_HTTP_PORT": "8080x"}, "AIP_HTTP_PORT='8080x' is not a port"),
    ({**ON, "AIP_HTTP_PORT": "0"}, "is not a port"),
    ({**ON, "AIP_HTTP_PORT": "65536"}, "is not a port"),
    ({**ON, "AIP_PREDICT_ROUTE": "/completion"},
     "AIP_PREDICT_ROUTE=/completion conflicts with an existing llama-server route"),
    ({**ON, "AIP_PREDICT_ROUTE": "v1/chat/completions"}, "conflicts"),
    ({**ON, "AIP_PREDICT_ROUTE": "/models/load"}, "conflicts"),  # a router's
    ({**ON, "AIP_PREDICT_ROUTE": "/spillway/predict"}, "Spillway's own routes"),
    ({**ON, "AIP_HEALTH_ROUTE": "/spillway"}, "Spillway's own routes"),
    ({**ON, "AIP_PREDICT_ROUTE": "/p/{x}"}, "not a plain path"),
    ({**ON, "AIP_HEALTH_ROUTE": "/h?x=1"}, "not a plain path"),
])
def test_a_contract_spillway_cannot_take_is_named(environ: dict[str, str], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("?", r"\?").replace("(", r"\(")):
        vertex.read(environ)


@pytest.mark.parametrize(("path", "name"), [
    ("/v1/chat/completions", "chatCompletions"), ("/apply-template", "applyTemplate"),
    ("/completion", "completion"), ("/v1/completions", "completions"),
    ("/slots/:id_slot", "slots"), ("/v1/messages/count_tokens", "messagesCountTokens"),
    ("/v1/stream", "stream"), ("/v1/streams/lookup", "streamsLookup"), ("/health", "health"),
    ("/lora-adapters", "loraAdapters"), ("/v1", "v1"),
])
def test_each_route_has_llama_servers_camel_case_name(path: str, name: str) -> None:
    assert vertex.gcp_format(path) == name


@pytest.mark.parametrize(("fmt", "router", "found"), [
    ("chatCompletions", False, ("POST", "/v1/chat/completions")),
    ("completion", False, ("POST", "/completion")),
    # Two paths, one name: as the pinned binary dispatches them (test_..._beside_llama_servers).
    ("completions", False, ("POST", "/v1/completions")),
    ("embeddings", False, ("POST", "/v1/embeddings")),
    ("embedding", False, ("POST", "/embedding")),
    ("slots", False, ("GET", "/slots")),
    ("models", False, ("GET", "/v1/models")),
    ("models", True, ("GET", "/v1/models")),
    # One handler a path, the first registered.
    ("props", False, ("GET", "/props")),
    ("stream", False, ("GET", "/v1/stream")),
    ("loraAdapters", False, ("GET", "/lora-adapters")),
    ("applyTemplate", False, ("POST", "/apply-template")),
    ("health", False, ("GET", "/v1/health")),
    ("modelsLoad", True, ("POST", "/models/load")),
    ("modelsLoad", False, None),  # no router, no such route
    # By path, and the routes registered after the predict route by path only.
    ("/completions", False, ("POST", "/completions")),
    ("/tokenize", False, ("POST", "/tokenize")),
    ("/tools", False, ("GET", "/tools")),
    ("tools", False, None),
    ("/spillway/status", False, None),
    ("nothing", False, None),
])
def test_a_request_format_names_a_route(fmt: str, router: bool,
                                        found: tuple[str, str] | None) -> None:
    assert vertex.resolve(fmt, router) == found


@pytest.mark.parametrize(("instance", "sent"), [
    ({"@requestFormat": "chatCompletions", "messages": [], "stream": True},
     Dispatch("POST", "/v1/chat/completions", b'{"messages":[],"stream":false}')),
    ({"@requestFormat": "props", "x": 1}, Dispatch("GET", "/props", None)),
    ({"@requestFormat": "/tokenize", "content": "hi"},
     Dispatch("POST", "/tokenize", b'{"content":"hi"}')),
    ([], Refused("each instance must be a JSON object")),
    ({}, Refused("each instance must include a string @requestFormat")),
    ({"@requestFormat": 3}, Refused("each instance must include a string @requestFormat")),
    ({"@requestFormat": "nope"}, Refused("no handler registered for @requestFormat: nope")),
])
def test_an_instance_is_a_request_of_its_own(instance: Any, sent: Dispatch | Refused) -> None:
    assert vertex.dispatch(instance, router=False) == sent


@pytest.mark.parametrize(("body", "found"), [
    (b'{"instances": []}', []),
    (b'{"instances": [1, {}], "parameters": {}}', [1, {}]),
    (b'[1]', Refused("request body must be a JSON object")),
    (b'{"instances": {}}', Refused("request body must include an array field named instances")),
    (b'{}', Refused("request body must include an array field named instances")),
    (json.dumps({"instances": [{}] * 129}).encode(),
     Refused("instances array exceeds maximum size of 128")),
])
def test_the_predict_body(body: bytes, found: list[Any] | Refused) -> None:
    assert vertex.instances(json.loads(body)) == found


def test_an_answer_is_a_prediction() -> None:
    assert vertex.prediction(b'{"a": 1}') == {"a": 1}
    assert vertex.prediction(b"# HELP x\n") == "# HELP x\n"  # /metrics: its text
    assert vertex.prediction(b"") is None


def test_the_health_route_is_added_only_where_llama_server_answers_nothing_else() -> None:
    assert vertex.health_alias(Contract(1, "/predict", None)) is None
    assert vertex.health_alias(Contract(1, "/predict", "/health")) is None
    assert vertex.health_alias(Contract(1, "/predict", "/props")) is None  # its own comes first
    assert vertex.health_alias(Contract(1, "/predict", "/")) is None  # the web UI
    assert vertex.health_alias(Contract(1, "/predict", "/hc")) == "/hc"
    assert vertex.open_reads(Contract(1, "/predict", "/hc")) == {"/hc"}
    assert vertex.open_reads(None) == frozenset()


# --- the config -----------------------------------------------------------------------------

def test_under_the_contract_every_listen_address_takes_its_port() -> None:
    raw = {"model": {"path": "/m.gguf"},
           "server": {"listen": ["127.0.0.1:8080", "[::1]:8081", "127.0.0.1:9000"]}}
    cfg = build(raw, environ={**ON, "AIP_HTTP_PORT": "7000"}, check_paths=False)
    assert [str(a) for a in cfg.server.listen] == ["127.0.0.1:7000", "[::1]:7000"]
    assert cfg.server.vertex == Contract(7000, "/predict", None)
    plain = build(raw, environ={"AIP_HTTP_PORT": "7000"}, check_paths=False)
    assert [a.port for a in plain.server.listen] == [8080, 8081, 9000]
    assert plain.server.vertex is None


def test_under_the_contract_spillway_listens_beyond_loopback_without_a_key() -> None:
    raw = {"model": {"path": "/m.gguf"}, "server": {"listen": "0.0.0.0:8080"}}
    with pytest.raises(ConfigError):
        build(raw, environ={}, check_paths=False)  # outside it, a key is asked for
    cfg = build(raw, environ=ON, check_paths=False)
    assert str(cfg.server.listen[0]) == "0.0.0.0:8080" and cfg.server.api_key is None


def test_a_bad_contract_is_a_config_problem() -> None:
    with pytest.raises(ConfigError) as bad:
        build({"model": {"path": "/m.gguf"}}, environ={**ON, "AIP_HTTP_PORT": "http"},
              check_paths=False)
    [problem] = bad.value.problems
    assert problem.path == "server.listen" and "AIP_HTTP_PORT='http'" in problem.message


# --- a daemon under the contract, with fake children ------------------------------------------

KEY = "vertex-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREDICT = "/v1/endpoints/7/deployedModels/8:predict"
HEALTH = "/v1/endpoints/7/deployedModels/8"


def contracted(s: Spillway, predict: str = PREDICT, health: str | None = HEALTH) -> int:
    """Put `s` under the contract, on its own port, with its config asking for another: that
    other port, which nothing must listen on."""
    asked = free_port()
    s.config["server"]["listen"] = f"127.0.0.1:{asked}"
    s.config_path.write_text(toml_dumps(s.config))
    s.env.update({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(s.port),
                  "AIP_PREDICT_ROUTE": predict})
    if health is not None:
        s.env["AIP_HEALTH_ROUTE"] = health
    return asked


def request(s: Spillway, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(s.url + path, data=body, method=method,
                                 headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def predict(s: Spillway, body: Any, headers: dict[str, str] | None = None,
            path: str = PREDICT) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, answer = request(s, "POST", path, raw, {**AUTH, **(headers or {})})
    return status, json.loads(answer)


@pytest.fixture
def fake_vertex(spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
                tmp_path: Path) -> Iterator[tuple[Spillway, int, Path]]:
    state = tmp_path / "seen.jsonl"
    watch = {"env": {"FAKE_STATE_FILE": str(state)}}
    s = spillway(fake_config(fake_server, tiny_model, server={"api_key": KEY}, gpu=watch,
                             cpu=watch), start=False)
    asked = contracted(s)
    s.start(wait_ready=False)
    # Before Spillway kept the contract from them, both children left their ports for this one
    # (the first took it, the second could not): neither ever became READY.
    s.wait_state(("gpu", "cpu"), ("READY",), timeout=30, headers=AUTH)
    yield s, asked, state


def test_the_children_never_see_the_contract_and_spillway_takes_its_port(
        fake_vertex: tuple[Spillway, int, Path]) -> None:
    s, asked, _ = fake_vertex
    for child in ("gpu", "cpu"):
        code, props = s.get("/props", {**AUTH, "X-Spillway-Child": child})
        # (The fake reports the AIP_* variables it was given, and GGML_NO_BACKTRACE, which
        # every child gets.)
        assert code == 200 and props["env"]["GGML_NO_BACKTRACE"] == "1", props
        assert not any(k.startswith("AIP_") for k in props["env"]), props["env"]
    with pytest.raises(OSError):  # the config's port: not Spillway's under the contract
        socket.create_connection(("127.0.0.1", asked), timeout=2).close()
    said = s.log_path.read_text()
    assert f"Vertex AI's contract (AIP_MODE=PREDICTION): listening on port {s.port}" in said
    assert "on loopback only, nothing it sends arrives" in said


def test_the_health_route_answers_as_health_and_without_the_key(
        fake_vertex: tuple[Spillway, int, Path]) -> None:
    s, _, _ = fake_vertex
    status, headers, body = request(s, "GET", HEALTH)
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    assert (status, json.loads(body)) == (lambda r: (r[0], json.loads(r[2])))(
        request(s, "GET", "/health"))
    assert request(s, "HEAD", HEALTH)[0] == 200
    # Only the health route is open: the predict route, at a path beside it, asks for the key.
    assert request(s, "POST", PREDICT, b'{"instances": []}')[0] == 401


def test_each_instance_goes_through_spillway_as_a_request_of_its_own(
        fake_vertex: tuple[Spillway, int, Path]) -> None:
    s, _, state = fake_vertex
    chat = {"@requestFormat": "chatCompletions", "stream": True,
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, body = predict(s, {"instances": [
        chat, {"@requestFormat": "props"}, {"@requestFormat": 3}, "x",
        {"@requestFormat": "nope"}, {"@requestFormat": "/v1/chat/completions", **chat}],
        "parameters": {}}, {"X-Request-Id": "pred-1"})
    assert status == 200, body
    first, props, no_format, not_object, unknown, by_path = body["predictions"]
    # A stream is not an answer a prediction can hold: llama-server turns it off, as here.
    assert first["object"] == "chat.completion" and first["choices"], first
    assert by_path["object"] == "chat.completion"
    assert props["total_slots"] == 2
    for error, words in ((no_format, "each instance must include a string @requestFormat"),
                         (not_object, "each instance must be a JSON object"),
                         (unknown, "no handler registered for @requestFormat: nope")):
        assert error["error"]["message"] == words and error["error"]["code"] == 400
        assert error["error"]["type"] == "invalid_request_error"
    # Each reached a child through Spillway, with the key of that child and an id of its own.
    seen = [{**r, "headers": {k.lower(): v for k, v in r["headers"].items()}}
            for r in (json.loads(line) for line in state.read_text().splitlines())]
    ids = {r["headers"].get("x-request-id"): r for r in seen}
    assert {"pred-1.0", "pred-1.1", "pred-1.5"} <= set(ids), sorted(filter(None, ids))
    assert ids["pred-1.0"]["path"] == "/v1/chat/completions"
    assert ids["pred-1.1"]["method"] == "GET" and ids["pred-1.1"]["path"] == "/props"
    assert all(r["headers"]["authorization"] != AUTH["Authorization"] for r in seen
               if "authorization" in r["headers"])


@pytest.mark.parametrize(("body", "words"), [
    (b"nope", "the request body is not valid JSON"),
    (b"[1]", "request body must be a JSON object"),
    (b'{"instances": {}}', "request body must include an array field named instances"),
    (json.dumps({"instances": [{}] * 129}).encode(),
     "instances array exceeds maximum size of 128"),
    (b'{"instances": ' + b"[" * 1000 + b"]" * 1000 + b"}",
     "the request body is nested more than 128 levels deep"),
    (b"\xff", "the request body is not valid JSON"),
])
def test_a_prediction_spillway_cannot_run_is_a_400(fake_vertex: tuple[Spillway, int, Path],
                                                    body: bytes, words: str) -> None:
    s, _, _ = fake_vertex
    status, answer = predict(s, body)
    assert status == 400 and answer["error"]["message"].startswith(words), answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["src"] == "spillway"


def test_on_loopback_the_contracts_routes_take_the_host_check_too(
        fake_vertex: tuple[Spillway, int, Path]) -> None:
    s, _, _ = fake_vertex
    rebound = {"Host": f"evil.example:{s.port}"}
    assert request(s, "GET", HEALTH, headers=rebound)[0] == 403
    assert predict(s, {"instances": []}, rebound)[0] == 403
    assert predict(s, {"instances": []}, {"Host": f"localhost:{s.port}"}) == \
        (200, {"predictions": []})


def test_while_no_child_is_ready_health_says_so_and_each_instance_is_answered(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    hang = {"env": {"FAKE_HANG_START": "1"}}
    s = spillway(fake_config(fake_server, tiny_model, server={"api_key": KEY}, gpu=hang,
                             cpu=hang, queue={"max_waiting": 0}), start=False)
    contracted(s)
    s.start(wait_ready=False)
    s.wait_state(("gpu", "cpu"), ("STARTING",), headers=AUTH)
    status, _, body = request(s, "GET", HEALTH)
    assert status == 503 and json.loads(body)["error"]["message"] == "Loading model"
    assert (status, json.loads(body)["error"]["type"]) == (lambda r: (
        r[0], json.loads(r[2])["error"]["type"]))(request(s, "GET", "/health"))
    # llama-server, loading, refuses the whole prediction; Spillway answers each instance.
    status, answer = predict(s, {"instances": [
        {"@requestFormat": "chatCompletions", "messages": [{"role": "user", "content": "hi"}]},
        {"@requestFormat": "nope"}]})
    assert status == 200, answer
    busy, unknown = answer["predictions"]
    assert busy["error"]["code"] == 503 and busy["error"]["type"] == "unavailable_error", busy
    assert unknown["error"]["message"] == "no handler registered for @requestFormat: nope"


# --- beside the real llama-server ------------------------------------------------------------

# Instances whose answers do not depend on the sampler or the process: the route each format
# names, and llama-server's own refusals.
SAME_ANSWERS = [
    {"@requestFormat": "health"},
    {"@requestFormat": "tokenize", "content": "hello world"},
    {"@requestFormat": "/tokenize", "content": "hello"},
    {"@requestFormat": "detokenize", "tokens": [1, 2, 3]},
    {"@requestFormat": 3},
    "x",
    {"@requestFormat": "nope"},
    {"@requestFormat": "stream"},  # GET /v1/stream without a conversation: its 400
]
# Formats two paths share: which one answered shows in the answer's shape.
SHAPES = [
    {"@requestFormat": "completions", "prompt": "hi", "max_tokens": 2},  # /v1/completions
    {"@requestFormat": "completion", "prompt": "hi", "n_predict": 2},  # /completion
    {"@requestFormat": "slots"},  # GET /slots: a list
    {"@requestFormat": "chatCompletions", "messages": [{"role": "user", "content": "hi"}],
     "max_tokens": 2, "stream": True},
]


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return sorted(value)
    if isinstance(value, list):
        return ["list", _shape(value[0]) if value else None]
    return type(value).__name__


def _slot_fields(value: Any) -> bool:
    """True for GET /slots's answer: a list of slots, each with the fields idle ones have."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(slot, dict) and {"id", "n_ctx", "is_processing"} <= set(slot)
        for slot in value)


def _error(value: Any) -> Any:
    """An error prediction as llama-server's and Spillway's share it (Spillway adds its own
    `src`, `request_id` and `param`)."""
    return {k: value["error"][k] for k in ("message", "type", "code")}


@pytest.fixture
def real_llama_under_contract(llama_server: Path, tiny_model: Path,
                              tmp_path: Path) -> Iterator[int]:
    """The pinned llama-server itself under the contract: the reference."""
    port = free_port()
    log = open(tmp_path / "llama.log", "wb")
    proc = subprocess.Popen(
        [str(llama_server), "-m", str(tiny_model), "-c", "1024", "-np", "2", "-t", "1",
         "-tb", "1", "--port", str(free_port())], stdout=log, stderr=subprocess.STDOUT,
        env={"PATH": "/usr/bin:/bin", "AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(port),
             "AIP_PREDICT_ROUTE": PREDICT, "AIP_HEALTH_ROUTE": HEALTH})
    try:
        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{HEALTH}", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False
        assert eventually(ready), (tmp_path / "llama.log").read_text()
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.integration
def test_spillway_predicts_as_the_pinned_llama_server_beside_it(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path,
        real_llama_under_contract: int) -> None:
    reference = real_llama_under_contract
    s = spillway(real_config(llama_server, tiny_model), start=False)
    contracted(s)
    s.start(wait_ready=False)
    # Before: both real children left their ports for AIP_HTTP_PORT, and never served.
    s.wait_state(("gpu", "cpu"), ("READY",))
    body = json.dumps({"instances": SAME_ANSWERS + SHAPES}).encode()
    theirs_status, theirs = _post(reference, PREDICT, body, {})
    ours_status, ours = _post(s.port, PREDICT, body, {})
    assert ours_status == theirs_status == 200
    n = len(SAME_ANSWERS)
    for i, (mine, real) in enumerate(zip(ours["predictions"], theirs["predictions"])):
        if isinstance(real, dict) and "error" in real:
            assert _error(mine) == _error(real), (i, mine, real)
        elif i < n:
            assert mine == real, (i, mine, real)
        elif SHAPES[i - n].get("@requestFormat") == "slots":
            # A busy slot lists more fields than an idle one, and whether a slot is still busy
            # with the instances before it differs run to run: both are /slots's list.
            assert _slot_fields(mine) and _slot_fields(real), (i, mine, real)
        else:
            assert _shape(mine) == _shape(real), (i, mine, real)
    # The health route, and the refusals of a whole prediction.
    with urllib.request.urlopen(f"{s.url}{HEALTH}") as r, \
            urllib.request.urlopen(f"http://127.0.0.1:{reference}{HEALTH}") as t:
        assert json.loads(r.read()) == json.loads(t.read()) == {"status": "ok"}
    for bad in (b"[1]", b'{"instances": {}}', json.dumps({"instances": [{}] * 129}).encode(),
                b"nope"):
        (code, mine), (real_code, real) = _post(s.port, PREDICT, bad, {}), \
            _post(reference, PREDICT, bad, {})
        assert code == real_code == 400
        assert mine["error"]["type"] == real["error"]["type"] == "invalid_request_error"
        if bad != b"nope":  # the parser's words are the parser's
            assert mine["error"]["message"] == real["error"]["message"]
