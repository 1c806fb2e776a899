"""Issue 49 in router mode: the GPU lent when idle, model by model (service/model_lending.py),
against the real llama-server routers over a folder of two small real models, driven by the
real OpenAI client.

`alpha` idle for gpu.idle_release_s (3 s here) while `beta` keeps being asked: alpha's instance
on the CPU router is loaded, then its GPU instance unloaded (its process gone), while beta's
stays; the status and `spillway status` say so. The next request for alpha is answered by its
CPU instance at once, and its GPU instance is loaded again.

And gpu.yield_to_other_processes, which in router mode lends the whole GPU router: with fake
NVML figures (tests/fake_nvml), a real process takes the card's memory while a stream runs on
the GPU router; the router is stopped, the stream goes on on the CPU router, and the router
starts again once the program has left."""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
from pathlib import Path

import openai
import pytest
from harness import Spillway, eventually, pid_alive, router_config, streamed_chat, write_json

from conftest import SpillwayFactory
from supervisor.commands.cli import format_status

pytestmark = pytest.mark.integration


def model(s: Spillway, child: str, name: str) -> dict[str, object]:
    found: dict[str, object] = s.child(child).get("models", {}).get(name, {})
    return found


def test_a_model_idle_on_the_gpu_router_is_unloaded_there_and_answered_by_the_cpu_router(
        spillway: SpillwayFactory, llama_server: Path, models_dir: Path) -> None:
    s = spillway(router_config(llama_server, models_dir, gpu={"idle_release_s": 3},
                               monitor={"sample_interval_s": 0.5}))
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=120, max_retries=0)

    def ask(name: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=name, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        assert raw.parse().choices[0].finish_reason in ("length", "stop")
        return raw.headers["X-Spillway-Child"]

    assert ask("alpha") == "gpu" and ask("beta") == "gpu"
    assert eventually(lambda: model(s, "gpu", "alpha").get("state") == "READY")
    alpha_pid = model(s, "gpu", "alpha")["pid"]
    assert isinstance(alpha_pid, int)
    # beta is asked every second; alpha is not.
    began = time.monotonic()
    while model(s, "gpu", "alpha").get("state") != "STOPPED" and time.monotonic() - began < 30:
        assert ask("beta") == "gpu"
        time.sleep(1.0)
    released_s = time.monotonic() - began
    assert model(s, "gpu", "alpha")["state"] == "STOPPED", s.log_tail()
    assert eventually(lambda: not pid_alive(alpha_pid))
    assert model(s, "gpu", "beta")["state"] == "READY"
    assert model(s, "cpu", "alpha")["state"] == "READY"  # loaded before the GPU one went
    status = s.status()
    lent = status["children"]["gpu"]["lent_models"]
    assert set(lent) == {"alpha"} and lent["alpha"]["why"] == "idle"
    assert "lent when idle: alpha (since" in format_status(status)
    print(f"alpha's GPU instance unloaded {released_s:.1f} s after its last request")

    # The next request for alpha: its CPU instance answers at once; its GPU instance loads.
    asked = time.monotonic()
    assert ask("alpha") == "cpu"
    print(f"alpha answered by the CPU router in {time.monotonic() - asked:.2f} s")
    assert eventually(lambda: model(s, "gpu", "alpha").get("state") == "READY", 60)
    assert "lent_models" not in s.status()["children"]["gpu"]
    assert ask("alpha") == "gpu"
    records = [(r["decision"], r["kind"], r["model"]) for r in s.incidents()
               if r["kind"] == "lent_idle"]
    assert records == [("lent", "lent_idle", "alpha"), ("woken", "lent_idle", "alpha")]
    assert s.samples("spillway_gpu_wakes_total", "why")["idle"] == 1.0


def test_the_whole_gpu_router_gives_way_to_another_program_and_comes_back(
        spillway: SpillwayFactory, llama_server: Path, slow_models_dir: Path,
        tmp_path: Path) -> None:
    """gpu.yield_to_other_processes in router mode: the GPU router (every model's instance on
    it) gives way; a stream in flight on it goes on on the CPU router for the same model."""
    nvml = tmp_path / "nvml.json"
    write_json(nvml, total_mib=24576, free_mib=20000, processes={})
    s = spillway(router_config(llama_server, slow_models_dir,
                               gpu={"yield_to_other_processes": True},
                               monitor={"sample_interval_s": 0.5}), fake_nvml=nvml)
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=180, max_retries=0)
    first = client.chat.completions.with_raw_response.create(
        model="alpha", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    assert first.headers["X-Spillway-Child"] == "gpu"
    router_pid = s.child("gpu")["pid"]
    # Spillway has seen the card with room: the other program's growth is counted from there.
    assert eventually(lambda: s.child("gpu").get("others_on_cards"))

    other = subprocess.Popen(["sleep", "600"])
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(stream_alpha, client)
            assert eventually(lambda: model(s, "gpu", "alpha").get("in_flight") == 1, 30)
            write_json(nvml, total_mib=24576, free_mib=500, processes={str(other.pid): 19500})
            took = time.monotonic()
            assert eventually(lambda: s.child("gpu")["state"] == "STOPPED", 10), s.log_tail()
            stopped_s = time.monotonic() - took
            assert eventually(lambda: not pid_alive(router_pid))
            beta = client.chat.completions.with_raw_response.create(
                model="beta", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
            assert beta.headers["X-Spillway-Child"] == "cpu"
            child, text, finish = stream.result()
        assert child == "gpu" and finish == "length" and text, (child, finish)
        lent = s.child("gpu")["lent"]
        assert lent["why"] == "yield" and lent["to_whom"] == f"pid {other.pid} (sleep)"
        print(f"the GPU router stopped {stopped_s:.1f} s after the program took the card; the "
              f"stream on it whole ({len(text)} chars)")
    finally:
        other.kill()
        other.wait()
    write_json(nvml, total_mib=24576, free_mib=20000, processes={})
    left = time.monotonic()
    assert eventually(lambda: s.child("gpu")["state"] == "READY", 30), s.log_tail()
    print(f"the GPU router READY again {time.monotonic() - left:.1f} s after the program left")
    again = client.chat.completions.with_raw_response.create(
        model="alpha", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    assert again.parse().choices[0].finish_reason in ("length", "stop")
    cut = [(r["decision"], r["kind"]) for r in s.incidents() if r["kind"] == "stopped"]
    assert cut == [("continued", "stopped")], s.incidents()


def stream_alpha(client: openai.OpenAI) -> tuple[str, str, str]:
    """A long greedy stream from `alpha` (the slow model): its first child, text, finish."""
    return streamed_chat(client, model="alpha", max_tokens=900, temperature=0,
                         messages=[{"role": "user", "content": "Tell a long story"}],
                         extra_body={"ignore_eos": True})
