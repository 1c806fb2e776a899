"""Issue 49: the GPU child gives way to another program (gpu.yield_to_other_processes), with
real llama-server children serving the embedded SmolLM2-135M (slow enough that the answers
are still running when the GPU child gives way), the real OpenAI client, and fake NVML figures
(tests/fake_nvml: this machine has no GPU; the figures are what the driver would say).

A real process (`sleep`, standing in for an image generator) appears on the card in the fake
driver's list and takes its free memory under the headroom while a stream and a non-streamed
answer run on the GPU child: the GPU child is STOPPED within 10 s, both answers finish whole
(on the CPU child), new requests go to the CPU child, and the status names the program. The
program ends and leaves the card: the GPU child is started again within 30 s."""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
from pathlib import Path

import openai
import pytest
from harness import Spillway, eventually, pid_alive, real_config, streamed_chat, write_json

from conftest import SpillwayFactory
from supervisor.commands import bootstrap
from supervisor.commands.cli import format_status

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return bootstrap.ensure_model()


def ask(client: openai.OpenAI, words: str, max_tokens: int, stream: bool) -> tuple[str, str, str]:
    """(the child that began it, the text, the finish reason; "" when it had none)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": words}],
            "max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**body)
        answer = raw.parse()
        return (raw.headers["X-Spillway-Child"], answer.choices[0].message.content or "",
                answer.choices[0].finish_reason or "")
    return streamed_chat(client, **body)


def gpu_state(s: Spillway) -> str:
    return str(s.status()["children"]["gpu"]["state"])


def test_another_program_taking_the_card_has_the_gpu_child_give_way_and_come_back(
        spillway: SpillwayFactory, llama_server: Path, smollm2: Path, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, total_mib=24576, free_mib=20000, processes={})
    s = spillway(real_config(llama_server, smollm2,
                             gpu={"yield_to_other_processes": True, "vram_headroom_mib": 1024},
                             monitor={"sample_interval_s": 0.5}), fake_nvml=nvml)
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=180, max_retries=0)
    assert ask(client, "Hello", 4, stream=False)[0] == "gpu"
    pid = s.status()["children"]["gpu"]["pid"]
    # Spillway has seen the card with room (what a program there before it held is not growth):
    # the card's used memory, none of it Spillway's in the fake driver's list.
    seen = eventually(lambda: s.status()["children"]["gpu"].get("others_on_cards"))
    assert seen["mib"] == 24576 - 20000 and seen["grown_mib"] == 0, seen

    other = subprocess.Popen(["sleep", "600"])
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            stream = pool.submit(ask, client, "Tell a long story", 900, True)
            whole = pool.submit(ask, client, "Write a long letter", 600, False)
            assert eventually(lambda: s.status()["children"]["gpu"]["in_flight"] == 2, 30)
            # The program takes the card's free memory, all but 500 MiB.
            write_json(nvml, total_mib=24576, free_mib=500, processes={str(other.pid): 19500})
            took = time.monotonic()
            assert eventually(lambda: gpu_state(s) == "STOPPED", 10), s.log_tail()
            stopped_s = time.monotonic() - took
            assert eventually(lambda: not pid_alive(pid))
            # New work goes to the CPU child meanwhile.
            assert ask(client, "Hello", 4, stream=False)[0] == "cpu"
            streamed, answered = stream.result(), whole.result()
        # No request lost: both whole, as long as asked.
        assert streamed[0] == "gpu" and streamed[2] == "length", streamed
        assert answered[2] == "length" and answered[1], answered
        print(f"stopped {stopped_s:.1f} s after the program took the card; the stream "
              f"({len(streamed[1])} chars) and the non-streamed answer ({answered[0]}) whole")
        status = s.status()
        lent = status["children"]["gpu"]["lent"]
        assert lent["why"] == "yield" and lent["to_whom"] == f"pid {other.pid} (sleep)"
        assert lent["pid"] == other.pid and lent["answered_by_cpu"] >= 1
        assert f"GPU lent (yield) to pid {other.pid} (sleep) since" in format_status(status)
        assert s.samples("spillway_gpu_lent", "why")["yield"] == 1.0
        assert s.samples("spillway_gpu_lendings_total", "why")["yield"] == 1.0

        # The card stays the program's while it holds the memory.
        time.sleep(3)
        assert gpu_state(s) == "STOPPED"
    finally:
        other.kill()
        other.wait()
    write_json(nvml, total_mib=24576, free_mib=20000, processes={})
    left = time.monotonic()
    assert eventually(lambda: gpu_state(s) == "READY", 30), s.log_tail()
    print(f"READY again {time.monotonic() - left:.1f} s after the program left")
    assert "lent" not in s.status()["children"]["gpu"]
    assert s.samples("spillway_gpu_wakes_total", "why")["yield"] == 1.0
    assert ask(client, "Hello", 4, stream=False)[0] == "gpu"
    records = s.wait_incidents(4)
    lending = [(r["decision"], r["kind"]) for r in records if r["kind"] == "lent_yield"]
    assert lending == [("lent", "lent_yield"), ("returned", "lent_yield")]
    # The answers the GPU child still had when it stopped (the kind says so: not a crash): the
    # stream went on on the CPU child, the other was replayed there, each once.
    moved = sorted((r["decision"], r["kind"]) for r in records if r["kind"] != "lent_yield")
    assert moved == [("continued", "stopped"), ("replayed", "stopped")], records
