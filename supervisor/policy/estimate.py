"""How long a request will take on a child, from what the child itself reported.

llama-server reports `timings` (prompt_n, prompt_ms, predicted_n, predicted_ms) with every
answer; a moving average of its prompt and generation speeds, per child, gives the expected time
of the next request from its prompt size and `max_tokens`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .media import NO_MEDIA, Media

ALPHA = 0.3  # weight of the newest observation
DEFAULT_MAX_TOKENS = 256  # what a request without max_tokens is assumed to generate
BYTES_PER_TOKEN = 3  # a cautious guess before the prompt is tokenized (English is about 4)


@dataclass(frozen=True)
class Throughput:
    prompt_tps: float | None = None
    gen_tps: float | None = None
    samples: int = 0


@dataclass(frozen=True)
class Work:
    """What a request asks of a child, for its expected time: its prompt's tokens (counted, or
    a bound from its body's size), the tokens it may generate, its media (each item an
    encoder's run before its tokens)."""

    prompt_tokens: int
    max_tokens: int
    media: Media = NO_MEDIA
    # Its earlier turns' keys (policy/mirror.lookup_keys): a child that holds one of them
    # prefills only the rest.
    prefix_keys: tuple[str, ...] = ()

    @classmethod
    def of_body(cls, body_size: int, max_tokens: int) -> Work:
        """Before the prompt is counted: its body's size over BYTES_PER_TOKEN."""
        return cls(prompt_tokens_bound(body_size), max_tokens)

    def with_max_tokens(self, max_tokens: int) -> Work:
        return Work(self.prompt_tokens, max_tokens, self.media, self.prefix_keys)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


def observe(t: Throughput, timings: Mapping[str, Any]) -> Throughput:
    """Fold one answer's `timings` into the averages."""
    prompt_tps, gen_tps = t.prompt_tps, t.gen_tps
    try:
        pn, pms = float(timings.get("prompt_n", 0)), float(timings.get("prompt_ms", 0))
        gn, gms = float(timings.get("predicted_n", 0)), float(timings.get("predicted_ms", 0))
    except (TypeError, ValueError):
        return t
    # Tiny prompts (a cached prefix) say little about speed.
    if pn >= 8 and pms > 0:
        prompt_tps = _ewma(prompt_tps, pn * 1000 / pms)
    if gn >= 2 and gms > 0:
        gen_tps = _ewma(gen_tps, gn * 1000 / gms)
    return Throughput(prompt_tps, gen_tps, t.samples + 1)


def requested_tokens(payload: Mapping[str, Any] | None) -> int:
    if payload:
        for key in ("max_completion_tokens", "max_tokens", "n_predict"):
            value = payload.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return DEFAULT_MAX_TOKENS


def prompt_tokens_bound(body_size: int) -> int:
    return max(1, body_size // BYTES_PER_TOKEN)


def expected_seconds(t: Throughput, prompt_tokens: int, max_tokens: int) -> float | None:
    """None until the child has reported both speeds."""
    if t.prompt_tps is None or t.gen_tps is None:
        return None
    return prompt_tokens / t.prompt_tps + max_tokens / t.gen_tps
