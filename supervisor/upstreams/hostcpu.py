"""What this machine's CPU is and can do, from /proc/cpuinfo: read once, passed on as facts.

Two readers: the embedded build (a `-march=native` binary is keyed by the instruction sets it
was built for, so a cache carried to another CPU is rebuilt instead of dying by SIGILL) and the
crash signatures (llama.cpp's AMX matmul crashes only on a CPU that has AMX).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class HostCpu:
    model: str  # "Intel(R) Xeon(R) Platinum 8480+", "AMD EPYC", or the machine's name
    flags: frozenset[str]  # x86 "flags" (avx2, avx512f, amx_int8, ...) or ARM "Features"

    @property
    def has_amx(self) -> bool:
        return "amx_int8" in self.flags or "amx_tile" in self.flags

    def describe(self) -> str:
        """`AMD EPYC (AVX-512, no AMX)`: what a crash verdict or a log line needs to say."""
        notes = []
        if "avx512f" in self.flags:
            notes.append("AVX-512")
        elif "avx2" in self.flags:
            notes.append("AVX2")
        if self.flags:
            notes.append("AMX" if self.has_amx else "no AMX")
        return f"{self.model} ({', '.join(notes)})" if notes else self.model


def parse_cpuinfo(text: str, machine: str = "") -> HostCpu:
    """The first processor's model name and flags (every core of a machine reports the same)."""
    model = ""
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return HostCpu(model=model or machine or "unknown CPU", flags=flags)


@functools.cache
def host_cpu() -> HostCpu:
    """This machine's CPU; an empty flag set where /proc/cpuinfo cannot be read."""
    try:
        text = CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    return parse_cpuinfo(text, platform.machine())
