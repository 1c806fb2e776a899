"""The mirror: conversations one child served, prefilled into another child in its idle time, so
that it already holds their prefix and prefills only the new turn. Two directions (lanes):

- the warm CPU child: what the GPU child served, mirrored to the CPU child, so that a
  conversation that fails over finds its prefix there;
- the warm GPU child after its restart (the rewarm): what the GPU child served before its death
  and what the CPU child served during the outage, prefilled into the restarted GPU child, whose
  cache is empty, where it is measured to pay (`pays`).

A mirror is the conversation so far (the request's messages and the child's answer, as a
final assistant message llama-server prefills) sent to the other child with `n_predict: 0` and
`cache_prompt: true`: that child prefills it and keeps it, in its slot and then in its
`--cache-ram` host cache (llama-server's default: 8 GiB), from which a later request with the
same prefix is restored. Measured against the other way, a KV "lifeboat" (the GPU child's slot
saved to a file after each turn, restored on the CPU child at a failover): see
docs/failover.md, "A warm CPU child".

Pure: which request each lane is offered (never one whose client opted out of being run
twice), which offers the queue keeps within its bounds (entries and bytes: the oldest go first),
which goes next (the newest, then the longest), whether it pays, the budget (the child's time
spent mirroring, a share of a sliding minute), the mirror's body, and the keys that tell a later
request's prefix (and the earlier prefixes a mirror covers). serving/mirror.py carries it out.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The lanes' names (their status keys, caches and metrics): the warm CPU child's, and the GPU
# child's after its restart.
MIRROR, REWARM = "mirror", "rewarm"
WINDOW_S = 60.0  # the budget's sliding window
DEFAULT_SHARE = 0.5  # at most this share of the window is spent mirroring
DEFAULT_MAX_QUEUED = 8  # offers waiting (the newest kept)
# Their bytes (bodies and answers) together: room for the queue full of the longest
# conversations mirrored (32,768 tokens, some 128 KiB of text, a few times that with tools).
DEFAULT_MAX_QUEUED_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_PROMPT_TOKENS = 32768  # a longer conversation is not mirrored (its prefill alone
# could take the whole budget on a small CPU)
KEYS_BACK = 4  # a later request's prefixes looked up: its messages less the last 1..4
# The rewarm: a conversation whose prefill the restarted child's own measured speed forecasts
# under this is not sent. Below it the next turn's time to first token gains less than a person
# notices, and the mirror would only take a slot (and the card's power) for nothing.
REWARM_MIN_SAVED_S = 0.1

# Fields a mirror drops: what would make the child generate, constrain or call, and what
# asks for a stream's extras. The rest (tools, templates' kwargs, reasoning settings) shapes the
# templated prompt and stays, so the prefix is the one the next turn renders.
_DROPPED = ("max_tokens", "max_completion_tokens", "n_predict", "stream_options", "tool_choice",
            "response_format", "json_schema", "grammar", "n", "logprobs", "top_logprobs",
            "n_probs", "stop")


@dataclass(frozen=True)
class Offer:
    """A conversation the GPU child served, offered for mirroring: kept as it came, the
    request's body as its bytes (one copy, and its size known; it is parsed, and the mirror's
    body and key made, only when it is mirrored: an offer costs the request nothing)."""

    body: bytes  # the request's, as received
    answer: str | None  # the GPU child's answer's text, when it is text alone
    prefills: bool  # the CPU child prefills a final assistant message
    prompt_tokens: int  # as counted or bounded: orders offers, bounds the work
    at: float  # when it was offered (monotonic)
    # The bytes it holds (the answer's characters, near enough): read at every bound.
    size: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", len(self.body) + len(self.answer or ""))


@dataclass(frozen=True)
class Bounds:
    """What the queue of offers may hold."""

    max_entries: int = DEFAULT_MAX_QUEUED
    max_bytes: int = DEFAULT_MAX_QUEUED_BYTES
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS


@dataclass(frozen=True)
class Ended:
    """A request that ended, as the mirror's lanes judge it."""

    status: int
    chat: bool  # a chat route, its body JSON
    media: bool
    continued: bool  # a stream cut and continued on another upstream
    attempts: int
    child: str  # the upstream that answered it (its last attempt's)
    first_child: bool  # that upstream is the first in the order (the GPU child)
    opted_out: bool  # sent with X-Spillway-Replay: never


def offered(ended: Ended, any_child: bool = False) -> bool:
    """Whether a request that ended is offered to a lane: a chat request with a JSON body and no
    media, answered whole (200). The warm CPU child's lane takes what the first child (the GPU
    child) answered alone, on its first attempt; the rewarm's (`any_child`) takes what any
    child answered, a replay or a continued stream too: those are the conversations the CPU
    child served during an outage. Never one sent with `X-Spillway-Replay: never`: its client
    would rather have an error than have it run twice, and a mirror is the request run again."""
    plain = ended.status == 200 and ended.chat and not ended.media and not ended.opted_out
    if any_child:
        return plain
    return plain and not ended.continued and ended.attempts == 1 and ended.first_child


@dataclass(frozen=True)
class Held:
    """The offers a lane holds, as its bounds read them: how many, their bytes together, and
    the offers oldest first, read lazily (only those that go are read: an answer's offer costs
    its request the same however many are held)."""

    count: int
    size: int
    oldest_first: Iterable[Offer]

    @classmethod
    def of(cls, offers: Sequence[Offer]) -> Held:
        return cls(len(offers), sum(o.size for o in offers), offers)


def admit(held: Held, offer: Offer, bounds: Bounds) -> int | None:
    """How many of the oldest `held` offers go so that `offer` is queued within the bounds;
    None when it is not queued: over max_prompt_tokens (it would never be chosen), or larger
    alone than the byte bound.

    Past a bound the oldest go, not the new offer: the newest is what `choose` mirrors first
    (its conversation the likeliest to go on), and a conversation's next turn holds its earlier
    turn's whole prefix, which makes that older offer worth nothing once the newer is
    mirrored."""
    if offer.prompt_tokens > bounds.max_prompt_tokens or offer.size > bounds.max_bytes:
        return None
    return over(Held(held.count + 1, held.size + offer.size,
                     itertools.chain(held.oldest_first, (offer,))), bounds)


def over(held: Held, bounds: Bounds) -> int:
    """How many of the oldest `held` offers go for the rest to be within the bounds (after a
    reload lowered them, or a cancelled mirror's offer came back as the oldest)."""
    total = held.size
    dropped = 0
    oldest = iter(held.oldest_first)
    while held.count - dropped > bounds.max_entries or total > bounds.max_bytes:
        going = next(oldest, None)
        if going is None:
            break
        total -= going.size
        dropped += 1
    return dropped


@dataclass(frozen=True)
class Budget:
    """The CPU child's time spent mirroring in the last window: (ended at, seconds) pairs."""

    spent: tuple[tuple[float, float], ...] = ()

    def used_s(self, now: float) -> float:
        return sum(s for at, s in self.spent if now - at < WINDOW_S)

    def after(self, now: float, seconds: float) -> Budget:
        kept = tuple((at, s) for at, s in self.spent if now - at < WINDOW_S)
        return Budget((*kept, (now, seconds)))

    def allows(self, now: float, share: float) -> bool:
        return self.used_s(now) < share * WINDOW_S


def prefix_key(messages: Sequence[Any], extra: Mapping[str, Any] | None = None) -> str:
    """A conversation prefix's identity: its messages (and what else shapes its template:
    tools, template kwargs), hashed."""
    shaping = {k: extra[k] for k in ("tools", "chat_template_kwargs", "model")
               if extra and k in extra}
    blob = json.dumps([list(messages), shaping], sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, default=str)
    return hashlib.blake2b(blob.encode(), digest_size=12).hexdigest()


def lookup_keys(payload: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys under which a request's earlier turns may have been mirrored: its messages
    less the last one, two, ... (a new user turn, a tool's result after a call)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return ()
    return tuple(prefix_key(messages[:-back], payload)
                 for back in range(1, min(KEYS_BACK, len(messages) - 1) + 1))


def offer_body(payload: Mapping[str, Any], answer: str | None,
               prefills: bool) -> tuple[str, dict[str, Any]] | None:
    """The mirror of a chat request the GPU child answered: its messages, and its answer as a
    final assistant message when the child prefills one (not under --no-prefill-assistant);
    `n_predict: 0` (one token is still sampled), cached, streamed (so that closing it cancels
    it within a batch). None for what is not mirrored: no messages, or a conversation already
    ending with an assistant message (a prefill of the client's own)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if isinstance(last, dict) and last.get("role") == "assistant":
        return None
    mirrored = list(messages)
    if answer and prefills:
        mirrored.append({"role": "assistant", "content": answer})
    body = {k: v for k, v in payload.items() if k not in _DROPPED}
    body.update(messages=mirrored, n_predict=0, stream=True, cache_prompt=True)
    return prefix_key(mirrored, payload), body


def covers(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The prefixes a child holds once it prefilled a mirror's body (or served its request):
    the whole conversation's, and its earlier turns' (its messages less the last 1..4), under
    which an earlier offer of the same conversation is keyed. Mirroring that earlier offer
    would be worse than useless: llama-server would reuse the slot that holds the longer
    conversation and cut it back to the shorter one."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return ()
    return (prefix_key(messages, body), *lookup_keys(body))


def pays(prefill_s: float | None, min_saved_s: float) -> bool:
    """Whether mirroring a conversation pays: the prefill it saves the next turn, as the
    child's own measured speed forecasts it (policy/estimate.py), is at least `min_saved_s`.
    A child that has measured nothing yet is sent it: the mirror's own timings measure it."""
    return prefill_s is None or prefill_s >= min_saved_s


def choose(offers: Sequence[Offer], max_prompt_tokens: int) -> int | None:
    """The offer to mirror next: the newest (its conversation is the likeliest to go on), and
    among offers of the same moment the longest (the most prefill saved); None when none fits
    the bound."""
    fitting = [i for i, o in enumerate(offers) if o.prompt_tokens <= max_prompt_tokens]
    if not fitting:
        return None
    return max(fitting, key=lambda i: (round(offers[i].at, 1), offers[i].prompt_tokens))
