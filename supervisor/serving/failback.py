"""Fail-back: a stream the CPU child answers because the GPU child was down moves back to the
GPU child once it is READY, when the rest is expected to end clearly sooner there.

The proxy enlists each such stream (`FailBack.enlist`: one that came in during the outage, or
one continued on the CPU child after a GPU death) with what it needs to be judged: its request,
what the client has of it so far, its deadline. When the GPU child becomes READY, or has room
again while streams are enlisted, each is judged by the pure rule (policy/continuation.
fail_back: the continuation's rules, at most once, FAIL_BACK_MARGIN) with the pool's forecasts:
the rest on the CPU child (its generation alone: its prefill is done) against the rest on the
GPU child (its prefill of the prompt and of everything relayed, its cache cold after the
restart, then the rest). The most time saved goes first, while the GPU child has room. A place
on the GPU child is taken before the stream is cut (`Recall.lease`), so a stream is never cut
for a place it then does not get; the relay stops at the next whole event it has relayed, and
the proxy continues the answer on that place. A stream that ends first gives the place back.

Non-streamed requests are not moved: nothing says how far the CPU child has come with one (no
byte is relayed before its end), so cancelling it would throw away work of unknown size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..policy import continuation
from ..policy.estimate import Work
from .pool import Lease, Pool

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Recall:
    """One stream on the CPU child that may move back to the GPU child."""

    payload: dict[str, Any]
    so_far: Callable[[], continuation.Transcript]  # what the client has of it, now
    work: Work  # the request's (its prompt's tokens; max_tokens when it sets no limit)
    deadline_left_s: Callable[[], float | None]
    target_prefills: bool = True  # the GPU child runs without --no-prefill-assistant
    # Set once it is chosen: the place on the GPU child, and the figures it was chosen by.
    lease: Lease | None = None
    reason: str = ""
    gpu_rest_s: float = 0.0
    cpu_rest_s: float = 0.0
    taken: bool = field(default=False)  # the proxy moved it (the lease is its, from then on)
    told: bool = field(default=False)  # why it stays was logged

    @property
    def due(self) -> bool:
        """Whether the relay should stop at this event boundary: chosen, and not at its end
        (a finish just relayed: the CPU child sends the rest in moments)."""
        return self.lease is not None and not self.so_far().finished

    def take(self) -> Lease:
        assert self.lease is not None
        self.taken = True
        return self.lease

    def release(self) -> None:
        """The stream ended on the CPU child after all: the GPU child's place goes back."""
        if self.lease is not None and not self.taken:
            self.lease.close(None, None)
            self.lease = None


class FailBack:
    """The streams of one pool that may move back to its first upstream (the GPU child)."""

    def __init__(self, pool: Pool, enabled: Callable[[], bool]) -> None:
        self.pool = pool
        self.enabled = enabled  # failover.fail_back, read at each decision (a reload)
        self._enlisted: list[Recall] = []
        self._judging: asyncio.Task[None] | None = None
        pool.on_room.append(self._room)

    @property
    def gpu(self) -> str:
        return self.pool.roles[0]

    def enlist(self, recall: Recall) -> Recall:
        self._enlisted.append(recall)
        self._room(self.gpu)  # (the GPU child may be back already)
        return recall

    def leave(self, recall: Recall) -> None:
        with contextlib.suppress(ValueError):
            self._enlisted.remove(recall)
        recall.release()

    def _room(self, name: str) -> None:
        """The pool's word that `name` is READY or has room again."""
        if name != self.gpu or not self._enlisted or not self.enabled() or \
                not self.pool.upstreams[name].is_ready:
            return
        if self._judging is None or self._judging.done():
            self._judging = asyncio.get_running_loop().create_task(self._judge())

    async def _judge(self) -> None:
        pool, gpu = self.pool, self.gpu
        upstream = pool.upstreams[gpu]
        ranked = []
        for recall in self._enlisted:
            if recall.lease is not None:
                continue
            chosen = self._figures(recall)
            if chosen is not None:
                ranked.append((chosen[1] - chosen[0], chosen, recall))
        ranked.sort(key=lambda item: -item[0])
        for _, (gpu_s, cpu_s, reason), recall in ranked:
            if not upstream.is_ready or pool.busy(gpu) >= pool.cap(gpu):
                return
            lease = await pool.replay_lease(gpu, 0.5)
            if lease is None:
                return
            if recall not in self._enlisted or recall.so_far().finished:
                lease.close(None, None)  # (it ended while the place was taken)
                continue
            recall.lease, recall.reason = lease, reason
            recall.gpu_rest_s, recall.cpu_rest_s = gpu_s, cpu_s
            log.info("fail-back: %s", reason)

    def _figures(self, recall: Recall) -> tuple[float, float, str] | None:
        """(the rest on the GPU child, on the CPU child, why) when the rule moves it."""
        pool, gpu = self.pool, self.gpu
        so_far = recall.so_far()
        left = continuation.tokens_left(recall.payload, so_far)
        rest = left if left is not None else max(1, recall.work.max_tokens - so_far.tokens)
        cpu = pool.roles[-1]
        cpu_s = pool.expected_seconds(cpu, Work(1, rest))
        gpu_s = pool.expected_seconds(gpu, Work(recall.work.prompt_tokens + so_far.tokens,
                                                rest, recall.work.media))
        decision = continuation.fail_back(recall.payload, so_far, False,
                                          recall.deadline_left_s(), gpu_s, cpu_s,
                                          recall.target_prefills)
        if not decision.allowed or gpu_s is None or cpu_s is None:
            if not recall.told:  # (once a stream: it is judged again at each room)
                recall.told = True
                log.info("fail-back not chosen after %d tokens (%d prompt tokens, %d left): %s",
                         so_far.tokens, recall.work.prompt_tokens, rest, decision.reason)
            return None
        return gpu_s, cpu_s, decision.reason
