"""The table of known crash signatures, on captured logs (tests/fixtures/crashes/README.md)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from supervisor.policy import lifecycle, signatures
from supervisor.policy.evidence import FailureKind, classify_exit
from supervisor.policy.signatures import CrashFacts, diagnose

FIXTURES = Path(__file__).parent / "fixtures"
CRASHES = FIXTURES / "crashes"
SEGV, ILL, ABRT, KILL = (-int(s) for s in (signal.SIGSEGV, signal.SIGILL, signal.SIGABRT,
                                           signal.SIGKILL))
XEON = ("Intel(R) Xeon(R) Platinum 8480+ (AVX-512, AMX)",
        frozenset({"avx512f", "amx_tile", "amx_int8", "amx_bf16"}))
EPYC = ("AMD EPYC (AVX-512, no AMX)", frozenset({"avx512f", "avx2"}))


def lines(name: str) -> list[str]:
    return (CRASHES / name).read_text().splitlines()


def facts(name: str, returncode: int, before_ready: bool = True,
          cpu: tuple[str, frozenset[str]] = EPYC) -> CrashFacts:
    return CrashFacts(returncode=returncode, lines=lines(name), before_ready=before_ready,
                      cpu_model=cpu[0], cpu_flags=cpu[1])


@pytest.mark.parametrize(("log", "returncode", "before_ready", "cpu", "expected"), [
    # The AMX buffer line names it, wherever it runs and whenever it dies.
    ("amx-sigsegv-lv4.log", SEGV, True, XEON, "amx_matmul"),
    ("amx-sigsegv-lv4.log", SEGV, False, EPYC, "amx_matmul"),
    ("amx-sigsegv-lv4.log", -int(signal.SIGBUS), True, XEON, "amx_matmul"),
    # At the default verbosity no line names it: on a CPU with AMX, before ready, it is likely.
    ("amx-sigsegv-default.log", SEGV, True, XEON, "amx_matmul"),
    # ... but not on a CPU without AMX, nor once it served (then it is some other crash).
    ("amx-sigsegv-default.log", SEGV, True, EPYC, None),
    ("amx-sigsegv-default.log", SEGV, False, XEON, None),
    # CPU_REPACK is not AMX: a SIGSEGV there is an unknown crash.
    ("repack-sigsegv-lv4.log", SEGV, True, XEON, "amx_matmul"),  # the CPU fact still speaks
    ("repack-sigsegv-lv4.log", SEGV, True, EPYC, None),
    # Killed, not crashed: never a signature, AMX line or not.
    ("amx-sigsegv-lv4.log", KILL, True, XEON, None),
    ("amx-sigsegv-lv4.log", 0, True, XEON, None),
    # SIGILL: an instruction this CPU lacks, on any CPU, at any moment; 132 is a shell's.
    ("sigill-default.log", ILL, True, EPYC, "illegal_instruction"),
    ("sigill-default.log", ILL, False, XEON, "illegal_instruction"),
    ("sigill-default.log", 128 + int(signal.SIGILL), True, EPYC, "illegal_instruction"),
    ("missing-library.log", 127, True, EPYC, "missing_library"),
    ("missing-library.log", 1, True, EPYC, None),
    ("unknown-architecture.log", 1, True, EPYC, "unknown_architecture"),
    ("cuda-no-kernel.log", ABRT, True, XEON, "cuda_no_kernel"),
    ("cuda-no-kernel.log", 134, False, XEON, "cuda_no_kernel"),
])
def test_the_table_names_each_captured_crash(log: str, returncode: int, before_ready: bool,
                                             cpu: tuple[str, frozenset[str]],
                                             expected: str | None) -> None:
    found = diagnose(facts(log, returncode, before_ready, cpu))
    assert (found.name if found else None) == expected


def test_a_real_gpu_oom_is_not_a_known_crash() -> None:
    """The H200's runtime OOM (SIGABRT after the CUDA line) stays an OOM: replayed, restarted,
    never FATAL for being "the same crash"."""
    oom = (FIXTURES / "llama-server" / "gpu" / "B-runtime-oom.log").read_text().splitlines()
    assert diagnose(CrashFacts(ABRT, oom, before_ready=False, cpu_model=XEON[0],
                               cpu_flags=XEON[1])) is None
    assert classify_exit(ABRT, oom).kind is FailureKind.CUDA_ERROR


def test_a_verdict_says_what_it_is_what_to_change_and_where_to_read_more() -> None:
    amx = diagnose(facts("amx-sigsegv-lv4.log", SEGV, cpu=XEON))
    assert amx is not None
    assert amx.evidence.endswith("AMX model buffer size =   213.91 MiB")
    assert "Intel(R) Xeon(R) Platinum 8480+" in amx.what
    assert "--no-repack" in amx.signature.remedy
    assert amx.summary().endswith("(see https://github.com/ggml-org/llama.cpp/issues/20824)")
    assert set(amx.to_json()) == {"signature", "what", "remedy", "upstream", "evidence"}
    likely = diagnose(facts("amx-sigsegv-default.log", SEGV, cpu=XEON))
    assert likely is not None and likely.what.startswith("likely ")
    assert "amx_int8" in likely.evidence
    library = diagnose(facts("missing-library.log", 127))
    assert library is not None and "libllama-server-impl.so" in library.what
    arch = diagnose(facts("unknown-architecture.log", 1))
    assert arch is not None and "'nosucharch'" in arch.what
    ill = diagnose(facts("sigill-default.log", ILL))
    assert ill is not None and "AMD EPYC" in ill.what and "GGML_NATIVE=OFF" in ill.signature.remedy


def test_marker_lines_are_the_ones_the_table_reads() -> None:
    marked = [line for line in lines("amx-sigsegv-lv4.log") if signatures.is_marker(line)]
    assert len(marked) == 1 and "AMX model buffer" in marked[0]
    assert not any(signatures.is_marker(line) for line in lines("repack-sigsegv-lv4.log"))


@pytest.mark.parametrize(("history", "expected"), [
    ([], 0),
    ([None], 0),
    (["amx_matmul"], 1),
    (["amx_matmul", "amx_matmul"], 2),
    ([None, "amx_matmul", "amx_matmul", "amx_matmul"], 3),
    (["amx_matmul", None, "amx_matmul"], 1),  # broken by another kind of exit
    (["illegal_instruction", "amx_matmul"], 1),
    (["no_such_signature", "no_such_signature"], 0),
])
def test_repeats_counts_the_latest_run_of_one_signature(history: list[str | None],
                                                        expected: int) -> None:
    assert signatures.repeats(history) == expected


def test_the_same_known_crash_twice_is_fatal_at_once_served_or_not() -> None:
    policy = lifecycle.BackoffPolicy(initial_s=1, max_s=30, quick_failure_s=10,
                                     max_quick_failures=5, fatal_retry_max_s=600)
    once = lifecycle.after_exit(policy, 0, run_s=0.5, jitter=0.5, known_crash_repeats=1)
    assert not once.fatal and once.quick_failures == 1
    twice = lifecycle.after_exit(policy, 1, run_s=0.5, jitter=0.5, known_crash_repeats=2)
    assert twice.fatal
    # A crash at the first request counts as "served" (no quick failure), yet the signature
    # still ends the loop: otherwise every request would meet a dying child.
    served = lifecycle.after_exit(policy, 0, run_s=30, jitter=0.5, served=True,
                                  known_crash_repeats=2)
    assert served.fatal and served.quick_failures == 0
    unknown = lifecycle.after_exit(policy, 1, run_s=0.5, jitter=0.5, known_crash_repeats=0)
    assert not unknown.fatal
