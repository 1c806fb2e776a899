"""A GPU child that is not on the GPU, end to end with a real llama-server as the GPU child.

The embedded llama-server is a CPU build: given `-ngl 99` it prints the real `warning: no usable
GPU found` line and loads everything on the CPU, as a CUDA build does after a driver update
(ollama/ollama#15918). The status, the status text and the incident log say none. A fake card
(the fake pynvml) where the child's own pid holds the model's worth, with a wrapper that keeps
`-ngl` from the CPU build (a CUDA build with a working card prints no warning), says full. With
gpu.require_offload the GPU child fails its start and backs off, and the CPU child answers."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cdp import Browser
from harness import PATIENCE_S, Spillway, eventually, real_config, write_json

from conftest import SpillwayFactory
from supervisor.commands.cli import format_status
from supervisor.config import gguf_meta

pytestmark = [pytest.mark.integration]

CARD = {"total_mib": 24576, "free_mib": 20000, "name": "Fake RTX", "uuid": "GPU-1234",
        "pci_bus_id": "00000000:2B:00.0"}


def wait_offload(s: Spillway, states: tuple[str, ...], timeout: float = PATIENCE_S
                 ) -> dict[str, Any]:
    """The GPU child's offload once judged (not "not judged yet") and in one of `states`."""
    def judged() -> dict[str, Any] | None:
        told = s.child("gpu").get("offload") or {}
        ok = told.get("state") in states and "not judged yet" not in told.get("why", "")
        return told if ok else None

    told = eventually(judged, timeout)
    assert told, (s.child("gpu").get("offload"), s.log_tail())
    return dict(told)


def layers_of(model: Path) -> int:
    """llama.cpp's count: the blocks and the output layer."""
    return gguf_meta.model_shape(str(model)).n_layer + 1


def test_a_cpu_build_with_ngl_99_is_told_none_with_its_own_line(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, **CARD, processes={})  # a card, but no per-process figures
    cfg = real_config(llama_server, tiny_model, monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, fake_nvml=nvml)
    told = wait_offload(s, ("none",))
    total = layers_of(tiny_model)
    assert told["layers"] == {"offloaded": 0, "total": total, "asked": total}
    assert told["why"] == (f"0 of {total} layers on the GPU: llama-server: no usable GPU "
                           "found, --gpu-layers option will be ignored")
    assert told["short"] is True and told["source"] == "log"
    # Told, and only told: it serves on.
    assert s.child("gpu")["state"] == "READY"
    assert f"  on the GPU: none: 0 of {total} layers on the GPU" in format_status(s.status())
    assert "[gpu] not on the GPU as asked: 0 of" in s.log_text()
    # No incident record: nothing was done (the tests' own GPU child is this CPU build too).
    assert s.incidents() == []
    # The CPU child is not judged.
    assert "offload" not in s.child("cpu")


ON_THE_GPU = ("(() => { const d = [...document.querySelectorAll('article[data-child=\"gpu\"] dt')]"
              ".find(d => d.textContent === 'on the GPU');"
              " return d && d.nextElementSibling.textContent; })()")


async def test_the_status_page_says_it_in_the_gpu_childs_card(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path,
        chromium: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, **CARD, processes={})
    cfg = real_config(llama_server, tiny_model, monitor={"sample_interval_s": 0.1})
    s = await asyncio.to_thread(spillway, cfg, fake_nvml=nvml)
    await asyncio.to_thread(wait_offload, s, ("none",))
    async with Browser.launch(chromium, tmp_path) as page:
        await page.navigate(f"{s.url}/spillway")
        shown = await page.wait_for(ON_THE_GPU)
        assert shown.startswith("none: 0 of 5 layers on the GPU: llama-server: no usable GPU"), \
            shown
        assert await page.evaluate(ON_THE_GPU.replace('"gpu"', '"cpu"')) is None
        assert page.problems == []


def without_ngl(tmp_path: Path, llama_server: Path) -> Path:
    """A build whose card works (a test double of a CUDA build): it lists a CUDA device, and
    the real CPU build is run without -ngl, so that it prints no `no usable GPU` warning."""
    script = tmp_path / "llama-server-cuda-build"
    script.write_text(
        "#!/bin/sh\n"
        "for a in \"$@\"; do\n"
        "  if [ \"$a\" = --list-devices ]; then\n"
        "    printf '%s\\n' 'Available devices:' "
        "'  CUDA0: NVIDIA Fake RTX (24576 MiB, 20000 MiB free)'; exit 0; fi\n"
        "done\n"
        "skip=0\n"
        "for a do\n"
        "  shift\n"
        "  if [ $skip = 1 ]; then skip=0; continue; fi\n"
        "  if [ \"$a\" = -ngl ]; then skip=1; continue; fi\n"
        "  set -- \"$@\" \"$a\"\n"
        "done\n"
        f"exec '{llama_server}' \"$@\"\n")
    script.chmod(0o755)
    return script


def test_a_card_where_the_childs_pid_holds_the_model_says_full(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, **CARD, processes={})
    cfg = real_config(llama_server, tiny_model, monitor={"sample_interval_s": 0.1},
                      gpu={"llama_server": str(without_ngl(tmp_path, llama_server))})
    s = spillway(cfg, fake_nvml=nvml)
    # Its log is silent (the default verbosity) and the card lists no process: not known.
    told = wait_offload(s, ("unknown",))
    assert "no per-process memory figures" in told["why"]
    pid = s.child("gpu")["pid"]
    write_json(nvml, **CARD, processes={str(pid): 3858})
    told = wait_offload(s, ("full",))
    total = layers_of(tiny_model)
    assert told["layers"] == {"offloaded": total, "total": total, "asked": total}
    assert told["why"].startswith("all of its layers on the GPU: it holds 3858 MiB of VRAM")
    assert told["source"] == "memory" and told["short"] is False
    assert s.incidents() == []
    # Judged once for this process: the figures changing later do not change it.
    write_json(nvml, **CARD, processes={})
    assert eventually(lambda: s.status()["gpu"]["children_used_bytes"]["gpu"] == 0)  # sampled
    assert s.child("gpu")["offload"]["state"] == "full"


def test_require_offload_fails_the_start_and_the_cpu_child_answers(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, **CARD, processes={})
    cfg = real_config(llama_server, tiny_model, monitor={"sample_interval_s": 0.1},
                      gpu={"require_offload": True, "stop_grace_s": 1},
                      restart={"backoff_initial_s": 0.2, "backoff_max_s": 0.5,
                               "max_quick_failures": 2, "fatal_retry_max_s": 600})
    s = spillway(cfg, fake_nvml=nvml, wait_ready=False)
    s.wait_state(("cpu",), ("READY",))
    # Ended as it loads (llama-server's first line says it has no GPU; the tiny model may be
    # ready by the time the end reaches it), twice in a row: quick failures, so the crash-loop
    # back-off takes it to FATAL.
    status = s.wait_state(("gpu",), ("FATAL",))
    gpu = status["children"]["gpu"]
    assert gpu["last_exit"]["kind"] == "no_offload"
    assert "not on the GPU as asked" in gpu["last_exit"]["evidence"]
    assert "no usable GPU found" in gpu["last_exit"]["evidence"]
    assert gpu["restarts"] >= 1 and gpu["quick_failures"] == 2
    assert gpu["offload"]["state"] == "none"
    assert "no_offload" in gpu["why"]
    records = s.incidents()
    assert len(records) == 2 and {r["decision"] for r in records} == {"ended"}
    assert {r["kind"] for r in records} == {"no_offload"}
    assert all("no usable GPU found" in r["evidence"] and r["request_id"] == ""
               for r in records)
    # Meanwhile the CPU child serves.
    req = urllib.request.Request(
        s.url + "/v1/chat/completions", method="POST",
        data=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        assert r.headers["X-Spillway-Child"] == "cpu"
