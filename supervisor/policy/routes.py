"""Which llama-server routes generate (admission and replay apply) and which never replay."""

from __future__ import annotations

import enum

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
