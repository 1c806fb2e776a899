"""The replay rule: may a failed request get a second attempt, on the upstream that takes over?

A request may be replayed only when all six hold:
1. its body was read whole (under the replay size limit) and parsed;
2. no byte of the response has reached the client;
3. the evidence says the child did not complete it (a 4xx or a complete answer never replays;
   nor does a read timeout, after which the child may still be working on it);
4. the route only generates (never /tools, slot save/restore/erase, LoRA, /cors-proxy), or
   the request only reads: a GET or HEAD without a body on one of llama-server's routes that
   change nothing (an allowlist, routes.read_only: /health, /props, /v1/models, /slots, the
   web UI's files, ...; not /cors-proxy, nor a query that loads a model), which either child
   answers alike;
5. the client did not opt out (`X-Spillway-Replay: never`), and its deadline leaves room for
   the other child's expected time;
6. it has not been replayed before.

When one fails, the reason says which, and the client gets a controlled error instead.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .evidence import FailureKind, Verdict
from .routes import RouteClass


class Refusal(enum.StrEnum):
    BODY = "body not replayable"
    BYTES_SENT = "bytes already reached the client"
    CHILD_COMPLETED = "the child answered"
    TIMED_OUT = "the child may still be working on it"
    ROUTE = "route never replays"
    OPTED_OUT = "client opted out (X-Spillway-Replay: never)"
    DEADLINE = "the client's deadline leaves no room for the other child"
    ALREADY_REPLAYED = "already replayed once"
    NO_TARGET = "no other child can take it"


def successors(order: Sequence[str], failed: str,
               skip: Collection[str] = ()) -> list[str]:
    """Who may take over a request that failed on `failed`, first choice first: the upstreams
    after it in the config's order, from the last back to the first (gpu -> small -> cpu,
    cpu -> gpu), less those in `skip` (a smaller model's, for a request that did not accept
    one)."""
    if failed not in order:
        return []
    at = order.index(failed)
    after = [order[(at + step) % len(order)] for step in range(1, len(order))]
    return [name for name in after if name not in skip]


def takeover(order: Sequence[str], failed: str, skip: Collection[str] = ()) -> str | None:
    """The first of `successors`; None alone."""
    return next(iter(successors(order, failed, skip)), None)


@dataclass(frozen=True)
class ReplayCase:
    verdict: Verdict
    route: RouteClass
    body_replayable: bool  # read whole, under the limit, parsed
    bytes_sent: bool
    timed_out: bool
    opted_out: bool
    attempts: int  # attempts made so far
    deadline_left_s: float | None  # None: the client gave no deadline
    target_expected_s: float | None  # None: no estimate yet
    target_available: bool  # the other child is ready or can be started in time
    # A read (routes.read_only) on a passthrough route: it changes nothing, so it may go to
    # the other child (the web UI's files and the routes it polls, caught in a GPU death).
    safe_read: bool = False


@dataclass(frozen=True)
class ReplayDecision:
    replay: bool
    reason: str
    refusal: Refusal | None = None


def decide(case: ReplayCase) -> ReplayDecision:
    def no(refusal: Refusal, detail: str = "") -> ReplayDecision:
        return ReplayDecision(False, f"{refusal}{': ' + detail if detail else ''}", refusal)

    # 4. a generation route, or a read (asked first: for any other route it is the whole
    # answer)
    read = case.safe_read and case.route is RouteClass.PASSTHROUGH
    if case.route is not RouteClass.GENERATION and not read:
        return no(Refusal.ROUTE)
    # 1. the body (a read has none to keep)
    if not case.body_replayable and not read:
        return no(Refusal.BODY)
    # 2. nothing sent yet
    if case.bytes_sent:
        return no(Refusal.BYTES_SENT)
    # 3. the child did not complete it
    if case.timed_out:
        return no(Refusal.TIMED_OUT)
    if not case.verdict.child_failed:
        return no(Refusal.CHILD_COMPLETED, str(case.verdict.kind))
    # 5. the client's wishes
    if case.opted_out:
        return no(Refusal.OPTED_OUT)
    if (case.deadline_left_s is not None and case.target_expected_s is not None
            and case.target_expected_s > case.deadline_left_s):
        return no(Refusal.DEADLINE, f"{case.deadline_left_s:.1f} s left, about "
                                    f"{case.target_expected_s:.1f} s needed")
    if case.deadline_left_s is not None and case.deadline_left_s <= 0:
        return no(Refusal.DEADLINE, "already past")
    # 6. once only
    if case.attempts >= 2:
        return no(Refusal.ALREADY_REPLAYED)
    if not case.target_available:
        return no(Refusal.NO_TARGET)
    return ReplayDecision(True, f"replay-safe after {case.verdict.kind}")


# Out-of-memory deaths: the memory a request's own prefill asks for may be what ran out.
_OOM = frozenset({FailureKind.RUNTIME_OOM, FailureKind.OOM_SURVIVED})


def own_size_suspect(kind: FailureKind, answer_started: bool) -> bool:
    """Whether the evidence may name the request's own size as the cause of an out-of-memory
    death: it was still in its prefill (the child had not begun its answer), which is where
    llama.cpp allocates for a prompt. Such a request does not wait for the GPU child to take
    the same memory again; it goes to the CPU child as before. A stream that was already
    generating, or a death that was not out of memory (a kill, a crash, a GPU reset), names
    no request's size."""
    return kind in _OOM and not answer_started


def unavailable(refusal: Refusal | None, safe_read: bool) -> bool:
    """Whether a request given up on is answered 503 (come back later) rather than 502: when
    no other child could take it, and when a read (rule 4) failed on both children, which
    leaves no child to answer it now either. A read's client is often a health check or a page
    polling `/health` and `/v1/models`: "unavailable, retry after" is what it can act on."""
    return refusal is Refusal.NO_TARGET or (safe_read and refusal is Refusal.ALREADY_REPLAYED)
