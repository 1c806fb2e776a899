"""After an attempt failed: what comes next, decided in one place.

The proxy says what happened: the attempt failed before any byte reached the client
(`Failed`), or a followed stream failed after bytes (`Cut`). The failover finds the upstream
that takes over (the next in the config's order: `Pool.takeover`), asks the pure rule with the
pool's figures for it (policy/replay.py before any byte, policy/continuation.py after bytes),
takes a place on it, and answers one of:

- `Replay`: send the request again, on the lease's upstream (the second and last attempt);
- `GoOn`: continue the stream from the lease's upstream;

either on the upstream that takes over now, or, after a death of the first upstream (the GPU
child), on that same upstream once it is back, when waiting for it is the earliest expected
finish (policy/admission.sooner_on_return, the rule new requests wait by: `waited`). A request
whose own prefill may have been what ran out of memory never waits to take that memory again
(policy/replay.own_size_suspect).
- `GiveUp`: the controlled error (why, the refusal, when to come back);
- `Close`: after bytes, the stream's token limit was reached before the death: the client has
  the whole answer, and the stream ends with the finish llama-server would have sent.

The proxy carries it out (the attempt, the continuation, the error's response) and records the
episode; nothing here touches HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from ..policy import admission, continuation, replay
from ..policy.estimate import Work
from ..policy.media import Modality
from ..policy.routes import RouteClass
from ..vocabulary import AttemptFailure
from .pool import Lease, Pool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failed:
    """An attempt that failed before any byte reached the client, and what the proxy knows of
    its request."""

    failure: AttemptFailure
    route: RouteClass
    body_replayable: bool  # read whole, under the replay size limit, parsed (rule 1)
    opted_out: bool  # X-Spillway-Replay: never
    attempts: int  # attempts made so far
    deadline_left_s: float | None
    work: Work  # what the request asks (the other upstream's expected time)
    smaller_ok: bool = False  # it accepts a smaller model's answer (X-Spillway-Fallback)
    prompt_tokens: int = 0  # as admission counted it (or its bound): does it fit a slot there
    safe_read: bool = False  # it only reads (policy/routes.read_only; replay rule 4)
    media: frozenset[Modality] = frozenset()  # its images, audio, video (policy/media.py)


@dataclass(frozen=True)
class Cut:
    """A followed stream whose upstream failed after bytes reached the client."""

    failure: AttemptFailure
    payload: dict[str, Any]
    so_far: continuation.Transcript
    continued_before: bool
    deadline_left_s: float | None
    work: Work  # what the request asks for (max_tokens: when its kind has no token limit)
    no_prefill: frozenset[str]  # upstreams run with --no-prefill-assistant
    media: frozenset[Modality] = frozenset()  # its images, audio, video (policy/media.py)


@dataclass(frozen=True)
class Replay:
    lease: Lease
    reason: str
    smaller: bool = False  # on an upstream serving a smaller model: rerouted, not replayed
    waited: bool = False  # on the failed upstream itself, back from its restart
    forecast_s: float | None = None  # from the decision to the answer's end, as expected


@dataclass(frozen=True)
class GoOn:
    lease: Lease
    reason: str
    waited: bool = False  # on the failed upstream itself, back from its restart
    forecast_s: float | None = None  # from the decision to the stream's end, as expected


@dataclass(frozen=True)
class Close:
    reason: str


@dataclass(frozen=True)
class GiveUp:
    reason: str
    refusal: replay.Refusal | None  # why, before any byte (None after bytes)
    retry_after_s: float  # when the failed upstream may serve again


class Failover:
    """What comes after a failure on one of `pool`'s upstreams."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def after_failure(self, failed: Failed) -> Replay | GiveUp:
        """A replay on the upstream that takes over, when the replay rule allows and it can
        take a place within the client's deadline; else why not."""
        pool, name = self.pool, failed.failure.child
        began = time.monotonic()
        back = self._sooner_back(name, failed.work, failed.deadline_left_s,
                                 failed.failure.stream_started, failed.failure.verdict.kind)
        if back is not None and replay.decide(self._case(failed, name, back.gpu_s)).replay:
            lease = await self._lease_back(name, back)
            if lease is not None:
                return Replay(lease, f"replay-safe after {failed.failure.verdict.kind}: "
                                     f"{back.reason}", waited=True, forecast_s=back.gpu_s)
            if failed.deadline_left_s is not None:  # (the wait took some of the client's time)
                failed = dataclasses.replace(failed, deadline_left_s=failed.deadline_left_s - (
                    time.monotonic() - began))
        # In order, those that can take it: a request that accepts a smaller model goes to the
        # small child when it can (GPU speed, if the prompt fits a slot there), else to the CPU
        # child as any other; and to the CPU child when the small child, starting on demand,
        # is stopped before it is ready (it makes way for the GPU child).
        candidates = [c for c in pool.takeovers(name, failed.smaller_ok)
                      if c not in pool.smaller or pool.fits(c, failed.prompt_tokens)]
        if failed.media and pool.takes(name, failed.media):
            # Its images or audio go only to an upstream whose projector takes them: one
            # without would answer its 500 for them.
            candidates = [c for c in candidates if pool.takes(c, failed.media)]
            if not candidates:
                no = replay.Refusal.NO_TARGET
                return GiveUp(f"{no}: no other child's projector takes its "
                              f"{' and '.join(sorted(failed.media))}", no,
                              pool.retry_after_s(name))
        able = [c for c in candidates if pool.can_take_replay(c)] or candidates[:1]
        refused: GiveUp | None = None
        for target in able:
            decision = replay.decide(self._case(failed, target))
            if not decision.replay:
                refused = refused or GiveUp(decision.reason, decision.refusal,
                                            pool.retry_after_s(name))
                continue
            lease = await pool.replay_lease(target, failed.deadline_left_s)
            if lease is None:
                no = replay.Refusal.NO_TARGET
                refused = GiveUp(f"{no}: the {target} child did not become ready in time", no,
                                 pool.retry_after_s(name))
                continue
            if target in pool.smaller:
                return Replay(lease, f"rerouted to the smaller model on the {target} child "
                                     f"(the request accepts one): {decision.reason}",
                              smaller=True)
            return Replay(lease, decision.reason,
                          forecast_s=pool.expected_seconds(target, failed.work))
        if refused is not None:
            return refused
        decision = replay.decide(self._case(failed, None))
        return GiveUp(decision.reason, decision.refusal, pool.retry_after_s(name))

    def _case(self, failed: Failed, target: str | None,
              expected_s: float | None = None) -> replay.ReplayCase:
        """The replay rule's question for a replay on `target` (None: nobody can take it);
        `expected_s` when its time is more than the target's own (a wait for it first)."""
        pool = self.pool
        return replay.ReplayCase(
            verdict=failed.failure.verdict,
            route=failed.route,
            body_replayable=failed.body_replayable,
            bytes_sent=False,  # a failure before any byte (after bytes, the stream is cut)
            timed_out=failed.failure.timed_out,
            opted_out=failed.opted_out,
            attempts=failed.attempts,
            deadline_left_s=failed.deadline_left_s,
            target_expected_s=None if target is None else expected_s or pool.expected_seconds(
                target, failed.work),
            target_available=target is not None and (
                expected_s is not None or pool.can_take_replay(target)),
            safe_read=failed.safe_read,
        )

    async def after_cut(self, cut: Cut) -> GoOn | Close | GiveUp:
        """The stream goes on from the upstream that takes over, when the continuation rule
        allows and it can take a place in time; else why not (the stream ends with its error
        event)."""
        pool, name = self.pool, cut.failure.child
        target = pool.takeover(name, after_bytes=True)  # never onto, or from, another model
        left = continuation.tokens_left(cut.payload, cut.so_far)  # (what the continuation asks)
        remaining = left if left is not None else cut.work.max_tokens
        decision = continuation.decide(
            cut.payload, cut.so_far, cut.continued_before, cut.deadline_left_s,
            target_expected_s=(pool.expected_seconds(target, cut.work.with_max_tokens(remaining))
                               if target is not None else None) or 0.0,
            target_available=target is not None and pool.can_take_replay(target),
            target_prefills=target not in cut.no_prefill)
        if decision.closing:  # (whichever child might have gone on: none is needed)
            return Close(decision.reason)
        if (waited := await self._continue_back(cut, decision, remaining)) is not None:
            return waited
        if target is not None and cut.media and pool.takes(name, cut.media) and \
                not pool.takes(target, cut.media):
            return GiveUp(f"the {target} child's projector does not take its "
                          f"{' and '.join(sorted(cut.media))}", None, pool.retry_after_s(name))
        if target is None and name in pool.smaller:
            return GiveUp("a stream from the smaller model is not continued on another model",
                          None, pool.retry_after_s(name))
        if not decision.allowed or target is None:
            return GiveUp(decision.reason, None, pool.retry_after_s(name))
        lease = await pool.replay_lease(target, cut.deadline_left_s)
        if lease is None:
            return GiveUp(f"the {target} child did not become ready in time", None,
                          pool.retry_after_s(name))
        return GoOn(lease, decision.reason, forecast_s=pool.expected_seconds(
            target, cut.work.with_max_tokens(remaining)))

    async def _continue_back(self, cut: Cut, decision: continuation.Decision,
                             remaining: int) -> GoOn | None:
        """The stream goes on from the failed upstream itself once it is back, when that is
        the earliest expected finish for the rest (as a replay's `_sooner_back`), the
        continuation rule allowing it there; None otherwise."""
        name = cut.failure.child
        if not decision.allowed and decision.refusal is not continuation.Refusal.NO_TARGET:
            return None  # (none now, but the failed upstream itself may be back soon)
        work = cut.work.with_max_tokens(remaining)
        back = self._sooner_back(name, work, cut.deadline_left_s, True, cut.failure.verdict.kind)
        if back is None or not continuation.decide(
                cut.payload, cut.so_far, cut.continued_before, cut.deadline_left_s,
                target_expected_s=back.gpu_s, target_available=True,
                target_prefills=name not in cut.no_prefill).allowed:
            return None
        lease = await self._lease_back(name, back)
        if lease is None:
            return None
        return GoOn(lease, f"{decision.reason}: {back.reason}", waited=True,
                    forecast_s=back.gpu_s)

    def _sooner_back(self, name: str, work: Work, deadline_left_s: float | None,
                     answer_started: bool, kind: Any) -> _Back | None:
        """Whether the request caught by the death of `name`, the first upstream (the GPU
        child), is expected to finish sooner on it once it is back than on the upstream that
        takes over now; None when not, or when waiting is off (failover.wait_for_gpu = false),
        or when its own prefill may have been what ran out of memory."""
        pool = self.pool
        if name != pool.roles[0] or not pool.wait_for_gpu or \
                replay.own_size_suspect(kind, answer_started):
            return None
        cap = pool.capacity(0, work)
        other = pool.takeover(name, after_bytes=True)  # (the same model's: never the small)
        if other is None:
            return None
        view = cap.child(other)
        cpu_s = None  # (it cannot take it now: any return in time is sooner)
        if pool.can_take_replay(other):
            if view.expected_s is None:
                return None  # its time not known yet: nothing says waiting is sooner (as 5w)
            cpu_s = view.expected_s
        back = admission.sooner_on_return(cap, deadline_left_s, cpu_s)
        return None if back is None else _Back(back.gpu_s, back.wait_limit_s,
                                                back.describe(cap))

    async def _lease_back(self, name: str, back: _Back) -> Lease | None:
        """A place on `name` once it is READY again, ahead of the line; None when it is not
        back within the wait's limit (the upstream that takes over then has it)."""
        lease = await self.pool.replay_lease(name, back.wait_limit_s, returning=True)
        if lease is None:
            log.warning("the %s child was not back within %.0f s as forecast; the request "
                        "goes to the upstream that takes over", name, back.wait_limit_s)
        return lease


@dataclass(frozen=True)
class _Back:
    """A wait for the failed upstream's return, chosen as the earliest expected finish."""

    gpu_s: float
    wait_limit_s: float
    reason: str
