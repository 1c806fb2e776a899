"""Router mode's GPU lent when idle, model by model (service/model_lending.py), against fake
model entries (the real routers are tests/test_model_lending_integration.py's): a model's CPU
instance is loaded before its GPU instance is unloaded; a model in use keeps its GPU instance;
the wake loads the GPU instance again only where the card has room for it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from supervisor.policy.lifecycle import ChildState
from supervisor.records.incidents import IncidentLog
from supervisor.service.model_lending import ModelLending


class FakeInstance:
    def __init__(self, told: list[str], where: str, state: ChildState) -> None:
        self.told, self.where = told, where
        self.state = state
        self.state_since = 0.0
        self.load = SimpleNamespace(in_flight=0)

    def unload(self, reason: str) -> None:
        self.told.append(f"unload {self.where}")
        self.state = ChildState.STOPPED

    async def wait_state(self, *states: ChildState, timeout: float | None = None) -> bool:
        return self.state in states


class FakeResources:
    def __init__(self, upstreams: dict[str, FakeInstance], told: list[str]) -> None:
        self.upstreams, self.told = upstreams, told
        self.room = True

    def startable(self, name: str, state: ChildState) -> tuple[bool, bool]:
        return state is ChildState.STOPPED and (self.room or name == "cpu"), True

    def start_child(self, name: str) -> None:
        self.told.append(f"load {name}")
        self.upstreams[name].state = ChildState.STARTING


def rig(tmp_path: Path) -> tuple[ModelLending, dict[str, Any], list[str], list[float]]:
    told: list[str] = []
    entries: dict[str, Any] = {}
    for name in ("alpha", "beta"):
        ups = {"gpu": FakeInstance(told, f"{name}@gpu", ChildState.READY),
               "cpu": FakeInstance(told, f"{name}@cpu", ChildState.STOPPED)}
        pool = SimpleNamespace(last_used={"gpu": 0.0, "cpu": 0.0}, line=[],
                               answers={"gpu": 0, "cpu": 0}, wake=lambda: None)
        entries[name] = SimpleNamespace(upstreams=ups, pool=pool,
                                        resources=FakeResources(ups, told))
    config = SimpleNamespace(gpu_child="gpu", cpu_child="cpu",
                             gpu_settings=SimpleNamespace(idle_release_s=60.0))
    now = [0.0]
    lending = ModelLending(cast(Any, SimpleNamespace(entries=entries)), lambda: cast(Any, config),
                           IncidentLog(tmp_path / "incidents.jsonl", 1 << 20), None,
                           clock=lambda: now[0])
    return lending, entries, told, now


@pytest.mark.asyncio
async def test_an_idle_model_is_warmed_on_the_cpu_router_then_lent_and_woken_with_room(
        tmp_path: Path) -> None:
    lending, entries, told, now = rig(tmp_path)
    alpha, beta = entries["alpha"], entries["beta"]
    now[0] = 50.0
    beta.pool.last_used["gpu"] = 49.0
    lending.tick()
    assert told == []  # not idle for 60 s yet
    now[0] = 70.0
    beta.upstreams["gpu"].load.in_flight = 1  # beta is busy: it keeps its place
    lending.tick()
    assert told == ["load cpu"]  # alpha's CPU instance first (beta is in use)
    alpha.upstreams["cpu"].state = ChildState.READY
    lending.tick()
    assert told == ["load cpu", "unload alpha@gpu"]
    assert set(lending.released) == {"alpha"} and "alpha" in (lending.to_json() or {})
    assert [r["decision"] for r in lending.incidents.recent] == ["lent"]
    assert lending.incidents.recent[0]["model"] == "alpha"

    # No room on the card: a request for alpha goes to its CPU instance, nothing loads.
    alpha.resources.room = False
    assert alpha.pool.wake() is None and told[-1] == "unload alpha@gpu"
    # With room: its GPU instance loads again, once.
    alpha.resources.room = True
    woken = alpha.pool.wake()
    assert woken is not None and told[-1] == "load gpu"
    await woken
    assert alpha.pool.wake() is None and lending.released == {} and lending.to_json() is None
    assert [r["decision"] for r in lending.incidents.recent] == ["lent", "woken"]


@pytest.mark.asyncio
async def test_a_model_loaded_again_by_a_request_meanwhile_is_no_longer_lent(
        tmp_path: Path) -> None:
    lending, entries, told, now = rig(tmp_path)
    alpha = entries["alpha"]
    for instance in (alpha.upstreams["cpu"], entries["beta"].upstreams["cpu"]):
        instance.state = ChildState.READY
    now[0] = 70.0
    lending.tick()
    assert set(lending.released) == {"alpha", "beta"}
    alpha.upstreams["gpu"].state = ChildState.STARTING  # the pool loaded it for a long prompt
    lending.tick()
    assert set(lending.released) == {"beta"} and alpha.pool.wake() is None
    await asyncio.sleep(0)
