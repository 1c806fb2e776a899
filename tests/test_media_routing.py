"""Routing by capability: a request with images or audio goes only to a child whose projector
takes them (learned from each child's /props), in admission, a replay and a continuation; the
small child only with a projector of its own; and when neither the GPU nor the CPU child takes
them, where a plain request goes (the child answers as llama-server does)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_failover_unit import cut, failed
from test_pool import FakeMember, FakeSource

from supervisor.policy.admission import Action, Capacity, ChildView, Request, decide
from supervisor.policy.estimate import Work
from supervisor.policy.lifecycle import ChildState
from supervisor.policy.media import Modality, find
from supervisor.policy.routes import RouteClass
from supervisor.serving.failover import Failover, GiveUp, GoOn, Replay
from supervisor.serving.pool import Lease, Pool

BOTH = frozenset({Modality.VISION, Modality.AUDIO})
VISION = frozenset({Modality.VISION})
NONE: frozenset[Modality] = frozenset()

GPU = ChildView("gpu", ChildState.READY, busy=0, cap=2, ctx_per_slot=4096, modalities=BOTH)
SMALL = ChildView("small", ChildState.READY, busy=0, cap=2, ctx_per_slot=4096, smaller=True,
                  modalities=NONE)
CPU = ChildView("cpu", ChildState.READY, busy=0, cap=1, ctx_per_slot=8192, expected_s=20.0,
                modalities=BOTH)
CAP = Capacity(children=(GPU, SMALL, CPU), vram_free_mib=8000, vram_headroom_mib=1024,
               waiting=0, max_waiting=4, wait_s=5.0, max_wait_s=60)
IMAGE = Request(route=RouteClass.GENERATION, prompt_tokens=100, cpu_allowed=True,
                deadline_s=None, media=VISION)
OPTED = dataclasses.replace(IMAGE, smaller_ok=True)
AUDIO = dataclasses.replace(IMAGE, media=frozenset({Modality.AUDIO}))
DOWN = {"state": ChildState.BACKOFF}


def cap(**changes: dict[str, Any]) -> Capacity:
    children = tuple(dataclasses.replace(c, **changes.get(c.name, {})) for c in CAP.children)
    return dataclasses.replace(CAP, children=children)


@pytest.mark.parametrize(("name", "req", "capacity", "action", "child"), [
    ("an image goes to the gpu child first", IMAGE, CAP, Action.FORWARD, "gpu"),
    ("gpu down: the cpu child, which takes images", IMAGE, cap(gpu=DOWN), Action.FORWARD, "cpu"),
    ("opted in, gpu down, the small child without a projector: the cpu child", OPTED,
     cap(gpu=DOWN), Action.FORWARD, "cpu"),
    ("opted in, the small child with a projector of its own (small.mmproj): the small child",
     OPTED, cap(gpu=DOWN, small={"modalities": VISION}), Action.FORWARD, "small"),
    ("an image, the cpu child without a projector, gpu full: it waits for the gpu child",
     IMAGE, cap(gpu={"busy": 2}, cpu={"modalities": NONE}), Action.WAIT, None),
    ("audio, the gpu child's projector vision only: the cpu child", AUDIO,
     cap(gpu={"modalities": VISION}), Action.FORWARD, "cpu"),
    ("audio, no child takes audio: where a plain request goes (the gpu child answers)",
     AUDIO, cap(gpu={"modalities": VISION}, cpu={"modalities": VISION}), Action.FORWARD, "gpu"),
    ("an image to a text-only server: where a plain request goes", IMAGE,
     cap(gpu={"modalities": NONE}, cpu={"modalities": NONE}), Action.FORWARD, "gpu"),
    ("not known yet (no /props read): taken as able", IMAGE,
     cap(gpu=DOWN, cpu={"modalities": None}), Action.FORWARD, "cpu"),
])
def test_who_takes_images_and_audio(name: str, req: Request, capacity: Capacity,
                                    action: Action, child: str | None) -> None:
    d = decide(req, capacity)
    assert (d.action, d.child) == (action, child), d.reason


def test_the_reason_names_the_projector() -> None:
    d = decide(AUDIO, cap(gpu={"modalities": VISION}))
    assert "projector does not take its audio" in d.reason


class MediaSource(FakeSource):
    """Each upstream's projector, as /props said it."""

    def __init__(self, modalities: dict[str, frozenset[Modality] | None],
                 states: dict[str, str]) -> None:
        super().__init__({name: 1 for name in states}, states)
        self.modalities = modalities

    def child_view(self, name: str, busy: int, work: Work,
                   with_estimate: bool = True) -> ChildView:
        view = super().child_view(name, busy, work, with_estimate)
        return dataclasses.replace(view, modalities=self.modalities.get(name))


def three(source: FakeSource) -> Pool:
    members = {name: FakeMember(name, source) for name in ("gpu", "small", "cpu")}
    return Pool(source, members, 4, 30.0, smaller={"small"})  # type: ignore[arg-type]


async def test_an_image_replay_skips_the_small_child_without_a_projector() -> None:
    source = MediaSource({"gpu": BOTH, "small": NONE, "cpu": BOTH},
                         {"gpu": "EXITED", "small": "READY", "cpu": "READY"})
    pool = three(source)
    nxt = await Failover(pool).after_failure(failed(smaller_ok=True, media=VISION))
    assert isinstance(nxt, Replay) and nxt.lease.name == "cpu" and not nxt.smaller
    nxt.lease.close(None, None)
    # with a projector of its own, the small child takes it
    source.modalities["small"] = VISION
    rerouted = await Failover(pool).after_failure(failed(smaller_ok=True, media=VISION))
    assert isinstance(rerouted, Replay) and rerouted.lease.name == "small"
    rerouted.lease.close(None, None)


async def test_no_other_projector_no_replay_and_the_reason_says_so() -> None:
    source = MediaSource({"gpu": BOTH, "small": NONE, "cpu": NONE},
                         {"gpu": "EXITED", "small": "READY", "cpu": "READY"})
    pool = three(source)
    refused = await Failover(pool).after_failure(failed(media=VISION))
    assert isinstance(refused, GiveUp) and "projector takes its vision" in refused.reason
    assert pool.busy("cpu") == 0
    # a text request still goes on
    plain = await Failover(pool).after_failure(failed())
    assert isinstance(plain, Replay) and plain.lease.name == "cpu"
    plain.lease.close(None, None)


async def test_a_cut_image_stream_goes_on_only_where_a_projector_takes_it() -> None:
    source = MediaSource({"gpu": BOTH, "small": NONE, "cpu": BOTH},
                         {"gpu": "EXITED", "small": "READY", "cpu": "READY"})
    pool = three(source)
    nxt = await Failover(pool).after_cut(cut(media=VISION))
    assert isinstance(nxt, GoOn) and nxt.lease.name == "cpu"
    nxt.lease.close(None, None)
    source.modalities["cpu"] = NONE
    refused = await Failover(pool).after_cut(cut(media=VISION))
    assert isinstance(refused, GiveUp) and "projector does not take" in refused.reason



class ReserveSource(MediaSource):
    """The GPU has 2,000 MiB free, a 1,024 MiB headroom, and each image's encoder took
    400 MiB above the child's baseline."""

    def vram_free_mib(self) -> float | None:
        return 2000.0

    def vram_headroom_mib(self) -> float:
        return 1024.0

    def media_reserve_mib(self, items: int) -> float:
        return 400.0 * items


async def test_the_headroom_keeps_room_for_the_images_encoded_at_once() -> None:
    image = find("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    source = ReserveSource({"gpu": BOTH, "cpu": BOTH}, {"gpu": "READY", "cpu": "READY"})
    source.caps = {"gpu": 4, "cpu": 1}
    members = {n: FakeMember(n, source) for n in ("gpu", "cpu")}
    pool = Pool(source, members, 4, 30.0)  # type: ignore[arg-type]

    async def lease(req: Request, work: Work) -> Lease:
        got = await pool.lease(req, work)
        assert isinstance(got, Lease), got
        pool.carry_media(got, len(work.media.items))  # as the handler does, attempting
        return got

    # 2,000 MiB free over a 1,024 MiB headroom; one image keeps 400 more: the GPU child.
    first = await lease(IMAGE, Work(100, 10, image))
    # A second while the first is encoded: 1,024 + 2 x 400 = 1,824 kept: still the GPU child.
    second = await lease(IMAGE, Work(100, 10, image))
    # A third: 1,024 + 3 x 400 = 2,224 > 2,000 free: the CPU child takes it.
    third = await lease(IMAGE, Work(100, 10, image))
    # A text request still goes to the GPU child: no encoder to make room for.
    text = await lease(dataclasses.replace(IMAGE, media=frozenset()), Work(100, 10))
    assert [x.name for x in (first, second, third, text)] == ["gpu", "gpu", "cpu", "gpu"]
    assert pool.media_in_flight("gpu") == 2
    for x in (first, second, third, text):
        x.close(None, None)
    assert pool.media_in_flight("gpu") == 0
