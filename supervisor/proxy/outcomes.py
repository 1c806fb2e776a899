"""What a request's attempt came to, as the proxy answers it: answered (whatever the child
said), broken (failed after bytes reached the client, ended with one error event), interrupted
(failed after bytes, its stream left open to go on from another upstream), or the failure
itself (vocabulary.AttemptFailure: nothing reached the client)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from ..vocabulary import AttemptEnd, AttemptFailure


@dataclass(frozen=True)
class Answered:
    response: web.StreamResponse
    # A 5xx the child answered while alive: its first line ("HTTP 500: ...") and its body's own
    # message, for the sick-child rule (policy/sickness.py); "" otherwise.
    server_error: str = ""
    server_message: str = ""


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


@dataclass(frozen=True)
class Recalled:
    """A followed stream stopped at a whole event by Spillway itself, its stream left open: it
    moves back to the GPU child (serving/failback.py). Not a failure of the child's."""

    response: web.StreamResponse
    anthropic: bool = False
    at: float = field(default_factory=time.monotonic)


AttemptResult = Answered | Broken | Interrupted | Recalled | AttemptFailure


def ending(result: AttemptResult | None, body: bytes = b"") -> AttemptEnd | None:
    """What the pool learns from an attempt's outcome (None: cancelled, the client left); a
    5xx answer's request `body`, hashed, tells requests apart for the sick-child rule."""
    if result is None:
        return None
    if isinstance(result, AttemptFailure):
        return AttemptEnd(failure=result, timed=False)
    if isinstance(result, (Broken, Interrupted)):
        return AttemptEnd(failure=result.failure)
    if isinstance(result, Recalled):
        return AttemptEnd(timed=False)  # (cut short: its timings are not a whole answer's)
    return AttemptEnd(ok=result.response.status == 200, status=result.response.status,
                      error_line=result.server_error, error_message=result.server_message,
                      body_digest=hash(body) if result.server_error else 0)
