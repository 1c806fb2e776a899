"""The mirror, carried out: conversations one child served are sent to another in its idle time
(policy/mirror.py says which, and the body), so that its next turn there finds its prefix in
that child's cache. One lane a direction:

- `mirror`, the warm CPU child: what the GPU child answered is sent to the CPU child as it
  comes, so that a conversation that fails over finds its prefix there;
- `rewarm`, the warm GPU child after its restart: the lane keeps what the GPU child holds (its
  own answers, and what the lane sent it) and queues what another child answered (the CPU
  child's answers during an outage); when the GPU child starts again its cache is empty, so
  what it held is queued too, and sent, newest first, once it is READY and every child idle,
  where the GPU child's own measured speed says it pays (policy/mirror.pays).

Real work always goes first. A mirror starts only when no upstream has had a request in flight
for `idle_s` (on a box whose GPU child runs on the CPU too, a mirror would slow it); while it
runs, the first request admitted anywhere cancels it: the mirror's stream is closed, and
llama-server drops the task within one batch. The child's time spent mirroring is held to a
share of a sliding minute. A mirror is not a lease: admission never waits for one.

A lane's offers wait in a queue bounded in entries and in bytes, together with those it keeps
(`cpu.mirror_max_queued_mib` for the CPU child's; past a bound the oldest go: policy/mirror.admit
says why), each the request's body as it came, and the status's caches show them
(`mirror_queue`, `rewarm_queue`), with the prefixes the child is known to hold (`mirror_warm`,
`rewarm_warm`).

What a lane's child then holds is kept (the mirrored prefixes and their tokens, the newest 64),
forgotten when it restarts, and read by the expected time of a request whose earlier turns were
mirrored (serving/resources.py), the status (`mirror`, `rewarm`), and the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from ..policy import mirror as rules
from ..policy.lifecycle import ChildState
from ..records.caches import figures
from ..vocabulary import Upstream

log = logging.getLogger("spillway.mirror")
WARM_KEPT = 64  # prefixes remembered as held by the child (its host cache decides, really)
POLL_S = 0.02  # how often a running mirror looks for real work (well within one batch)
COVERED_KEPT = WARM_KEPT * (rules.KEYS_BACK + 1)  # the prefixes those hold, each with its turns


@dataclass(frozen=True)
class MirrorSettings:
    enabled: bool = True
    share: float = rules.DEFAULT_SHARE  # of a sliding minute of the child's time
    idle_s: float = 1.0  # every upstream idle this long before a mirror starts
    max_queued: int = rules.DEFAULT_MAX_QUEUED
    max_queued_bytes: int = rules.DEFAULT_MAX_QUEUED_BYTES
    max_prompt_tokens: int = rules.DEFAULT_MAX_PROMPT_TOKENS
    # A conversation whose prefill on the child is forecast under this is not sent (0: all).
    min_saved_s: float = 0.0

    @functools.cached_property
    def bounds(self) -> rules.Bounds:
        return rules.Bounds(self.max_queued, self.max_queued_bytes, self.max_prompt_tokens)


class Lane:
    """One direction of the mirror: conversations sent to `target` in its idle time.

    `any_child`: it takes what any child answered (policy/mirror.offered), else what the first
    child answered alone. `keeps`: what the target answered itself, and what was sent to it, is
    kept while the target holds it, and queued again when the target starts again."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession], target: Upstream,
                 upstreams: Sequence[Upstream], settings: MirrorSettings,
                 clock: Callable[[], float] = time.monotonic, *, name: str = rules.MIRROR,
                 any_child: bool = False, keeps: bool = False) -> None:
        self._session = session
        self.target = target
        self.upstreams = list(upstreams)
        self.settings = settings
        self.clock = clock
        self.name = name
        self.any_child = any_child
        self.keeps = keeps
        self.queue: deque[rules.Offer] = deque()  # to send, oldest first
        self.kept: deque[rules.Offer] = deque()  # held by the target now, oldest first
        self.queued_bytes = 0  # of both
        self.warm: OrderedDict[str, int] = OrderedDict()  # prefix key -> tokens held
        # Prefixes the mirrors sent cover (policy/mirror.covers), the newest.
        self.covered: OrderedDict[str, None] = OrderedDict()
        self.budget = rules.Budget()
        self.counts = {"mirrored": 0, "cancelled": 0, "failed": 0, "skipped": 0}
        self.tokens_mirrored = 0
        self._wake = asyncio.Event()
        self._last_busy = clock()
        self.running: rules.Offer | None = None
        # Told each mirror's timings: the child's prefill speed, measured while it was idle.
        self.on_timings: Callable[[Mapping[str, Any]], None] = lambda timings: None
        # The child's prefill of so many tokens, forecast from its own timings (None: unknown).
        self.prefill_s: Callable[[int], float | None] = lambda tokens: None
        # Whether requests wait in line (for a child coming back): real work, not yet in
        # flight anywhere (wired by the daemon: the pool's line).
        self.waiting: Callable[[], bool] = lambda: False
        target.listeners.append(self._target_changed)

    # --- what the proxy tells it, and asks it ------------------------------------------------

    def offer(self, body: bytes, answer: str | None, prompt_tokens: int,
              prefills: bool = True, held: bool = False) -> None:
        """A chat request answered whole (its body as received): its conversation may be
        mirrored; `held`: the target answered it itself (kept, when the lane keeps, until the
        target starts again)."""
        if not self.settings.enabled or (held and not self.keeps):
            return
        offer = rules.Offer(body, answer, prefills, prompt_tokens, self.clock())
        dropped = rules.admit(self._held(), offer, self.settings.bounds)
        if dropped is None:
            self.counts["skipped"] += 1
            return
        self._drop_oldest(dropped)
        (self.kept if held else self.queue).append(offer)
        self.queued_bytes += offer.size
        if not held:
            self._wake.set()

    def warm_tokens(self, keys: Sequence[str]) -> int:
        """The tokens of a request's prefix the target is known to hold (0: none)."""
        return max((self.warm.get(k, 0) for k in keys), default=0)

    def busy(self) -> None:
        """Real work began somewhere: a running mirror yields, an idle spell starts over."""
        self._last_busy = self.clock()

    def configure(self, settings: MirrorSettings) -> None:
        self.settings = settings
        self._drop_oldest(rules.over(self._held(), settings.bounds))

    def _held(self) -> rules.Held:
        """The offers held, kept and queued, in the order they go past a bound: the older
        head of the two first (a cancelled mirror's offer is the queue's head). Merged
        lazily: an offer reads only the oldest, which go."""
        queue, kept = self.queue, self.kept
        return rules.Held(len(queue) + len(kept), self.queued_bytes,
                          heapq.merge(queue, kept, key=_offered_at) if queue and kept else
                          queue or kept)

    def _drop_oldest(self, n: int) -> None:
        queue, kept = self.queue, self.kept
        for _ in range(n):
            oldest = queue if queue and (not kept or queue[0].at <= kept[0].at) else kept
            self.queued_bytes -= oldest.popleft().size
            self.counts["skipped"] += 1

    def _take(self, i: int) -> rules.Offer:
        offer = self.queue[i]
        del self.queue[i]
        self.queued_bytes -= offer.size
        return offer

    def _keep(self, offer: rules.Offer) -> None:
        """An offer the target now holds: kept in order, when the lane keeps."""
        if not self.keeps:
            return
        at = next((i for i, o in enumerate(self.kept) if o.at > offer.at), len(self.kept))
        self.kept.insert(at, offer)
        self.queued_bytes += offer.size
        # (Newer offers may have taken its room while it was sent.)
        self._drop_oldest(rules.over(self._held(), self.settings.bounds))

    def cache_figures(self) -> dict[str, dict[str, Any]]:
        """For the status's caches: the offers held (their bodies), and the prefixes the
        target is known to hold."""
        return {f"{self.name}_queue": figures(
                    len(self.queue) + len(self.kept), max_entries=self.settings.max_queued,
                    size=self.queued_bytes, max_bytes=self.settings.max_queued_bytes),
                f"{self.name}_warm": figures(len(self.warm), max_entries=WARM_KEPT)}

    def to_json(self) -> dict[str, Any]:
        now = self.clock()
        return {"enabled": self.settings.enabled, "child": self.target.name,
                "queued": len(self.queue), "kept": len(self.kept),
                "queued_bytes": self.queued_bytes,
                "warm_prefixes": len(self.warm), "warm_tokens": sum(self.warm.values()),
                "budget_used_s": round(self.budget.used_s(now), 3),
                "budget_s": self.settings.share * rules.WINDOW_S,
                "running": self.running is not None, **self.counts,
                "tokens_mirrored": self.tokens_mirrored}

    # --- the task -----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            if not self.queue or not self.settings.enabled:
                self._wake.clear()
                await self._wake.wait()
                continue
            wait = self._wait_s()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            chosen = rules.choose(self.queue, self.settings.max_prompt_tokens)
            if chosen is None:
                self._drop_oldest_queued(len(self.queue))
                continue
            offer = self._take(chosen)
            made = _body(offer)
            if made is None or made[0] in self.covered or made[0] in self._kept_covers(offer):
                # Unreadable, or held already (a later turn of it, sent or answered here).
                self.counts["skipped"] += 1
            elif not rules.pays(self.prefill_s(offer.prompt_tokens), self.settings.min_saved_s):
                self.counts["skipped"] += 1
            else:
                await self._mirror(offer, *made)

    def _requeue(self, offer: rules.Offer) -> None:
        """A mirror that did not finish is tried again in the next idle spell, as the oldest
        (the first to go should newer offers fill the queue meanwhile)."""
        self.queue.appendleft(offer)
        self.queued_bytes += offer.size
        self._drop_oldest(rules.over(self._held(), self.settings.bounds))

    def _drop_oldest_queued(self, n: int) -> None:
        for _ in range(n):
            self.queued_bytes -= self.queue.popleft().size
            self.counts["skipped"] += 1

    def _kept_covers(self, offer: rules.Offer) -> set[str]:
        """The prefixes the target holds by the kept offers newer than `offer` (parsed here,
        in idle time: an offer costs its request nothing)."""
        found: set[str] = set()
        for kept in self.kept:
            made = _body(kept) if kept.at > offer.at else None
            if made is not None:
                found.update(rules.covers(made[1]))
        return found

    def _idle(self) -> bool:
        return all(u.load.in_flight == 0 for u in self.upstreams) and not self.waiting()

    def _wait_s(self) -> float:
        """Seconds before a mirror may start (0: now)."""
        now = self.clock()
        if not self._idle():
            self._last_busy = now
        if self.target.state is not ChildState.READY:
            return 1.0
        idle_for = now - self._last_busy
        if idle_for < self.settings.idle_s:
            return self.settings.idle_s - idle_for
        if not self.budget.allows(now, self.settings.share):
            return 1.0
        return 0.0

    async def _mirror(self, offer: rules.Offer, key: str, body: Mapping[str, Any]) -> None:
        began = self.clock()
        self.running = offer
        task = asyncio.get_running_loop().create_task(self._send(body))
        try:
            while not task.done():
                await asyncio.wait([task], timeout=POLL_S)
                if not task.done() and not self._idle():
                    task.cancel()  # real work first: the stream closes, the child drops it
                    self.counts["cancelled"] += 1
                    self._requeue(offer)
                    self._last_busy = self.clock()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return
            try:
                tokens = task.result()
            except (aiohttp.ClientError, TimeoutError) as e:
                # The connection lost (the child died under it, most likely): tried again.
                log.info("mirror to the %s child failed: %s", self.target.name, e)
                self.counts["failed"] += 1
                self._requeue(offer)
                return
            if tokens is None:  # refused, or no timings: not tried again
                self.counts["failed"] += 1
                return
            self.counts["mirrored"] += 1
            self.tokens_mirrored += tokens
            self.warm[key] = tokens
            self.warm.move_to_end(key)
            while len(self.warm) > WARM_KEPT:
                self.warm.popitem(last=False)
            for covered in rules.covers(body):
                self.covered[covered] = None
                self.covered.move_to_end(covered)
            while len(self.covered) > COVERED_KEPT:
                self.covered.popitem(last=False)
            self._keep(offer)
            log.info("mirrored a conversation of %d tokens to the %s child in %.2fs (%s)",
                     tokens, self.target.name, self.clock() - began, self.name)
        finally:
            self.running = None
            self.budget = self.budget.after(self.clock(), self.clock() - began)

    async def _send(self, body: Mapping[str, Any]) -> int | None:
        """The mirror's request; the prompt tokens the target now holds, or None (refused);
        aiohttp.ClientError or TimeoutError when the connection failed."""
        target = self.target
        # llama-server closes the connection after every streamed answer (proxy/forward.py):
        # said up front, it is never pooled, and the next mirror never meets it closed.
        headers = {"Authorization": f"Bearer {target.api_key}",
                   "Content-Type": "application/json", "X-Spillway-Mirror": "1",
                   "Connection": "close"}
        timings: dict[str, Any] | None = None
        async with self._session().post(
                f"{target.base_url}/v1/chat/completions", data=json.dumps(body),
                headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as r:
            if r.status != 200:
                log.info("mirror refused by the %s child: HTTP %d", target.name, r.status)
                return None
            async for line in r.content:
                if line.startswith(b"data: {") and b'"timings"' in line:
                    with contextlib.suppress(ValueError):
                        timings = json.loads(line[6:]).get("timings")
        if not isinstance(timings, dict):
            return None
        self.on_timings(timings)
        n, cached = timings.get("prompt_n", 0), timings.get("cache_n", 0)
        return n + cached if isinstance(n, int) and isinstance(cached, int) else None

    def _target_changed(self, member: Any, old: ChildState, new: ChildState,
                        reason: str) -> None:
        if new is not ChildState.STARTING:
            return
        # A new process: its cache is empty. What it held is to be sent again (the newest
        # first, as ever: the queue is kept in the order the offers came).
        self.warm.clear()
        self.covered.clear()
        if self.kept:
            self.queue = deque(sorted([*self.kept, *self.queue], key=lambda o: o.at))
            self.kept.clear()
            self._wake.set()


class Mirror:
    """The lanes, as the proxy's recovery coordinator offers them what ended (one object: the
    proxy holds it) and the resources ask what each child holds."""

    def __init__(self, lanes: Sequence[Lane]) -> None:
        self.lanes = list(lanes)

    def offer(self, ended: rules.Ended, body: bytes, answer: str | None, prompt_tokens: int,
              no_prefill: frozenset[str] = frozenset()) -> None:
        """A request ended: each lane that takes it (policy/mirror.offered) is offered it; a
        lane's target under --no-prefill-assistant holds the prompt alone."""
        for lane in self.lanes:
            if rules.offered(ended, lane.any_child):
                lane.offer(body, answer, prompt_tokens,
                           prefills=lane.target.name not in no_prefill,
                           held=ended.child == lane.target.name)

    def busy(self) -> None:
        for lane in self.lanes:
            lane.busy()

    @property
    def holding(self) -> bool:
        """Whether any child is known to hold a mirrored prefix (else none is looked up)."""
        return any(lane.warm for lane in self.lanes)

    def warm_tokens(self, child: str, keys: Sequence[str]) -> int:
        """The tokens of a request's prefix `child` is known to hold (0: none)."""
        return max((lane.warm_tokens(keys) for lane in self.lanes if lane.target.name == child),
                   default=0)

    def lane(self, name: str) -> Lane | None:
        return next((lane for lane in self.lanes if lane.name == name), None)

    def cache_figures(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for lane in self.lanes:
            out.update(lane.cache_figures())
        return out


def _offered_at(offer: rules.Offer) -> float:
    return offer.at


def _body(offer: rules.Offer) -> tuple[str, dict[str, Any]] | None:
    """The mirror's key and body, from the offer's request parsed again (the proxy parsed it
    once already: it is a JSON object)."""
    try:
        payload = json.loads(offer.body)
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    return rules.offer_body(payload, offer.answer, offer.prefills)
