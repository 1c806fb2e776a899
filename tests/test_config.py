"""Configuration: every problem reported with its key path; defaults; flag merging."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import schema as config
from supervisor.config.schema import ConfigError, build

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "spillway.toml"


def minimal(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": {"path": "/m.gguf"}}
    for k, v in extra.items():
        doc[k] = {**doc.get(k, {}), **v}
    return doc


def problems(doc: dict[str, Any], **kw: Any) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        build(doc, check_paths=kw.pop("check_paths", False), **kw)
    return {p.path: p.message for p in e.value.problems}


def test_minimal_config_gets_the_documented_defaults() -> None:
    cfg = build(minimal(), check_paths=False)
    assert [str(a) for a in cfg.server.listen] == ["127.0.0.1:8080"]
    assert cfg.server.api_key is None
    assert cfg.server.max_body_bytes == 64 * 1024 * 1024
    assert cfg.gpu.args == ("-ngl", "99", "-fit", "off")
    assert cfg.cpu.args == ("--device", "none", "-ngl", "0")
    assert cfg.cpu.mode == "hot"
    assert cfg.gpu.stop_grace_s == 10.0
    assert cfg.gpu.max_concurrency is None


def test_unknown_key_is_an_error_that_suggests_the_nearest_key() -> None:
    found = problems(minimal(gpu={"arg": ["-ngl", "1"]}))
    assert "did you mean 'args'" in found["gpu.arg"]


def test_unknown_section_suggests_the_nearest_section() -> None:
    found = problems({**minimal(), "sever": {"listen": "127.0.0.1:1"}})
    assert "did you mean 'server'" in found["sever"]


def test_every_problem_is_listed_at_once_with_its_key_path() -> None:
    doc = minimal(
        server={"max_body_mib": "big", "listen": "127.0.0.1:99999"},
        gpu={"args": ["-ngl", "99", "--port", "9000"], "start_timeout_s": -1},
        cpu={"mode": "lukewarm"},
    )
    found = problems(doc)
    assert "expected a number" in found["server.max_body_mib"]
    assert "port must be 1-65535" in found["server.listen"]
    assert "chosen by Spillway" in found["gpu.args[2]"]
    assert "greater than 0" in found["gpu.start_timeout_s"]
    assert "'hot', 'on-demand'" in found["cpu.mode"]


def test_host_and_api_key_in_child_args_are_errors_pointing_at_the_right_key() -> None:
    found = problems(minimal(model={"path": "/m.gguf", "args": ["--host", "0.0.0.0"]},
                             cpu={"args": ["-c", "4096", "--api-key", "x"]}))
    assert "model.args[0]" in found
    assert "server.api_key" in found["cpu.args[2]"]


def test_model_flag_in_args_points_at_model_path() -> None:
    found = problems(minimal(gpu={"args": ["--model", "/other.gguf"]}))
    assert "model.path" in found["gpu.args[0]"]


def test_non_string_list_items_are_reported_by_index() -> None:
    found = problems(minimal(gpu={"args": ["-ngl", 99]}))
    assert "expected a string" in found["gpu.args[1]"]


def test_a_public_address_needs_a_key() -> None:
    found = problems(minimal(server={"listen": ["127.0.0.1:8080", "0.0.0.0:8080"]}))
    assert "not a loopback address" in found["server.listen"]
    cfg = build(minimal(server={"listen": "0.0.0.0:8080", "api_key": "k"}), check_paths=False)
    assert cfg.server.api_key == "k"


def test_ipv6_and_several_listen_addresses() -> None:
    cfg = build(minimal(server={"listen": ["127.0.0.1:8080", "[::1]:8081"]}), check_paths=False)
    assert [str(a) for a in cfg.server.listen] == ["127.0.0.1:8080", "[::1]:8081"]
    assert all(a.is_loopback for a in cfg.server.listen)


def test_api_key_env_reads_the_variable_and_fails_when_it_is_unset() -> None:
    doc = minimal(server={"api_key_env": "SPILLWAY_TEST_KEY"})
    assert build(doc, check_paths=False, environ={"SPILLWAY_TEST_KEY": "s3"}).server.api_key == "s3"
    assert "is not set" in problems(doc, environ={})["server.api_key_env"]
    both = minimal(server={"api_key_env": "X", "api_key": "y"})
    assert "not both" in problems(both, environ={"X": "1"})["server.api_key_env"]


def test_a_child_flag_replaces_the_shared_flag_under_any_alias() -> None:
    cfg = build(minimal(model={"path": "/m.gguf", "args": ["-c", "8192", "-np", "2", "-t", "4"]},
                        gpu={"args": ["--ctx-size", "4096", "-ngl", "99"]},
                        cpu={"args": ["--parallel", "1"]}), check_paths=False)
    assert cfg.gpu.args == ("-np", "2", "-t", "4", "--ctx-size", "4096", "-ngl", "99",
                            "-fit", "off")
    assert cfg.cpu.args == ("-c", "8192", "-t", "4", "--parallel", "1")


def test_fit_off_is_added_to_the_gpu_child_only_when_the_user_did_not_set_fit() -> None:
    cfg = build(minimal(gpu={"args": ["-ngl", "99", "--fit", "on"]}), check_paths=False)
    assert cfg.gpu.args == ("-ngl", "99", "--fit", "on")
    assert "-fit" not in build(minimal(), check_paths=False).cpu.args


def test_command_line_owns_model_host_and_port() -> None:
    cfg = build(minimal(), check_paths=False)
    argv = cfg.gpu.command(41234, "k")
    assert argv[:3] == ["llama-server", "-m", "/m.gguf"]
    assert argv[-6:] == ["--host", "127.0.0.1", "--port", "41234", "--api-key", "k"]


def test_missing_files_are_problems_of_their_keys(tmp_path: Path) -> None:
    doc = minimal(model={"path": str(tmp_path / "nope.gguf"),
                         "llama_server": str(tmp_path / "no-binary")})
    found = problems(doc, check_paths=True)
    assert "no such file" in found["model.path"]
    assert "not an executable" in found["model.llama_server"]


def test_relative_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "spillway.toml").write_text(
        '[model]\npath = "m.gguf"\nllama_server = "/bin/true"\n')
    cfg = config.load(tmp_path / "spillway.toml")
    assert cfg.model.path == str(tmp_path / "m.gguf")
    assert cfg.path == str(tmp_path / "spillway.toml")


def test_toml_syntax_error_is_one_clear_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\nlisten = 1\n")
    with pytest.raises(ConfigError) as e:
        config.load(bad)
    assert "not valid TOML" in str(e.value)


def test_the_example_documents_every_key() -> None:
    text = EXAMPLE.read_text()
    sections = re.findall(r"^\[(\w+)\]", text, re.M)
    for key in config.known_keys():
        section, name = key.split(".")
        assert section in sections, f"[{section}] missing from the example"
        assert re.search(rf"^#?\s*{name}\s*=", text, re.M), f"{key} is not documented"


def _example_keys() -> list[str]:
    """`section.key` for every key the example sets or shows commented out."""
    keys, section = [], None
    for line in EXAMPLE.read_text().splitlines():
        if m := re.match(r"^\[(\w+)\]", line):
            section = m.group(1)
        elif (m := re.match(r"^#?\s*(\w+)\s*=", line)) and section:
            keys.append(f"{section}.{m.group(1)}")
    return keys


def test_the_example_documents_exactly_the_known_keys() -> None:
    documented = _example_keys()
    assert len(documented) == len(set(documented)), "the example shows a key twice"
    assert sorted(documented) == sorted(config.known_keys())


def test_each_key_is_declared_once_on_the_field_it_fills() -> None:
    """SCHEMA is derived from the dataclasses: every field of every section declares its key
    (or is marked derived), and every key in SCHEMA is one field's declaration."""
    declarations = set()
    for section, cls in config.SECTIONS.items():
        assert cls.__dataclass_params__.frozen, cls
        for f in dataclasses.fields(cls):
            assert config.KEYS in f.metadata, f"{cls.__name__}.{f.name} declares no key"
            declarations |= {id(k) for k in f.metadata[config.KEYS]}
        declared = list(config.section_keys(cls, section))
        names = [name for name, _, _ in declared]
        assert len(names) == len(set(names)), f"[{section}] declares a key twice"
        assert list(config.SCHEMA[section]) == names
        for name, k, f in declared:
            assert config.SCHEMA[section][name] is k
            if not f.metadata.get(config.DERIVED):  # a plain field is its one key's value
                assert sum(g is f for _, _, g in declared) == 1, f"{section}.{name}"
    assert {id(k) for keys in config.SCHEMA.values() for k in keys.values()} == declarations
    assert list(config.SECTIONS) == [f.name for f in dataclasses.fields(config.Config)][1:]


def test_only_these_fields_are_worked_out_by_build() -> None:
    derived = {f"{cls.__name__}.{f.name}" for cls in config.SECTIONS.values()
               for f in dataclasses.fields(cls) if f.metadata.get(config.DERIVED)}
    assert derived == {"ServerConfig.listen", "ServerConfig.api_key", "ServerConfig.vertex",
                       "ChildConfig.name", "ChildConfig.args", "ChildConfig.llama_server",
                       "ChildConfig.model_path"}


def test_sizes_in_mib_become_bytes_and_child_only_keys_stay_with_their_child(
        tmp_path: Path) -> None:
    cfg = build(minimal(server={"max_body_mib": 1.5}, failover={"max_replay_body_mib": 2},
                        incidents={"max_mib": 0.5, "path": "inc/x.jsonl"},
                        idempotency={"max_response_mib": 0, "max_total_mib": 3},
                        gpu={"device": 1, "vram_headroom_mib": 7},
                        cpu={"mode": "on-demand", "idle_stop_s": 5}),
                check_paths=False, base_dir=tmp_path)
    mib = 1024 * 1024
    assert cfg.server.max_body_bytes == int(1.5 * mib)
    assert cfg.failover.max_replay_body_bytes == 2 * mib
    assert cfg.incidents.max_bytes == mib // 2
    assert cfg.incidents.path == str(tmp_path / "inc" / "x.jsonl")
    assert (cfg.idempotency.max_response_bytes, cfg.idempotency.max_total_bytes) == (0, 3 * mib)
    assert (cfg.gpu.device, cfg.gpu.vram_headroom_mib, cfg.gpu.mode) == ("1", 7, "hot")
    assert (cfg.cpu.device, cfg.cpu.vram_headroom_mib) == (None, 0)
    assert (cfg.cpu.mode, cfg.cpu.idle_stop_s) == ("on-demand", 5.0)
    assert "unknown key" in problems(minimal(cpu={"device": 0}))["cpu.device"]


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", "check-config", str(path)],
                          capture_output=True, text=True, cwd=REPO)


def test_check_config_accepts_the_example_once_its_paths_exist(tmp_path: Path) -> None:
    # As shipped, the example names a model and binary this machine does not have: exactly those
    # two problems, nothing else.
    shipped = _check_config(EXAMPLE)
    assert shipped.returncode == 2
    lines = [line.strip() for line in shipped.stderr.splitlines()[1:]]
    assert len(lines) == 2 and lines[0].startswith("model.path:"), shipped.stderr
    assert lines[1].startswith("model.llama_server:"), shipped.stderr
    # With real paths, it is valid.
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    text = EXAMPLE.read_text().replace('"/srv/models/model.gguf"', f'"{model}"')
    text = text.replace('llama_server = "llama-server"', f'llama_server = "{sys.executable}"')
    local = tmp_path / "spillway.toml"
    local.write_text(text)
    result = _check_config(local)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout


def test_check_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\npath = "/m.gguf"\n[gpu]\nargs = ["-ngl", "99", "-c", "1", "--port", '
                   '"1"]\n')
    result = _check_config(bad)
    assert result.returncode == 2
    assert "gpu.args[4]" in result.stderr


def test_a_flags_value_llama_server_would_refuse_is_a_problem_of_its_key() -> None:
    found = problems(minimal(model={"path": "/m.gguf", "args": ["-c", "4096", "-np", "abc"]},
                             gpu={"args": ["-ngl", "99", "--temp", "warm"]},
                             cpu={"args": ["--threads"]}))
    assert found["model.args[2]"] == ("-np takes a whole number, not 'abc': llama-server would "
                                      "refuse it and not start")
    assert "--temp takes a number, not 'warm'" in found["gpu.args[2]"]
    assert "--threads takes a whole number, and none follows it" in found["cpu.args[0]"]
    # What llama-server itself takes stays valid: std::stoi reads "8k" as 8, "-1" is a value.
    build(minimal(model={"path": "/m.gguf", "args": ["-c", "8k", "-n", "-1", "-ngl", "all",
                                                      "--top-p", ".9"]}), check_paths=False)


def test_check_config_names_a_value_llama_server_would_refuse(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\npath = "/m.gguf"\nargs = ["-np", "abc"]\n')
    result = _check_config(bad)
    assert result.returncode == 2
    assert "model.args[0]: -np takes a whole number, not 'abc'" in result.stderr


def test_run_with_a_bad_config_exits_2_before_starting_anything(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nlisten = "0.0.0.0:8080"\n[model]\npath = "/m.gguf"\n')
    result = subprocess.run([sys.executable, "-m", "supervisor", "run", "--config", str(bad)],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2
    assert "server.listen" in result.stderr


def test_version_command() -> None:
    from supervisor import __version__
    result = subprocess.run([sys.executable, "-m", "supervisor", "version"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0
    assert result.stdout.strip() == f"spillway {__version__}"
