"""After an attempt failed: what comes next, decided in one place.

The proxy says what happened: the attempt failed before any byte reached the client
(`Failed`), or a followed stream failed after bytes (`Cut`). The failover finds the upstream
that takes over (the next in the config's order: `Pool.takeover`), asks the pure rule with the
pool's figures for it (policy/replay.py before any byte, policy/continuation.py after bytes),
takes a place on it, and answers one of:

- `Replay`: send the request again, on the lease's upstream (the second and last attempt);
- `GoOn`: continue the stream from the lease's upstream;
- `GiveUp`: the controlled error (why, the refusal, when to come back);
- `Close`: after bytes, the stream's token limit was reached before the death: the client has
  the whole answer, and the stream ends with the finish llama-server would have sent.

The proxy carries it out (the attempt, the continuation, the error's response) and records the
episode; nothing here touches HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..policy import continuation, replay
from ..policy.estimate import Work
from ..policy.media import Modality
from ..policy.routes import RouteClass
from ..vocabulary import AttemptFailure
from .pool import Lease, Pool


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


@dataclass(frozen=True)
class GoOn:
    lease: Lease
    reason: str


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
            return Replay(lease, decision.reason)
        if refused is not None:
            return refused
        decision = replay.decide(self._case(failed, None))
        return GiveUp(decision.reason, decision.refusal, pool.retry_after_s(name))

    def _case(self, failed: Failed, target: str | None) -> replay.ReplayCase:
        """The replay rule's question for a replay on `target` (None: nobody can take it)."""
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
            target_expected_s=None if target is None else pool.expected_seconds(
                target, failed.work),
            target_available=target is not None and pool.can_take_replay(target),
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
        return GoOn(lease, decision.reason)
