"""Is a child with work in flight getting anywhere? The stall rule.

llama-server answers `/health` from its HTTP thread while its inference loop may be stuck (a
CUDA OOM that hangs instead of aborting, llama.cpp#13085): `/health` says nothing of progress.
Progress is what the work itself shows: a byte of an answer from the child, or a change in its
slots' figures (`/slots`: the task each slot runs, its prompt tokens processed, its tokens
decoded). A long prompt's prefill moves `n_prompt_tokens_processed` batch by batch, so it is
progress, not a stall; between two batches `/slots` may not answer (the loop that answers it is
computing), which is why the timeout is several batches long.

A child is stalled when it has generation work in flight and nothing moved for the timeout.
Without the slots' figures (`--no-slots`: a 501) only bytes can tell, and a non-streamed answer
sends none until it is done: such a child is never judged stalled on silence alone.

Pure: the caller reads the clock, the slots and the child's speeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The timeout derived from the child's own speeds: this many of its slowest steps (one prompt
# batch, or a few tokens), bounded. Before it has any measured speed, the ceiling: a first
# prompt batch of 2,048 tokens on a large model on a CPU can take minutes, with /slots silent
# all along (the loop that answers it is inside llama_decode), and must not look like a stall.
STEPS = 4.0
MIN_STALL_S = 15.0
MAX_STALL_S = 300.0
UNMEASURED_STALL_S = MAX_STALL_S
DEFAULT_BATCH = 2048  # llama-server's -b
TOKENS_PER_STEP = 16  # a handful of tokens: a slow child's decode step, with room


@dataclass(frozen=True)
class Slot:
    id: int
    task: int
    processing: bool
    prompt_done: int  # n_prompt_tokens_processed
    decoded: int  # next_token[0].n_decoded


@dataclass(frozen=True)
class SlotsView:
    slots: tuple[Slot, ...]

    @property
    def figures(self) -> tuple[tuple[int, int, bool, int, int], ...]:
        return tuple((s.id, s.task, s.processing, s.prompt_done, s.decoded) for s in self.slots)

    def describe(self) -> str:
        busy = [s for s in self.slots if s.processing]
        if not busy:
            return f"{len(self.slots)} slot(s), none processing"
        parts = ", ".join(f"slot {s.id} task {s.task}: {s.prompt_done} prompt tokens "
                          f"processed, {s.decoded} decoded" for s in busy)
        return f"{len(self.slots)} slot(s), {len(busy)} processing ({parts})"


def read_slots(payload: Any) -> SlotsView | None:
    """llama-server's `GET /slots` answer; None if it is not that shape."""
    if not isinstance(payload, list):
        return None
    slots = []
    for item in payload:
        if not isinstance(item, dict):
            return None
        token = item.get("next_token")
        first = token[0] if isinstance(token, list) and token and \
            isinstance(token[0], dict) else {}
        slots.append(Slot(id=_int(item.get("id")), task=_int(item.get("id_task")),
                          processing=bool(item.get("is_processing")),
                          prompt_done=_int(item.get("n_prompt_tokens_processed")),
                          decoded=_int(first.get("n_decoded"))))
    return SlotsView(tuple(slots))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def moved(before: SlotsView | None, after: SlotsView | None) -> bool:
    """Whether the slots' figures changed between two readings (a new task counts)."""
    return before is not None and after is not None and before.figures != after.figures


def stall_timeout(configured: float | None, prompt_tps: float | None, gen_tps: float | None,
                  batch: int = DEFAULT_BATCH) -> float:
    """`restart.stall_timeout_s`, or (None: "auto") STEPS of the child's slowest step at its
    own measured speeds, one prompt batch or TOKENS_PER_STEP tokens, within
    [MIN_STALL_S, MAX_STALL_S]."""
    if configured is not None:
        return configured
    steps = [batch / prompt_tps if prompt_tps else 0.0,
             TOKENS_PER_STEP / gen_tps if gen_tps else 0.0]
    if not any(steps):
        return UNMEASURED_STALL_S
    return min(MAX_STALL_S, max(MIN_STALL_S, STEPS * max(steps)))


@dataclass(frozen=True)
class Watch:
    """What is known of one child's progress at one moment."""

    busy: int  # generation requests in flight
    since_progress_s: float  # since the last byte, the last slots' change, or the work began
    since_byte_s: float | None  # since its last byte of an answer (None: none yet)
    slots: SlotsView | None  # the last reading (None: none)
    slots_answer: str  # "answered", "unanswered" (no reply in time), "disabled" (501/404)


def stalled(w: Watch, timeout_s: float) -> bool:
    """The stall rule: work in flight, nothing moved for the timeout, and the slots did not
    say they cannot be read (then silence alone is no evidence: see the module's note)."""
    return w.busy > 0 and w.since_progress_s >= timeout_s and w.slots_answer != "disabled"


def evidence(w: Watch, timeout_s: float) -> str:
    """The incident's line: what was in flight, the age of the last byte, the slots."""
    byte = ("no byte of an answer yet" if w.since_byte_s is None
            else f"last byte {w.since_byte_s:.1f} s ago")
    if w.slots_answer == "unanswered":
        slots = "/slots unanswered"
    elif w.slots is None:
        slots = "/slots not read"
    else:
        slots = f"/slots unchanged: {w.slots.describe()}"
    return (f"no progress for {w.since_progress_s:.1f} s (stall_timeout_s {timeout_s:.0f}) "
            f"with {w.busy} request(s) in flight; {byte}; {slots}")

