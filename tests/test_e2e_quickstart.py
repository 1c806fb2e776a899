"""End to end: `spillway quickstart` with the real SmolLM2-135M-Instruct model, through the
OpenAI Python client, as a new user would run it: a sensible first answer from both children,
and a taken port named before anything is built."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from harness import REPO, free_port

from supervisor.commands import bootstrap, remote as client, quickstart

pytestmark = [pytest.mark.integration]


@pytest.fixture
def own_cache(tmp_path: Path, llama_server: Path, web_ui: Path,
              monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache (SPILLWAY_CACHE) as the quickstart sees it: the shared cache's build, model
    and locks, linked into a folder of this test's own, so that the quickstart's note of its
    config (`quickstart-config`, which `spillway status` with no flag reads) is its own and
    not that of another suite's quickstart running on this machine at the same time (seen:
    `spillway status` found the other one's daemon). Set for this process too, so that
    bootstrap.model_path() names what the quickstart writes. The chat page (`web_ui`) is built
    first, so that the quickstart finds it cached and serves it."""
    shared = bootstrap.cache_dir()
    (shared / "models").mkdir(parents=True, exist_ok=True)  # a first run's fetch lands there
    own = tmp_path / "cache"
    own.mkdir()
    for entry in shared.iterdir():
        if entry.name != "quickstart-config":
            (own / entry.name).symlink_to(entry)
    monkeypatch.setenv("SPILLWAY_CACHE", str(own))
    return own


def start_quickstart(tmp_path: Path, config_path: Path, port: int,
                     *extra: str) -> tuple[subprocess.Popen[bytes], Any, dict[str, Any]]:
    """`spillway quickstart` as a new user runs it; returns once both children are READY (and,
    in router mode, the routers have listed their models): the process, its log and the status."""
    log = open(tmp_path / "quickstart.log", "wb")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("LLAMA_SERVER", None)  # the embedded default: the cached build
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "quickstart", *extra, "--config", str(config_path),
         "--listen", f"127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600  # a first run fetches the model
    while True:
        assert proc.poll() is None, (tmp_path / "quickstart.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/spillway/status",
                                        timeout=5) as r:
                status = json.loads(r.read())
            if all(c["state"] == "READY" for c in status["children"].values()) and (
                    not status.get("router") or status["models"]):
                return proc, log, status
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("quickstart never became ready")
        time.sleep(0.5)


# What leaks into an answer when the chat template is not the model's own (ChatML's and Gemma's
# turn markers; SmolLM2 speaks ChatML, so its own markers must never show either).
TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>")


def ask(oa: openai.OpenAI, model: str) -> Any:
    """The newcomer's first question (the one the quickstart's welcome suggests), greedily."""
    return oa.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": quickstart.QUESTION}],
        max_tokens=32, temperature=0)


def assert_sensible(text: str | None) -> None:
    """The instruction-tuned model's answer to the welcome's question: Paris, with no
    template token (the pinned build, greedy: "The capital of France is Paris.")."""
    assert_no_template_tokens(text)
    assert text is not None and "Paris" in text, text


def assert_no_template_tokens(text: str | None) -> None:
    assert text
    leaked = [t for t in TEMPLATE_TOKENS if t in text]
    assert not leaked, f"the answer carries template tokens {leaked}: {text!r}"


def welcome_of(tmp_path: Path) -> list[str]:
    """The welcome lines in the quickstart's output, which come after "listening"."""
    out = (tmp_path / "quickstart.log").read_text()
    assert "listening on" in out
    after = out[out.index("listening on"):]
    assert "Spillway is serving on" in after, out[-3000:]
    return after[after.index("Spillway is serving on"):].splitlines()[:6]


def stop_quickstart(proc: subprocess.Popen[bytes], log: Any) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    log.close()


def test_quickstart_serves_smollm2_from_both_children_through_the_openai_client(
        tmp_path: Path, llama_server: Path, own_cache: Path) -> None:
    port = free_port()
    config_path = tmp_path / "quickstart.toml"
    proc, log, status = start_quickstart(tmp_path, config_path, port)
    try:
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=120)
        text = config_path.read_text()
        assert str(bootstrap.model_path()) in text
        assert f'listen = "127.0.0.1:{port}"' in text
        assert status["gpu_child_on_cpu"] in (True, False)
        if status["gpu_child_on_cpu"]:
            assert "runs CPU-only" in status["children"]["gpu"]["runs_on"]
        raw = ask(oa, "smollm2")
        answer = raw.parse()
        assert raw.headers["X-Spillway-Child"] == "gpu"
        assert_sensible(answer.choices[0].message.content)
        assert answer.choices[0].finish_reason == "stop"
        assert "SmolLM2-135M-Instruct" in answer.model
        # The CPU child, the safety net, answers the same: with the GPU child paused, the
        # same question goes to it.
        pause = urllib.request.Request(f"http://127.0.0.1:{port}/spillway/gpu/pause",
                                       method="POST", data=b"")
        with urllib.request.urlopen(pause, timeout=60) as r:
            assert r.status == 200
        raw = ask(oa, "smollm2")
        assert raw.headers["X-Spillway-Child"] == "cpu"
        assert_sensible(raw.parse().choices[0].message.content)
        resume = urllib.request.Request(f"http://127.0.0.1:{port}/spillway/gpu/resume",
                                        method="POST", data=b"")
        with urllib.request.urlopen(resume, timeout=60) as r:
            assert r.status == 200
        # The welcome's curl line works as printed, and answers in bounded time.
        welcome = welcome_of(tmp_path)
        curl = subprocess.run(["bash", "-c", "\n".join(welcome[1:3])], capture_output=True,
                              text=True, timeout=120)
        assert curl.returncode == 0, curl.stderr
        answer_json = json.loads(curl.stdout)
        assert answer_json["usage"]["completion_tokens"] <= quickstart.MAX_TOKENS
        assert_sensible(answer_json["choices"][0]["message"]["content"])
        # The welcome's status line works as printed, with no flag: the client commands find
        # the quickstart's config by themselves.
        assert f"http://127.0.0.1:{port}/spillway/" in welcome[4]
        status_cmd = shlex.split(welcome[3].split("#")[0])
        assert status_cmd[-1] == "status", welcome
        env = {k: v for k, v in os.environ.items() if k != "SPILLWAY_CONFIG"}
        if os.path.exists(client.DEFAULT_CONFIG):
            assert "--config" in status_cmd  # the service's config would win: said so
        done = subprocess.run(status_cmd, capture_output=True, text=True, timeout=60,
                              env={**env, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr
        assert f"listening on 127.0.0.1:{port}" in done.stdout
        # The chat page, at the address the welcome names: llama.cpp's web UI, from the
        # children's --path (the cached build), through Spillway.
        assert welcome[5].split("#")[0].strip() == f"http://127.0.0.1:{port}/", welcome
        assert "--path" in text and "web-ui-" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=60) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
            page = r.read().decode()
        assert "_app/immutable/bundle." in page  # the UI's page, which loads its bundle
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/manifest.webmanifest",
                                    timeout=60) as r:
            assert json.loads(r.read())["name"] == "llama-ui"  # the UI's title
    finally:
        stop_quickstart(proc, log)


def test_quickstart_router_serves_smollm2_by_name_through_the_openai_client(
        tmp_path: Path, llama_server: Path, own_cache: Path) -> None:
    port = free_port()
    config_path = tmp_path / "quickstart-router.toml"
    proc, log, status = start_quickstart(tmp_path, config_path, port, "--router")
    try:
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=120)
        assert "--models-dir" in config_path.read_text() and status["router"] is True
        name = bootstrap.model_path().stem  # the model is served by its file's name
        assert [m.id for m in oa.models.list()] == [name]
        raw = ask(oa, name)
        assert raw.headers["X-Spillway-Child"] == "gpu"
        assert raw.headers["X-Spillway-Model"] == name
        assert_sensible(raw.parse().choices[0].message.content)
        assert f'"model": "{name}"' in "\n".join(welcome_of(tmp_path))
    finally:
        stop_quickstart(proc, log)


def test_a_taken_port_is_named_with_its_holder_before_anything_is_built(
        tmp_path: Path) -> None:
    """Port 8080 held by another program: the quickstart says which one and the next free port
    at once (no build, no download: an empty cache stays empty), and exits 2."""
    holder = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline().split("port ")[1].split()[0])
        cache = tmp_path / "cache"
        env = {**os.environ, "PYTHONPATH": str(REPO), "SPILLWAY_CACHE": str(cache)}
        env.pop("LLAMA_SERVER", None)
        done = subprocess.run(
            [sys.executable, "-m", "supervisor", "quickstart", "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert done.returncode == 2, done.stderr
        assert f"127.0.0.1:{port} is in use by python" in done.stderr
        assert f"(pid {holder.pid}:" in done.stderr and "http.server" in done.stderr
        assert "The next free port is" in done.stderr
        suggested = done.stderr.split("quickstart --listen ")[1].split()[0]
        free = int(suggested.rpartition(":")[2])
        assert free > port
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", free))  # what it offers is free indeed
        # Nothing was built or fetched: the cache it was given is still empty.
        assert not any(cache.glob("llama-server-*")) and not (cache / "models").exists()
    finally:
        holder.kill()
        holder.wait()
