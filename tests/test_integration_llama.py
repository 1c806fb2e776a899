"""Integration: Spillway in front of two real llama-server children (a tiny real model)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import openai
import pytest
from harness import Spillway, eventually, eventually_async, llama_servers_left, \
    real_config, wait_gone
from test_children_functional import transitions

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def client(s: Spillway, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_both_children_start_and_serve_chat_streamed_and_not(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    status = s.status()
    assert {n: c["state"] for n, c in status["children"].items()} == {"gpu": "READY",
                                                                     "cpu": "READY"}
    oa = client(s)
    raw = oa.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        extra_body={"ignore_eos": True})
    answer = raw.parse()
    assert raw.headers["X-Spillway-Child"] == "gpu"
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    chunks = list(oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        stream=True, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices[0].finish_reason == "length"
    # The routes the children serve themselves pass through too.
    code, props = s.get("/props")
    assert code == 200 and props["default_generation_settings"]["n_ctx"] == 1024


@pytest.mark.asyncio
async def test_the_first_event_reaches_the_client_while_the_child_is_still_generating(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 900,
            "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{s.url}/v1/chat/completions", json=body) as r:
            first = await r.content.readuntil(b"\n\n")
            assert first.startswith(b"data: {")
            # Had Spillway buffered the stream, the child would be done by now.
            async with http.get(f"{s.url}/slots", headers={"X-Spillway-Child": "gpu"}) as sr:
                slots = await sr.json()
            assert any(slot["is_processing"] for slot in slots)
            rest = await r.read()
    events = [e for e in (first + rest).split(b"\n\n") if e.startswith(b"data: {")]
    assert len(events) > 100
    assert rest.rstrip().endswith(b"data: [DONE]")


def cancelled_tasks(log: str, child: str) -> list[int]:
    """Tokens each cancelled task of `child` had when llama-server released its slot."""
    out = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if f"[{child}]" in line and "stop: cancel task" in line:
            for later in lines[i:i + 20]:
                if f"[{child}]" in later and "release:" in later and "n_tokens = " in later:
                    out.append(int(later.split("n_tokens = ")[1].split(",")[0]))
                    break
    return out


async def _read_all(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> bytes:
    async with http.post(url, json=body) as r:
        return await r.read()


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_frees_the_childs_slot(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, stream: bool) -> None:
    # A context large enough that the generation would run for many seconds.
    s = spillway(real_config(llama_server, tiny_model,
                             model={"args": ["-c", "16384", "-np", "2", "-t", "1", "-tb", "1"]}))
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8000,
            "ignore_eos": True, "stream": stream}
    async with aiohttp.ClientSession() as http:
        request = asyncio.create_task(_read_all(http, f"{s.url}/v1/chat/completions", body))
        assert await eventually_async(lambda: s.child("gpu")["tasks_started"] == 1)
        await asyncio.sleep(0.5)
        request.cancel()  # the client goes away mid-generation
        with pytest.raises(asyncio.CancelledError):
            await request
    # llama-server notices a closed connection at its next poll (once a second, when no other
    # result wakes it) and cancels the task, long before 8000 tokens.
    released = eventually(lambda: cancelled_tasks(s.log_text(), "gpu"))
    assert released and released[0] < 8000
    # A client leaving is no error of Spillway's: no traceback in its log.
    assert "Error handling request" not in s.log_text()
    assert "Traceback" not in s.log_text()


def test_a_killed_gpu_child_comes_back_and_the_cpu_child_serves_meanwhile(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    cfg = real_config(llama_server, tiny_model,
                      restart={"backoff_initial_s": 3.0, "backoff_max_s": 5.0})
    s = spillway(cfg)
    gpu_pid = s.child("gpu")["pid"]
    import os
    os.kill(gpu_pid, signal.SIGKILL)
    s.wait_state(("gpu",), ("EXITED", "BACKOFF"))
    raw = client(s).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert raw.headers["X-Spillway-Child"] == "cpu"
    assert raw.parse().choices[0].message.content
    status = s.wait_state(("gpu",), ("READY",))
    gpu = status["children"]["gpu"]
    assert gpu["pid"] != gpu_pid and gpu["restarts"] == 1
    assert gpu["last_exit"]["signal"] == "SIGKILL" and gpu["last_exit"]["kind"] == "crash"
    assert transitions(s.log_text(), "gpu")[2:] == [
        "READY -> EXITED", "EXITED -> BACKOFF", "BACKOFF -> STARTING", "STARTING -> READY"]
    raw = client(s).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert raw.headers["X-Spillway-Child"] == "gpu"


def test_sigterm_stops_both_children_and_leaves_none(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    pids = {s.child(n)["pid"] for n in ("gpu", "cpu")}
    assert s.stop() == 0
    assert wait_gone(pids, 5) == set()
    log = s.log_text()
    assert "[gpu] STOPPING -> STOPPED" in log and "[cpu] STOPPING -> STOPPED" in log


@pytest.mark.parametrize("binary", ["llama_server", "wrapped_llama_server"])
def test_a_daemon_killed_with_sigkill_orphans_no_llama_server(
        spillway: SpillwayFactory, request: pytest.FixtureRequest, llama_server: Path,
        tiny_model: Path, binary: str) -> None:
    """Issue 40: its llama-servers outlive it by design, and the next start adopts them (the
    same pids, no model reload); that one's stop ends them (tests/test_adoption.py has more).
    Issue 47: the same with a llama-server that is a wrapper script exec'ing the real binary
    (its command line is not the one Spillway started), and after the stop no process of this
    config's runs, by its owner mark or its binary."""
    s = spillway(real_config(request.getfixturevalue(binary), tiny_model))
    pids = {s.child(n)["pid"] for n in ("gpu", "cpu")}
    s.signal(signal.SIGKILL)
    assert s.proc is not None and s.proc.wait(10) == -signal.SIGKILL
    s._log.close()
    assert wait_gone(pids, 1) == pids
    s.start()
    assert {s.child(n)["pid"] for n in ("gpu", "cpu")} == pids
    assert s.status()["daemon"]["left_alone"] == []
    assert llama_servers_left(s, llama_server, tiny_model) == pids  # none started beside them
    assert s.stop() == 0
    assert wait_gone(pids, 10) == set()
    assert llama_servers_left(s, llama_server, tiny_model) == set()


def test_with_a_key_a_request_without_it_never_reaches_a_child(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    key = "k-" + "x" * 30
    s = spillway(real_config(llama_server, tiny_model, server={"api_key": key}), start=False)
    s.start(wait_ready=False)
    auth = {"Authorization": f"Bearer {key}"}
    s.wait_ready(headers=auth)
    with pytest.raises(openai.AuthenticationError) as e:
        client(s, key="wrong").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert e.value.status_code == 401
    assert json.loads(e.value.response.text)["error"]["type"] == "authentication_error"
    tasks = {n: c["tasks_started"] for n, c in s.status(auth)["children"].items()}
    assert tasks == {"gpu": 0, "cpu": 0}  # the children never saw it
    answer = client(s, key=key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert answer.choices[0].message.content
    assert s.status(auth)["children"]["gpu"]["tasks_started"] == 1
    # A child's own port refuses anyone without its private key.
    port = s.status(auth)["children"]["gpu"]["port"]
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as direct:
        urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(CHAT).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}))
    assert direct.value.code == 401
