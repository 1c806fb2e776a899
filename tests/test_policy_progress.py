"""The stall rule (policy/progress.py): llama-server's /slots read, the timeout derived from a
child's own speeds, and when silence is a stall."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.policy.progress import (
    MAX_STALL_S, MIN_STALL_S, UNMEASURED_STALL_S, SlotsView, Watch, evidence, moved,
    read_slots, stall_timeout, stalled,
)

SLOTS = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "llama-server" / "cpu" / \
    "slots-200.json"


def real_slots() -> list[dict[str, object]]:
    if SLOTS.exists():  # the capture of a real llama-server's answer
        payload = json.loads(SLOTS.read_text())["json"]
        assert isinstance(payload, list)
        return payload
    return [{"id": 0, "id_task": 31, "is_processing": False, "n_prompt_tokens_processed": 0,
             "next_token": [{"n_decoded": 0}]}]


def test_slots_are_read_as_llama_server_answers_them() -> None:
    view = read_slots(real_slots())
    assert view is not None and view.slots[0].id == 0 and view.slots[0].task >= 0
    assert "none processing" in view.describe()
    assert read_slots({"error": "x"}) is None and read_slots(["x"]) is None


def slot(task: int, prompt: int, decoded: int, processing: bool = True) -> dict[str, object]:
    return {"id": 0, "id_task": task, "is_processing": processing,
            "n_prompt_tokens_processed": prompt, "next_token": [{"n_decoded": decoded}]}


def test_prefill_and_decoding_move_the_figures_a_stuck_loop_does_not() -> None:
    a = read_slots([slot(7, 2048, 0)])
    prefill = read_slots([slot(7, 4096, 0)])  # the next prompt batch
    decoding = read_slots([slot(7, 4096, 12)])
    assert moved(a, prefill) and moved(prefill, decoding)
    assert not moved(decoding, read_slots([slot(7, 4096, 12)]))
    assert moved(decoding, read_slots([slot(8, 0, 0)]))  # another task
    assert not moved(None, a)  # one reading says nothing yet
    assert decoding is not None and "4096 prompt tokens processed, 12 decoded" in \
        decoding.describe()


@pytest.mark.parametrize("configured,prompt_tps,gen_tps,expected", [
    (7.0, 500.0, 40.0, 7.0),  # as configured
    (0.0, 500.0, 40.0, 0.0),  # off
    (None, None, None, UNMEASURED_STALL_S),  # nothing measured yet
    (None, 600.0, 44.0, MIN_STALL_S),  # a fast child: 4 x 3.4 s -> the floor
    (None, 40.0, 5.0, 4 * 2048 / 40.0),  # a 70B on the CPU: four prompt batches
    (None, 5.0, 1.0, MAX_STALL_S),  # slower still: the ceiling
    (None, None, 0.5, 4 * 16 / 0.5),  # decoding alone measured: 16 tokens a step
])
def test_the_timeout_is_four_of_the_childs_slowest_steps_bounded(
        configured: float | None, prompt_tps: float | None, gen_tps: float | None,
        expected: float) -> None:
    assert stall_timeout(configured, prompt_tps, gen_tps) == pytest.approx(expected)


def watch(**kw: object) -> Watch:
    base: dict[str, object] = {"busy": 1, "since_progress_s": 10.0, "since_byte_s": 10.0,
                               "slots": None, "slots_answer": "unanswered"}
    base.update(kw)
    return Watch(**base)  # type: ignore[arg-type]


def test_a_stall_is_work_in_flight_and_nothing_moving_for_the_timeout() -> None:
    assert stalled(watch(), 10.0)
    assert not stalled(watch(since_progress_s=9.9), 10.0)
    assert not stalled(watch(busy=0), 10.0)  # nothing in flight: an idle child is fine
    # Without /slots a silent non-streamed answer cannot be told from a stuck one.
    assert not stalled(watch(slots_answer="disabled"), 10.0)
    view = SlotsView(read_slots([slot(7, 33, 5)]).slots)  # type: ignore[union-attr]
    line = evidence(watch(slots=view, slots_answer="answered", since_byte_s=None), 10.0)
    assert line.startswith("no progress for 10.0 s (stall_timeout_s 10) with 1 request(s) in "
                           "flight; no byte of an answer yet; /slots unchanged: 1 slot(s), 1 "
                           "processing (slot 0 task 7: 33 prompt tokens processed, 5 decoded)")
    assert "/slots unanswered" in evidence(watch(), 10.0)
