"""A request's expected time on a child sees its images and audio: its counted prompt at the
child's text speed, plus each item at the child's own encoder time, learned from the timings of
its media answers (the text speed from the others only)."""

from __future__ import annotations

import base64

import pytest

from supervisor.config.schema import build
from supervisor.gpu import GpuMonitor
from supervisor.policy import media
from supervisor.policy.estimate import Work
from supervisor.serving.resources import Resources
from supervisor.upstreams.children import Child

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode()
ONE_IMAGE = media.find("/v1/chat/completions", {"messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]})


def resources() -> Resources:
    cfg = build({"model": {"path": "/m.gguf"}}, check_paths=False)
    children = {name: Child(cfg.child(name), cfg.restart) for name in cfg.order}
    return Resources(cfg, children, GpuMonitor(cfg.monitor.sample_interval_s))


def test_the_cpu_childs_encoder_time_is_learned_and_counted() -> None:
    res = resources()
    # The text speeds, from an answer without media: 100 prompt tokens/s, 10 generated/s.
    res.observe_timings("cpu", {"prompt_n": 100, "prompt_ms": 1000.0,
                                "predicted_n": 10, "predicted_ms": 1000.0})
    text = Work(100, 10)
    assert res.expected_seconds("cpu", text) == pytest.approx(2.0)
    image = Work(116, 10, ONE_IMAGE)
    # Not measured yet: the CPU encoder's cautious default, per item.
    assert res.expected_seconds("cpu", image) == pytest.approx(
        1.16 + 1.0 + media.DEFAULT_ENCODE_S[False])
    # An image answer: 116 tokens in 4.16 s, 3 s of it the encoder's.
    res.observe_timings("cpu", {"prompt_n": 116, "prompt_ms": 4160.0,
                                "predicted_n": 10, "predicted_ms": 1000.0}, media_items=1)
    assert res.encode_s["cpu"] == pytest.approx(3.0)
    assert res.expected_seconds("cpu", image) == pytest.approx(1.16 + 1.0 + 3.0)
    # The media answer did not slow the text speed down.
    assert res.throughput["cpu"].prompt_tps == pytest.approx(100.0)
    assert res.to_json("cpu", 0)["encode_s_per_item"] == pytest.approx(3.0)


def test_the_gpu_childs_default_is_its_own() -> None:
    res = resources()
    res.observe_timings("gpu", {"prompt_n": 1000, "prompt_ms": 100.0,
                                "predicted_n": 100, "predicted_ms": 1000.0})
    assert res.expected_seconds("gpu", Work(1000, 100, ONE_IMAGE)) == pytest.approx(
        0.1 + 1.0 + media.DEFAULT_ENCODE_S[True])
