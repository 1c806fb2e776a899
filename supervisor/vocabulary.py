"""The words the parts of Spillway share: the roles, what an upstream is, and what one attempt
at a request came to. A leaf: it imports nothing of Spillway but the pure policy types (and,
for type checking only, the config and the load counter), so that the pool, the proxy, the
resources and the router can all speak of upstreams without importing each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from .policy import evidence as ev
from .policy.lifecycle import ChildState

if TYPE_CHECKING:
    from .config import ChildConfig
    from .load import Load

# The roles, the GPU's first: the order of preference, of the config's sections and of the
# status. Said here once (config, admission and the daemon read it).
GPU = "gpu"
CPU = "cpu"
ROLES = (GPU, CPU)

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
    def cfg(self) -> ChildConfig: ...

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


@dataclass(frozen=True)
class Answered:
    response: web.StreamResponse


@dataclass(frozen=True)
class Broken:
    """Failed after bytes reached the client: the stream was ended with one error event and no
    [DONE]; never a final answer."""

    response: web.StreamResponse
    failure: AttemptFailure


@dataclass(frozen=True)
class Interrupted:
    """Failed after bytes reached the client, its stream left open: it goes on from the other
    child (`Forwarder.continue_stream`) or ends with the error event (`Forwarder.end_broken`).
    Only a followed stream (`RequestCtx.follow`) is interrupted rather than broken."""

    response: web.StreamResponse
    failure: AttemptFailure
    anthropic: bool = False
    at: float = field(default_factory=time.monotonic)  # when the failure was seen


AttemptResult = Answered | Broken | Interrupted | AttemptFailure
