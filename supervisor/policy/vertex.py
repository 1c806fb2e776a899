"""Vertex AI's custom-container contract, as the pinned llama-server takes it: pure.

Vertex AI runs a serving container with `AIP_MODE=PREDICTION` and says where it must listen and
what it must answer: `AIP_HTTP_PORT`, `AIP_PREDICT_ROUTE`, `AIP_HEALTH_ROUTE`. llama-server
follows it (tools/server/server-http.cpp: `gcp_params`, `server_http_context::init`,
`register_gcp_compat`):

- only with `AIP_MODE` exactly `PREDICTION`; an empty variable counts as unset;
- its port becomes `AIP_HTTP_PORT` (8080 when unset), whatever `--port` said; its host stays
  `--host`'s;
- `POST AIP_PREDICT_ROUTE` (`/predict` when unset; a leading `/` added) takes
  `{"instances": [...]}`, at most 128, each an object naming a route in `@requestFormat` (the
  route's camelCase name, `chatCompletions`, or its path) with that route's body; every instance
  is run (with `stream` forced off) and the answer is `{"predictions": [...]}`, each the route's
  JSON (an error's too), its text when not JSON, or null when empty, in the instances' order;
- `GET AIP_HEALTH_ROUTE`, when set, answers as `/health`; when unset, there is no such route;
- a predict route that is one of its own routes is refused at start.

Spillway takes the contract itself (its listen addresses take the port; the two routes are
answered as above, each instance going through Spillway as a request of its own), and keeps the
variables from its children (upstreams/children.py): they would otherwise all try the one port.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODE = "AIP_MODE"
PORT = "AIP_HTTP_PORT"
PREDICT = "AIP_PREDICT_ROUTE"
HEALTH = "AIP_HEALTH_ROUTE"
VARIABLES = (MODE, PORT, PREDICT, HEALTH)  # the ones llama-server reads
PREDICTION = "PREDICTION"
DEFAULT_PORT = 8080
DEFAULT_PREDICT = "/predict"
MAX_INSTANCES = 128
FORMAT = "@requestFormat"

# llama-server's routes (server.cpp), in the order it registers them. It keeps one handler a
# path, the first registered (`handlers.emplace`): GET /props, not POST; GET /v1/stream, not
# DELETE. In router mode its own come first, so POST /models holds /models there.
ROUTER_ROUTES = (
    ("POST", "/models"), ("POST", "/models/load"), ("POST", "/models/unload"),
    ("GET", "/models/sse"), ("DELETE", "/models"),
)
ROUTES = (
    ("GET", "/health"), ("GET", "/v1/health"), ("GET", "/metrics"), ("GET", "/props"),
    ("POST", "/props"), ("GET", "/models"), ("GET", "/v1/models"), ("POST", "/completion"),
    ("POST", "/completions"), ("POST", "/v1/completions"), ("POST", "/chat/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/chat/completions/control"),
    ("POST", "/v1/responses"), ("POST", "/responses"), ("POST", "/v1/audio/transcriptions"),
    ("POST", "/audio/transcriptions"), ("POST", "/v1/messages"), ("POST", "/infill"),
    ("POST", "/embedding"), ("POST", "/embeddings"), ("POST", "/v1/embeddings"),
    ("POST", "/rerank"), ("POST", "/reranking"), ("POST", "/v1/rerank"),
    ("POST", "/v1/reranking"), ("POST", "/v1/systemone"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("POST", "/apply-template"),
    ("POST", "/chat/completions/input_tokens"), ("POST", "/v1/chat/completions/input_tokens"),
    ("POST", "/responses/input_tokens"), ("POST", "/v1/responses/input_tokens"),
    ("POST", "/v1/messages/count_tokens"), ("GET", "/lora-adapters"),
    ("POST", "/lora-adapters"), ("GET", "/slots"), ("POST", "/slots/:id_slot"),
    ("GET", "/v1/stream"), ("POST", "/v1/streams/lookup"), ("DELETE", "/v1/stream"),
)
# Registered after the predict route: named by their path only (no camelCase name), and not in
# the way of a predict route there (llama-server's first match is the predict route then).
LATER_ROUTES = (("GET", "/cors-proxy"), ("POST", "/cors-proxy"), ("GET", "/tools"),
                ("POST", "/tools"))

# A route as the contract gives it: a plain path (no query; no braces, which the app's router
# would read as a pattern).
_ROUTE = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*")


@dataclass(frozen=True)
class Contract:
    port: int
    predict_route: str
    health_route: str | None  # None: unset, /health as ever


def read(environ: Mapping[str, str]) -> Contract | None:
    """The contract, when `AIP_MODE=PREDICTION`; ValueError, naming the variable, for one
    Spillway cannot take (llama-server reads the port with `std::stoi`: a bad one ends it, and
    `8080x` is 8080; Spillway says so instead)."""
    if environ.get(MODE, "") != PREDICTION:
        return None
    text = environ.get(PORT, "").strip() or str(DEFAULT_PORT)
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{PORT}={text!r} is not a port (1-65535)")
    predict = _route(environ, PREDICT) or DEFAULT_PREDICT
    health = _route(environ, HEALTH)
    if predict in _paths(router=True, later=True):
        # llama-server's words (it exits 1).
        raise ValueError(f"{PREDICT}={predict} conflicts with an existing llama-server route")
    for name, route in ((PREDICT, predict), (HEALTH, health)):
        if route is not None and (route == "/spillway" or route.startswith("/spillway/")):
            raise ValueError(f"{name}={route} is one of Spillway's own routes (/spillway/*)")
    return Contract(int(text), predict, health)


def _route(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name, "")
    if not value:
        return None
    route = value if value.startswith("/") else "/" + value  # as llama-server adds it
    if not _ROUTE.fullmatch(route):
        raise ValueError(f"{name}={value!r} is not a plain path")
    return route


def health_alias(contract: Contract) -> str | None:
    """The path that answers as /health, if Spillway must add one: not when the variable is
    unset, nor when llama-server answers GET on that path already (its own handler comes first
    there: /health is /health)."""
    route = contract.health_route
    # "/": the web UI, which llama-server serves before any of these routes.
    if route is None or route == "/" or route in {p for m, p in ROUTES + LATER_ROUTES
                                                   if m == "GET"}:
        return None
    return route


def open_reads(contract: Contract | None) -> frozenset[str]:
    """Paths open to GET without the key: the health route, which answers as /health (open in
    llama-server and Spillway alike) and which Vertex AI's health checks ask without a key."""
    alias = health_alias(contract) if contract is not None else None
    return frozenset({alias}) if alias is not None else frozenset()


# --- the predict route ------------------------------------------------------------------------

@dataclass(frozen=True)
class Dispatch:
    """One instance, as a request of its own."""

    method: str
    path: str
    body: bytes | None  # JSON, for a POST


@dataclass(frozen=True)
class Refused:
    """An instance llama-server refuses itself: its words, as an invalid_request_error."""

    message: str


def instances(data: Any) -> list[Any] | Refused:
    """The predict body's instances (the body parsed, proxy/bodies.py: its depth limited), or
    why the whole request is refused (400)."""
    if not isinstance(data, dict):
        return Refused("request body must be a JSON object")
    found = data.get("instances")
    if not isinstance(found, list):
        return Refused("request body must include an array field named instances")
    if len(found) > MAX_INSTANCES:
        return Refused(f"instances array exceeds maximum size of {MAX_INSTANCES}")
    return found


def dispatch(instance: Any, router: bool) -> Dispatch | Refused:
    """Where one instance goes, with what: its `@requestFormat` by camelCase name or by path,
    and the rest of it as the body (`stream` forced off, as llama-server does)."""
    if not isinstance(instance, dict):
        return Refused("each instance must be a JSON object")
    fmt = instance.get(FORMAT)
    if not isinstance(fmt, str):
        return Refused(f"each instance must include a string {FORMAT}")
    found = resolve(fmt, router)
    if found is None:
        return Refused(f"no handler registered for {FORMAT}: {fmt}")
    method, path = found
    payload = {k: v for k, v in instance.items() if k != FORMAT}
    if "stream" in payload:
        payload["stream"] = False
    if method == "GET":
        return Dispatch(method, path, None)  # llama-server's GET handlers read no body
    return Dispatch(method, path, json.dumps(payload, separators=(",", ":")).encode())


def gcp_format(path: str) -> str:
    """A route's camelCase name (llama-server's `path_to_gcp_format`): `/v1/chat/completions`
    -> `chatCompletions`, `/apply-template` -> `applyTemplate`, `/slots/:id_slot` -> `slots`."""
    name = path[3:] if len(path) > 3 and path.startswith("/v1") else path
    name = name[1:] if name.startswith("/") else name
    out: list[str] = []
    cap = False
    for c in name:
        if c == ":":
            break
        if c in "/-_":
            cap = True
            continue
        out.append(c.upper() if cap else c)
        cap = False
    return "".join(out)


def resolve(fmt: str, router: bool) -> tuple[str, str] | None:
    """(method, path) for a `@requestFormat`. Where two paths share a name, llama-server takes
    the one its hash map iterates first; on the pinned binary that is the path under /v1/
    (`completions` is /v1/completions, `embeddings` /v1/embeddings, `models` /v1/models in router
    mode), else the first registered (`slots` is GET /slots): checked against the real binary by
    tests/test_vertex.py."""
    owners = _paths(router, later=False)
    named: dict[str, str] = {}
    for path in owners:
        alias = gcp_format(path)
        if alias not in named or (path.startswith("/v1/") and
                                  not named[alias].startswith("/v1/")):
            named[alias] = path
    if fmt in named:
        return owners[named[fmt]], named[fmt]
    everything = _paths(router, later=True)
    return (everything[fmt], fmt) if fmt in everything else None


def _paths(router: bool, later: bool) -> dict[str, str]:
    """Each path's method, the first registered's, in registration order."""
    table = (ROUTER_ROUTES if router else ()) + ROUTES + (LATER_ROUTES if later else ())
    out: dict[str, str] = {}
    for method, path in table:
        out.setdefault(path, method)
    return out


STREAMING = "predict route does not support streaming responses"  # llama-server's words


def prediction(body: bytes) -> Any:
    """One instance's answer as a prediction: its JSON, else its text, None when empty."""
    if not body:
        return None
    text = body.decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text
