"""The fleet (service/fleet.py), the one owner of the children: its commands are taken in the
order posted, on a later turn of the loop than the one that posted them, never for a paused
child's start; a long one does not hold up the next; its holds are named, several at once.
Against a fake child that records what it was told (a unit test: the real children's commands
are the engine's, tested in test_child_commands.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from supervisor.service.fleet import Fleet

pytestmark = pytest.mark.asyncio


class RecordingChild:
    """Stands in for upstreams.children.Child: records each command; its stop waits until
    `stopped` is set."""

    def __init__(self, name: str, told: list[str]) -> None:
        self.name = name
        self.told = told
        self.hold: Any = None
        self.stopped = asyncio.Event()

    def start(self) -> None:
        self.told.append(f"{self.name} start")

    def restart(self, reason: str) -> None:
        self.told.append(f"{self.name} restart ({reason})")

    def drain(self, reason: str, then_stop: bool = False) -> None:
        self.told.append(f"{self.name} drain{' then stop' if then_stop else ''}")

    async def stop(self, reason: str, grace_s: float | None = None) -> None:
        self.told.append(f"{self.name} stopping")
        await self.stopped.wait()
        self.told.append(f"{self.name} stopped")

    async def close(self, grace_s: float | None = None) -> None:
        if self.name == "cpu":
            raise OSError("its process table entry is gone")
        self.told.append(f"{self.name} closed")


def fleet_of(*names: str) -> tuple[Fleet, dict[str, RecordingChild], list[str]]:
    told: list[str] = []
    children = {n: RecordingChild(n, told) for n in names}
    return Fleet(cast(Any, children), set()), children, told


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_commands_are_taken_in_order_on_a_later_turn() -> None:
    fleet, _, told = fleet_of("gpu", "cpu")
    fleet.drain("gpu", "sick", then_stop=True)
    fleet.start("cpu")
    fleet.restart("gpu", "the card has room again")
    assert told == []  # not inside the caller's step (a listener, a lifecycle step)
    await settle()
    assert told == ["gpu drain then stop", "cpu start", "gpu restart (the card has room again)"]


async def test_a_paused_child_is_not_started_until_resumed() -> None:
    fleet, children, told = fleet_of("gpu", "cpu")
    children["gpu"].stopped.set()
    await fleet.pause("gpu", "operator: pause")
    assert "gpu" in fleet.paused and told == ["gpu stopping", "gpu stopped"]
    fleet.start("gpu")  # a request's on-demand start, say
    await settle()
    assert told == ["gpu stopping", "gpu stopped"]
    fleet.resume("gpu")
    await settle()
    assert told[-1] == "gpu start" and "gpu" not in fleet.paused
    # An operator's restart of a paused child brings it back.
    fleet.keep_stopped(["gpu"])
    fleet.restart("gpu", "operator", unpause=True)
    await settle()
    assert told[-1] == "gpu restart (operator)" and "gpu" not in fleet.paused


async def test_a_long_command_does_not_hold_up_the_next_and_its_future_says_when_done() -> None:
    fleet, children, told = fleet_of("gpu", "small")
    stopping = fleet.stop("small", "making way")
    fleet.start("gpu")
    await settle()
    assert told == ["small stopping", "gpu start"] and not stopping.done()
    children["small"].stopped.set()
    await asyncio.wait_for(stopping, 1)
    assert told[-1] == "small stopped"


async def test_a_failing_command_is_its_callers_and_the_fleet_goes_on() -> None:
    fleet, _, told = fleet_of("gpu", "cpu")
    ended = await fleet.close(None)
    assert ended["gpu"] is None and isinstance(ended["cpu"], OSError)
    assert told == ["gpu closed"]
    fleet.start("gpu")
    await settle()
    assert told == ["gpu closed", "gpu start"]


async def test_holds_are_named_and_the_child_asks_the_fleet() -> None:
    fleet, children, _ = fleet_of("gpu", "small")
    small_up = [True]
    fleet.hold("gpu", "small", lambda: "the small child holds the card" if small_up[0] else None)
    fleet.hold("gpu", "handover", lambda: "an upgrade's handover is in progress")
    gpu_hold = children["gpu"].hold  # set once by the fleet: the child's lifecycle asks it
    assert gpu_hold() == "the small child holds the card"
    small_up[0] = False
    assert gpu_hold() == "an upgrade's handover is in progress"
    fleet.unhold("gpu", "handover")
    assert gpu_hold() is None and children["small"].hold() is None
    assert children["gpu"].hold is gpu_hold  # never swapped


async def test_a_child_lent_when_idle_is_woken_by_a_request_not_one_the_operator_paused(
        ) -> None:
    from supervisor.service.fleet import IDLE, Lent

    fleet, children, told = fleet_of("gpu", "cpu")
    children["gpu"].stopped.set()
    await fleet.pause("gpu", "idle", Lent(IDLE, "idle for 5 s", 0.0, 0.0))
    assert "gpu" in fleet.paused and fleet.lent["gpu"].why == IDLE
    woken = fleet.wake("gpu")
    assert woken is not None and "gpu" not in fleet.paused and "gpu" not in fleet.lent
    await woken
    assert told[-1] == "gpu start"
    assert fleet.wake("gpu") is None  # (woken once)
    # Lent by the operator: a request does not bring it back; `resume` does.
    await fleet.pause("gpu", "operator: spillway gpu pause")
    assert fleet.lent["gpu"].why == "operator" and fleet.wake("gpu") is None
    assert "gpu" in fleet.paused
    fleet.resume("gpu")
    await settle()
    assert "gpu" not in fleet.lent and told[-1] == "gpu start"
