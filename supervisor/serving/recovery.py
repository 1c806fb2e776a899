"""The recovery coordinator: every decision an outage asks for, made in one place, from the
request as received (vocabulary.Received, frozen) and the pure rules in policy/.

- Where a request goes, and whether it waits: its admission request and its `Work` (the
  counted prompt, its media, its earlier turns' keys), asked of the pool (policy/admission.py:
  branch 5w waits for the GPU child when that is the earliest expected finish).
- Where a replay goes, or why none (before any byte: serving/failover.py with
  policy/replay.py).
- Where a cut stream goes on, or why not (after bytes: policy/continuation.py).
- What is mirrored to the warm CPU child, and kept to warm the GPU child again after its
  restart (serving/mirror.py with policy/mirror.py).
- Which streams the CPU child answers move back to the GPU child once it is READY
  (serving/failback.py with policy/continuation.fail_back).

The HTTP handler (proxy/handler.py) carries bytes and asks; it writes the request's progress
(its attempts, what the client received) and its records, never a decision of these.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..policy import admission, continuation, estimate, prompts, routes
from ..policy import mirror as mirror_rules
from ..policy.estimate import Work
from ..vocabulary import Attempt, AttemptFailure, Received
from .failback import FailBack, Recall
from .failover import Close, Cut, Failed, Failover, GiveUp, GoOn, Replay
from .mirror import Mirror
from .pool import Lease, Pool

__all__ = ["Close", "GiveUp", "GoOn", "Recall", "Recovery", "RecoverySettings", "Replay"]


class Settings(Protocol):
    """What the config says of recovery, read at each decision (the proxy's settings, which a
    reload updates in place)."""

    replay: bool  # failover.replay
    max_replay_body_bytes: int  # failover.max_replay_body_mib
    # Upstreams started with --no-prefill-assistant: no stream is continued there, and a
    # mirror there holds the prompt alone.
    no_prefill: frozenset[str]
    fail_back: bool  # failover.fail_back


@dataclass
class RecoverySettings:
    """Settings of its own, for a coordinator outside the proxy (the tests)."""

    replay: bool = True
    max_replay_body_bytes: int = 16 << 20
    no_prefill: frozenset[str] = frozenset()
    fail_back: bool = True


class Recovery:
    """The decisions for the requests of one pool (router mode: one model's)."""

    def __init__(self, pool: Pool, settings: Settings, mirror: Mirror | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.settings = settings
        self.mirror = mirror
        self.clock = clock
        self.failback = FailBack(pool, lambda: self.settings.fail_back)

    # --- where a request goes -----------------------------------------------------------------

    def deadline_left(self, req: Received) -> float | None:
        deadline = req.own.deadline_s
        return None if deadline is None else deadline - (self.clock() - req.received)

    def work(self, req: Received, prompt_tokens: int = 0, counted: bool = False) -> Work:
        """What the request asks of a child, for its expected time: the counted prompt, else
        a bound from the bytes of its text (its media's base64 is no text). Read from its
        JSON: asked before a held body's is let go (its count then replaces the bound)."""
        text_bytes = max(0, len(req.body) - req.media.inline_bytes)
        return Work(prompt_tokens if counted else estimate.prompt_tokens_bound(text_bytes),
                    estimate.requested_tokens(req.payload), req.media, self._prefix_keys(req))

    async def admit(self, req: Received, work: Work, prompt_tokens: int,
                    exact: bool) -> Lease | admission.Decision:
        """A place for a generation request (branches 3 to 7), or why not."""
        return await self.pool.lease(admission.Request(
            route=req.route, prompt_tokens=prompt_tokens, cpu_allowed=req.own.replay,
            deadline_s=self.deadline_left(req), exact_count=exact, smaller_ok=req.smaller_ok,
            media=req.media.modalities), work)

    def _prefix_keys(self, req: Received) -> tuple[str, ...]:
        """A chat request's earlier turns, as the mirrors are keyed: looked up only while a
        child holds some."""
        if self.mirror is None or not self.mirror.holding or req.payload is None or \
                req.path not in prompts.CHAT_ROUTES:
            return ()
        return mirror_rules.lookup_keys(req.payload)

    # --- after a failure ----------------------------------------------------------------------

    async def after_failure(self, req: Received, work: Work, failure: AttemptFailure,
                            attempts: int, prompt_tokens: int) -> Replay | GiveUp:
        """Before any byte reached the client: a replay on the upstream that takes over, or
        the controlled error's reason."""
        return await Failover(self.pool).after_failure(Failed(
            failure=failure, route=req.route,
            body_replayable=(self.settings.replay and req.is_json
                             and len(req.body) <= self.settings.max_replay_body_bytes),
            opted_out=not req.own.replay, attempts=attempts,
            deadline_left_s=self.deadline_left(req), work=work, smaller_ok=req.smaller_ok,
            prompt_tokens=prompt_tokens, safe_read=safe_read(req),
            media=req.media.modalities))

    async def after_cut(self, req: Received, work: Work, so_far: continuation.Transcript,
                        continued_before: bool,
                        failure: AttemptFailure) -> GoOn | Close | GiveUp:
        """After bytes: the stream goes on from the upstream that takes over (its prompt is
        the request's and the text the client has), closes at its limit, or ends."""
        assert req.payload is not None
        return await Failover(self.pool).after_cut(Cut(
            failure=failure, payload=req.payload, so_far=so_far,
            continued_before=continued_before, deadline_left_s=self.deadline_left(req),
            work=Work(work.prompt_tokens + so_far.tokens, work.max_tokens, work.media,
                      work.prefix_keys),
            no_prefill=self.settings.no_prefill, media=req.media.modalities))

    # --- back to the GPU child ----------------------------------------------------------------

    def may_fail_back(self, req: Received, child: str, work: Work,
                      so_far: Callable[[], continuation.Transcript]) -> Recall | None:
        """Enlists a stream about to be answered by `child` that may move back to the GPU
        child once it is READY: one on the CPU child (the last upstream) while fail-back is
        on; `so_far` says what the client has of it. None for any other (nor a held body,
        its JSON let go: the judge reads the request). The proxy `leave`s it when it ends."""
        pool = self.pool
        if not self.settings.fail_back or child != pool.roles[-1] or \
                child == pool.roles[0] or req.payload is None:
            return None
        return self.failback.enlist(Recall(
            req.payload, so_far, work, lambda: self.deadline_left(req),
            target_prefills=pool.roles[0] not in self.settings.no_prefill))

    # --- after an answer ----------------------------------------------------------------------

    def served(self, req: Received, attempts: list[Attempt], status: int, continued: bool,
               streamed_text: str | None, prompt_tokens: int) -> None:
        """A request ended: real work just ran (a mirror waits for the next idle spell), and a
        chat conversation answered whole is offered to the mirror's lanes: the warm CPU child
        takes what the first upstream (the GPU child) answered alone, on its first attempt;
        the rewarm, what any upstream answered, replays and continuations too
        (policy/mirror.offered)."""
        if self.mirror is None:
            return
        self.mirror.busy()
        last = attempts[-1] if attempts else None
        if last is None:
            return
        answer = last.answer_text if last.answer_text is not None else streamed_text
        self.mirror.offer(mirror_rules.Ended(
            status=status, chat=req.is_json and req.path in prompts.CHAT_ROUTES,
            media=bool(req.media), continued=continued, attempts=len(attempts),
            child=last.child, first_child=last.child == self.pool.roles[0],
            opted_out=not req.own.replay), req.body, answer, prompt_tokens,
            self.settings.no_prefill)


def safe_read(req: Received) -> bool:
    """A request that changes nothing (policy/routes.read_only; policy/replay.py's rule 4)."""
    return routes.read_only(req.method, req.path, req.path_qs.partition("?")[2], bool(req.body))
