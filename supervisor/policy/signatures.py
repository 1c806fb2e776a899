"""Known crash signatures: a child that dies the same way at the same point every time.

Not an out-of-memory: a bug or a mismatch that no restart mends (llama.cpp's AMX matmul on a
Xeon, a binary built for another CPU, a CUDA build without this GPU's kernels, a missing shared
library, a model newer than the binary). Each signature names what happened, what to change,
and the upstream issue or document, so that status, the incident and the log can say it in one
line instead of "crash". The lifecycle takes a signature seen twice in a row as the end of the
quick retries: the child goes FATAL at once with the remedy as its reason.

Pure: the exit status, the lines the process wrote (its tail, plus every line that one of the
signatures names, kept from the start of the process) and the CPU's facts come in as values.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .evidence import exit_signal

SIGSEGV = int(signal.SIGSEGV)
SIGILL = int(signal.SIGILL)
SIGABRT = int(signal.SIGABRT)
SIGBUS = int(signal.SIGBUS)

LLAMA_CPP = "https://github.com/ggml-org/llama.cpp"
BUILD_DOC = f"{LLAMA_CPP}/blob/master/docs/build.md"


@dataclass(frozen=True)
class Signature:
    """One known way to die. It matches when the process ended by one of `signals` (or exited
    with one of `exit_codes`) and either a line of its output matches `line`, or, with no such
    line, it died before it was ready on a CPU with `cpu_flag`. A signature with neither `line`
    nor `cpu_flag` matches on the exit alone."""

    name: str
    what: str  # the verdict; "{cpu}" is the CPU's model, "{match}" the line's first group
    remedy: str
    upstream: str  # the issue or document that says more
    signals: frozenset[int] = frozenset()
    exit_codes: frozenset[int] = frozenset()
    line: re.Pattern[str] | None = None
    cpu_flag: str = ""
    deterministic: bool = True  # the same again on every start: retrying cannot help

    def ended_so(self, returncode: int) -> bool:
        sig = exit_signal(returncode)
        if sig is not None:
            return sig in self.signals
        return returncode in self.exit_codes


@dataclass(frozen=True)
class CrashFacts:
    returncode: int
    lines: Sequence[str]  # what the process wrote: its tail and the marker lines
    before_ready: bool  # it died while loading or warming up
    cpu_model: str = ""
    cpu_flags: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Diagnosis:
    signature: Signature
    evidence: str  # the line that named it, or the fact that did
    what: str  # the signature's verdict, filled in

    @property
    def name(self) -> str:
        return self.signature.name

    def summary(self) -> str:
        """One line for a log, a state's reason or an incident."""
        s = self.signature
        return f"known crash {s.name}: {self.what}. Fix: {s.remedy} (see {s.upstream})"

    def to_json(self) -> dict[str, str]:
        s = self.signature
        return {"signature": s.name, "what": self.what, "remedy": s.remedy,
                "upstream": s.upstream, "evidence": self.evidence}


SIGNATURES: tuple[Signature, ...] = (
    Signature(
        name="amx_matmul",
        what="llama.cpp's AMX matrix multiply (ggml_backend_amx_mul_mat) crashed at the first "
             "compute, a known upstream bug with Q4_K weights on CPUs with AMX ({cpu})",
        remedy='add "--no-repack" to model.args (cpu.args for the CPU child alone), so that the '
               "weights stay in plain CPU buffers; or run a llama-server built without AMX "
               "(CFLAGS and CXXFLAGS \"-mno-amx-tile -mno-amx-int8 -mno-amx-bf16\"), as "
               "Spillway's embedded build is",
        upstream=f"{LLAMA_CPP}/issues/20824",
        signals=frozenset({SIGSEGV, SIGBUS}),
        # load_tensors' buffer line (printed at -lv 4, and by Ollama's logs), or the AMX
        # kernel's name in a backtrace.
        line=re.compile(r"\bAMX model buffer size\b|ggml_backend_amx_mul_mat"),
        cpu_flag="amx_int8",
    ),
    Signature(
        name="illegal_instruction",
        what="the binary uses an instruction this CPU ({cpu}) does not have: it was built for "
             "another CPU (-march=native on another machine, or a prebuilt for a newer one)",
        remedy="rebuild llama-server on this machine, or build it with -DGGML_NATIVE=OFF "
               "-DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON so that it picks this CPU's "
               "variant at run time (Spillway's embedded build is keyed by the CPU's "
               "instruction sets and rebuilds by itself on another CPU)",
        upstream=f"{BUILD_DOC}#cpu-build",
        signals=frozenset({SIGILL}),
    ),
    Signature(
        name="cuda_no_kernel",
        what="this CUDA build has no kernels for the GPU's architecture",
        remedy="rebuild llama-server with -DCMAKE_CUDA_ARCHITECTURES set to the GPU's compute "
               "capability (nvidia-smi --query-gpu=compute_cap --format=csv; 8.6 is 86), or "
               "\"native\" when building on this machine",
        upstream=f"{BUILD_DOC}#cuda",
        signals=frozenset({SIGABRT}),
        exit_codes=frozenset({1}),
        line=re.compile(r"no kernel image is available for execution on the device"),
    ),
    Signature(
        name="cuda_driver_too_old",
        what="the NVIDIA driver is older than the CUDA runtime this llama-server was built with",
        remedy="update the NVIDIA driver, or build llama-server with the CUDA toolkit that the "
               "driver supports (nvidia-smi shows its CUDA version)",
        upstream=f"{BUILD_DOC}#cuda",
        signals=frozenset({SIGABRT}),
        exit_codes=frozenset({1}),
        line=re.compile(r"CUDA driver version is insufficient for CUDA runtime version|"
                        r"forward compatibility was attempted on non supported HW"),
    ),
    Signature(
        name="missing_library",
        what="llama-server cannot start: the shared library {match} is not found",
        remedy="install the library, or name its folder in LD_LIBRARY_PATH in gpu.env (or "
               "cpu.env); for a CUDA build, the folder that holds libcudart and libcublas",
        upstream=f"{BUILD_DOC}#cuda",
        exit_codes=frozenset({127}),
        line=re.compile(r"error while loading shared libraries: ([^:\s]+)"),
    ),
    Signature(
        name="unknown_architecture",
        what="this llama-server is older than the model: it does not know the architecture "
             "'{match}'",
        remedy="update llama-server, or name a newer binary in model.llama_server",
        upstream=f"{LLAMA_CPP}/releases",
        exit_codes=frozenset({1}),
        line=re.compile(r"unknown model architecture: '([^']+)'"),
    ),
    Signature(
        name="image_over_ubatch",
        what="an image's tokens did not fit in one micro-batch: the model's vision encoder "
             "needs non-causal attention over the whole image, and llama-server aborts "
             "(GGML_ASSERT in llama_context::decode, under mtmd_helper_decode_image_chunk)",
        remedy='raise the micro-batch in model.args to hold an image, e.g. "-ub 2048 -b 2048", '
               'or cap the image\'s tokens with "--image-max-tokens" (at most -ub; half of it '
               "for models that take the prompt in the same micro-batch)",
        upstream=f"{LLAMA_CPP}/issues/23409",
        signals=frozenset({SIGABRT}),
        line=re.compile(r"non-causal attention requires n_ubatch >= n_tokens"),
        # An image request kills it, not a start: text keeps being served, so no FATAL.
        deterministic=False,
    ),
)

_MARKERS = tuple(s.line for s in SIGNATURES if s.line is not None)


def is_marker(line: str) -> bool:
    """A line some signature names: the child keeps it past its output tail's bound."""
    return any(p.search(line) for p in _MARKERS)


@dataclass(frozen=True)
class _Match:
    evidence: str
    group: str = ""  # the line's first group, for "{match}"
    likely: bool = False  # only the CPU and the moment matched, not a line


def _last_line(lines: Sequence[str], pattern: re.Pattern[str]) -> re.Match[str] | None:
    for line in reversed(lines):
        m = pattern.search(line)
        if m:
            return m
    return None


def _matches(s: Signature, facts: CrashFacts) -> _Match | None:
    if not s.ended_so(facts.returncode):
        return None
    if s.line is not None:
        m = _last_line(facts.lines, s.line)
        if m is not None:
            return _Match(m.string.strip(), (m.group(1) if m.groups() else "") or "")
    if s.cpu_flag:
        if facts.before_ready and s.cpu_flag in facts.cpu_flags:
            # No line named it (llama.cpp prints its buffer types only at -lv 4): the CPU and
            # the moment make it the likely cause, and the verdict says "likely".
            return _Match(f"died before it was ready on a CPU with {s.cpu_flag}", likely=True)
        return None
    return _Match("the exit status") if s.line is None else None


def diagnose(facts: CrashFacts) -> Diagnosis | None:
    """The first signature of the table that the facts match, filled in; None when none does."""
    for s in SIGNATURES:
        found = _matches(s, facts)
        if found is not None:
            what = s.what.format(cpu=facts.cpu_model or "this CPU", match=found.group or "?")
            return Diagnosis(signature=s, evidence=found.evidence,
                             what=f"likely {what}" if found.likely else what)
    return None


def repeats(names: Iterable[str | None]) -> int:
    """How many of the latest exits, newest last, share the newest one's deterministic
    signature (0 when the newest has none)."""
    run: list[str | None] = list(names)
    if not run or run[-1] is None:
        return 0
    latest = run[-1]
    if not any(s.name == latest and s.deterministic for s in SIGNATURES):
        return 0
    count = 0
    for name in reversed(run):
        if name != latest:
            break
        count += 1
    return count
