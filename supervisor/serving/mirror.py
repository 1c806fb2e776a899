"""The warm CPU child, carried out: conversations the GPU child served are sent to the CPU
child in its idle time (policy/mirror.py says which, and the body), so that a conversation that
fails over finds its prefix in the CPU child's cache.

Real work always goes first. A mirror starts only when no upstream has had a request in flight
for `idle_s` (on a box whose GPU child runs on the CPU too, a mirror would slow it); while it
runs, the first request admitted anywhere cancels it: the mirror's stream is closed, and
llama-server drops the task within one batch. The CPU child's time spent mirroring is held to a
share of a sliding minute. A mirror is not a lease: admission never waits for one.

The offers wait in a queue bounded in entries and in bytes (`cpu.mirror_max_queued_mib`; past
a bound the oldest go: policy/mirror.admit says why), each the request's body as it came, and
the status's caches show it (`mirror_queue`), with the prefixes the CPU child holds
(`mirror_warm`).

What the CPU child then holds is kept (the mirrored prefixes and their tokens, the newest 64),
forgotten when it restarts, and read by the expected time of a request whose earlier turns were
mirrored (serving/resources.py), the status (`mirror`), and the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
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
WARM_KEPT = 64  # prefixes remembered as held by the CPU child (its host cache decides, really)
POLL_S = 0.02  # how often a running mirror looks for real work (well within one batch)


@dataclass
class MirrorSettings:
    enabled: bool = True
    share: float = rules.DEFAULT_SHARE  # of a sliding minute of the CPU child's time
    idle_s: float = 1.0  # every upstream idle this long before a mirror starts
    max_queued: int = rules.DEFAULT_MAX_QUEUED
    max_queued_bytes: int = rules.DEFAULT_MAX_QUEUED_BYTES
    max_prompt_tokens: int = rules.DEFAULT_MAX_PROMPT_TOKENS

    @property
    def bounds(self) -> rules.Bounds:
        return rules.Bounds(self.max_queued, self.max_queued_bytes, self.max_prompt_tokens)


class Mirror:
    def __init__(self, session: Callable[[], aiohttp.ClientSession], cpu: Upstream,
                 upstreams: Sequence[Upstream], settings: MirrorSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._session = session
        self.cpu = cpu
        self.upstreams = list(upstreams)
        self.settings = settings
        self.clock = clock
        self.queue: deque[rules.Offer] = deque()  # oldest first
        self.queued_bytes = 0
        self.warm: OrderedDict[str, int] = OrderedDict()  # prefix key -> tokens held
        self.budget = rules.Budget()
        self.counts = {"mirrored": 0, "cancelled": 0, "failed": 0, "skipped": 0}
        self.tokens_mirrored = 0
        self._wake = asyncio.Event()
        self._last_busy = clock()
        self.running: rules.Offer | None = None
        # Told each mirror's timings: the CPU child's prefill speed, measured while it was idle.
        self.on_timings: Callable[[Mapping[str, Any]], None] = lambda timings: None
        cpu.listeners.append(self._cpu_changed)

    # --- what the proxy tells it, and asks it ------------------------------------------------

    def offer(self, body: bytes, answer: str | None, prompt_tokens: int,
              prefills: bool = True) -> None:
        """A chat request the GPU child answered (its body as received): its conversation may
        be mirrored."""
        if not self.settings.enabled:
            return
        offer = rules.Offer(body, answer, prefills, prompt_tokens, self.clock())
        dropped = rules.admit(self.queue, offer, self.settings.bounds)
        if dropped is None:
            self.counts["skipped"] += 1
            return
        self._drop_oldest(dropped)
        self.queue.append(offer)
        self.queued_bytes += offer.size
        self._wake.set()

    def warm_tokens(self, keys: Sequence[str]) -> int:
        """The tokens of a request's prefix the CPU child is known to hold (0: none)."""
        return max((self.warm.get(k, 0) for k in keys), default=0)

    def busy(self) -> None:
        """Real work began somewhere: a running mirror yields, an idle spell starts over."""
        self._last_busy = self.clock()

    def configure(self, settings: MirrorSettings) -> None:
        self.settings = settings
        self._drop_oldest(rules.over(self.queue, settings.bounds))

    def _drop_oldest(self, n: int) -> None:
        for _ in range(n):
            self.queued_bytes -= self.queue.popleft().size
            self.counts["skipped"] += 1

    def _take(self, i: int) -> rules.Offer:
        offer = self.queue[i]
        del self.queue[i]
        self.queued_bytes -= offer.size
        return offer

    def cache_figures(self) -> dict[str, dict[str, Any]]:
        """For the status's caches: the offers waiting (their bodies), and the prefixes the
        CPU child is known to hold."""
        return {"mirror_queue": figures(len(self.queue), max_entries=self.settings.max_queued,
                                        size=self.queued_bytes,
                                        max_bytes=self.settings.max_queued_bytes),
                "mirror_warm": figures(len(self.warm), max_entries=WARM_KEPT)}

    def to_json(self) -> dict[str, Any]:
        now = self.clock()
        return {"enabled": self.settings.enabled, "queued": len(self.queue),
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
                self._drop_oldest(len(self.queue))
                continue
            offer = self._take(chosen)
            made = _body(offer)
            if made is None:
                self.counts["skipped"] += 1
            elif made[0] not in self.warm:  # (held already: nothing to do)
                await self._mirror(offer, *made)

    def _idle(self) -> bool:
        return all(u.load.in_flight == 0 for u in self.upstreams)

    def _wait_s(self) -> float:
        """Seconds before a mirror may start (0: now)."""
        now = self.clock()
        if not self._idle():
            self._last_busy = now
        if self.cpu.state is not ChildState.READY:
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
                    # Tried again in the next idle spell, as the oldest (the first to go
                    # should newer offers fill the queue meanwhile).
                    self.queue.appendleft(offer)
                    self.queued_bytes += offer.size
                    self._drop_oldest(rules.over(self.queue, self.settings.bounds))
                    self._last_busy = self.clock()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return
            tokens = task.result()
            if tokens is None:
                self.counts["failed"] += 1
                return
            self.counts["mirrored"] += 1
            self.tokens_mirrored += tokens
            self.warm[key] = tokens
            self.warm.move_to_end(key)
            while len(self.warm) > WARM_KEPT:
                self.warm.popitem(last=False)
            log.info("mirrored a conversation of %d tokens to the %s child in %.2fs",
                     tokens, self.cpu.name, self.clock() - began)
        finally:
            self.running = None
            self.budget = self.budget.after(self.clock(), self.clock() - began)

    async def _send(self, body: Mapping[str, Any]) -> int | None:
        """The mirror's request; the prompt tokens the CPU child now holds, or None."""
        headers = {"Authorization": f"Bearer {self.cpu.api_key}",
                   "Content-Type": "application/json", "X-Spillway-Mirror": "1"}
        timings: dict[str, Any] | None = None
        try:
            async with self._session().post(
                    f"{self.cpu.base_url}/v1/chat/completions", data=json.dumps(body),
                    headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as r:
                if r.status != 200:
                    log.info("mirror refused by the %s child: HTTP %d", self.cpu.name, r.status)
                    return None
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"timings"' in line:
                        with contextlib.suppress(ValueError):
                            timings = json.loads(line[6:]).get("timings")
        except (aiohttp.ClientError, TimeoutError) as e:
            log.info("mirror to the %s child failed: %s", self.cpu.name, e)
            return None
        if not isinstance(timings, dict):
            return None
        self.on_timings(timings)
        n, cached = timings.get("prompt_n", 0), timings.get("cache_n", 0)
        return n + cached if isinstance(n, int) and isinstance(cached, int) else None

    def _cpu_changed(self, member: Any, old: ChildState, new: ChildState, reason: str) -> None:
        if new is ChildState.STARTING:
            self.warm.clear()  # a new process: its cache is empty


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
