"""A model's capacity in router mode (supervisor/router/capacity.py): a model not loaded on
the GPU router may be loaded on demand only when its weights, KV cache and the headroom fit the
free VRAM (NVML), never without a reading being skipped silently; a router's --models-max is
kept by unloading an idle model first, and nothing is loaded where all loaded models are busy.
The model upstreams are the real ones over fake router children (test_router_upstream.py's)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from test_router_upstream import FakeLoader, FakeRouter, loaded, told
from tinymodel import write_tiny_model

from supervisor.config import schema as config_module
from supervisor.gpu import MIB, GpuMonitor, GpuSample
from supervisor.policy.devices import Selection
from supervisor.policy.lifecycle import ChildState as S
from supervisor.router.capacity import ModelResources
from supervisor.router.upstream import ModelUpstream


class FakeMonitor(GpuMonitor):
    """The real monitor, without sources: its cards' figures are what the test sets."""

    def __init__(self, free_mib: float | None, cards: int = 1) -> None:
        super().__init__(1.0, samplers=[])
        self.cards = cards
        if free_mib is not None:
            self.set_free(free_mib)

    def set_free(self, *free_mib: float) -> None:
        """Each card's free MiB (the first's for the rest when fewer are given)."""
        frees = list(free_mib) + [free_mib[0]] * (self.cards - len(free_mib))
        devices = [GpuSample(time.monotonic(), time.time(), i, "Fake GPU",
                             f"0000:0{i + 1}:00.0", f"GPU-{i}", 24576 * MIB,
                             int(free * MIB), int((24576 - free) * MIB))
                   for i, free in enumerate(frees)]
        self._keep(devices, Selection(tuple(d.pci_bus_id for d in devices), "config"))


def config(models_max: int = 2, headroom: int = 1024) -> config_module.Config:
    return config_module.build({
        "model": {"args": ["--models-dir", "/srv/models", "-c", "2048", "-np", "2"]},
        "gpu": {"args": ["-ngl", "99", "--models-max", str(models_max)],
                "vram_headroom_mib": headroom},
    }, check_paths=False)


class Routers:
    """Two fake routers and every model's upstream on each, with its ModelResources."""

    def __init__(self, cfg: config_module.Config, monitor: FakeMonitor) -> None:
        self.cfg = cfg
        self.monitor = monitor
        self.routers = {"gpu": FakeRouter(), "cpu": FakeRouter()}
        self.routers["cpu"].name = "cpu"
        self.loader = FakeLoader()
        self.models: dict[str, dict[str, ModelUpstream]] = {}
        self.res: dict[str, ModelResources] = {}

    def add(self, model: str, path: Path | None = None) -> ModelResources:
        ups = {name: ModelUpstream(r, model, self.loader)  # type: ignore[arg-type]
               for name, r in self.routers.items()}
        self.models[model] = ups
        res = ModelResources(self.cfg, ups, self.monitor, model,  # type: ignore[arg-type]
                             lambda child: [m[child] for m in self.models.values()])
        if path is not None:
            res.path = str(path)
            res.read_model()
        res.ram_available = 64 * 1024 * MIB
        self.res[model] = res
        return res


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "alpha.gguf")


@pytest.mark.asyncio
async def test_a_load_that_would_not_fit_the_free_vram_is_refused_with_the_figures(
        model_file: Path) -> None:
    monitor = FakeMonitor(free_mib=20000)
    routers = Routers(config(headroom=1024), monitor)
    res = routers.add("alpha", model_file)
    need_mib = res.gpu_need_bytes() / MIB
    size_mib = res.model_size / MIB
    # The file's weights (x1.1), its KV cache at -c 2048 from the GGUF shape, the headroom.
    assert size_mib > 10 and 1024 + size_mib < need_mib < 1024 + 200
    assert res.load_refusal("gpu") is None
    assert res.child_view("gpu", 0, 0, 0).startable
    monitor.set_free(need_mib - 1)
    refusal = res.load_refusal("gpu")
    assert refusal is not None and "VRAM" in refusal and f"{need_mib - 1:.0f} MiB free" in refusal
    assert not res.child_view("gpu", 0, 0, 0).startable
    # The CPU router is not held to the card's memory.
    assert res.child_view("cpu", 0, 0, 0).startable


@pytest.mark.asyncio
async def test_with_two_cards_the_load_must_fit_each_cards_part(model_file: Path) -> None:
    """Without -ts llama.cpp splits by free memory; each card keeps the headroom."""
    monitor = FakeMonitor(free_mib=20000, cards=2)
    routers = Routers(config(headroom=1024), monitor)
    res = routers.add("alpha", model_file)
    weights_mib = res.gpu_need_bytes() / MIB - 1024
    assert res.load_refusal("gpu") is None
    # Enough in all (the sum of the two is more than the need plus one headroom), but the
    # second card cannot keep its headroom besides its part.
    monitor.set_free(20000, 1024)
    refusal = res.load_refusal("gpu")
    assert refusal is not None and "on 0000:02:00.0 Fake GPU" in refusal, refusal
    assert "1024 MiB free" in refusal
    monitor.set_free(20000, 1024 + weights_mib)  # its part is far less than the weights
    assert res.load_refusal("gpu") is None


@pytest.mark.asyncio
async def test_without_an_nvml_reading_the_vram_check_is_skipped(model_file: Path) -> None:
    routers = Routers(config(), FakeMonitor(free_mib=None))
    res = routers.add("alpha", model_file)
    assert res.load_refusal("gpu") is None


@pytest.mark.asyncio
async def test_the_most_vram_a_model_was_seen_using_counts_when_it_is_more(
        model_file: Path) -> None:
    monitor = FakeMonitor(free_mib=4000)
    routers = Routers(config(headroom=1024), monitor)
    res = routers.add("alpha", model_file)
    assert res.load_refusal("gpu") is None
    res.profiles["gpu"].peak_vram = 3500 * MIB  # NVML saw its instance use this much once
    assert res.load_refusal("gpu") is not None


@pytest.mark.asyncio
async def test_models_max_unloads_an_idle_model_first_and_refuses_when_all_are_busy() -> None:
    routers = Routers(config(models_max=2), FakeMonitor(free_mib=None))
    for name in ("a", "b"):
        routers.add(name)
        await loaded(routers.models[name]["gpu"])
    c = routers.add("c")
    busy: list[Any] = []
    for name in ("a", "b"):
        routers.models[name]["gpu"].load.take(generation=True)
        busy.append(routers.models[name]["gpu"])
    refusal = c.load_refusal("gpu")
    assert refusal is not None and "--models-max (2)" in refusal
    busy[0].load.give_back(generation=True)  # `a` is idle now: it makes room
    assert c.load_refusal("gpu") is None
    c.start_child("gpu")
    await told(routers.models["a"]["gpu"])
    assert routers.models["a"]["gpu"].state is S.STOPPING
    assert routers.models["c"]["gpu"].state is S.STOPPED  # loads once `a` is gone
    assert routers.loader.unloads == ["a"]
    routers.models["a"]["gpu"].heard_exit(1)  # the unload, reported as status 1
    await told(routers.models["a"]["gpu"])
    await asyncio.wait_for(routers.models["c"]["gpu"].wait_state(S.STARTING), 5)  # `a` gone
    await told(routers.models["c"]["gpu"])
    assert routers.models["c"]["gpu"].state is S.STARTING and routers.loader.loads == ["c"]
    assert routers.models["a"]["gpu"].failures == 0
