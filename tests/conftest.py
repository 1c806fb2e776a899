"""Shared fixtures: a real llama-server binary, a tiny real model, the fake child, daemons."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Spillway, fake_server_script, injector_script, wait_gone  # noqa: E402
from tinymm import write_tiny_projector  # noqa: E402
from tinymodel import write_tiny_model  # noqa: E402

from supervisor.commands import bootstrap, webui  # noqa: E402


@pytest.fixture(scope="session")
def llama_server() -> Path:
    """A real llama-server: $LLAMA_SERVER, or the cached build (built now if missing: about
    five minutes on two cores, once per machine)."""
    return bootstrap.ensure_llama_server()


@pytest.fixture(scope="session")
def wrapped_llama_server(llama_server: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real llama-server behind a wrapper script that execs it, as distribution packages,
    Nix and scripts that set LD_LIBRARY_PATH ship it: the process keeps the script's pid, start
    time and environment, and runs another command line than the one Spillway started (the
    real binary's path, and a flag of the package's own after the caller's arguments, as Nix's
    makeWrapper --append-flags writes it)."""
    wrapper = tmp_path_factory.mktemp("wrapped") / "llama-server"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(str(llama_server))} "$@" --log-colors off\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture(scope="session")
def web_ui() -> Path:
    """llama.cpp's web UI (the quickstart's chat page), its built `dist` folder: cached, or
    built now by the quickstart's own function (npm ci and npm run build on the pinned sdist's
    tools/ui, about two minutes, once per machine). Fails, never skips, without Node.js 20.19+
    and npm or when the build fails: CI has both and must run the tests that need it."""
    try:
        return webui.ensure_web_ui()
    except webui.WebUiError as e:
        pytest.fail(f"the web UI could not be built: {e}")


@pytest.fixture(scope="session")
def throttled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A child's `llama_server` that runs the real one (REAL_LLAMA_SERVER in the child's env)
    at a third of its speed: a CPU child clearly slower than the "GPU child" on a machine with
    no GPU (tests/throttled_llama_server.py)."""
    path = tmp_path_factory.mktemp("throttled") / "throttled-llama-server"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" '
                    f'"{Path(__file__).resolve().parent / "throttled_llama_server.py"}" "$@"\n')
    path.chmod(0o755)
    return path


# The tiny model's embedding width: its projector's output must be as wide, or llama-server
# exits 1 while loading the pair.
TINY_N_EMBD = 256


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_embd=TINY_N_EMBD)


@pytest.fixture(scope="session")
def tiny_projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's multimodal projector (`--mmproj`): a vision and an audio encoder in one
    file, 16 tokens an image and 50 per started 30 s of audio (see tinymm.py)."""
    return write_tiny_projector(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf",
                                n_embd_text=TINY_N_EMBD)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder for router mode: `alpha` (the tiny model) and `beta` (a second one,
    with other dimensions)."""
    folder = tmp_path_factory.mktemp("models")
    write_tiny_model(folder / "alpha.gguf")
    write_tiny_model(folder / "beta.gguf", n_embd=128, n_layer=2, n_ff=256)
    return folder


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model about fifteen times slower than the tiny one (some 160 tokens a second on
    one thread of this machine, unloaded; a real model is slower still), for the drill: its
    simulated failures must land while a child is answering, and the tiny model answered
    whole, on a busy machine, before Spillway's word to stop it arrived."""
    return write_tiny_model(tmp_path_factory.mktemp("slow") / "slow.gguf", n_embd=512,
                            n_layer=8, n_ff=1536, n_head=8, n_head_kv=8)


@pytest.fixture(scope="session")
def slow_models_dir(tmp_path_factory: pytest.TempPathFactory, slow_model: Path) -> Path:
    """models_dir with the slow model as `alpha` (the drilled one) and the same `beta`."""
    folder = tmp_path_factory.mktemp("slow-models")
    (folder / "alpha.gguf").symlink_to(slow_model)
    write_tiny_model(folder / "beta.gguf", n_embd=128, n_layer=2, n_ff=256)
    return folder


@pytest.fixture(scope="session")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_server_script(tmp_path_factory.mktemp("fake"))


@pytest.fixture(scope="session")
def injector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return injector_script(tmp_path_factory.mktemp("injector"))


SpillwayFactory = Callable[..., Spillway]


@pytest.fixture
def spillway(tmp_path: Path) -> Iterator[SpillwayFactory]:
    """Make daemons; every one is stopped (and its children reaped) at teardown."""
    made: list[Spillway] = []

    def make(config: Mapping[str, Any], env: Mapping[str, str] | None = None,
             fake_nvml: Path | None = None, start: bool = True,
             wait_ready: bool = True) -> Spillway:
        s = Spillway(tmp_path / f"spillway{len(made)}", config, env=env, fake_nvml=fake_nvml)
        made.append(s)
        if start:
            s.start(wait_ready=wait_ready)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's Chromium, installed by the test setup when missing (downloaded browsers are
    not reachable from these machines)."""
    import os
    import shutil
    import subprocess
    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env,
                       capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env,
                       capture_output=True)
        found = shutil.which("chromium")
    assert found is not None, "the report test needs Debian's chromium (apt-get install chromium)"
    return Path(found)


@pytest.fixture
def new_daemons() -> Iterator[list[int]]:
    """The daemons an upgrade started (not the harness's own process): stopped at the end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    wait_gone(set(pids), 30)
