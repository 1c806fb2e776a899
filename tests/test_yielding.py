"""Issue 49: the GPU child giving way to another program on its cards, and coming back.

The pure rules (policy/yielding.py), then the lending (service/lending.py) driving a real fleet
of recording children, with the cards' figures, the clock and the sleeps through their seams."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from supervisor.policy import yielding
from supervisor.policy.lifecycle import ChildState
from supervisor.records.incidents import IncidentLog
from supervisor.service.fleet import IDLE, YIELD, Fleet, Lent
from supervisor.service.lending import Lending

MIB = 1024 * 1024
GIB = 1024 * MIB
HEADROOM = 1024 * MIB


def card(free_mib: int, processes: dict[int, int], total_mib: int = 24576,
         listed: bool = True) -> yielding.CardUse:
    return yielding.CardUse((free_mib) * MIB, (total_mib - free_mib) * MIB,
                            {pid: mib * MIB for pid, mib in processes.items()}, listed)


# --- the rules ----------------------------------------------------------------------------------

def test_the_others_are_each_cards_use_less_spillways_own_processes() -> None:
    cards = [card(10000, {100: 4000, 4242: 6000}), card(20000, {100: 2000, 77: 500})]
    others = yielding.others_on(cards, own={100})
    # used: 14576 + 4576 MiB; own: 6000 MiB (the driver's own use counts as the others')
    assert others.bytes == (14576 + 4576 - 6000) * MIB
    assert others.by_pid == {4242: 6000 * MIB, 77: 500 * MIB} and others.listed
    # The DRM fdinfo reads only the pids asked for: the others are a sum, and none is named.
    drm = yielding.others_on([card(10000, {100: 4000}, listed=False)], own={100})
    assert drm.bytes == (14576 - 4000) * MIB and drm.by_pid == {} and not drm.listed


def test_the_grower_is_the_listed_process_that_grew_most() -> None:
    before = yielding.Others(0, {77: 500 * MIB, 4242: 1000 * MIB})
    assert yielding.grower(yielding.Others(0, {77: 600 * MIB, 4242: 5000 * MIB}), before) == 4242
    assert yielding.grower(yielding.Others(0, {77: 500 * MIB, 9: 300 * MIB}), before) == 9
    assert yielding.grower(yielding.Others(0, {77: 400 * MIB}), before) is None
    assert yielding.grower(yielding.Others(5 * GIB), before) is None


def test_growth_counts_from_the_last_sample_with_room_and_quiet_from_the_last_move() -> None:
    watch = yielding.OthersWatch()
    watch.see(yielding.Others(2 * GIB), now=0.0, room=True)
    watch.see(yielding.Others(3 * GIB), now=1.0, room=True)
    watch.see(yielding.Others(9 * GIB), now=2.0, room=False)
    assert watch.grown_bytes(yielding.Others(9 * GIB)) == 6 * GIB
    watch.see(yielding.Others(9 * GIB + 10 * MIB), now=9.0, room=False)  # (NVML's own wobble)
    assert watch.quiet_for(12.0) == 10.0
    watch.afresh()
    watch.see(yielding.Others(9 * GIB), now=13.0, room=False)  # counted afresh, room or not
    assert watch.grown_bytes(yielding.Others(9 * GIB)) == 0


@pytest.mark.parametrize(("state", "lent", "free", "grown", "gives"), [
    (ChildState.READY, False, 500 * MIB, 6 * GIB, True),
    (ChildState.READY, False, 2 * GIB, 6 * GIB, False),  # the headroom kept
    (ChildState.READY, False, 500 * MIB, 0, False),  # the GPU child's own growth
    (ChildState.READY, False, 500 * MIB, 32 * MIB, False),  # within the figures' wobble
    (ChildState.STARTING, False, 500 * MIB, 6 * GIB, False),  # loading: its own not listed yet
    (ChildState.READY, True, 500 * MIB, 6 * GIB, False),  # lent already
])
def test_the_gpu_child_gives_way_to_others_growing_into_its_headroom(
        state: ChildState, lent: bool, free: int, grown: int, gives: bool) -> None:
    assert yielding.gives_way(True, state, lent, free, HEADROOM, grown) is gives
    assert not yielding.gives_way(False, state, lent, free, HEADROOM, grown)


def test_it_comes_back_with_room_once_the_program_left_or_held_still() -> None:
    assert yielding.comes_back(room=True, quiet_for_s=0.0, quiet_s=10.0, gone=True)
    assert yielding.comes_back(room=True, quiet_for_s=10.0, quiet_s=10.0, gone=False)
    assert not yielding.comes_back(room=True, quiet_for_s=9.0, quiet_s=10.0, gone=False)
    assert not yielding.comes_back(room=False, quiet_for_s=60.0, quiet_s=10.0, gone=True)


# --- the lending, with a real fleet of recording children ----------------------------------------

class FakeChild:
    """Stands in for upstreams.children.Child: its state moves as it is told."""

    def __init__(self, name: str, told: list[str]) -> None:
        self.name = name
        self.told = told
        self.hold: Any = None
        self.state = ChildState.READY
        self.state_since = 0.0
        self.load = SimpleNamespace(in_flight=0)
        self.cfg = SimpleNamespace(label=f"{name.upper()} child")
        self.stop_grace: float | None = None
        self.pid: int | None = 100 if name == "gpu" else 200

    def start(self) -> None:
        self.told.append(f"{self.name} start")
        self.state = ChildState.STARTING

    async def stop(self, reason: str, grace_s: float | None = None) -> None:
        self.told.append(f"{self.name} stop")
        self.stop_grace = grace_s
        self.state = ChildState.STOPPED
        self.pid = None


class FakeCards:
    """The cards' figures as a test sets them (tests/fake_nvml is the daemon's own)."""

    def __init__(self) -> None:
        self.cards = [card(20000, {})]
        self.taken = 0.0
        self.room = True
        self.names = {4242: "ComfyUI"}
        self.running = {4242}
        self.keeps = False

    def set(self, free_mib: int, processes: dict[int, int], at: float) -> None:
        self.cards, self.taken = [card(free_mib, processes)], at

    def sample(self) -> tuple[float, list[yielding.CardUse]] | None:
        return self.taken, self.cards

    def own(self) -> set[int]:
        return {100, 200}

    def pids_of(self, name: str) -> list[int]:
        return [100] if name == "gpu" else [200]

    def short(self) -> bool:
        return not self.room

    def name_of(self, pid: int) -> str | None:
        return self.names.get(pid)

    def alive(self, pid: int) -> bool:
        return pid in self.running

    async def now(self) -> list[yielding.CardUse] | None:
        """Sampled now: the GPU child (pid 100) stopped, its memory back on the card (unless
        the driver keeps it: `keeps`)."""
        if self.keeps:
            return self.cards
        return [yielding.CardUse(c.free_bytes + c.process_bytes.get(100, 0), c.used_bytes,
                                 {p: b for p, b in c.process_bytes.items() if p != 100},
                                 c.lists_every_process) for c in self.cards]


class Rig:
    def __init__(self, tmp_path: Path, yield_on: bool = True, idle_s: float = 0.0) -> None:
        self.told: list[str] = []
        self.children = {n: FakeChild(n, self.told) for n in ("gpu", "cpu")}
        self.fleet = Fleet(cast(Any, self.children), set())
        self.pool = SimpleNamespace(roles=["gpu", "cpu"], last_used={"gpu": 0.0, "cpu": 0.0},
                                    line=[], answers={"gpu": 0, "cpu": 0}, wake=None)
        self.settings = SimpleNamespace(yield_to_other_processes=yield_on, yield_quiet_s=10.0,
                                        vram_headroom_mib=1024, idle_release_s=idle_s)
        self.incidents = IncidentLog(tmp_path / "incidents.jsonl", 1 << 20)
        self.now = 0.0
        self.slept = 0.0
        self.cards = FakeCards()
        self.lending = Lending(self.fleet, cast(Any, self.pool),
                               lambda: cast(Any, SimpleNamespace(gpu_settings=self.settings)),
                               self.incidents, None, self.cards, clock=lambda: self.now,
                               sleep=self.sleep)

    async def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.now += seconds
        await asyncio.sleep(0)

    async def sample(self, free_mib: int, processes: dict[int, int], dt: float = 1.0) -> None:
        """One more sample, the lending's tick on it, and the fleet's commands taken."""
        self.now += dt
        self.cards.set(free_mib, processes, self.now)
        self.lending.tick()
        for _ in range(20):
            await asyncio.sleep(0)

    def decisions(self) -> list[tuple[str, str]]:
        return [(r["decision"], r["kind"]) for r in self.incidents.recent]


@pytest.mark.asyncio
async def test_another_program_taking_the_headroom_has_the_gpu_child_give_way_and_come_back(
        tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    gpu = rig.children["gpu"]
    await rig.sample(8000, {100: 12000})  # the GPU child's own 12 GB: room to spare
    assert rig.lending.others_json() == {"mib": 24576 - 8000 - 12000, "processes": {},
                                         "grown_mib": 0, "still_for_s": 0.0}
    await rig.sample(600, {100: 12000, 4242: 7400})  # ComfyUI takes 7.4 GB
    lent = rig.fleet.lent["gpu"]
    assert lent.why == YIELD and lent.to_whom == "pid 4242 (ComfyUI)" and lent.pid == 4242
    assert "gpu" in rig.fleet.paused and gpu.state is ChildState.STOPPED
    assert rig.slept == 0.0 and gpu.stop_grace == yielding.GRACE_S  # nothing in flight
    assert "7400 MiB more" in lent.reason and "600 MiB free" in lent.reason
    assert rig.decisions() == [("lent", "lent_yield")]
    assert rig.lending.wake() is None  # a request does not bring it back
    status = rig.lending.to_json()
    assert status is not None and status["to_whom"] == "pid 4242 (ComfyUI)"
    assert status["vram"] == "12000 MiB back on the card"  # checked on the card

    # The card has no room: it stays lent, however long the others hold still.
    rig.cards.room = False
    await rig.sample(12600, {4242: 7400}, dt=30.0)
    assert "gpu" in rig.fleet.lent
    # ComfyUI left the card: back at once, with room.
    rig.cards.room = True
    rig.cards.running.clear()
    await rig.sample(20000, {})
    assert "gpu" not in rig.fleet.lent and "gpu" not in rig.fleet.paused
    assert rig.told[-1] == "gpu start"
    assert rig.decisions()[-1] == ("returned", "lent_yield")
    assert "pid 4242 (ComfyUI) left it" in rig.incidents.recent[-1]["reason"]


@pytest.mark.asyncio
async def test_the_gpu_childs_own_growth_never_makes_it_give_way(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    await rig.sample(8000, {100: 12000, 4242: 500})
    await rig.sample(600, {100: 19400, 4242: 500})  # its own KV cache and batch
    assert "gpu" not in rig.fleet.lent
    # Off (the default): another program taking the headroom changes nothing either.
    off = Rig(tmp_path / "off", yield_on=False)
    await off.sample(8000, {100: 12000})
    await off.sample(600, {100: 12000, 4242: 7400})
    assert "gpu" not in off.fleet.lent and off.decisions() == []


@pytest.mark.asyncio
async def test_answers_in_flight_get_a_moment_then_the_gpu_child_stops(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    gpu = rig.children["gpu"]
    gpu.load.in_flight = 2  # they outlast the drain: cut, and the failover takes them on
    await rig.sample(8000, {100: 12000})
    await rig.sample(600, {100: 12000, 4242: 7400})
    for _ in range(100):
        await asyncio.sleep(0)
    assert gpu.state is ChildState.STOPPED
    assert rig.slept == pytest.approx(yielding.DRAIN_S, abs=0.11)


@pytest.mark.asyncio
async def test_with_an_unnamed_program_it_comes_back_once_the_others_held_still(
        tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cards.names.clear()
    rig.cards.running = {31337}
    await rig.sample(8000, {100: 12000})
    await rig.sample(600, {100: 12000, 31337: 7400})
    assert rig.fleet.lent["gpu"].to_whom == "pid 31337"
    await rig.sample(12600, {31337: 7400})  # still there, but the card has room for it
    await rig.sample(12600, {31337: 7400}, dt=5.0)
    assert "gpu" in rig.fleet.lent  # 6 s still: not yet
    await rig.sample(12600, {31337: 7400}, dt=5.0)
    assert "gpu" not in rig.fleet.lent
    assert "held still for 11 s" in rig.incidents.recent[-1]["reason"]


@pytest.mark.asyncio
async def test_a_gpu_child_lent_when_idle_is_not_woken_into_a_card_another_program_filled(
        tmp_path: Path) -> None:
    rig = Rig(tmp_path, yield_on=False)
    gpu = rig.children["gpu"]
    await rig.fleet.pause("gpu", "idle", Lent(IDLE, "idle for 300 s", 0.0, 0.0))
    gpu.state_since = rig.now
    rig.cards.room = False
    await rig.sample(600, {4242: 19400})  # ComfyUI took the card meanwhile
    assert rig.lending.wake() is None
    lent = rig.fleet.lent["gpu"]
    assert lent.why == YIELD and lent.to_whom == "pid 4242 (ComfyUI)"
    assert rig.told[-1] == "gpu stop"  # never started into it
    rig.cards.room = True
    rig.cards.running.clear()
    await rig.sample(20000, {})
    assert rig.told[-1] == "gpu start" and "gpu" not in rig.fleet.lent
    # With room, a request wakes it as before.
    idle = Rig(tmp_path / "room", yield_on=False)
    await idle.fleet.pause("gpu", "idle", Lent(IDLE, "idle for 300 s", 0.0, 0.0))
    await idle.sample(20000, {})
    woken = idle.lending.wake()
    assert woken is not None
    await woken
    assert idle.told[-1] == "gpu start"


# --- a lending carried over an upgrade -------------------------------------------------------

def test_a_lending_is_kept_in_the_state_file_and_carried_to_the_next_daemon(
        tmp_path: Path) -> None:
    import time

    from supervisor.upstreams.owned import ChildRecord, State, StateFile

    lent = Lent(YIELD, "ComfyUI took the card", time.time() - 30, 0.0, 7, "pid 4242 (ComfyUI)",
                4242)
    record = ChildRecord(name="cpu", pid=1234, start_ticks=1, boot_id="b", argv=("x",),
                         port=1, api_key="k", owner="o", media_marker="m", fingerprint="f",
                         started=0.0, daemon_pid=1)
    file = StateFile(str(tmp_path / "spillway.toml"), folder=tmp_path)
    file.write(State(1, "m", (record,), {"gpu": lent.to_json()}))
    read = file.read()
    assert read is not None and set(read.lent) == {"gpu"}
    carried = Lent.carried(read.lent["gpu"])
    # The same lending, in this process's clock; the CPU child's answers counted from now.
    assert (carried.why, carried.reason, carried.since, carried.to_whom, carried.pid) == (
        lent.why, lent.reason, lent.since, lent.to_whom, lent.pid)
    assert carried.answers_then == 0
    assert 29 < time.monotonic() - carried.since_monotonic < 40
    for bad in ({"why": "borrowed", "since": 1.0}, {"why": IDLE}, {"why": IDLE, "since": 1.0,
                                                                  "pid": "4242"}):
        with pytest.raises(ValueError):
            Lent.carried(bad)
    # A state file without lent (an older daemon's) reads as nothing lent.
    file.write(State(1, "m", (record,)))
    older = file.read()
    assert older is not None and older.lent == {}


@pytest.mark.asyncio
async def test_a_card_that_keeps_the_lent_childs_memory_is_said(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cards.keeps = True  # the driver has not torn its context down
    await rig.sample(8000, {100: 12000})
    await rig.sample(600, {100: 12000, 4242: 7400})
    for _ in range(200):
        await asyncio.sleep(0)
    status = rig.lending.to_json()
    assert status is not None
    assert status["vram"] == "pid 100 still holds 12000 MiB on the card"
    assert rig.slept == pytest.approx(yielding.RELEASE_CHECK_S, abs=0.6)

