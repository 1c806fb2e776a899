"""The prefill forecast grows with the prompt as the child's own times do (issue 48): each
token attends to those before it, so a long prompt costs more per token than a short one, and
the forecast fitted to a child's answers says so where an average speed does not (measured on
main before: 43.9 s forecast for a 4,480-token prompt the CPU child took 76 s over)."""

from __future__ import annotations

import pytest

from supervisor.policy import estimate

# A child whose token at position p costs 0.5 ms + 0.0004 ms · p (per_position over per_token:
# a 4,480-token prompt costs about 2.8x the first token's rate at its end).
A_MS, B_MS = 0.5, 0.0004


def true_ms(start: int, tokens: int) -> float:
    return sum(A_MS + B_MS * p for p in range(start, start + tokens))


def answered(t: estimate.Throughput, tokens: int, start: int = 0) -> estimate.Throughput:
    return estimate.observe(t, {"prompt_n": tokens, "prompt_ms": true_ms(start, tokens),
                                "cache_n": start, "predicted_n": 10, "predicted_ms": 100.0})


def gen_s(tokens: int) -> float:
    return tokens / 100.0  # the answers above: 10 tokens in 100 ms


def learned(*sizes: int) -> estimate.Throughput:
    t = estimate.Throughput()
    for n in sizes:
        t = answered(t, n)
    return t


def test_a_long_prompts_forecast_grows_as_the_childs_times_do() -> None:
    t = learned(200, 600, 1200, 2000, 300, 900)
    truth = true_ms(0, 4480) / 1000
    forecast = estimate.expected_seconds(t, 4480, 0)
    assert forecast is not None and forecast == pytest.approx(truth, rel=0.02)
    # The average speed of the same answers says far less: the forecast issue 48 measured.
    assert t.prompt_tps is not None and 4480 / t.prompt_tps < 0.8 * truth


def test_a_cached_prefix_makes_the_rest_dearer() -> None:
    """The tokens after a cached prefix attend to it: the same 500 tokens cost more after 4,000
    cached ones than from the start, as the child measured."""
    t = learned(200, 600, 1200, 2000)
    after = estimate.expected_seconds(t, 500, 0, cached=4000)
    fresh = estimate.expected_seconds(t, 500, 0)
    assert after is not None and fresh is not None
    assert after == pytest.approx(true_ms(4000, 500) / 1000, rel=0.02)
    assert after > 2 * fresh


def test_prompts_all_of_a_size_leave_the_average_speed() -> None:
    """Nothing tells a token's own cost from its position's while the sizes are alike: the
    average speed, as before."""
    t = learned(1000, 1010, 990, 1005)
    assert t.prefill_fit is None
    forecast = estimate.expected_seconds(t, 4480, 10)
    assert t.prompt_tps is not None and forecast == pytest.approx(4480 / t.prompt_tps + gen_s(10))


def test_noise_that_says_later_tokens_are_cheaper_is_not_believed() -> None:
    """A slow short answer (another request shared the child) and a fast long one would fit a
    negative cost per position: the average speed instead, never a forecast that shrinks."""
    t = estimate.Throughput()
    for tokens, ms in ((100, 400.0), (2000, 1000.0), (300, 900.0), (1500, 800.0)):
        t = estimate.observe(t, {"prompt_n": tokens, "prompt_ms": ms})
    assert t.prefill_fit is None


def test_the_fit_reads_the_recent_answers_only() -> None:
    t = learned(*([200, 2000] * 20))
    assert len(t.prefills) == estimate.PREFILL_WINDOW
