"""The failover engine against real llama-server children, the GPU's failure injected by
tests/gpu_fault_injector.py (captured CUDA lines, then SIGABRT, during prompt processing)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from harness import Spillway, eventually, eventually_async, real_config, settled
from test_children_functional import transitions
from test_integration_llama import cancelled_tasks

from conftest import SpillwayFactory
from supervisor.records.incidents import FIELDS

pytestmark = [pytest.mark.integration]
MARKER = "OOM-ME"


def failover_config(llama_server: Path, model_path: Path, injector: Path,
                    fault: dict[str, str], **sections: Any) -> dict[str, Any]:
    cfg = real_config(llama_server, model_path, **sections)
    cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector),
                  "env": {"REAL_LLAMA_SERVER": str(llama_server), **fault}}
    return cfg


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "ignore_eos": True, **extra}


def tasks(s: Spillway) -> dict[str, int]:
    return {n: c["tasks_started"] for n, c in s.status()["children"].items()}


def assert_complete_records(records: list[dict[str, Any]]) -> None:
    for r in records:
        assert set(FIELDS) <= set(r), set(FIELDS) - set(r)
        assert r["time"].endswith("Z") and r["decision"] in ("replayed", "continued", "rejected",
                                                             "passed_on")


async def post(http: aiohttp.ClientSession, s: Spillway, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    async with http.post(f"{s.url}/v1/chat/completions", json=body, headers=headers) as r:
        raw = await r.read()
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw
        return r.status, r.headers, data


@pytest.mark.asyncio
async def test_a_non_streaming_request_replays_once_with_its_identity(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    s = spillway(failover_config(llama_server, tiny_model, injector, {"FAULT_MARKER": MARKER}))
    before = tasks(s)
    async with aiohttp.ClientSession() as http:
        status, headers, body = await post(http, s, chat(f"please {MARKER} now"),
                                           {"X-Request-Id": "agent-7-step-2"})
    assert status == 200, body
    assert headers["X-Request-Id"] == "agent-7-step-2"
    assert headers["X-Spillway-Attempts"] == "2"
    assert headers["X-Spillway-Failover"] == "runtime_oom"
    assert headers["X-Spillway-Child"] == "cpu"
    assert body["choices"][0]["message"]["content"]
    # One execution on each child: the one the GPU lost, and the replay.
    assert eventually(lambda: tasks(s) == {"gpu": before["gpu"] + 1, "cpu": before["cpu"] + 1})
    [record] = s.wait_incidents(1)
    assert_complete_records([record])
    assert record["request_id"] == "agent-7-step-2"
    assert record["decision"] == "replayed" and record["replay_child"] == "cpu"
    assert record["kind"] == "runtime_oom"
    assert "CUDA error: out of memory" in record["evidence"]
    assert record["status"] == 200 and record["client_connected"] is True
    assert record["cpu_start_s"] == 0  # the CPU child was hot
    assert record["tokens"] == 12
    # The GPU child is back.
    status_now = s.wait_state(("gpu",), ("READY",))
    assert status_now["children"]["gpu"]["last_exit"]["signal"] == "SIGABRT"
    assert status_now["children"]["gpu"]["restarts"] == 1


@pytest.mark.asyncio
async def test_a_stream_that_fails_before_its_first_event_replays(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    s = spillway(failover_config(llama_server, tiny_model, injector, {"FAULT_MARKER": MARKER}))
    events = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions",
                             json=chat(MARKER, stream=True)) as r:
            assert r.status == 200
            assert r.headers["X-Spillway-Attempts"] == "2"
            assert r.headers["X-Spillway-Child"] == "cpu"
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    assert not any(b'"error"' in e for e in events)
    [record] = s.wait_incidents(1)
    assert record["decision"] == "replayed" and record["stream"] is True


@pytest.mark.asyncio
@pytest.mark.parametrize(("headers", "failover"), [
    ({"X-Spillway-Replay": "never"}, {}),
    ({}, {"continue_streams": False}),
])
async def test_a_stream_that_fails_after_events_and_may_not_go_on_ends_with_one_error_event(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path,
        headers: dict[str, str], failover: dict[str, Any]) -> None:
    """No continuation where the client or the config says no (the body's own refusals are
    table-tested in test_policy_continuation.py; continuing, in
    test_continuation_integration.py): the honest error event, no [DONE], never a second
    child."""
    s = spillway(failover_config(llama_server, tiny_model, injector,
                                 {"FAULT_MARKER": MARKER, "FAULT_WHEN": "events:3"},
                                 failover=failover))
    before = tasks(s)
    data = []
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", headers=headers,
                             json=chat(MARKER, stream=True, max_tokens=200)) as r:
            assert r.status == 200
            assert r.headers["X-Spillway-Attempts"] == "1"
            async for line in r.content:
                if line.startswith(b"data: "):
                    data.append(line[6:].strip())
    assert len(data) == 4  # three events from the child, then Spillway's one error event
    error = json.loads(data[-1])["error"]
    assert error["type"] == "upstream_error" and error["src"] == "spillway"
    assert error["kind"] == "runtime_oom"
    assert b"[DONE]" not in data
    assert settled(lambda: tasks(s))["cpu"] == before["cpu"]  # never replayed
    [record] = s.wait_incidents(1)
    assert record["decision"] == "passed_on" and "bytes already" in record["reason"]


@pytest.mark.asyncio
async def test_routes_that_change_state_are_never_replayed(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    s = spillway(failover_config(llama_server, tiny_model, injector,
                                 {"FAULT_MARKER": MARKER, "FAULT_PATHS": "*"}))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/slots/0?action=save",
                             json={"filename": f"{MARKER}.bin"}) as r:
            assert r.status == 502
            err = (await r.json())["error"]
    assert err["type"] == "upstream_error" and err["kind"] == "runtime_oom"
    assert "route never replays" in err["message"]
    s.wait_state(("gpu",), ("READY",))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/tools", json={"tool": MARKER}) as r:
            assert r.status == 502
    records = s.wait_incidents(2)
    assert [r["decision"] for r in records] == ["rejected", "rejected"]
    assert all(r["attempts"] == 1 and r["replay_child"] is None for r in records)
    assert_complete_records(records)


@pytest.mark.asyncio
async def test_opt_out_and_a_spent_deadline_get_a_controlled_error(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    s = spillway(failover_config(llama_server, tiny_model, injector, {"FAULT_MARKER": MARKER}))
    async with aiohttp.ClientSession() as http:
        status, headers, body = await post(http, s, chat(MARKER),
                                           {"X-Spillway-Replay": "never"})
        assert status == 502
        assert headers["Content-Type"].startswith("application/json")
        assert headers["x-should-retry"] == "true"
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert "opted out" in body["error"]["message"]
        s.wait_state(("gpu",), ("READY",))
        status, _, body = await post(http, s, chat(MARKER), {"X-Spillway-Deadline": "0.001"})
        assert status == 502
        assert "deadline" in body["error"]["message"]
    first, second = s.wait_incidents(2)
    assert first["reason"] == "client opted out (X-Spillway-Replay: never)"
    assert second["reason"].startswith("the client's deadline leaves no room")


@pytest.mark.asyncio
async def test_sixteen_concurrent_requests_across_a_crash_complete_exactly_once(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    # Enough slots that all sixteen are executing (not queued) when the GPU dies, so that each
    # execution shows in the children's own logs as one `launch_slot_` line; and answers long
    # enough (slots of 963 tokens) that none is done before the seventeenth brings the GPU
    # child down, on a busy machine too.
    cfg = failover_config(llama_server, tiny_model, injector, {"FAULT_MARKER": MARKER},
                          model={"args": ["-c", "16384", "-np", "17", "-t", "1", "-tb", "1"]})
    s = spillway(cfg)
    before = tasks(s)

    async def one(i: int, http: aiohttp.ClientSession, content: str) -> dict[str, Any]:
        stream = i % 3 == 0
        body = chat(content, max_tokens=800, stream=stream)
        async with http.post(f"{s.url}/v1/chat/completions", json=body,
                             headers={"X-Request-Id": f"r{i}"}) as r:
            raw = await r.read()
            return {"i": i, "status": r.status, "stream": stream, "raw": raw,
                    "attempts": int(r.headers.get("X-Spillway-Attempts", "0")),
                    "rid": r.headers.get("X-Request-Id")}

    async with aiohttp.ClientSession() as http:
        running = [asyncio.create_task(one(i, http, f"request {i}")) for i in range(16)]
        # All sixteen executing on the GPU child; then a seventeenth brings it down.
        assert await eventually_async(lambda: tasks(s)["gpu"] >= before["gpu"] + 16)
        trigger = await one(16, http, MARKER)
        results = await asyncio.gather(*running) + [trigger]
    completed = errors = 0
    for r in results:
        assert r["rid"] == f"r{r['i']}"
        if r["status"] == 200 and r["stream"]:
            events = [e for e in r["raw"].split(b"\n\n") if e.startswith(b"data: ")]
            if events[-1] == b"data: [DONE]":
                completed += 1
            else:  # cut after bytes: exactly one error event, last
                assert b'"error"' in events[-1] and b"[DONE]" not in r["raw"]
                assert sum(b'"error"' in e for e in events) == 1
                errors += 1
        elif r["status"] == 200:
            assert json.loads(r["raw"])["choices"][0]["message"]["content"]
            completed += 1
        else:
            assert r["status"] in (502, 503)
            assert json.loads(r["raw"])["error"]["src"] == "spillway"
            errors += 1
    assert completed + errors == 17
    # Every request completes: replayed before its first byte, or its stream continued on the
    # CPU child after (each chat here is text only).
    assert errors == 0 and completed == 17
    records = s.wait_incidents(17)  # every request was caught in the crash
    assert_complete_records(records)
    replays = sum(1 for r in records if r["decision"] in ("replayed", "continued"))

    def executions() -> int:
        after = tasks(s)
        return (after["gpu"] - before["gpu"]) + (after["cpu"] - before["cpu"])

    # Each launch line read (the children's logs are read a moment behind), and no more.
    eventually(lambda: executions() >= 17 + replays)
    assert settled(executions) == 17 + replays
    # A continued stream's headers went out with its first attempt (X-Spillway-Attempts: 1);
    # its final event says where it went on.
    continued = [r for r in results if b'"spillway_continuation"' in r["raw"]]
    assert len(continued) == sum(1 for r in records if r["decision"] == "continued")
    assert sum(r["attempts"] for r in results) + len(continued) == 17 + replays
    # One death, one episode, every request caught in it recorded once.
    assert len({r["episode"] for r in records}) == 1
    assert len({r["request_id"] for r in records}) == 17


@pytest.mark.parametrize("figures,kind", [({"free_mib": 61, "total_mib": 143771}, "runtime_oom"),
                                          (None, "cuda_error")])
def test_the_terse_h200_abort_is_runtime_oom_with_a_low_gpu_sample_else_cuda_error(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path,
        tmp_path: Path, figures: dict[str, int] | None, kind: str) -> None:
    nvml = None
    if figures is not None:
        nvml = tmp_path / "nvml.json"
        nvml.write_text(json.dumps(figures))
    cfg = failover_config(llama_server, tiny_model, injector,
                          {"FAULT_MARKER": MARKER, "FAULT_LINES": "terse"},
                          gpu={"vram_headroom_mib": 0}, monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, fake_nvml=nvml)
    if figures is not None:  # the card's low figure sampled before the death
        assert eventually(lambda: (s.status()["gpu"] or {}).get("free_mib") == figures["free_mib"])
    answer = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0).chat \
        .completions.with_raw_response.create(model="m", messages=[
            {"role": "user", "content": MARKER}], max_tokens=4)
    assert answer.headers["X-Spillway-Failover"] == kind
    [record] = s.wait_incidents(1)
    assert record["kind"] == kind
    assert "ggml-cuda.cu:109: CUDA error" in record["evidence"]
    if figures is not None:
        assert "free VRAM 61 MiB of 143771 MiB" in record["evidence"]
    last = s.wait_state(("gpu",), ("READY",))["children"]["gpu"]["last_exit"]
    assert last["kind"] == kind and last["code"] == -6


def test_a_lost_device_is_gpu_fault_replayed_and_restarted_as_an_oom_is(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    cfg = failover_config(llama_server, tiny_model, injector,
                          {"FAULT_MARKER": MARKER, "FAULT_LINES": "vulkan_lost"})
    s = spillway(cfg)
    answer = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0).chat \
        .completions.with_raw_response.create(model="m", messages=[
            {"role": "user", "content": MARKER}], max_tokens=4)
    assert answer.headers["X-Spillway-Failover"] == "gpu_fault"
    assert answer.headers["X-Spillway-Child"] == "cpu"
    assert answer.parse().choices[0].message.content is not None
    [record] = s.wait_incidents(1)
    assert record["kind"] == "gpu_fault" and "ErrorDeviceLost" in record["evidence"]
    assert record["decision"] == "replayed"
    last = s.wait_state(("gpu",), ("READY",))["children"]["gpu"]["last_exit"]
    assert last["kind"] == "gpu_fault" and last["code"] == -6


def test_an_agent_loop_crashed_between_tool_call_and_model_call_runs_each_tool_once(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path,
        tmp_path: Path) -> None:
    once = tmp_path / "fired"
    s = spillway(failover_config(llama_server, tiny_model, injector,
                                 {"FAULT_MARKER": MARKER, "FAULT_ONCE_FILE": str(once)}))
    oa = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=2)
    side_effects: dict[int, int] = {}

    def tool(step: int) -> str:
        """The simulated tool: a side effect we can count (a payment, a file write...)."""
        side_effects[step] = side_effects.get(step, 0) + 1
        # Its result sends the agent's next model call into the GPU's failure.
        return f"tool result {step}" + (f" {MARKER}" if step == 2 else "")

    messages: list[dict[str, Any]] = [{"role": "user", "content": "plan the trip"}]
    attempts = []
    for step in range(4):
        raw = oa.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=6,  # type: ignore[arg-type]
            extra_headers={"Idempotency-Key": f"agent-run-1-step-{step}"})
        attempts.append(raw.headers["X-Spillway-Attempts"])
        messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        messages.append({"role": "user", "content": tool(step)})
    assert once.exists()  # the GPU did fail, on the model call after the tool of step 2
    assert attempts == ["1", "1", "1", "2"]
    assert side_effects == {0: 1, 1: 1, 2: 1, 3: 1}
    # A client retry of a completed call is answered from the store, not run again.
    before = tasks(s)
    again = oa.chat.completions.with_raw_response.create(
        model="m", messages=messages[:7], max_tokens=6,  # type: ignore[arg-type]
        extra_headers={"Idempotency-Key": "agent-run-1-step-3"})
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["X-Spillway-Attempts"] == "2"
    assert settled(lambda: tasks(s)) == before


@pytest.mark.asyncio
async def test_an_oom_the_child_survived_drains_it_while_its_other_request_completes(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    # The unrelated request must outlast the failing one and its replay: 3,000 tokens (a slot
    # of 4,096), a second or more even on a quiet machine (900 tokens were sometimes done
    # before the drain could be seen).
    s = spillway(failover_config(llama_server, tiny_model, injector,
                                 {"FAULT_MARKER": MARKER, "FAULT_MODE": "survive"},
                                 model={"args": ["-c", "8192", "-np", "2", "-t", "1", "-tb",
                                                 "1"]}))
    gpu_pid = s.child("gpu")["pid"]
    before = tasks(s)
    async with aiohttp.ClientSession() as http:
        long_one = asyncio.create_task(post(http, s, chat("unrelated work", max_tokens=3000)))
        # The unrelated request running on the GPU child before the failing one is sent.
        assert await eventually_async(lambda: tasks(s)["gpu"] == before["gpu"] + 1)
        status, headers, body = await post(http, s, chat(MARKER))
        assert status == 200
        assert headers["X-Spillway-Failover"] == "oom_survived"
        assert headers["X-Spillway-Child"] == "cpu"
        status_now = s.status()["children"]["gpu"]
        assert status_now["state"] == "DRAINING"
        # New work goes elsewhere while the GPU child drains.
        status2, headers2, _ = await post(http, s, chat("new work"))
        assert status2 == 200 and headers2["X-Spillway-Child"] == "cpu"
        status3, headers3, body3 = await long_one
    assert status3 == 200 and headers3["X-Spillway-Child"] == "gpu"
    assert body3["usage"]["completion_tokens"] == 3000
    after = s.wait_state(("gpu",), ("READY",))["children"]["gpu"]
    assert after["pid"] != gpu_pid and after["restarts"] == 1
    seq = transitions(s.log_text(), "gpu")
    assert seq[2:] == ["READY -> DRAINING", "DRAINING -> STOPPING", "STOPPING -> STOPPED",
                       "STOPPED -> STARTING", "STARTING -> READY"]
    [record] = s.wait_incidents(1)
    assert record["kind"] == "oom_survived" and "Compute error" in record["evidence"]


@pytest.mark.asyncio
async def test_a_live_child_that_lost_its_device_is_gpu_fault_and_drained(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    """`Compute error.` from a child that lives on: its last lines say which (a lost device
    here, not an OOM); it is replayed and the child drained and restarted all the same."""
    s = spillway(failover_config(llama_server, tiny_model, injector,
                                 {"FAULT_MARKER": MARKER, "FAULT_MODE": "survive",
                                  "FAULT_LINES": "vulkan_lost"}))
    gpu_pid = s.child("gpu")["pid"]
    async with aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, s, chat(MARKER))
    assert status == 200
    assert headers["X-Spillway-Failover"] == "gpu_fault"
    assert headers["X-Spillway-Child"] == "cpu"
    [record] = s.wait_incidents(1)
    assert record["kind"] == "gpu_fault" and "ErrorDeviceLost" in record["evidence"]
    after = s.wait_state(("gpu",), ("READY",))["children"]["gpu"]
    assert after["pid"] != gpu_pid
    assert "READY -> DRAINING" in transitions(s.log_text(), "gpu")


@pytest.mark.asyncio
async def test_a_client_that_leaves_during_a_replay_cancels_it(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, injector: Path) -> None:
    cfg = failover_config(llama_server, tiny_model, injector, {"FAULT_MARKER": MARKER},
                          model={"args": ["-c", "16384", "-np", "2", "-t", "1", "-tb", "1"]})
    s = spillway(cfg)
    before = tasks(s)
    async with aiohttp.ClientSession() as http:
        request = asyncio.create_task(post(http, s, chat(MARKER, max_tokens=8000)))
        # The replay is running on the CPU child...
        assert await eventually_async(lambda: tasks(s)["cpu"] == before["cpu"] + 1)
        await asyncio.sleep(0.5)
        request.cancel()  # ...when the client goes away.
        with pytest.raises(asyncio.CancelledError):
            await request
    released = eventually(lambda: cancelled_tasks(s.log_text(), "cpu"))
    assert released and released[0] < 8000
    [record] = s.wait_incidents(1)
    assert record["decision"] == "replayed"
    assert record["client_connected"] is False and record["status"] == 499
