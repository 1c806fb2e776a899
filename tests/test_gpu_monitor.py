"""The GPU monitor behind its sampler interface, with scripted samplers (test doubles): what it
keeps of the samples of every card, which of them it weighs for the GPU child, and what it
says when a source has no figures or fails."""

from __future__ import annotations

import time
from collections.abc import Collection

from supervisor.gpu import MIB, GpuMonitor, GpuSample, Unavailable
from supervisor.policy.devices import Selection


class ScriptedSampler:
    """A sampler of the cards the test names (`free` by PCI address), or failing as told."""

    def __init__(self, free: dict[str, int] | None = None, unavailable: str | None = None,
                 vendor: str = "nvidia") -> None:
        self.unavailable = unavailable
        self.free = dict(free or {"0000:03:00.0": 1000 * MIB})
        self.vendor = vendor
        self.fail: Exception | None = None
        self.opened = self.closed = 0
        self.asked_pids: list[set[int]] = []

    def open(self) -> None:
        self.opened += 1
        if self.unavailable is not None:
            raise Unavailable(self.unavailable)

    def sample(self, monotonic: float, wall: float, pids: Collection[int]) -> list[GpuSample]:
        self.asked_pids.append(set(pids))
        if self.fail is not None:
            raise self.fail
        return [GpuSample(monotonic=monotonic, wall=wall, index=i, name=f"scripted {i}",
                          pci_bus_id=pci, uuid=f"GPU-{i}", total_bytes=4000 * MIB,
                          free_bytes=free, used_bytes=4000 * MIB - free,
                          process_bytes={42: 500 * MIB}, vendor=self.vendor)
                for i, (pci, free) in enumerate(sorted(self.free.items()))]

    def close(self) -> None:
        self.closed += 1


async def test_the_monitor_keeps_what_its_sampler_says() -> None:
    sampler = ScriptedSampler()
    monitor = GpuMonitor(3600.0, [sampler])  # no sample on the interval during the test
    monitor.owners = lambda: {"gpu": [42], "cpu": None}
    await monitor.start()
    assert monitor.available and monitor.note is None and monitor.index == 0
    assert sampler.asked_pids[-1] == {42}  # the children's processes, for per-process sources
    before = time.monotonic()
    sampler.free = {"0000:03:00.0": 100 * MIB}
    await monitor.sample_now()
    assert [s[0].free_bytes // MIB for s in monitor.history] == [1000, 100]
    evidence = monitor.vram_before(time.monotonic())
    assert evidence is not None and evidence.free_mib == 100 and evidence.total_mib == 4000
    assert monitor.vram_before(before - 10) is None  # nothing was sampled that early
    shown = monitor.to_json({"gpu": [42], "cpu": None})
    assert shown is not None and shown["children_used_bytes"] == {"gpu": 500 * MIB, "cpu": None}
    assert [d["pci_bus_id"] for d in shown["devices"]] == ["0000:03:00.0"]
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


async def test_every_card_is_kept_and_the_childs_tightest_is_the_one_weighed() -> None:
    nvidia = ScriptedSampler({"0000:01:00.0": 9000 * MIB, "0000:02:00.0": 300 * MIB})
    amd = ScriptedSampler({"0000:c3:00.0": 50 * MIB}, vendor="amd")
    monitor = GpuMonitor(3600.0, [amd, nvidia])
    chosen = ("0000:01:00.0", "0000:02:00.0")
    monitor.chooser = lambda samples: Selection(chosen, "config", "the test's")
    await monitor.start()
    # Every card, in PCI order, whichever source found it.
    assert [s.pci_bus_id for s in monitor.devices] == ["0000:01:00.0", "0000:02:00.0",
                                                      "0000:c3:00.0"]
    # The child's cards are the NVIDIA two; the AMD card, fuller still, is not its own.
    assert [s.pci_bus_id for s in monitor.child_devices] == list(chosen)
    latest = monitor.latest
    assert latest is not None and latest.pci_bus_id == "0000:02:00.0"
    assert [r.free_bytes // MIB for r in monitor.rooms()] == [9000, 300]
    evidence = monitor.vram_before(time.monotonic())
    assert evidence is not None and evidence.free_mib == 300
    shown = monitor.to_json({"gpu": [42]})
    assert shown is not None and shown["pci_bus_id"] == "0000:02:00.0"
    assert [(d["vendor"], d["used_by_gpu_child"]) for d in shown["devices"]] == [
        ("nvidia", True), ("nvidia", True), ("amd", False)]
    assert shown["gpu_child_devices"]["pci_bus_ids"] == list(chosen)
    point = monitor.chart.since(0.0)[-1]
    assert point.free_bytes == 9300 * MIB  # the child's cards, summed for the chart's band
    assert set(point.devices) == {"0000:01:00.0", "0000:02:00.0", "0000:c3:00.0"}
    await monitor.close()


async def test_one_source_without_figures_leaves_the_others() -> None:
    monitor = GpuMonitor(3600.0, [ScriptedSampler(unavailable="no NVIDIA GPU: no driver"),
                                  ScriptedSampler({"0000:03:00.0": 7 * MIB}, vendor="amd")])
    await monitor.start()
    assert monitor.available and monitor.note is None
    assert [s.vendor for s in monitor.devices] == ["amd"]
    await monitor.close()


async def test_a_source_without_figures_says_why_and_samples_nothing() -> None:
    sampler = ScriptedSampler(unavailable="no GPU: no driver here")
    monitor = GpuMonitor(3600.0, [sampler, ScriptedSampler(unavailable="no AMD or Intel GPU")])
    await monitor.start()
    assert not monitor.available and monitor.index is None
    assert monitor.note == "no GPU: no driver here; no AMD or Intel GPU"
    assert await monitor.sample_now() is None and monitor.to_json({}) is None
    await monitor.close()
    assert sampler.closed == 0
