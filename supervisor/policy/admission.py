"""Admission: the decision taken before forwarding (forward, route elsewhere, wait, reject).

Pure. The design's order, numbered the same way in the code:

1. Spillway's own routes are answered directly (the app routes them before this module).
2. Bad input is rejected with a 4xx before any child sees it (the handler checks the body).
3. A prompt over the GPU child's context per slot goes to a child with room, else 400.
4. GPU child ready, under its concurrency cap, VRAM headroom kept: forward to it.
   (4c) A request that accepts another model (X-Spillway-Fallback: smaller, or
   small.requests = "all"), when a small child serves a smaller model on the GPU: forward to
   it, ready with room (or on-demand and startable): its answer comes at GPU speed, where the
   CPU child's would take minutes or miss the deadline.
5. Replay-safe, CPU child ready or startable (RAM available), expected CPU time within the
   client's deadline: forward to the CPU child.

The children come in the config's order (`Capacity.children`): the first is the GPU child (the
preferred, given the GPU: the headroom rule is its), the last the CPU child (the one a request
that may move goes to), and between them the small child when one is configured (`smaller`:
only the requests that accept another model go to it); their names and labels are the config's.
6. Room in the waiting line and the wait fits the deadline: wait, in FIFO order.
7. Else 503 with Retry-After, x-should-retry, queue position and the estimated wait.

Routes outside generation (`/props`, `/slots`, ...) are outside the caps: the GPU child when
ready, else the CPU child, or the child pinned with `X-Spillway-Child`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass

from .lifecycle import ChildState
from .media import Modality
from .routes import RouteClass



class Action(enum.StrEnum):
    FORWARD = "forward"
    WAIT = "wait"
    REJECT = "reject"  # 503: no capacity now
    TOO_LONG = "too_long"  # 400 exceed_context_size_error


@dataclass(frozen=True)
class ChildView:
    name: str
    state: ChildState
    busy: int  # generation requests it is working on
    cap: int  # at most this many at once
    ctx_per_slot: int | None  # from its /props; None until known
    startable: bool = False  # stopped, may be started now (on-demand CPU child)
    ram_ok: bool = True  # enough RAM for it (the CPU guard)
    expected_s: float | None = None  # how long this request would take on it
    # Not ready: seconds until it is expected to serve again on its own (a restart under way);
    # None when it is not coming back by itself (FATAL, stopped, paused) or nothing is known.
    back_in_s: float | None = None
    label: str = ""  # as people are told ("GPU child"); by default from its name
    smaller: bool = False  # serves a smaller model: only requests that accept one go to it
    # What its projector takes (/props `modalities`); None: not known yet, taken as able.
    modalities: frozenset[Modality] | None = None

    @property
    def shown(self) -> str:
        return self.label or f"{self.name.upper()} child"

    @property
    def ready(self) -> bool:
        return self.state == ChildState.READY

    @property
    def has_room(self) -> bool:
        return self.ready and self.busy < self.cap

    def fits(self, prompt_tokens: int) -> bool:
        # llama-server refuses a prompt that fills its slot: it needs room for one more token.
        return self.ctx_per_slot is None or prompt_tokens < self.ctx_per_slot

    def takes(self, media: frozenset[Modality]) -> bool:
        """Whether its projector takes the request's images, audio or video."""
        return not media or self.modalities is None or media <= self.modalities


@dataclass(frozen=True)
class Request:
    route: RouteClass
    prompt_tokens: int  # counted, or a cheap upper bound when that shows it is small
    cpu_allowed: bool  # replay-safe: a parsed generation request that did not opt out
    deadline_s: float | None  # seconds the client still waits, if it said
    pin: str | None = None  # X-Spillway-Child (routes outside generation only)
    # Counted and checked as the child counts and checks (policy/prompts.py): Spillway may then
    # refuse a prompt over every context itself, in the child's words.
    exact_count: bool = True
    # It accepts an answer from a smaller model (X-Spillway-Fallback: smaller, or the config's
    # small.requests = "all"): the small child may take it.
    smaller_ok: bool = False
    # The request's images, audio or video (policy/media.py): only a child whose projector
    # takes them is sent it, while one of the GPU and CPU children does; when neither does,
    # it goes where a plain request goes and the child answers as llama-server does.
    media: frozenset[Modality] = frozenset()
    # Seconds it has waited in line, when it is there (asked again as capacity changes:
    # can_serve_now); None for a request that arrives. One waiting for the GPU child's return
    # goes on waiting for it, a little late, for up to half of what it is allowed to wait.
    waited_s: float | None = None


@dataclass(frozen=True)
class Capacity:
    children: tuple[ChildView, ...]  # in the config's order: the GPU child first, the CPU last
    vram_free_mib: float | None  # None: no GPU figures (no driver): the rule does not apply
    vram_headroom_mib: float
    waiting: int  # requests already in line, ahead of this one
    max_waiting: int
    wait_s: float  # estimated wait for a place at the back of the line
    max_wait_s: float
    # Branch 5w on (failover.wait_for_gpu): a request may wait for the GPU child on its way
    # back when that is clearly sooner; off, the CPU child takes what it can take now.
    wait_for_gpu: bool = True

    @property
    def gpu(self) -> ChildView:
        """The first child: the preferred, given the GPU."""
        return self.children[0]

    @property
    def cpu(self) -> ChildView:
        """The last child: where a request that may move goes when the first cannot take it."""
        return self.children[-1]

    @property
    def small(self) -> ChildView | None:
        """The child serving a smaller model, when one is configured."""
        return next((c for c in self.children if c.smaller), None)

    def child(self, name: str) -> ChildView:
        return next(c for c in self.children if c.name == name)


@dataclass(frozen=True)
class Decision:
    action: Action
    branch: int
    reason: str
    child: str | None = None
    start_child: bool = False  # start it first (on-demand cold start)
    warm: str | None = None  # start this one too, in the background (router mode: a load)
    retry_after_s: float = 0.0
    queue_position: int = 0
    cause: str = ""  # for REJECT/TOO_LONG: a short label for metrics and logs
    n_ctx: int = 0  # TOO_LONG: the largest context of a slot, which the prompt exceeds
    # The forecast it acted on: seconds until the answer is expected to end on the path taken
    # (None: none was made), recorded beside what happened so the estimator can be judged.
    expected_s: float | None = None


# States from which a child serves again without anyone's help.
_COMING = frozenset({ChildState.READY, ChildState.STARTING, ChildState.BACKOFF,
                     ChildState.EXITED, ChildState.DRAINING, ChildState.STOPPING})


def _may_serve(child: ChildView) -> bool:
    return child.state in _COMING


def _headroom_kept(cap: Capacity) -> bool:
    return cap.vram_free_mib is None or cap.vram_free_mib >= cap.vram_headroom_mib


def _retry_after(cap: Capacity) -> float:
    """How soon capacity may be back, from what is known."""
    if cap.wait_s > 0:
        return cap.wait_s
    states = {c.state for c in cap.children}
    if states & {ChildState.STARTING, ChildState.DRAINING, ChildState.STOPPING}:
        return 2.0
    if states & {ChildState.BACKOFF, ChildState.EXITED}:
        return 5.0
    return 30.0


# Branch 7, no child can take the request: the children that would fit it are stopped or FATAL,
# not on their way back by themselves (a GPU child lent to another program or paused, and a
# prompt over the CPU child's context; one coming back would be waited for, branch 6). When it
# is back is not known: the waiting line's estimate is for the requests the others can serve.
NO_CHILD_RETRY_S = 30.0


def _too_long(req: Request, cap: Capacity) -> str:
    """Where a ready child cannot take the request because its prompt is over that child's
    context, said: otherwise `_why` calls a child with free slots only "busy"."""
    over = [f"the {c.shown}'s context ({c.ctx_per_slot} tokens a slot)"
            for c in (cap.gpu, cap.cpu)
            if c.ctx_per_slot is not None and req.prompt_tokens and not c.fits(req.prompt_tokens)]
    return f"; the prompt (about {req.prompt_tokens} tokens) is over {' and '.join(over)}" \
        if over else ""


def _to_smaller(req: Request, cap: Capacity, gpu_fits: bool) -> Decision | None:
    """Branch 4c: for a request that accepts a smaller model, the small child (if there is
    one), ready with room or startable, when the prompt fits it."""
    small = cap.small
    if not req.smaller_ok or small is None or not small.fits(req.prompt_tokens) or not (
            small.has_room or small.startable) or not small.takes(req.media):
        return None  # (without a projector of its own, it is not sent images or audio)
    # Router mode: the model not loaded on the GPU router, and loading it would fit (4b): it is
    # loaded for the requests after, while the smaller one answers this one.
    gpu = cap.gpu
    warm = gpu.name if gpu_fits and gpu.startable and _headroom_kept(cap) else None
    return Decision(Action.FORWARD, 4, f"rerouted to the smaller model on the {small.shown}: "
                                       f"{_gpu_cannot(cap, gpu_fits, req.media)}", child=small.name,
                    start_child=not small.has_room, warm=warm)


# Waiting for the GPU child is chosen only when its forecast beats the CPU child's by this
# factor: its return is a forecast from its last start, and a child that died of an OOM may
# die again; the CPU child's time is measured on the spot.
GPU_WAIT_MARGIN = 0.8


def gpu_forecast_s(cap: Capacity, gpu_fits: bool = True) -> float | None:
    """When a request that waits for the GPU child, on its way back, is expected to be
    answered: what is left of its restart (back-off and its measured start time), the requests
    ahead of it in line, and its own time at the GPU child's speed. None when it is not coming
    back by itself, or its speed is not known yet."""
    gpu = cap.gpu
    if gpu.ready or not gpu_fits or gpu.back_in_s is None or gpu.expected_s is None:
        return None
    ahead_s = cap.waiting * gpu.expected_s / max(1, gpu.cap)
    return gpu.back_in_s + ahead_s + gpu.expected_s


@dataclass(frozen=True)
class Return:
    """Waiting for the GPU child on its way back, chosen as the earliest expected finish."""

    gpu_s: float  # answered after its return (back-off, start, line ahead, its own time)
    cpu_s: float | None  # on the CPU child now (None: it cannot take it now)
    back_in_s: float  # the GPU child's return, as forecast
    wait_limit_s: float  # how long to wait for that return before the CPU child takes it

    def describe(self, cap: Capacity) -> str:
        gpu, cpu = cap.gpu, cap.cpu
        against = (f"against about {self.cpu_s:.0f} s on the {cpu.shown}"
                   if self.cpu_s is not None else f"the {cpu.shown} cannot take it now")
        return (f"waiting for the {gpu.shown} ({gpu.state}, back in about "
                f"{self.back_in_s:.0f} s): answered in about {self.gpu_s:.0f} s there, "
                f"{against}")


def sooner_on_return(cap: Capacity, deadline_s: float | None, cpu_s: float | None,
                     gpu_fits: bool = True, waited_s: float | None = None) -> Return | None:
    """Whether waiting for the GPU child, on its way back, is clearly the earliest finish:
    its forecast (gpu_forecast_s) under GPU_WAIT_MARGIN of the CPU child's time `cpu_s` (None:
    the CPU child cannot take it now, so any return in time beats a 503), and the wait (its
    return and the line ahead: max_wait_s bounds waiting, not answering) within half of what
    is allowed, so that a late return still leaves the CPU child time to answer; with a
    client's deadline, the whole answer within half of it. Only a forecast with room to be wrong: a GPU child already overdue (its start
    longer than the last one: back in 0 s) has none for a request that arrives; one already
    waiting for it (`waited_s`: in line that long) goes on waiting while it has waited less
    than half of what it is allowed (the line asks it again then: serving/pool.py), and the
    child is not far past its forecast (serving/resources.back_in_s: none then). Used for new
    requests (branch 5w) and for the replays and continuations a GPU death caught
    (serving/failover.py)."""
    gpu_s = gpu_forecast_s(cap, gpu_fits)
    back_in = cap.gpu.back_in_s
    if gpu_s is None or back_in is None:
        return None
    if cpu_s is not None and gpu_s >= cpu_s * GPU_WAIT_MARGIN:
        return None
    allowed = cap.max_wait_s if deadline_s is None else min(cap.max_wait_s, deadline_s)
    if not back_in and (waited_s is None or waited_s >= allowed / 2):
        return None  # late, and no longer worth the wait
    wait_s = gpu_s - (cap.gpu.expected_s or 0.0)
    if wait_s > allowed / 2 or (deadline_s is not None and gpu_s > deadline_s / 2):
        return None
    # Past twice its forecast return (and a little), the GPU child is late: the CPU child then
    # takes the request with what is left of the client's time.
    return Return(gpu_s, cpu_s, back_in, min(allowed / 2, 2 * back_in + 5.0))


def _gpu_sooner(req: Request, cap: Capacity, gpu_fits: bool) -> Decision | None:
    """Branch 5w: the earliest expected finish. A request the CPU child could take now
    waits for the GPU child instead when the GPU child's return plus its own time is clearly
    sooner than the CPU child's time (its prompt at its measured speed, less what its cache
    holds), and the wait fits the line and the client's deadline (sooner_on_return). The head
    of the line asks again each time capacity changes: a GPU child that does not come back in
    time leaves the request to the CPU child. Off with failover.wait_for_gpu = false."""
    if not cap.wait_for_gpu or cap.waiting >= cap.max_waiting:
        return None
    cpu = cap.cpu
    if not cpu.has_room or cpu.expected_s is None:
        return None
    back = sooner_on_return(cap, req.deadline_s, cpu.expected_s, gpu_fits, req.waited_s)
    if back is None:
        return None
    return Decision(Action.WAIT, 6, back.describe(cap), queue_position=cap.waiting + 1,
                    retry_after_s=back.gpu_s, expected_s=back.gpu_s)


def _to_cpu(req: Request, cap: Capacity, gpu_fits: bool) -> Decision | None:
    """Branch 5, for a request that may move, fits the CPU child, has its RAM and its
    deadline: the CPU child when it is ready with room (or can start), unless waiting for the
    GPU child, on its way back, is expected to answer clearly sooner (5w)."""
    cpu = cap.cpu
    if (wait := _gpu_sooner(req, cap, gpu_fits)) is not None:
        return wait
    if cpu.has_room:
        return Decision(Action.FORWARD, 5, f"{cpu.shown}: {_gpu_cannot(cap, gpu_fits, req.media)}",
                        child=cpu.name, expected_s=cpu.expected_s)
    if cpu.startable:
        return Decision(Action.FORWARD, 5, f"{cpu.shown} started on demand", child=cpu.name,
                        start_child=True)
    return None


def _coming(req: Request, cap: Capacity, gpu_fits: bool, cpu_fits: bool) -> bool:
    """Whether a child that could take the request serves (or may start) before long."""
    gpu, cpu, small = cap.gpu, cap.cpu, cap.small
    return (gpu_fits and (_may_serve(gpu) or gpu.startable)) or (
        req.cpu_allowed and cpu_fits and (_may_serve(cpu) or cpu.startable)) or (
        req.smaller_ok and small is not None and small.fits(req.prompt_tokens)
        and small.takes(req.media) and _may_serve(small))


def _gpu_cannot(cap: Capacity, gpu_fits: bool,
                media: frozenset[Modality] = frozenset()) -> str:
    """Why the GPU child cannot take a request now, in a few words."""
    gpu = cap.gpu
    if not gpu_fits and not gpu.takes(media):
        return f"the {gpu.shown}'s projector does not take its {_words(media)}"
    if not gpu_fits:
        return f"the prompt exceeds the {gpu.shown}'s context"
    if not gpu.ready:
        return f"the {gpu.shown} is {gpu.state}"
    if gpu.busy >= gpu.cap:
        return f"the {gpu.shown} is full ({gpu.busy}/{gpu.cap})"
    return (f"the GPU has {cap.vram_free_mib:.0f} MiB free, under the "
            f"{cap.vram_headroom_mib:.0f} MiB headroom")


def _words(media: frozenset[Modality]) -> str:
    names = {Modality.VISION: "images", Modality.AUDIO: "audio", Modality.VIDEO: "video"}
    return " and ".join(names[m] for m in Modality if m in media)


def _why(cap: Capacity) -> str:
    parts = []
    for c in cap.children:
        if c.ready:
            parts.append(f"{c.name} busy ({c.busy}/{c.cap})")
        else:
            parts.append(f"{c.name} is {c.state}")
    if not cap.cpu.ram_ok:
        parts.append(f"not enough free RAM for the {cap.cpu.shown}")
    if not _headroom_kept(cap):
        parts.append(f"GPU has {cap.vram_free_mib:.0f} MiB free, under the "
                     f"{cap.vram_headroom_mib:.0f} MiB headroom")
    return ", ".join(parts)


def loading(states: Mapping[str, ChildState], pin: str | None = None) -> bool:
    """Whether llama-server would answer `503 Loading model` here: no child (or not the pinned
    one) is ready, and one (the pinned one) is starting, that is loading its model. A child
    in back-off or FATAL is not loading: llama-server would not answer at all."""
    chosen = [states[pin]] if pin is not None and pin in states else list(states.values())
    return ChildState.READY not in chosen and ChildState.STARTING in chosen


def passthrough(states: Mapping[str, ChildState], pin: str | None,
                smaller: frozenset[str] = frozenset()) -> Decision:
    """Routes outside generation: outside the caps, never replayed. `states`: each upstream's,
    in the order of preference (the config's). An upstream serving a smaller model (`smaller`)
    answers them only when pinned: /props, /tokenize and the rest speak of the model the
    others serve."""
    if pin is not None and pin in states:
        if states[pin] == ChildState.READY:
            return Decision(Action.FORWARD, 4, "pinned by X-Spillway-Child", child=pin)
        return Decision(Action.REJECT, 7, f"the {pin} child (pinned by X-Spillway-Child) is "
                                          f"{states[pin]}", retry_after_s=5.0,
                        cause="no_child")
    for name, state in states.items():
        if state == ChildState.READY and name not in smaller:
            return Decision(Action.FORWARD, 4, f"{name} child ready", child=name)
    return Decision(Action.REJECT, 7, "no child is ready (" + ", ".join(
        f"{n} is {s}" for n, s in states.items()) + ")", retry_after_s=5.0, cause="no_child")


def _fitting(req: Request, gpu: ChildView, cpu: ChildView) -> tuple[bool, bool]:
    """Which children have room in a slot for the prompt. A count that is not the child's own
    (prompts.Plan.exact) over every context leaves the request to the child with the largest
    context: it refuses it in its own words, or serves it (infill trims its prompt to fit)."""
    gpu_fits, cpu_fits = gpu.fits(req.prompt_tokens), cpu.fits(req.prompt_tokens)
    if gpu_fits or cpu_fits or req.exact_count:
        return gpu_fits, cpu_fits
    gpu_larger = (gpu.ctx_per_slot or 0) >= (cpu.ctx_per_slot or 0) or not req.cpu_allowed
    return gpu_larger, not gpu_larger


def decide(req: Request, cap: Capacity) -> Decision:
    """Forward, wait or reject one generation request (branches 3 to 7)."""
    gpu, cpu = cap.gpu, cap.cpu
    # 3. A prompt over the GPU child's context per slot goes to a child with room for it;
    #    over every child's, it gets llama-server's own 400 (its words: errors.exceed_context).
    gpu_fits, cpu_fits = _fitting(req, gpu, cpu)
    if not gpu_fits and not cpu_fits:
        limit = max(c.ctx_per_slot or 0 for c in cap.children)
        return Decision(Action.TOO_LONG, 3, f"request ({req.prompt_tokens} tokens) exceeds the "
                                            f"available context size ({limit} tokens), try "
                                            "increasing it", cause="too_long", n_ctx=limit)
    # Images, audio or video go only to a child whose projector takes them, while the GPU or
    # the CPU child does (learned from /props); when neither does, where a plain request goes.
    if req.media and (gpu.takes(req.media) or cpu.takes(req.media)):
        gpu_fits, cpu_fits = gpu_fits and gpu.takes(req.media), cpu_fits and cpu.takes(req.media)
    # 4. The GPU child: ready, under its cap, VRAM headroom kept.
    if gpu_fits and gpu.has_room and _headroom_kept(cap):
        return Decision(Action.FORWARD, 4, f"{gpu.shown} has room", child=gpu.name,
                        expected_s=gpu.expected_s)
    # 4c. A smaller model on the GPU, for a request that accepts one.
    if (to_small := _to_smaller(req, cap, gpu_fits)) is not None:
        return to_small
    cpu_in_time = (req.deadline_s is None or cpu.expected_s is None
                   or cpu.expected_s <= req.deadline_s)
    # 4b. Router mode: the model is not loaded on the GPU router, and loading it would fit
    #     (startable). The CPU router serves it now if it has it loaded with room, while the
    #     GPU router loads it for the requests after; else the request waits for the load.
    if gpu_fits and gpu.startable and _headroom_kept(cap):
        if req.cpu_allowed and cpu.has_room and cpu_fits and cpu.ram_ok and cpu_in_time:
            return Decision(Action.FORWARD, 5, f"{cpu.shown} while the {gpu.shown} loads the "
                                               "model", child=cpu.name, warm=gpu.name)
        return Decision(Action.FORWARD, 4, f"{gpu.shown}: loading the model on demand",
                        child=gpu.name, start_child=True)
    # 5. The CPU child (or waiting for the GPU child, when that is sooner).
    if req.cpu_allowed and cpu_fits and cpu.ram_ok and cpu_in_time and \
            (to_cpu := _to_cpu(req, cap, gpu_fits)) is not None:
        return to_cpu
    # 6. Wait in line, if there is room, the wait fits, and capacity can come back at all.
    if not _coming(req, cap, gpu_fits, cpu_fits):
        return Decision(Action.REJECT, 7, f"no child can take it: {_why(cap)}"
                                          f"{_too_long(req, cap)}",
                        retry_after_s=NO_CHILD_RETRY_S, cause="no_child")
    allowed = cap.max_wait_s if req.deadline_s is None else min(cap.max_wait_s, req.deadline_s)
    position = cap.waiting + 1
    if cap.waiting < cap.max_waiting and cap.wait_s <= allowed:
        return Decision(Action.WAIT, 6, f"waiting: {_why(cap)}", queue_position=position,
                        retry_after_s=cap.wait_s)
    # 7. Reject, saying when to come back.
    return _reject(req, cap, allowed, cpu_in_time)


def _reject(req: Request, cap: Capacity, allowed: float, cpu_in_time: bool) -> Decision:
    """Branch 7: the line is full, or the wait is longer than the client will wait."""
    cpu = cap.cpu
    cause = "queue_full" if cap.waiting >= cap.max_waiting else "wait_too_long"
    if cap.waiting >= cap.max_waiting:
        reason = f"the waiting line is full ({cap.max_waiting} waiting): {_why(cap)}"
    else:
        reason = (f"the estimated wait ({cap.wait_s:.0f} s) is longer than the client will "
                  f"wait ({allowed:.0f} s): {_why(cap)}")
    if req.deadline_s is not None and cpu.expected_s is not None and not cpu_in_time:
        reason += (f"; the {cpu.shown} would need about {cpu.expected_s:.0f} s, the deadline "
                   f"is {req.deadline_s:.0f} s")
    return Decision(Action.REJECT, 7, reason, retry_after_s=_retry_after(cap),
                    queue_position=cap.waiting + 1, cause=cause)


def can_serve_now(req: Request, cap: Capacity, waited_s: float = 0.0) -> Decision | None:
    """For the head of the line (in it for `waited_s`): a FORWARD decision if it can go now,
    else None."""
    d = decide(dataclasses.replace(req, waited_s=waited_s), cap)
    return d if d.action in (Action.FORWARD, Action.TOO_LONG) else None
