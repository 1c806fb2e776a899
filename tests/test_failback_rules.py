"""The rules of issue 48's outage end, pure: a request caught by a GPU death waits for the GPU
child's return when that is the earliest finish (policy/admission.sooner_on_return), unless its
own prefill may have been what ran out of memory (policy/replay.own_size_suspect); a stream the
CPU child answers moves back to the GPU child when the rest is clearly sooner there
(policy/continuation.fail_back), and what the client has of a stream continued once is its two
parts joined (continuation.joined)."""

from __future__ import annotations

import dataclasses

from supervisor.policy import continuation as c
from supervisor.policy.admission import Capacity, ChildView, sooner_on_return
from supervisor.policy.evidence import FailureKind
from supervisor.policy.replay import own_size_suspect

GPU = ChildView("gpu", "BACKOFF", busy=0, cap=2, ctx_per_slot=4096, expected_s=10.0,
                back_in_s=1.0)
CPU = ChildView("cpu", "READY", busy=0, cap=1, ctx_per_slot=8192, expected_s=40.0)
CAP = Capacity(children=(GPU, CPU), vram_free_mib=None, vram_headroom_mib=1024, waiting=0,
               max_waiting=4, wait_s=0.0, max_wait_s=60)
CHAT = {"messages": [{"role": "user", "content": "Tell me."}], "stream": True,
        "max_tokens": 300}


def gpu(**kw: object) -> Capacity:
    return dataclasses.replace(CAP, children=(dataclasses.replace(GPU, **kw), CPU))


def test_a_request_waits_for_the_gpu_childs_return_when_that_is_clearly_sooner() -> None:
    back = sooner_on_return(CAP, None, 40.0)
    assert back is not None and back.gpu_s == 11.0 and back.back_in_s == 1.0
    assert back.wait_limit_s == 7.0  # late past twice its return (and a little)
    assert "against about 40 s on the CPU child" in back.describe(CAP)


def test_no_wait_when_the_gpu_child_is_not_clearly_sooner_or_overdue_or_past_the_deadline(
        ) -> None:
    assert sooner_on_return(CAP, None, 13.0) is None  # 11 s is not under 0.8 of 13 s
    assert sooner_on_return(gpu(back_in_s=0.0), None, 40.0) is None  # overdue: no forecast
    assert sooner_on_return(gpu(back_in_s=None), None, 40.0) is None  # not coming back
    assert sooner_on_return(gpu(expected_s=None), None, 40.0) is None  # speed unknown
    assert sooner_on_return(CAP, 20.0, 40.0) is None  # 11 s is over half of the 20 s left
    assert sooner_on_return(CAP, 30.0, 40.0) is not None


def test_with_no_cpu_child_to_take_it_any_return_in_time_is_waited_for() -> None:
    back = sooner_on_return(gpu(expected_s=20.0), None, None)
    assert back is not None and "the CPU child cannot take it now" in back.describe(CAP)


def test_only_an_out_of_memory_death_in_the_requests_own_prefill_names_its_size() -> None:
    assert own_size_suspect(FailureKind.RUNTIME_OOM, answer_started=False)
    assert own_size_suspect(FailureKind.OOM_SURVIVED, answer_started=False)
    assert not own_size_suspect(FailureKind.RUNTIME_OOM, answer_started=True)
    assert not own_size_suspect(FailureKind.CRASH, answer_started=False)
    assert not own_size_suspect(FailureKind.GPU_FAULT, answer_started=False)


def transcript(tokens: int, text: str = "Once upon a time", **kw: object) -> c.Transcript:
    return dataclasses.replace(c.Transcript("chat", text=text, tokens=tokens, role_sent=True),
                               **kw)


def test_a_stream_fails_back_when_the_rest_is_clearly_sooner_on_the_gpu_child() -> None:
    moved = c.fail_back(CHAT, transcript(40), False, None, gpu_rest_s=5.0, cpu_rest_s=20.0)
    assert moved.allowed and "after 40 tokens" in moved.reason


def test_a_stream_stays_on_the_cpu_child_when_the_rules_or_figures_say_so() -> None:
    def why(so_far: c.Transcript, before: bool = False, deadline: float | None = None,
            gpu_s: float | None = 5.0, cpu_s: float | None = 20.0) -> c.Refusal | None:
        decision = c.fail_back(CHAT, so_far, before, deadline, gpu_s, cpu_s)
        assert not decision.allowed
        return decision.refusal

    assert why(transcript(40), before=True) is c.Refusal.FAILED_BACK  # at most once
    assert why(transcript(40, finished=True)) is c.Refusal.FINISHED  # at its end
    assert why(transcript(300)) is c.Refusal.FINISHED  # its limit reached
    assert why(transcript(40, tool_calls=True)) is c.Refusal.TOOLS
    assert why(transcript(40), deadline=2.0) is c.Refusal.DEADLINE
    assert why(transcript(40), gpu_s=17.0) is c.Refusal.NO_TARGET  # not under 0.8 of 20 s
    assert why(transcript(40), gpu_s=None) is c.Refusal.NO_TARGET


def test_a_stream_continued_once_is_its_two_parts_joined() -> None:
    before = transcript(4, text="Once upon a", id="chatcmpl-1", created=7)
    leg = c.Transcript("chat", text=" time there", tokens=2)
    whole = c.joined(before, leg, " time there")
    assert (whole.text, whole.tokens, whole.id, whole.created) == (
        "Once upon a time there", 6, "chatcmpl-1", 7)
    assert whole.role_sent and not whole.finished and not whole.counted
    assert before.text == "Once upon a"  # (the part before is left as it was)
    # A tool call, reasoning after content, or the finish in the second part are the whole's.
    assert c.joined(before, dataclasses.replace(leg, tool_calls=True), "").tool_calls
    assert c.joined(before, dataclasses.replace(leg, reasoning_text="hm"), "").reasoning
    assert c.joined(before, dataclasses.replace(leg, finished=True), "").finished
