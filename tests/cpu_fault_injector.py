#!/usr/bin/env python3
"""A fault injector around a real llama-server, standing in for a CPU that crashes it.

Named for what it is: a test double of the *CPU* (or of a binary built for another one), not of
llama-server. Spillway starts it as a child's `llama_server`; it runs the real llama-server
(REAL_LLAMA_SERVER) with the same arguments, every line passing through to stderr, and dies the
way the captured crashes die (tests/fixtures/crashes/README.md):

  CPU_FAULT=amx     llama.cpp's AMX matmul (llama.cpp#20824): the load prints the AMX buffer
                    line (as an AMX build of the pinned version does at -lv 4), and the process
                    dies by SIGSEGV at the warm-up, right after `init: llama threadpool init`.
                    With `--no-repack` among the arguments (the remedy: no extra buffer types,
                    so no AMX buffer) it is the real llama-server, exec'd as it is.
  CPU_FAULT=sigill  a binary built for another CPU: once the real server launches its first
                    task, this process executes an undefined instruction (x86 `ud2`) and the
                    CPU itself raises SIGILL.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import resource
import signal
import subprocess
import sys

ENV = os.environ
AMX_LINE = "0.00.150.000 I load_tensors:          AMX model buffer size =    12.66 MiB"
WARM_UP = "init: llama threadpool init"


def write(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def die_by_sigsegv() -> None:
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGSEGV)


def execute_an_undefined_instruction() -> None:
    """A real illegal instruction: the CPU raises #UD and the kernel sends SIGILL."""
    code = b"\x0f\x0b" if platform.machine() in ("x86_64", "AMD64") else \
        b"\x00\x00\x00\x00"  # aarch64: udf #0
    buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    signal.signal(signal.SIGILL, signal.SIG_DFL)
    ctypes.CFUNCTYPE(None)(address)()


def main() -> None:
    args = sys.argv[1:]
    real = ENV["REAL_LLAMA_SERVER"]
    fault = ENV.get("CPU_FAULT", "amx")
    if fault == "amx" and ("--no-repack" in args or "-nr" in args):
        os.execv(real, [real, *args])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the crash leaves no core file behind
    proc = subprocess.Popen([real, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    signal.signal(signal.SIGTERM, lambda *_: (proc.terminate(), proc.wait(), sys.exit(0)))
    for raw in proc.stdout:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        write(line)
        if fault == "amx" and "loading model" in line:
            write(AMX_LINE)
        crash = (fault == "amx" and WARM_UP in line) or \
            (fault == "sigill" and "launch_slot_" in line)
        if crash:
            proc.kill()  # the real server is this process in the case it stands for
            proc.wait()
            if fault == "amx":
                die_by_sigsegv()
            execute_an_undefined_instruction()
    sys.exit(proc.wait())


if __name__ == "__main__":
    main()
