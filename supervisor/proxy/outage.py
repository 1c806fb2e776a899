"""What a child's failure does to a request being served, carried out on the client's one
response: the replay (its second attempt), a stream's continuation on the child that takes over
or its close as llama-server would end it, a stream moved back to the GPU child once it is
READY (fail-back), and the controlled error when nothing can take it. Every decision is made
elsewhere: who takes over, whether to wait for the GPU child, whether to move back
(serving/recovery.py and the failover and fail-back under it, on policy/'s rules); this module
carries them out and notes each step as an `Episode` for the request's incident. The handler
(proxy/handler.py) reads the request, leases and attempts, and hands each outcome here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from ..policy import continuation, replay
from ..policy import evidence as ev
from ..records.metrics import Metrics
from ..serving.pool import Lease
from ..serving.recovery import Close, GiveUp, GoOn, Recall, Recovery, safe_read
from ..vocabulary import Attempt, AttemptFailure
from . import closing, errors
from .continued import ContinuedStream
from .forward import Forwarder, RequestCtx, pinging
from .outcomes import Answered, AttemptResult, Broken, Interrupted, Recalled, ending

log = logging.getLogger("spillway.proxy")


@dataclass
class Episode:
    """What an outage did to the request, for its incident record."""

    failure: AttemptFailure
    # replayed | rerouted | rejected | passed_on | continued | finished | waited (replayed or
    # continued on the failed child itself, back from its restart)
    decision: str
    reason: str
    cpu_start_s: float = 0.0
    replay_child: str | None = None
    tokens_before: int = 0  # continued: the tokens the client had from the failed child
    continued_after_s: float | None = None  # continued: the death to the next token
    # The forecast the failover acted on (from its decision to the answer's end), and when
    # it decided: the incident has it beside what it took.
    forecast_s: float | None = None
    decided_at: float = dataclasses.field(default_factory=time.monotonic)


class Outage:
    """Carries out what the recovery coordinator decides for a request whose attempt failed,
    was cut mid-stream, or was recalled to the GPU child. `recovery_of` gives the request's
    pool's coordinator; `attempt` is the handler's one attempt on a lease (its headers, its
    lease closed with the outcome)."""

    def __init__(self, forwarder: Forwarder, metrics: Metrics,
                 recovery_of: Callable[[RequestCtx], Recovery],
                 attempt: Callable[[web.Request, RequestCtx, Lease], Awaitable[AttemptResult]]
                 ) -> None:
        self.forwarder = forwarder
        self.metrics = metrics
        self.recovery_of = recovery_of
        self.attempt = attempt

    async def after(self, request: web.Request, ctx: RequestCtx, result: AttemptResult,
                    back: tuple[Lease, Recall] | None,
                    episodes: list[Episode]) -> Answered | Broken:
        """The request's answer, given its attempt's outcome: as it is when whole (or broken
        beyond help), else what the failover, the continuation or the fail-back makes of it."""
        if isinstance(result, AttemptFailure):
            return await self.after_failure(request, ctx, result, episodes)
        if isinstance(result, Interrupted):
            return await self.after_interruption(ctx, result, episodes)
        if isinstance(result, Recalled):
            assert back is not None
            return await self.fail_back(ctx, result, back, episodes)
        return result

    def so_far(self, ctx: RequestCtx) -> continuation.Transcript:
        """What the client has of its followed stream: across a continuation, the two parts
        joined."""
        assert ctx.follow is not None
        if not ctx.continued or ctx.leg is None or ctx.continued_stream is None:
            return ctx.follow
        return continuation.joined(ctx.continued_stream.before, ctx.leg,
                                   ctx.continued_stream.text)

    def watch(self, ctx: RequestCtx, lease: Lease) -> None:
        """A stream the CPU child takes while the GPU child is down may move back to the GPU
        child once it is READY (fail-back): watched from here to its attempt's end (unlist)."""
        pool = lease.pool
        if lease.counted and ctx.follow is not None and \
                not pool.upstreams[pool.roles[0]].is_ready:
            ctx.recall = self.recovery_of(ctx).may_fail_back(ctx.req, lease.name, ctx.work,
                                                             lambda: self.so_far(ctx))

    def unlist(self, ctx: RequestCtx,
               result: AttemptResult | None) -> tuple[Lease, Recall] | None:
        """The stream's fail-back watch ends with its attempt: when it was recalled, its place
        on the GPU child is the request's now; else that place (if one was taken) goes back."""
        recall, ctx.recall = ctx.recall, None
        if recall is None:
            return None
        moved = (recall.take(), recall) if isinstance(result, Recalled) else None
        self.recovery_of(ctx).failback.leave(recall)
        return moved

    async def fail_back(self, ctx: RequestCtx, recalled: Recalled, back: tuple[Lease, Recall],
                        episodes: list[Episode]) -> Answered | Broken:
        """The CPU child's stream, stopped at a whole event, goes on from the GPU child, back
        and READY, in the client's one stream: the continuation in reverse."""
        lease, recall = back
        so_far = self.so_far(ctx)
        ctx.req = ctx.req.whole()
        assert ctx.req.payload is not None
        gpu, cpu = lease.name, ctx.attempts[-1].child
        # The incident belongs to the GPU child's outage: its death when this request saw it.
        failure = next((e.failure for e in episodes if e.failure.child == gpu), None) or \
            AttemptFailure(gpu, max(0, lease.upstream.generation - 1), ev.Verdict(
                ev.FailureKind.NONE, f"the {gpu} child was not ready when the stream began"))
        log.warning("rid=%s fail-back: the %s child's stream moves to the %s child after %d "
                    "tokens (%s)", ctx.req.request_id, cpu, gpu, so_far.tokens, recall.reason)
        note = {"from_child": cpu, "child": gpu, "kind": "failed_back",
                "tokens_before": so_far.tokens}
        body = json.dumps(continuation.continuation_body(ctx.req.payload, so_far)).encode()
        attempt = Attempt(gpu, len(ctx.attempts) + 1)
        ctx.attempts.append(attempt)
        ctx.failed_back = True
        episode = Episode(failure, "failed_back", recall.reason, 0.0, gpu,
                           tokens_before=so_far.tokens, forecast_s=recall.gpu_rest_s)
        episodes.append(episode)
        result: Answered | Broken | Recalled | None = None
        try:
            result = await self.forwarder.continue_stream(
                ctx, attempt, lease.upstream, Interrupted(recalled.response, failure,
                                                          recalled.anthropic),
                body, ContinuedStream(so_far, note))
        finally:
            lease.close(attempt, ending(result))
        if attempt.first_byte_s is not None:
            episode.continued_after_s = ctx.req.received + attempt.first_byte_s - recalled.at
        done = isinstance(result, Answered)
        self.metrics.failbacks.labels("completed" if done else "failed").inc()
        if done:
            self.metrics.failback_saved.inc(max(0.0, recall.cpu_rest_s - (
                time.monotonic() - recalled.at)))
        assert not isinstance(result, Recalled)  # (a stream on the GPU child is not recalled)
        return result

    async def after_failure(self, request: web.Request, ctx: RequestCtx,
                            failure: AttemptFailure,
                            episodes: list[Episode]) -> Answered | Broken:
        """Before any byte: the failover says replay (the second attempt) or give up (the
        controlled error)."""
        nxt = await self.recovery_of(ctx).after_failure(ctx.req, ctx.work, failure,
                                                       len(ctx.attempts), ctx.prompt_tokens)
        if isinstance(nxt, GiveUp):
            episodes.append(Episode(failure, "rejected", nxt.reason))
            return Answered(self._controlled_error(ctx, failure, nxt))
        other = nxt.lease.name
        decision = "rerouted" if nxt.smaller else "waited" if nxt.waited else "replayed"
        episodes.append(Episode(failure, decision, nxt.reason, nxt.lease.start_s, other,
                                 forecast_s=nxt.forecast_s))
        ctx.follow = None  # a replay is the second attempt: it is not continued in turn
        ctx.failover_kind = str(failure.verdict.kind)
        log.warning("rid=%s %s child failed (%s: %s); replaying on the %s child",
                    ctx.req.request_id, failure.child, failure.verdict.kind,
                    failure.verdict.evidence, other)
        second = await self.attempt(request, ctx, nxt.lease)
        if isinstance(second, AttemptFailure):
            # No third attempt: the client gets a controlled error naming both failures.
            refusal = replay.Refusal.ALREADY_REPLAYED
            episodes.append(Episode(second, "rejected", str(refusal)))
            return Answered(self._controlled_error(ctx, second, GiveUp(
                str(refusal), refusal, self.recovery_of(ctx).pool.retry_after_s(second.child))))
        if isinstance(second, Interrupted):  # (not followed, so not expected)
            return await self.forwarder.end_broken(ctx, second.response, second.failure,
                                                   second.anthropic)
        assert not isinstance(second, Recalled)  # (a replay is not followed: never recalled)
        return second

    async def after_interruption(self, ctx: RequestCtx, cut: Interrupted,
                                 episodes: list[Episode]) -> Answered | Broken:
        """A followed stream's upstream failed after bytes: the failover says go on from the
        upstream that takes over (policy/continuation.py), or the stream ends with the error
        event."""
        failure, so_far = cut.failure, ctx.follow
        ctx.req = ctx.req.whole()  # (a held body's JSON, let go, is read again)
        assert so_far is not None and ctx.req.payload is not None
        # (A client that asked for pings hears them while the other child is found.)
        nxt = await pinging(cut.response, self.forwarder.ping_interval(ctx, failure.child),
                            self.recovery_of(ctx).after_cut(ctx.req, ctx.work, so_far,
                                                          ctx.continued, failure))
        if isinstance(nxt, Close):
            return await self._close(ctx, cut, nxt.reason, episodes)
        if isinstance(nxt, GiveUp):
            self.metrics.continuations.labels("refused").inc()
            episodes.append(Episode(failure, "passed_on", f"the stream had started; not "
                                                           f"continued: {nxt.reason}"))
            return await self.forwarder.end_broken(ctx, cut.response, failure, cut.anthropic,
                                                   f"; not continued: {nxt.reason}")
        return await self._continue(ctx, cut, nxt, episodes)

    async def _continue(self, ctx: RequestCtx, cut: Interrupted, nxt: GoOn,
                        episodes: list[Episode]) -> Answered | Broken:
        """The stream goes on from the lease's upstream, in the client's one stream."""
        failure, so_far, lease = cut.failure, ctx.follow, nxt.lease
        assert so_far is not None and ctx.req.payload is not None
        other = lease.name
        kind = str(failure.verdict.kind)
        ctx.failover_kind = kind
        log.warning("rid=%s %s child failed mid-stream (%s: %s) after %d tokens; continuing "
                    "on the %s child", ctx.req.request_id, failure.child, kind,
                    failure.verdict.evidence, so_far.tokens, other)
        # Told in the final event's `spillway_continuation`, the incident, the access log and
        # the metrics: never in a line of its own, which llama-server would not send.
        note = {"from_child": failure.child, "child": other, "kind": kind,
                "tokens_before": so_far.tokens}
        body = json.dumps(continuation.continuation_body(ctx.req.payload, so_far)).encode()
        attempt = Attempt(other, len(ctx.attempts) + 1)
        ctx.attempts.append(attempt)
        episode = Episode(failure, "waited" if nxt.waited else "continued", nxt.reason,
                           lease.start_s, other, tokens_before=so_far.tokens,
                           forecast_s=nxt.forecast_s)
        episodes.append(episode)
        # On the CPU child, the rest may move back to the GPU child once it is READY.
        ctx.recall = self.recovery_of(ctx).may_fail_back(ctx.req, other, ctx.work,
                                                       lambda: self.so_far(ctx))
        result: Answered | Broken | Recalled | None = None
        try:
            result = await self.forwarder.continue_stream(
                ctx, attempt, lease.upstream, cut, body, ContinuedStream(so_far, note))
        finally:
            lease.close(attempt, ending(result))
            back = self.unlist(ctx, result)
        if attempt.first_byte_s is not None:
            # From the death to the continuation's first token: the continuation's price.
            episode.continued_after_s = ctx.req.received + attempt.first_byte_s - cut.at
        if isinstance(result, Recalled):
            assert back is not None
            result = await self.fail_back(ctx, result, back, episodes)
        self.metrics.continuations.labels(
            "completed" if isinstance(result, Answered) else "failed").inc()
        return result

    async def _close(self, ctx: RequestCtx, cut: Interrupted, reason: str,
                     episodes: list[Episode]) -> Answered | Broken:
        """The token limit was reached, or the finish relayed, before the child died: the client
        has the whole answer, and gets the end llama-server would have sent (proxy/closing.py),
        into the resumable stream's buffer too (the response is its tee)."""
        failure, so_far = cut.failure, ctx.follow
        assert so_far is not None and ctx.req.payload is not None
        where = (f"after its finish ({so_far.tokens} tokens" if so_far.finished
                 else f"after the last of {so_far.tokens} tokens")
        log.warning("rid=%s %s child failed mid-stream (%s: %s) %s, by %s%s; closing the "
                    "stream as llama-server would", ctx.req.request_id, failure.child,
                    failure.verdict.kind, failure.verdict.evidence, where, so_far.count_basis,
                    ")" if so_far.finished else "")
        episodes.append(Episode(failure, "finished", reason, tokens_before=so_far.tokens))
        note = {"from_child": failure.child, "kind": str(failure.verdict.kind),
                "tokens": so_far.tokens, "reason": "finished" if so_far.finished else "length"}
        events = closing.rest_events if so_far.finished else closing.closing_events
        return await self.forwarder.end_closed(cut.response, events(so_far, ctx.req.payload, note))

    def _controlled_error(self, ctx: RequestCtx, failure: AttemptFailure,
                          gave_up: GiveUp) -> web.Response:
        v = failure.verdict
        back = gave_up.retry_after_s
        model = ctx.req.model
        what = f"the {failure.child} child failed ({v.kind}: {v.evidence})" if model is None \
            else f"model {model} on the {failure.child} child failed ({v.kind}: {v.evidence})"
        if failure.timed_out:
            return errors.json_error(
                504, "upstream_error", f"{what}; not replayed: {gave_up.reason}",
                ctx.req.request_id, kind=str(v.kind), headers={"x-should-retry": "false"})
        if replay.unavailable(gave_up.refusal, safe_read(ctx.req)):
            # Capacity is the cause: a 503 that says when to come back.
            return errors.unavailable(f"{what}, and no other child can take the request now; "
                                      "retry later", ctx.req.request_id, retry_after_s=back,
                                      queue_position=0, kind=str(v.kind))
        return errors.upstream_error(f"{what}; not replayed: {gave_up.reason}",
                                     ctx.req.request_id, kind=str(v.kind), retry_after_s=back)
