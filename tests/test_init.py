"""`spillway init`, end to end: the command as a user runs it, the files it writes (or does not),
and the result checked by config.load and, once, by `spillway check-config` in a subprocess.

The inputs are real shapes: command lines from llama.cpp's server README
(tests/fixtures/init/server-readme-commands.txt), a systemd unit, an environment file and a
drop-in (tests/fixtures/init/llama.service*), a llama-swap config in the shape of its
config.example.yaml (tests/fixtures/init/llama-swap.yaml). `@ROOT@` in a fixture is the test's
folder, where a stand-in llama-server and model files are made.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.commands import cli
from supervisor.config import schema as config
from supervisor.upstreams.hostcpu import HostCpu
from supervisor.commands.init import command

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "init"
KEY = "sk-test-0123456789abcdef"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Result:
    code: int
    out: str
    err: str


def init(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    args = cli.build_parser().parse_args(["init", *argv])
    code = args.func(args)
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A machine in a folder: llama-server on PATH, a model, the working folder there."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "llama-server"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.chdir(tmp_path)
    for var in ("SPILLWAY_API_KEY", "LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    # A CPU without AMX, whatever this machine's is: on an AMX CPU `spillway init` adds
    # --no-repack to the CPU child (test_init_plan and the test below say so).
    monkeypatch.setattr(command, "host_cpu", lambda: HostCpu("test CPU", frozenset({"avx2"})))
    return tmp_path


def test_on_an_amx_cpu_init_gives_the_cpu_child_no_repack(
        box: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(command, "host_cpu",
                        lambda: HostCpu("test Xeon", frozenset({"avx512f", "amx_int8"})))
    r = init(capsys, "-o", "spillway.toml", "--", "llama-server", "-m", "models/m.gguf")
    assert r.code == 0, r.err
    assert read(box / "spillway.toml")["cpu"]["args"][-1] == "--no-repack"
    assert "this CPU has AMX" in r.err


def fixture(name: str, root: Path) -> str:
    return (FIXTURES / name).read_text().replace("@ROOT@", str(root))


def read(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text())


def comment_for(text: str, key: str) -> str:
    """The comment above the first `key = ...` line, its lines joined (as wrapped, unwrapped)."""
    block: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            block.append(line[1:].strip())
        elif line.startswith(f"{key} ="):
            return " ".join(block)
        else:
            block = []
    raise AssertionError(f"no {key} in {text}")


def comments(text: str) -> str:
    """Every comment, unwrapped: lines joined with a space."""
    return " ".join(line.lstrip("# ").strip() for line in text.splitlines()
                    if line.lstrip().startswith("#"))


def all_args(doc: dict[str, Any]) -> list[str]:
    return [*doc["model"].get("args", []), *doc["gpu"]["args"], *doc["cpu"]["args"]]


def test_readme_quick_start_passes_check_config(box: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # "./llama-server -m models/7B/ggml-model.gguf -c 2048" (server README, Quick Start)
    (box / "models" / "7B").mkdir()
    (box / "models" / "7B" / "ggml-model.gguf").write_bytes(b"GGUF")
    (box / "llama-server").write_text("#!/bin/sh\n")
    (box / "llama-server").chmod(0o755)
    line = readme_commands()[0]
    assert line == "./llama-server -m models/7B/ggml-model.gguf -c 2048"

    r = init(capsys, "-o", "spillway.toml", "--", *shlex.split(line))

    assert r.code == 0, r.err
    doc = read(box / "spillway.toml")
    assert doc["model"]["path"] == str(box / "models" / "7B" / "ggml-model.gguf")
    assert doc["model"]["llama_server"] == str(box / "llama-server")  # a path stays a path
    assert doc["model"]["args"] == ["-c", "2048"]
    assert doc["gpu"]["args"] == ["-ngl", "99"]  # none given: Spillway's default, said so
    assert doc["cpu"] == {"args": ["--device", "none", "-ngl", "0"], "mode": "hot"}
    assert doc["server"] == {"listen": "127.0.0.1:8080"}  # llama-server's default address
    assert f"spillway check-config {box / 'spillway.toml'}" in r.err
    assert f"spillway run --config {box / 'spillway.toml'}" in r.err
    checked = subprocess.run([sys.executable, "-m", "supervisor", "check-config",
                              str(box / "spillway.toml")], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "valid" in checked.stdout


def test_the_command_line_lands_section_by_section(box: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    model = box / "models" / "m.gguf"
    r = init(capsys, "-o", "out/spillway.toml", "--", "llama-server", "-m", str(model),
             "-ngl", "99", "-c", "16384", "-np", "2", "--port", "8080", "--host", "0.0.0.0",
             "--api-key", KEY)

    assert r.code == 0, r.err
    path = box / "out" / "spillway.toml"
    text = path.read_text()
    doc = tomllib.loads(text)
    assert list(doc) == ["server", "model", "gpu", "cpu"]  # config.SECTIONS' order
    assert doc["server"] == {"listen": "0.0.0.0:8080", "api_key_env": "SPILLWAY_API_KEY"}
    assert doc["model"] == {"llama_server": "llama-server", "path": str(model),
                            "args": ["-c", "16384", "-np", "2"]}
    assert doc["gpu"] == {"args": ["-ngl", "99"]}
    assert doc["cpu"]["args"] == ["--device", "none", "-ngl", "0"]
    # each key says where it came from
    assert comment_for(text, "path") == f"from -m {model} on the command line"
    assert comment_for(text, "listen") == ("from --host 0.0.0.0 --port 8080 on the command "
                                           "line: clients keep their URL")
    assert comment_for(text, "api_key_env").startswith("from --api-key on the command line. ")
    assert comment_for(text, "llama_server").endswith("(a name, looked up on PATH)")
    # the key: in the env file beside the config, 0600, never in the config
    assert KEY not in text
    env = box / "out" / "env"
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    assert env.read_text() == f"SPILLWAY_API_KEY='{KEY}'\n"
    assert f"SPILLWAY_API_KEY in {env} (mode 0600)" in r.err
    cfg = config.load(path, environ={"SPILLWAY_API_KEY": KEY})
    assert cfg.server.api_key == KEY
    assert [str(a) for a in cfg.server.listen] == ["0.0.0.0:8080"]
    assert cfg.gpu.args == ("-c", "16384", "-np", "2", "-ngl", "99", "-fit", "off")
    assert cfg.cpu.args == ("-c", "16384", "-np", "2", "--device", "none", "-ngl", "0")


def test_an_existing_config_is_replaced_only_with_force(box: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    cmd = ["--", "llama-server", "-m", "models/m.gguf"]
    assert init(capsys, "-o", "spillway.toml", *cmd).code == 0
    (box / "spillway.toml").write_text("# mine\n")

    refused = init(capsys, "-o", "spillway.toml", *cmd, "-c", "4096")
    assert refused.code == 2
    assert "exists; --force replaces it" in refused.err
    assert (box / "spillway.toml").read_text() == "# mine\n"

    forced = init(capsys, "-o", "spillway.toml", "--force", *cmd, "-c", "4096")
    assert forced.code == 0, forced.err
    assert read(box / "spillway.toml")["model"]["args"] == ["-c", "4096"]


def test_print_writes_the_config_to_stdout_and_no_file(box: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(box.rglob("*"))
    r = init(capsys, "--print", "--", "llama-server", "-m", "models/m.gguf", "--host",
             "0.0.0.0", "--api-key", KEY)

    assert r.code == 0, r.err
    assert sorted(box.rglob("*")) == before  # neither the config nor an env file
    doc = tomllib.loads(r.out)
    assert doc["server"]["api_key_env"] == "SPILLWAY_API_KEY"
    assert KEY not in r.out
    assert f"export SPILLWAY_API_KEY={KEY}" in r.err
    config.build(doc, environ={"SPILLWAY_API_KEY": KEY})


def test_default_output_is_the_system_config_as_root_else_this_folder(
        box: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert command.default_output() == Path("/etc/spillway/spillway.toml")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    r = init(capsys, "--", "llama-server", "-m", "models/m.gguf")
    assert r.code == 0, r.err
    assert read(box / "spillway.toml")["model"]["path"] == str(box / "models" / "m.gguf")


def test_a_public_address_without_a_key_falls_back_to_loopback(
        box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "-m models/7B/ggml-model.gguf -c 512 --host 0.0.0.0 --port 8080" (server README, Docker)
    r = init(capsys, "--print", "--", "llama-server", "-m", "models/m.gguf", "-c", "512",
             "--host", "0.0.0.0", "--port", "8080")

    assert r.code == 0, r.err
    doc = tomllib.loads(r.out)
    assert doc["server"] == {"listen": "127.0.0.1:8080"}
    assert "0.0.0.0:8080 came without an API key" in comment_for(r.out, "listen")
    assert "warning: 0.0.0.0:8080 came without an API key" in r.err


def test_new_key_keeps_the_public_address(box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = init(capsys, "-o", "spillway.toml", "--new-key", "--", "llama-server", "-m",
             "models/m.gguf", "--host", "0.0.0.0")

    assert r.code == 0, r.err
    doc = read(box / "spillway.toml")
    assert doc["server"] == {"listen": "0.0.0.0:8080", "api_key_env": "SPILLWAY_API_KEY"}
    key = (box / "env").read_text().strip().split("=", 1)[1].strip("'")
    assert len(key) >= 32
    assert key not in (box / "spillway.toml").read_text()
    assert "give it to your clients" in r.err


def test_flags_spillway_owns_are_moved_or_explained(box: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    r = init(capsys, "--print", "--", "llama-server", "-m", "models/m.gguf", "--port", "8081",
             "--log-file", "/var/log/llama.log", "--ssl-key-file", "k.pem", "--ssl-cert-file",
             "c.pem", "--reuse-port", "--api-prefix", "/llm", "--metrics", "--slots")

    assert r.code == 0, r.err
    doc = tomllib.loads(r.out)
    args = all_args(doc)
    for flag in ("--log-file", "--ssl-key-file", "--ssl-cert-file", "--reuse-port",
                 "--api-prefix", "--port", "-m", "--host"):
        assert flag not in args
    assert doc["server"]["listen"] == "127.0.0.1:8081"
    header = comments(r.out.split("[server]")[0])
    assert "- --log-file /var/log/llama.log on the command line: both children" in header
    assert "- --ssl-key-file k.pem on the command line: Spillway serves plain HTTP" in header
    assert "- --ssl-cert-file c.pem" in header
    assert "- --reuse-port on the command line: Spillway picks" in header
    assert "- --api-prefix /llm on the command line: Spillway answers at /" in header
    # endpoints Spillway passes through to the children stay
    assert doc["model"]["args"] == ["--metrics", "--slots"]


def test_a_result_that_would_not_be_valid_writes_nothing(
        box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = init(capsys, "-o", "spillway.toml", "--", "llama-server", "-m", "models/missing.gguf",
             "--api-key", KEY)

    assert r.code == 2
    assert "nothing written" in r.err
    assert f"model.path: no such file: {box / 'models' / 'missing.gguf'}" in r.err
    assert not (box / "spillway.toml").exists()
    assert not (box / "env").exists()


def test_router_mode_from_the_readme(box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "llama-server --models-dir ./models_directory" (server README, Model sources)
    (box / "models_directory").mkdir()
    (box / "models_directory" / "Qwen3-8B-Q4_K_M.gguf").write_bytes(b"GGUF")
    r = init(capsys, "-o", "spillway.toml", "--", "llama-server", "--models-dir",
             "./models_directory", "--models-max", "2", "-np", "2")

    assert r.code == 0, r.err
    text = (box / "spillway.toml").read_text()
    doc = tomllib.loads(text)
    assert "path" not in doc["model"]
    assert "No path: router mode." in text
    assert doc["model"]["args"] == ["--models-dir", str(box / "models_directory"),
                                    "--models-max", "2", "-np", "2"]
    cfg = config.load(box / "spillway.toml")
    assert cfg.router and cfg.gpu.models_max == 2 and cfg.cpu.models_max == 2


def make_cache(root: Path) -> Path:
    """A llama.cpp model cache holding ggml-org/gemma-3-1b-it-GGUF, as -hf leaves it."""
    repo = root / "cache" / "models--ggml-org--gemma-3-1b-it-GGUF"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name in ("gemma-3-1b-it-Q8_0.gguf", "gemma-3-1b-it-Q4_K_M.gguf", "mmproj-model-f16.gguf"):
        (snapshot / name).write_bytes(b"GGUF")
    return snapshot


def test_hf_is_the_file_in_llama_cpps_cache(box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = make_cache(box)
    cache = f"LLAMA_CACHE={box / 'cache'}"
    r = init(capsys, "--print", "--", cache, "llama-server", "-hf", "ggml-org/gemma-3-1b-it-GGUF")

    assert r.code == 0, r.err
    doc = tomllib.loads(r.out)
    assert doc["model"]["path"] == str(snapshot / "gemma-3-1b-it-Q4_K_M.gguf")
    assert doc["model"]["args"] == ["-mm", str(snapshot / "mmproj-model-f16.gguf")]
    assert comment_for(r.out, "path").startswith(
        "from -hf ggml-org/gemma-3-1b-it-GGUF on the command line: the file")
    assert "-hf" not in all_args(doc)
    assert doc["gpu"]["env"]["LLAMA_CACHE"] == str(box / "cache")

    tagged = init(capsys, "--print", "--", cache, "llama-server", "-hf",
                  "ggml-org/gemma-3-1b-it-GGUF:Q8_0", "--no-mmproj")
    assert tagged.code == 0, tagged.err
    doc = tomllib.loads(tagged.out)
    assert doc["model"]["path"] == str(snapshot / "gemma-3-1b-it-Q8_0.gguf")
    assert doc["model"]["args"] == ["--no-mmproj"]


def test_hf_not_in_the_cache_is_a_clear_error(box: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    r = init(capsys, "-o", "spillway.toml", "--", f"LLAMA_CACHE={box / 'cache'}", "llama-server",
             "-hf", "ggml-org/gemma-3-1b-it-GGUF")

    assert r.code == 2
    assert "not in llama.cpp's cache" in r.err
    assert "run your llama-server with -hf ggml-org/gemma-3-1b-it-GGUF once" in r.err
    assert not (box / "spillway.toml").exists()


def install_unit(root: Path) -> Path:
    units = root / "etc" / "systemd" / "system"
    (units / "llama.service.d").mkdir(parents=True)
    unit = units / "llama.service"
    unit.write_text(fixture("llama.service", root))
    (units / "llama.service.d" / "10-slots.conf").write_text(
        fixture("llama.service.d/10-slots.conf", root))
    (root / "etc" / "default").mkdir()
    (root / "etc" / "default" / "llama-server").write_text(fixture("llama-server.env", root))
    (root / "srv").mkdir()
    (root / "models" / "Qwen3-8B-Q4_K_M.gguf").write_bytes(b"GGUF")
    return unit


def test_from_unit(box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unit = install_unit(box)
    r = init(capsys, "--from-unit", str(unit), "-o", "conf/spillway.toml")

    assert r.code == 0, r.err
    text = (box / "conf" / "spillway.toml").read_text()
    doc = tomllib.loads(text)
    assert doc["server"] == {"listen": "0.0.0.0:8080", "api_key_env": "SPILLWAY_API_KEY"}
    assert doc["model"]["llama_server"] == str(box / "bin" / "llama-server")
    assert doc["model"]["path"] == str(box / "models" / "Qwen3-8B-Q4_K_M.gguf")
    # Environment= (the drop-in's -np 4 over the unit's 2), then ExecStart='s own flags, with
    # $EXTRA_ARGS from the EnvironmentFile= split into words
    assert doc["model"]["args"] == ["-c", "16384", "-np", "4", "--jinja", "--cache-reuse",
                                    "256", "-fa", "on"]
    assert doc["gpu"]["args"] == ["-ngl", "99"]
    assert doc["gpu"]["device"] == 0  # CUDA_VISIBLE_DEVICES=0
    assert doc["gpu"]["env"] == {"GGML_CUDA_ENABLE_UNIFIED_MEMORY": "0"}
    assert doc["cpu"]["env"] == {"GGML_CUDA_ENABLE_UNIFIED_MEMORY": "0"}
    assert comment_for(text, "args").startswith(f"from ExecStart= in {unit}: the flags both")
    assert f"from LLAMA_ARG_CTX_SIZE=16384 in Environment= in {unit}" in comments(text)
    assert (f"- LLAMA_ARG_FLASH_ATTN=on in Environment= in {unit}: the command line gives"
            in comments(text))
    # the secrets: the key and HF_TOKEN from the EnvironmentFile=, in the env file only
    for secret in ("sk-unit-secret-0123456789", "hf_abcdefghijklmnopqrstuvwxyz0123456789AB"):
        assert secret not in text
    env = (box / "conf" / "env").read_text()
    assert "SPILLWAY_API_KEY='sk-unit-secret-0123456789'" in env
    assert "HF_TOKEN='hf_abcdefghijklmnopqrstuvwxyz0123456789AB'" in env
    assert stat.S_IMODE((box / "conf" / "env").stat().st_mode) == 0o600
    config.load(box / "conf" / "spillway.toml",
                environ={"SPILLWAY_API_KEY": "sk-unit-secret-0123456789"})


def install_swap(root: Path) -> Path:
    (root / "models" / "qwen.gguf").write_bytes(b"GGUF")
    path = root / "llama-swap.yaml"
    path.write_text(fixture("llama-swap.yaml", root))
    return path


def test_from_llama_swap(box: Path, capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    swap = install_swap(box)
    monkeypatch.setenv("SPILLWAY_TEST_MODELS", str(box / "models"))

    several = init(capsys, "--from-llama-swap", str(swap), "-o", "spillway.toml")
    assert several.code == 2
    assert "4 models; name one with --model: docker-llama, llama-8B, qwen, qwen-unlisted" \
        in several.err

    r = init(capsys, "--from-llama-swap", str(swap), "--model", "qwen", "-o", "spillway.toml")
    assert r.code == 0, r.err
    text = (box / "spillway.toml").read_text()
    doc = tomllib.loads(text)
    # llama-swap's default --listen :8080, kept: its apiKeys give the key
    assert doc["server"] == {"listen": "0.0.0.0:8080", "api_key_env": "SPILLWAY_API_KEY"}
    assert doc["model"]["path"] == str(box / "models" / "qwen.gguf")
    assert doc["model"]["args"] == ["-fa", "on", "--ctx-size", "16384", "--temperature", "0.7",
                                    "--jinja", "-a", "qwen,gpt-4o-mini"]
    assert doc["gpu"]["args"] == ["-ngl", "99"]
    assert doc["gpu"]["device"] == 0
    assert "--port" not in all_args(doc)
    assert "- --port '${PORT}' in models.qwen.cmd in" in comments(text)
    assert "sk-hunter2-swap-0123456789" not in text
    assert (box / "env").read_text() == "SPILLWAY_API_KEY='sk-hunter2-swap-0123456789'\n"
    config.load(box / "spillway.toml", environ={"SPILLWAY_API_KEY": "sk-hunter2-swap-0123456789"})


def test_a_docker_command_is_refused_with_why(box: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    swap = install_swap(box)
    monkeypatch.setenv("SPILLWAY_TEST_MODELS", str(box / "models"))
    r = init(capsys, "--from-llama-swap", str(swap), "--model", "docker-llama", "--print")
    assert r.code == 2
    assert "runs llama-server through docker" in r.err
    assert r.out == ""


@pytest.mark.parametrize("argv, message", [
    ([], "give one of"),
    (["--model", "qwen", "--", "llama-server"], "use it with --from-llama-swap"),
    (["--from-unit", "x.service", "--", "llama-server"], "give one of"),
    (["--", "llama-server", "-m", "m.gguf", "stray"], "takes no positional arguments"),
    (["--", "llama-server", "--help"], "prints something and exits"),
    (["--", "llama-server", "-mu", "https://example.com/m.gguf"], "download nothing"),
    (["--from-unit", "missing.service"], "missing.service: no such file"),
])
def test_unusable_input_is_exit_2_with_a_reason(box: Path, capsys: pytest.CaptureFixture[str],
                                               argv: list[str], message: str) -> None:
    r = init(capsys, "-o", "spillway.toml", *argv)
    assert r.code == 2
    assert message in r.err
    assert not (box / "spillway.toml").exists()


def test_the_env_file_keeps_its_other_lines_and_a_different_key_needs_force(
        box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (box / "env").write_text("OTHER=1\nSPILLWAY_API_KEY=old-key-value\n")
    cmd = ["--", "llama-server", "-m", "models/m.gguf", "--api-key", KEY]

    refused = init(capsys, "-o", "spillway.toml", *cmd)
    assert refused.code == 2
    assert "already sets SPILLWAY_API_KEY to another value; --force" in refused.err
    assert not (box / "spillway.toml").exists()

    r = init(capsys, "-o", "spillway.toml", "--force", *cmd)
    assert r.code == 0, r.err
    assert (box / "env").read_text() == f"OTHER=1\nSPILLWAY_API_KEY='{KEY}'\n"
    assert stat.S_IMODE((box / "env").stat().st_mode) == 0o600


def readme_commands() -> list[str]:
    lines = FIXTURES.joinpath("server-readme-commands.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize("line", readme_commands())
def test_every_readme_command_line_becomes_a_valid_config(
        box: Path, capsys: pytest.CaptureFixture[str], line: str) -> None:
    for folder in ("models/7B", "models_directory"):
        (box / folder).mkdir(parents=True, exist_ok=True)
    for name in ("models/7B/ggml-model.gguf", "model.gguf", "models_directory/a.gguf"):
        (box / name).write_bytes(b"GGUF")
    (box / "mcp.json").write_text("{}")
    (box / "my-models.ini").write_text("version = 1\n\n[qwen]\nmodel = /srv/qwen.gguf\n")
    (box / "llama-server").write_text("#!/bin/sh\n")
    (box / "llama-server").chmod(0o755)
    make_cache(box)

    words = shlex.split(line)
    r = init(capsys, "--print", "--", f"LLAMA_CACHE={box / 'cache'}", *words)

    assert r.code == 0, r.err
    doc = tomllib.loads(r.out)
    config.build(doc, base_dir=box)
    for flag in ("--host", "--port", "-m", "-hf"):
        assert flag not in all_args(doc)
    given = [w for w in words[1:] if w.startswith("-")]
    owned = {"--host", "--port", "-m", "-hf"}
    # every other flag of the line is in some args, under its own spelling
    assert set(given) - owned <= set(all_args(doc))


def test_small_writes_the_small_childs_section(box: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (box / "models" / "m.gguf").write_bytes(b"GGUF" * 1000)
    (box / "models" / "small.gguf").write_bytes(b"GGUF" * 10)
    (box / "models" / "proj.gguf").write_bytes(b"GGUF")
    r = init(capsys, "-o", "spillway.toml", "--small", "models/small.gguf", "--small-mode",
             "on-demand", "--", "GGML_CUDA_ENABLE_UNIFIED_MEMORY=1", "llama-server", "-m",
             "models/m.gguf", "-c", "8192", "-a", "big", "--mmproj", "models/proj.gguf")

    assert r.code == 0, r.err
    assert "warning" not in r.err.replace("warning: this CPU has AMX", "")
    text = (box / "spillway.toml").read_text()
    doc = tomllib.loads(text)
    assert list(doc) == ["server", "model", "gpu", "small", "cpu"]  # config.SECTIONS' order
    assert doc["small"] == {"path": str(box / "models" / "small.gguf"), "args": ["-ngl", "99"],
                            "mode": "on-demand", "requests": "opt-in",
                            "env": {"GGML_CUDA_ENABLE_UNIFIED_MEMORY": "1"}}
    small_text = text.split("[small]", 1)[1]
    assert comment_for(small_text, "path").startswith("from --small given to spillway init")
    assert comment_for(small_text, "mode").startswith("from --small-mode given to spillway init")
    assert comment_for(small_text, "requests").startswith("Spillway's default")
    # what it says the small child leaves out of model.args is what config.build leaves out
    assert f"(-a big, --mmproj {box / 'models' / 'proj.gguf'})" in comment_for(small_text,
                                                                                 "args")
    assert "No small child" not in text  # the header's note is for a config without one
    cfg = config.load(box / "spillway.toml")
    assert cfg.order == ("gpu", "small", "cpu")
    assert cfg.small_child == "small"
    assert (cfg.small.mode, cfg.small.requests) == ("on-demand", "opt-in")
    assert cfg.small.model_path == str(box / "models" / "small.gguf")
    assert cfg.small.args == ("-c", "8192", "-ngl", "99", "-fit", "off")
    assert "-a" in cfg.gpu.args and "-a" in cfg.cpu.args

    args = cli.build_parser().parse_args(["check-config", str(box / "spillway.toml")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"small child: llama-server -m {box / 'models' / 'small.gguf'} -c 8192" in out
    assert "on-demand; serves the requests that say X-Spillway-Fallback: smaller" in out


def test_small_requests_all_and_the_default_mode(box: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (box / "small.gguf").write_bytes(b"GG")
    r = init(capsys, "--print", "--small", str(box / "small.gguf"), "--small-requests", "all",
             "--", "llama-server", "-m", "models/m.gguf", "-dev", "Vulkan1")

    assert r.code == 0, r.err
    doc = tomllib.loads(r.out)
    # -dev picks the GPU child's card; the small child runs beside it, on the same one
    assert doc["small"]["args"] == ["-ngl", "99", "-dev", "Vulkan1"]
    assert (doc["small"]["mode"], doc["small"]["requests"]) == ("resident", "all")
    assert "env" not in doc["small"]
    cfg = config.build(doc, base_dir=box)
    assert cfg.order == ("gpu", "small", "cpu")
    assert (cfg.small.mode, cfg.small.requests) == ("resident", "all")


def test_small_is_refused_in_router_mode_and_without_its_file(
        box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (box / "models" / "small.gguf").write_bytes(b"GG")
    router = init(capsys, "-o", "spillway.toml", "--small", "models/small.gguf", "--",
                  "llama-server", "--models-dir", "models")
    assert router.code == 2
    assert "--small " in router.err and "single-model mode" in router.err
    assert "names no model: router mode" in router.err

    missing = init(capsys, "-o", "spillway.toml", "--small", "models/none.gguf", "--",
                   "llama-server", "-m", "models/m.gguf")
    assert missing.code == 2
    assert f"small.path: no such file: {box / 'models' / 'none.gguf'}" in missing.err

    for flag, value in (("--small-mode", "on-demand"), ("--small-requests", "all")):
        alone = init(capsys, "-o", "spillway.toml", flag, value, "--", "llama-server", "-m",
                     "models/m.gguf")
        assert alone.code == 2
        assert f"{flag} {value} sets up the small child: give --small FILE too" in alone.err
    assert not (box / "spillway.toml").exists()

    with pytest.raises(SystemExit):  # argparse's choices are the schema's
        cli.build_parser().parse_args(["init", "--small", "s.gguf", "--small-mode", "hot"])
    assert "invalid choice: 'hot'" in capsys.readouterr().err


def test_a_small_model_that_is_not_smaller_is_a_warning(
        box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (box / "models" / "big.gguf").write_bytes(b"G" * 3 * 2**20)
    r = init(capsys, "--print", "--small", "models/big.gguf", "--", "llama-server", "-m",
             "models/m.gguf")
    assert r.code == 0, r.err
    assert (f"warning: --small {box / 'models' / 'big.gguf'} (3 MiB) is not smaller than "
            f"model.path {box / 'models' / 'm.gguf'} (4 bytes)") in r.err
    assert tomllib.loads(r.out)["small"]["path"] == str(box / "models" / "big.gguf")


def test_without_small_the_header_says_how_to_add_it_and_that_works(
        box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from supervisor.config import edit as config_edit

    r = init(capsys, "-o", "spillway.toml", "--", "llama-server", "-m", "models/m.gguf")
    assert r.code == 0, r.err
    path = box / "spillway.toml"
    text = path.read_text()
    assert "small" not in tomllib.loads(text)
    header = comments(text.split("[server]")[0])
    assert "No small child: a [small] section would add one" in header
    assert "`spillway config set small.path FILE` adds it" in header

    (box / "models" / "small.gguf").write_bytes(b"GG")
    config_edit.edit(path, "small.path", str(box / "models" / "small.gguf"))
    after = path.read_text()
    assert list(tomllib.loads(after)) == ["server", "model", "gpu", "small", "cpu"]
    assert f'\n\n[small]\npath = "{box / "models" / "small.gguf"}"\n\n[cpu]\n' in after
    assert config.load(path).order == ("gpu", "small", "cpu")


def test_router_mode_has_no_note_of_the_small_child(
        box: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = init(capsys, "--print", "--", "llama-server", "--models-dir", "models")
    assert r.code == 0, r.err
    assert "small" not in r.out
