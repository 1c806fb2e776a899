"""A GPU child that died restarts only once the card has the memory back (issue 38,
llama.cpp#26981: after an image killed llama-server mid-prefill, each restart raced the dying
process for the VRAM and died the same way).

The rule (policy/release.py) is table-tested; then a child on fake processes and the fake
clock (tests/fake_launcher.py, tests/fake_clock.py: no sleeping), its cards sampled for real by
the GPU monitor from the fake GPUs: NVML (tests/fake_nvml, whose process list shows the dead
pid until the driver lets it go) and amdgpu's sysfs (tests/fake_gpu_tree.py, whose free memory
comes back late, as KFD's deferred teardown gives it back). A death whose memory lingers is
restarted only once it is released; one that never releases is started after
restart.release_wait_s, and the log says so.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from fake_clock import FakeClock
from fake_gpu_tree import GIB, add_card, add_fd, amdgpu_fdinfo, set_memory
from fake_launcher import FakeLauncher, Script

from supervisor.config.schema import ChildConfig, RestartConfig
from supervisor.gpu import GpuMonitor
from supervisor.gpu.drm import DrmSampler
from supervisor.gpu.nvml import NvmlSampler
from supervisor.policy import lifecycle, release
from supervisor.policy.lifecycle import ChildState
from supervisor.upstreams.children import Child

MIB = release.MIB
SLACK = 256 * MIB
S = ChildState
SIGABRT = -int(signal.SIGABRT)
CUDA_OOM = ("CUDA error: out of memory",
            "/src/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error")
PCI = "0000:01:00.0"
PID = 4001  # the fake launcher's first process


# --- the rule -----------------------------------------------------------------------------------


def _card(free_mib: int, processes: dict[int, int] | None = None, every: bool = True,
          pci: str = PCI) -> release.Card:
    return release.Card(pci, free_mib * MIB, {p: m * MIB for p, m in (processes or {}).items()},
                        every)


BEFORE = (_card(22000),)
LISTED = release.Footprint(PID, ended_at=100.0, before=BEFORE, listed_on=frozenset({PCI}))
UNLISTED = release.Footprint(PID, ended_at=100.0, before=BEFORE)  # DRM, or NVML in a container


@pytest.mark.parametrize("fp,cards,now,go,forced,said", [
    # NVML lists the dead pid with memory: not back, whatever the free figure.
    (LISTED, [_card(1500, {PID: 20480})], 101.0, False, False,
     f"pid {PID} still holds 20480 MiB on {PCI}"),
    (UNLISTED, [_card(22000, {PID: 20480})], 101.0, False, False, "still holds 20480 MiB"),
    # NVML listed it while it lived and lists it no more: back, even if another process took
    # the memory since.
    (LISTED, [_card(1500, {7: 20480})], 104.0, True, False,
     f"the card has pid {PID}'s memory back 4.0 s after its end"),
    # A source that lists only its own (DRM fdinfo), or a pid NVML never showed: free memory.
    (UNLISTED, [_card(1500, every=False)], 101.0, False, False,
     f"{PCI} has 1500 MiB free, 22000 MiB before pid {PID} started"),
    (UNLISTED, [_card(21800, every=False)], 101.0, True, False, "memory back 1.0 s after"),
    (UNLISTED, [_card(1500)], 101.0, False, False, "1500 MiB free"),
    # Past the bound: started anyway, saying what is still held.
    (LISTED, [_card(1500, {PID: 20480})], 130.0, True, True,
     f"pid {PID} still holds 20480 MiB on {PCI}, 30 s after its end: starting anyway "
     "(restart.release_wait_s = 30)"),
    # Nothing to compare with, or no figures: nothing to wait for.
    (release.Footprint(PID, 100.0), [_card(1500, every=False)], 101.0, True, False, "back"),
    (LISTED, None, 101.0, True, False, ""),
    (LISTED, [], 101.0, True, False, ""),
])
def test_the_release_rule(fp: release.Footprint, cards: list[release.Card] | None, now: float,
                          go: bool, forced: bool, said: str) -> None:
    judged = release.judge(fp, cards, now, bound_s=30.0, slack_bytes=SLACK, poll_s=1.0)
    assert (judged.go, judged.forced) == (go, forced), judged
    assert said in judged.why
    if not go:
        assert judged.again_s == 1.0


def test_the_rule_looks_again_no_later_than_the_bound_and_is_off_at_zero() -> None:
    held = [_card(1500, {PID: 20480})]
    assert release.judge(LISTED, held, 129.5, 30.0, SLACK, 1.0).again_s == pytest.approx(0.5)
    assert release.judge(LISTED, held, 101.0, 0.0, SLACK, 1.0).go  # restart.release_wait_s = 0


def test_every_card_the_process_used_must_have_it_back() -> None:
    other = "0000:02:00.0"
    fp = release.Footprint(PID, 100.0, (_card(22000), _card(22000, pci=other)),
                           frozenset({PCI, other}))
    judged = release.judge(fp, [_card(1500), _card(1500, {PID: 9000}, pci=other)], 101.0, 30.0,
                           SLACK, 1.0)
    assert not judged.go and judged.why == f"pid {PID} still holds 9000 MiB on {other}"


# --- a child on the fake GPUs -------------------------------------------------------------------


class Rig:
    """The GPU child on fake processes and the fake clock, its cards sampled by a real GPU
    monitor from a fake source; the first process dies of an OOM when the test says."""

    def __init__(self, sampler: Any, release_wait_s: float = 30.0) -> None:
        self.clock = FakeClock(fake_processes=True)
        self.launcher = FakeLauncher(self.clock, Script(ready_after=1))
        self.monitor = GpuMonitor(1.0, [sampler])
        cfg = ChildConfig(name="gpu", llama_server="/opt/llama/llama-server",
                          model_path="/models/tiny.gguf", args=("-c", "4096"), env={},
                          start_timeout_s=60.0, stop_grace_s=5.0, max_concurrency=None)
        restart = RestartConfig(backoff_initial_s=1.0, backoff_max_s=8.0, quick_failure_s=30.0,
                                max_quick_failures=5, hang_timeout_s=0.0,
                                fatal_retry_max_s=60.0, release_wait_s=release_wait_s)
        self.child = Child(cfg, restart, hang_timeout_s=0.0, rng=lambda: 0.5,
                           release_probe=self.monitor, clock=self.clock,
                           launcher=self.launcher)
        self.monitor.owners = lambda: {"gpu": [self.child.pid] if self.child.pid else None}

    async def ready(self, nth: int) -> None:
        """Until process `nth` is READY (a real timeout only as a guard: virtual time gets
        anywhere in moments)."""
        assert await self.child.engine.until(
            lambda life: life.generation == nth and life.state is S.READY, timeout=10), \
            self.child.to_json()

    async def kill_first(self) -> float:
        """The first process dies of a CUDA OOM (SIGABRT) half a second from now, on the
        clock (a timer, as the fake processes' own ends are: a crash dealt from the test's
        turn could land as a wait of the child's is about to jump); the clock's time of it."""
        proc = self.launcher.last
        assert proc.pid == PID and proc.alive
        died = self.clock.now() + 0.5
        self.clock.call_later(0.5, lambda: proc.crash(SIGABRT, *CUDA_OOM))
        return died

    def at(self, moment: float, act: Callable[[], None]) -> None:
        """`act` when the clock reaches `moment`."""
        self.clock.call_later(moment - self.clock.now(), act)

    async def second_spawned_at(self) -> float:
        await self.ready(2)
        return self.launcher.processes[1].spawned_at


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """tests/fake_nvml as `pynvml`, its figures in a file the test rewrites: one card."""
    spec = importlib.util.spec_from_file_location(
        "pynvml", Path(__file__).parent / "fake_nvml" / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    figures = tmp_path / "nvml.json"
    monkeypatch.setenv("FAKE_NVML_FILE", str(figures))

    def write(free_mib: int, processes: dict[int, int]) -> None:
        tmp = figures.with_suffix(".tmp")
        tmp.write_text(json.dumps({"total_mib": 24576, "free_mib": free_mib,
                                   "pci_bus_id": f"0000{PCI}",
                                   "processes": {str(p): m for p, m in processes.items()}}))
        tmp.replace(figures)

    write(22000, {})
    return write


@pytest.fixture
async def closing() -> AsyncIterator[list[Rig]]:
    rigs: list[Rig] = []
    yield rigs
    for rig in rigs:
        await rig.child.close()
        await rig.monitor.close()


async def _nvml_rig(write: Callable[..., None], rigs: list[Rig], **kw: Any) -> Rig:
    rig = Rig(NvmlSampler(), **kw)
    rigs.append(rig)
    await rig.monitor.start()
    rig.child.start()
    await rig.ready(1)
    # Loaded: the card shows the process and what it holds, in a sample taken while it lives.
    write(1500, {PID: 20480})
    await rig.monitor.sample_now()
    assert rig.monitor.listed_on(PID) == frozenset({PCI})
    return rig


async def test_nvml_a_dead_childs_lingering_memory_holds_its_restart_until_released(
        fake_nvml: Callable[..., None], closing: list[Rig],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spillway.child")
    rig = await _nvml_rig(fake_nvml, closing)
    died = await rig.kill_first()
    # The driver lets the dead process go 8 s after its end (its pid leaves NVML's list).
    rig.at(died + 8.0, lambda: fake_nvml(21900, {}))
    spawned = await rig.second_spawned_at()
    # The back-off was over at +1 s; the start waited for the card, and no longer.
    assert spawned == pytest.approx(died + 8.0)
    text = caplog.text
    assert f"pid {PID} still holds 20480 MiB on {PCI}" in text
    assert "waiting for the card to release the memory" in text
    assert f"the card has pid {PID}'s memory back 8.0 s after its end: starting" in text
    assert "starting anyway" not in text
    assert rig.child.to_json()["waiting_for_memory"] is None


async def test_nvml_memory_that_is_never_released_waits_no_longer_than_the_bound(
        fake_nvml: Callable[..., None], closing: list[Rig],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spillway.child")
    rig = await _nvml_rig(fake_nvml, closing, release_wait_s=30.0)
    died = await rig.kill_first()
    spawned = await rig.second_spawned_at()
    assert spawned == pytest.approx(died + 30.0)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and
              "starting anyway" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert warned[0].getMessage() == (
        f"[gpu] pid {PID} still holds 20480 MiB on {PCI}, 30 s after its end: starting anyway "
        "(restart.release_wait_s = 30)")


async def test_nvml_memory_released_at_once_is_no_wait(
        fake_nvml: Callable[..., None], closing: list[Rig],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="spillway.child")
    rig = await _nvml_rig(fake_nvml, closing)
    fake_nvml(21900, {})  # the usual case: gone with the process
    died = await rig.kill_first()
    assert await rig.second_spawned_at() == pytest.approx(died + 1.0)  # the back-off alone
    assert "waiting for the card" not in caplog.text


async def test_a_stop_while_it_waits_for_the_card_stops_it_there(
        fake_nvml: Callable[..., None], closing: list[Rig]) -> None:
    rig = await _nvml_rig(fake_nvml, closing)
    died = await rig.kill_first()
    seen: list[tuple[float, str | None, ChildState, int | None]] = []

    def stop() -> None:
        # 4 s after its end: the back-off is over, its start waits for the card.
        child = rig.child
        seen.append((rig.clock.now(), child.waiting_for_memory, child.state, child.pid))
        child.engine.post(lifecycle.Stop("stop asked for"))

    rig.at(died + 4.0, stop)
    assert await rig.child.engine.until(
        lambda life: life.state is S.STOPPED and not life.wanted, timeout=10)
    [(when, waiting, state, pid)] = seen
    assert when == pytest.approx(died + 4.0) and state is S.STARTING and pid is None
    assert waiting == f"pid {PID} still holds 20480 MiB on {PCI}"
    assert len(rig.launcher.processes) == 1  # it ended there: nothing was spawned
    assert rig.clock.now() == pytest.approx(died + 4.0)  # and it waited no longer
    assert rig.child.last_exit is not None and rig.child.last_exit.pid == PID  # the death's
    # The next start still waits for what the dead process holds.
    rig.at(died + 7.0, lambda: fake_nvml(21900, {}))
    rig.child.start()
    await rig.ready(3)  # (the second start ended before its process)
    assert rig.launcher.processes[1].spawned_at == pytest.approx(died + 7.0)


async def test_drm_free_memory_that_comes_back_late_holds_the_restart(
        tmp_path: Path, closing: list[Rig], caplog: pytest.LogCaptureFixture) -> None:
    """amdgpu: the process's own use is read from its fdinfo while it lives; once it is
    reaped only the card's free memory can say whether KFD has let the memory go."""
    caplog.set_level(logging.INFO, logger="spillway.child")
    sysfs, procfs = tmp_path / "sys", tmp_path / "proc"
    card = add_card(sysfs, 1, PCI, vram_used=2 * GIB)
    rig = Rig(DrmSampler(sysfs, procfs))
    closing.append(rig)
    await rig.monitor.start()
    rig.child.start()
    await rig.ready(1)  # it started with 22 GiB free
    set_memory(card, 24 * GIB, 22 * GIB, 32 * GIB, 0)  # loaded: 20 GiB of it its own
    add_fd(procfs, PID, 9, amdgpu_fdinfo(PCI, 3, vram_kib=20 * 1024 * 1024))
    await rig.monitor.sample_now()
    assert rig.monitor.child_devices[0].process_bytes == {PID: 20 * GIB}
    died = await rig.kill_first()
    # Reaped: no /proc entry any more, the VRAM not yet back; KFD gives it back 5 s later.
    rig.at(died, lambda: shutil.rmtree(procfs / str(PID)))
    rig.at(died + 5.0, lambda: set_memory(card, 24 * GIB, 2 * GIB, 32 * GIB, 0))
    assert await rig.second_spawned_at() == pytest.approx(died + 5.0)
    assert f"{PCI} has 2048 MiB free, 22528 MiB before pid {PID} started" in caplog.text


async def test_a_child_with_no_gpu_figures_starts_as_before(closing: list[Rig]) -> None:
    """No card to read (the monitor has no source): nothing to wait for."""

    class Nothing:
        def open(self) -> None:
            from supervisor.gpu import Unavailable
            raise Unavailable("no GPU here")

        def sample(self, *_: Any) -> list[Any]:
            return []

        def close(self) -> None:
            pass

    rig = Rig(Nothing())
    closing.append(rig)
    await rig.monitor.start()
    rig.child.start()
    await rig.ready(1)
    died = await rig.kill_first()
    assert await rig.second_spawned_at() == pytest.approx(died + 1.0)
