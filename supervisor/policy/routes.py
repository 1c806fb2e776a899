"""Which llama-server routes generate (admission and replay apply), which only read (replayed
like a generation), and which never replay."""

from __future__ import annotations

import enum
from urllib.parse import parse_qsl

GENERATION_ROUTES = frozenset({
    "/completion", "/completions", "/v1/completions",
    "/chat/completions", "/v1/chat/completions",
    "/v1/responses", "/responses",
    "/v1/messages",
    "/infill",
    "/embedding", "/embeddings", "/v1/embeddings",
    "/rerank", "/reranking", "/v1/rerank", "/v1/reranking",
})

# Routes that answer with their own SSE dialect: `event: error` comes before the error data.
ANTHROPIC_ROUTES = frozenset({"/v1/messages"})

# Routes whose streams end with `data: [DONE]` (the OpenAI-style ones).
DONE_SENTINEL_ROUTES = frozenset({
    "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions",
})

# llama-server's routes that Spillway answers itself (proxy/stream_routes.py) and that change
# something: a browser's request to one must come from the page's own origin, as on Spillway's
# own routes (policy/browser.py). Without it a page of another site cut a client's resumable
# stream: the child, not Spillway, answers the preflight, and grants it by default.
ANSWERED_CHANGES = frozenset({("DELETE", "/v1/stream")})

# The open routes: llama-server answers them without a key, and so does Spillway.
PUBLIC_ROUTES = frozenset({"/health", "/v1/health", "/spillway/health"})

# Open for GET and HEAD only: Spillway's status page (and the redirect to it). It carries no data;
# the routes it reads keep asking for the key.
PUBLIC_PAGES = frozenset({"/spillway", "/spillway/"})


class RouteClass(enum.StrEnum):
    OWN = "own"  # Spillway's own, under /spillway/
    GENERATION = "generation"  # admission and replay apply
    PASSTHROUGH = "passthrough"  # outside the caps, never replayed


def classify_route(path: str) -> RouteClass:
    if path == "/spillway" or path.startswith("/spillway/"):
        return RouteClass.OWN
    if path in GENERATION_ROUTES:
        return RouteClass.GENERATION
    return RouteClass.PASSTHROUGH


# llama-server's GET routes that only read (server.cpp's table, the pinned source): each answers
# from what the server holds and changes nothing, so one caught in a child's death may be asked
# again of the other child. An allowlist: a route not named here is never replayed. Not among
# them: /cors-proxy (fetches the URL it is given, outside: a replay fetches it twice), /tools
# (the replay rule keeps every /tools request on the child it went to), /v1/stream (Spillway
# answers it itself).
READ_ROUTES = frozenset({
    "/health", "/v1/health", "/metrics", "/props", "/slots", "/lora-adapters",
    "/models", "/v1/models", "/models/sse",
})
# The web UI's page; its other files are told by their name (read_only).
UI_PAGES = frozenset({"/", "/index.html"})
# Query parameters with which a GET acts (server-models.cpp): `autoload=true` has a router load
# the model the request names (on any route it proxies, `/props?model=X` too), `reload` has
# `GET /models` read the models' folder again. A read that carries one is not replayed.
ACTING_PARAMS = frozenset({"autoload", "reload"})


def _ui_file(path: str) -> bool:
    """A file of the web UI (its hashed assets, the manifest, sw.js) or of `--path`: none of
    llama-server's API routes has a dot in its last segment, its static files all do."""
    name = path.rsplit("/", 1)[-1]
    stem, dot, _ = name.rpartition(".")
    return bool(dot and stem)


def read_only(method: str, path: str, query: str, has_body: bool) -> bool:
    """A request that only reads: a GET or HEAD without a body, to one of llama-server's read
    routes or the web UI's files, with no query parameter that acts (`query` as it came, without
    its `?`). The replay rule replays it like a generation (policy/replay.py, rule 4)."""
    if method not in ("GET", "HEAD") or has_body:
        return False
    if path not in READ_ROUTES and path not in UI_PAGES and not _ui_file(path):
        return False
    return not any(name in ACTING_PARAMS
                   for name, _ in parse_qsl(query, keep_blank_values=True))


# Routes named in the metrics beyond those above (a path under one counts as it).
LABELLED_ROUTES = ("/props", "/slots", "/metrics", "/tokenize", "/detokenize",
                   "/apply-template", "/v1/models", "/models", "/lora-adapters", "/tools")
# Every value route_label can give: its bound.
ROUTE_LABEL_COUNT = len(GENERATION_ROUTES | PUBLIC_ROUTES | set(LABELLED_ROUTES)) + 1


def route_label(path: str) -> str:
    """A bounded label for metrics and logs: known routes by name, everything else `other`."""
    if path in GENERATION_ROUTES or path in PUBLIC_ROUTES:
        return path
    for k in LABELLED_ROUTES:
        if path == k or path.startswith(k + "/"):
            return k
    return "other"
