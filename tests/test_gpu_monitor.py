"""The GPU monitor behind its sampler interface, with a scripted sampler (a test double): what
it keeps of the samples, and what it says when a source has no figures or fails."""

from __future__ import annotations

import time

from supervisor.gpu import MIB, GpuMonitor, GpuSample, Unavailable


class ScriptedSampler:
    """A sampler that says what the test tells it (`free`), or fails as told."""

    def __init__(self, unavailable: str | None = None) -> None:
        self.index = 3
        self.unavailable = unavailable
        self.free = 1000 * MIB
        self.fail: Exception | None = None
        self.opened = self.closed = 0

    def open(self) -> None:
        self.opened += 1
        if self.unavailable is not None:
            raise Unavailable(self.unavailable)

    def sample(self, monotonic: float, wall: float) -> GpuSample:
        if self.fail is not None:
            raise self.fail
        return GpuSample(monotonic=monotonic, wall=wall, index=self.index, name="scripted",
                         pci_bus_id="0000:03:00.0", uuid="GPU-x", total_bytes=4000 * MIB,
                         free_bytes=self.free, used_bytes=4000 * MIB - self.free,
                         process_bytes={42: 500 * MIB})

    def close(self) -> None:
        self.closed += 1


async def test_the_monitor_keeps_what_its_sampler_says() -> None:
    sampler = ScriptedSampler()
    monitor = GpuMonitor("3", 3600.0, sampler)  # no sample on the interval during the test
    monitor.owners = lambda: {"gpu": [42], "cpu": None}
    await monitor.start()
    assert monitor.available and monitor.note is None and monitor.index == 3
    before = time.monotonic()
    sampler.free = 100 * MIB
    await monitor.sample_now()
    assert [s.free_bytes // MIB for s in monitor.history] == [1000, 100]
    evidence = monitor.vram_before(time.monotonic())
    assert evidence is not None and evidence.free_mib == 100 and evidence.total_mib == 4000
    assert monitor.vram_before(before - 10) is None  # nothing was sampled that early
    shown = monitor.to_json({"gpu": 42, "cpu": None})
    assert shown is not None and shown["children_used_bytes"] == {"gpu": 500 * MIB, "cpu": None}
    assert monitor.chart.since(0.0)[-1].children == {"gpu": 500 * MIB, "cpu": None}
    # A sampling that fails keeps the last figures and says why; the next one clears it.
    sampler.fail = RuntimeError("the device fell off the bus")
    assert (await monitor.sample_now()) is monitor.latest
    assert monitor.note == "GPU sampling failed: the device fell off the bus"
    sampler.fail = None
    await monitor.sample_now()
    assert monitor.note is None
    await monitor.close()
    assert sampler.closed == 1


async def test_a_source_without_figures_says_why_and_samples_nothing() -> None:
    sampler = ScriptedSampler(unavailable="no GPU: no driver here")
    monitor = GpuMonitor(None, 3600.0, sampler)
    await monitor.start()
    assert not monitor.available and monitor.index is None
    assert monitor.note == "no GPU: no driver here"
    assert await monitor.sample_now() is None and monitor.to_json({}) is None
    await monitor.close()
    assert sampler.closed == 0
