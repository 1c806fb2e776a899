"""The words the parts of Spillway share: what an upstream is (and the one count of what it is
working on), and what one attempt at a request came to. A leaf above the pure policy:
it imports nothing of Spillway's but the policy's value types (ChildState, FailureKind, Verdict),
and no aiohttp (import-linter checks it), so that the pool, the proxy, the resources and the
router can all speak of upstreams without importing each other.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from multidict import CIMultiDictProxy

from .policy import evidence as ev
from .policy.lifecycle import ChildState
from .policy.media import NO_MEDIA, Media
from .policy.routes import RouteClass

# What one upstream is working on: the one count of its requests in flight. The pool writes it
# (a lease taken, a lease closed); nothing else does. The child reads it: a draining child waits
# for `idle`, and its status shows the count.
class Load:
    __slots__ = ("generation", "other", "idle", "progress", "last_byte")

    def __init__(self) -> None:
        self.generation = 0  # generation requests: what the admission caps count
        self.other = 0  # routes outside the caps (/props, /slots, ...)
        self.idle = asyncio.Event()  # set while nothing is in flight
        self.idle.set()
        # The stall rule's clock (policy/progress.py), monotonic: the last progress of its
        # generation work (a byte of an answer, a change in /slots), or when that work began.
        self.progress = 0.0
        self.last_byte: float | None = None  # its last byte of a generation answer

    def moved(self, now: float, byte: bool = True) -> None:
        """Its generation work made progress now (a byte of an answer, or its slots)."""
        self.progress = now
        if byte:
            self.last_byte = now

    @property
    def in_flight(self) -> int:
        return self.generation + self.other

    def take(self, generation: bool) -> None:
        if generation:
            if self.generation == 0:  # idle until now: the stall clock starts with this work
                self.progress = time.monotonic()
            self.generation += 1
        else:
            self.other += 1
        self.idle.clear()

    def give_back(self, generation: bool) -> None:
        if generation:
            self.generation = max(0, self.generation - 1)
        else:
            self.other = max(0, self.other - 1)
        if self.generation == 0 and self.other == 0:
            self.idle.set()


# A change of an upstream's state: (the upstream, old, new, why).
StateListener = Callable[[Any, ChildState, ChildState, str], None]


class ExitInfo(Protocol):
    @property
    def kind(self) -> ev.FailureKind: ...

    @property
    def evidence(self) -> str: ...

    @property
    def known_crash(self) -> str: ...  # a known crash signature's verdict and fix, or ""


class Upstream(Protocol):
    """One upstream: a child (children.Child), or one model's instance on a router child
    (router/upstream.ModelUpstream). The proxy forwards to it, the pool holds it (its load,
    state and listeners), the resources read its figures; one protocol for all three, so that
    what an upstream is is said once.
"""

    @property
    def name(self) -> str: ...

    # The model a request sent to it must name, when it is not the one the client named (a
    # larger model's request sent to its smaller model in router mode); None: as sent.
    @property
    def serves_model(self) -> str | None: ...

    @property
    def generation(self) -> int: ...

    @property
    def api_key(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int | None: ...

    @property
    def stderr_tail(self) -> Sequence[str]: ...

    @property
    def base_url(self) -> str: ...

    @property
    def is_ready(self) -> bool: ...

    def running(self, generation: int) -> bool: ...

    async def exit_of(self, generation: int, timeout: float) -> ExitInfo | None: ...

    # What the pool holds.
    @property
    def load(self) -> Load: ...

    @property
    def last_start_s(self) -> float | None: ...

    @property
    def listeners(self) -> list[StateListener]: ...

    @property
    def state(self) -> ChildState: ...

    @property
    def state_since(self) -> float: ...

    def next_try_in_s(self) -> float | None: ...

    def drain(self, reason: str) -> None: ...

    # What the resources read.
    @property
    def pid(self) -> int | None: ...

    @property
    def start_timeout_s(self) -> float: ...  # how long a start may take

    def start(self) -> None: ...

    async def wait_state(self, *states: ChildState, timeout: float | None = None) -> bool: ...


@dataclass(frozen=True)
class AttemptFailure:
    """An attempt that failed: before any byte reached the client, unless `after_bytes`."""

    child: str
    generation: int
    verdict: ev.Verdict
    status: int | None = None  # the child's HTTP status, when it answered
    body: bytes = b""
    timed_out: bool = False  # no byte for read_timeout_s: the child may still be working
    stream_started: bool = False  # the child had sent its 200 before failing
    after_bytes: bool = False  # the client already had part of the answer


@dataclass
class Attempt:
    """One forwarding of a request to one child: what it delivered, as it goes."""

    child: str
    number: int  # 1; 2 for the replay
    started: float = field(default_factory=time.monotonic)
    first_byte_s: float | None = None  # from the request's arrival to its first byte out
    events: int = 0  # SSE data events delivered (a token count for streams)
    timings: dict[str, Any] | None = None  # llama-server's own timings of the answer
    tokens: int | None = None  # completion tokens, when the answer said
    prompt_tokens: int | None = None  # the prompt's tokens, as the answer said (with cached)
    media_items: int = 0  # images and audio clips in its prompt (each an encoder's run)
    answer_text: str | None = None  # a whole chat answer's text (no tool call), for a mirror


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ended, as the pool learns from it (the proxy says it from the answer it
    gave: proxy/outcomes.ending); None for an attempt cancelled (the client left)."""

    failure: AttemptFailure | None = None  # the upstream failed, before or after bytes
    timed: bool = True  # its timings count: not a failure before any byte reached the client
    ok: bool = False  # a whole answer, status 200
    status: int | None = None  # an answer's status (None: no answer of the child's)
    error_line: str = ""  # a 5xx answer's first line
    error_message: str = ""  # a 5xx answer's own message (llama-server's error.message): the
    # sick-child rule tells a request's own fault by it
    body_digest: int = 0  # the request's body, hashed: different requests differ


@dataclass(frozen=True)
class OwnHeaders:
    """What a request's own headers ask of Spillway."""

    pin: str | None = None  # X-Spillway-Child (routes outside generation only)
    replay: bool = True  # False: X-Spillway-Replay: never
    deadline_s: float | None = None  # X-Spillway-Deadline or X-Stainless-Timeout; the smaller
    fallback: str = ""  # X-Spillway-Fallback: "smaller", "none", or "" (not given)


@dataclass(frozen=True)
class Received:
    """A client request as it arrived, read and checked once before it is served: what every
    attempt, replay and continuation reads, and nothing writes."""

    request_id: str
    method: str
    path: str
    path_qs: str
    route: RouteClass
    body: bytes  # as received: what every attempt sends, unless a step rewrites it
    payload: dict[str, Any] | None  # its JSON object (None: not one, or let go: see `light`)
    stream: bool
    client_headers: CIMultiDictProxy[str]
    received: float = field(default_factory=time.monotonic)
    trusted: bool = True  # passed Spillway's key check: the child's key goes along
    own: OwnHeaders = field(default_factory=OwnHeaders)  # what its X-Spillway-* headers ask
    media: Media = NO_MEDIA  # its images, audio and video (policy/media.py)
    model: str | None = None  # router mode: the model it names, as the routers list it
    smaller_ok: bool = False  # it accepts a smaller model's answer (X-Spillway-Fallback)
    # A resumable stream's X-Conversation-Id (read once, checked).
    conversation: str | None = None
    payload_let_go: bool = False  # its body is a JSON object whose parse was let go (`light`)

    @property
    def is_json(self) -> bool:
        """Its body is a JSON object: its payload is kept, or was let go."""
        return self.payload is not None or self.payload_let_go

    def light(self) -> Received:
        """The request without its parsed JSON. A large body (an image's base64) parsed is as
        large again as its bytes: once admission has read what it needs of it, a body held for
        its replay keeps its bytes alone while it waits and runs (each attempt sends them as
        received)."""
        return self if self.payload is None else replace(self, payload=None,
                                                         payload_let_go=True)

    def whole(self) -> Received:
        """The request with its parsed JSON, its bytes parsed again if it was let go: for the
        rare step that reads it after admission (a continuation, a smaller model's name)."""
        if not self.payload_let_go:
            return self
        return replace(self, payload=json.loads(self.body), payload_let_go=False)
