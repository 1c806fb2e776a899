"""How long a request will take on a child, from what the child itself reported.

llama-server reports `timings` (prompt_n, prompt_ms, cache_n, predicted_n, predicted_ms) with
every answer; a moving average of its prompt and generation speeds, per child, gives the expected
time of the next request from its prompt size and `max_tokens`.

A prompt's tokens do not cost alike: each attends to all before it, so a token at position p
costs about a + b·p, and a long prompt's prefill grows faster than its length (issue 48: on the
CPU child, SmolLM2, a 4,480-token prompt took 76 s where its average speed said 43.9 s). The
prefill forecast fits a and b to the child's recent answers (`PrefillFit`, least squares over
each answer's tokens and the positions they sat at, its cached prefix included) once they span
prompt sizes far enough apart to tell the two apart; until then, the average speed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .media import NO_MEDIA, Media

ALPHA = 0.3  # weight of the newest observation
DEFAULT_MAX_TOKENS = 256  # what a request without max_tokens is assumed to generate
BYTES_PER_TOKEN = 3  # a cautious guess before the prompt is tokenized (English is about 4)


PREFILL_WINDOW = 16  # the recent answers the prefill fit reads
PREFILL_SPREAD = 2.0  # the largest prompt at least this many times the smallest: a fit tells


@dataclass(frozen=True)
class PrefillSample:
    """One answer's prefill: `tokens` processed after `start` cached ones, in `ms`."""

    start: int
    tokens: int
    ms: float

    @property
    def positions(self) -> float:
        """The sum of the positions its tokens sat at (the attention each one paid for)."""
        return self.tokens * self.start + self.tokens * (self.tokens - 1) / 2


@dataclass(frozen=True)
class PrefillFit:
    """Milliseconds of prefill = per_token_ms · tokens + per_position_ms · their positions."""

    per_token_ms: float
    per_position_ms: float

    def ms(self, start: int, tokens: int) -> float:
        return self.per_token_ms * tokens + self.per_position_ms * PrefillSample(
            start, tokens, 0.0).positions


def fit_prefill(samples: tuple[PrefillSample, ...]) -> PrefillFit | None:
    """Least squares of a + b·p over `samples`, with b >= 0 (a token never costs less for
    coming later); None while their sizes are too alike to tell a from b."""
    if len(samples) < 3:
        return None
    sizes = [s.start + s.tokens for s in samples]
    if max(sizes) < PREFILL_SPREAD * min(sizes):
        return None
    # The normal equations of ms = a·x + b·y, x the tokens, y their positions.
    sxx = sum(s.tokens ** 2 for s in samples)
    syy = sum(s.positions ** 2 for s in samples)
    sxy = sum(s.tokens * s.positions for s in samples)
    sxm = sum(s.tokens * s.ms for s in samples)
    sym = sum(s.positions * s.ms for s in samples)
    det = sxx * syy - sxy * sxy
    if det <= 1e-9 * sxx * syy:
        return None
    a, b = (sxm * syy - sym * sxy) / det, (sym * sxx - sxm * sxy) / det
    if b < 0 or a <= 0:
        # Noise says later tokens are cheaper, or the per-token part is none: the flat
        # average is the honest answer then.
        return None
    return PrefillFit(a, b)


@dataclass(frozen=True)
class Throughput:
    prompt_tps: float | None = None
    gen_tps: float | None = None
    samples: int = 0
    prefills: tuple[PrefillSample, ...] = field(default=(), repr=False)
    prefill_fit: PrefillFit | None = None


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
    prompt_tps, gen_tps, prefills, fit = t.prompt_tps, t.gen_tps, t.prefills, t.prefill_fit
    try:
        pn, pms = float(timings.get("prompt_n", 0)), float(timings.get("prompt_ms", 0))
        gn, gms = float(timings.get("predicted_n", 0)), float(timings.get("predicted_ms", 0))
        cached = max(0, int(timings.get("cache_n", 0) or 0))
    except (TypeError, ValueError):
        return t
    # Tiny prompts (a cached prefix) say little about speed.
    if pn >= 8 and pms > 0:
        prompt_tps = _ewma(prompt_tps, pn * 1000 / pms)
        prefills = (*prefills, PrefillSample(cached, int(pn), pms))[-PREFILL_WINDOW:]
        fit = fit_prefill(prefills)
    if gn >= 2 and gms > 0:
        gen_tps = _ewma(gen_tps, gn * 1000 / gms)
    return Throughput(prompt_tps, gen_tps, t.samples + 1, prefills, fit)


def requested_tokens(payload: Mapping[str, Any] | None) -> int:
    if payload:
        for key in ("max_completion_tokens", "max_tokens", "n_predict"):
            value = payload.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return DEFAULT_MAX_TOKENS


def prompt_tokens_bound(body_size: int) -> int:
    return max(1, body_size // BYTES_PER_TOKEN)


def expected_seconds(t: Throughput, prompt_tokens: int, max_tokens: int,
                     cached: int = 0) -> float | None:
    """None until the child has reported both speeds. `prompt_tokens`: those to prefill, after
    `cached` ones its cache holds (they sit before them: each new token attends to them)."""
    prefill_s = prefill_seconds(t, prompt_tokens, cached)
    if prefill_s is None or t.gen_tps is None:
        return None
    return prefill_s + max_tokens / t.gen_tps


def prefill_seconds(t: Throughput, prompt_tokens: int, cached: int = 0) -> float | None:
    """The prefill alone (the fit once it tells, else the average speed); None until the child
    has reported a prompt's speed."""
    if t.prompt_tps is None:
        return None
    return (t.prefill_fit.ms(cached, prompt_tokens) / 1000 if t.prefill_fit is not None
            else prompt_tokens / t.prompt_tps)
