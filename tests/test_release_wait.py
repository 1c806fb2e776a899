"""The release rule (policy/release.py): a dead GPU process's memory, back on the card or not,
and whether the next start waits (issue 38, llama.cpp#26981)."""

from __future__ import annotations

import signal

import pytest

from supervisor.policy import release
from supervisor.policy.lifecycle import ChildState

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
