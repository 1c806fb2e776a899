"""Router mode's configuration: detection, validation, the children's command lines, the models
the routers would serve (llama.cpp's rules), and check-config's report."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.commands import cli
from supervisor.config import schema as config, llama_args, models_dir
from supervisor.config.schema import ConfigError, build

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "router.toml"


def problems(doc: dict[str, Any], **kw: Any) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        build(doc, check_paths=kw.pop("check_paths", False), **kw)
    return {p.path: p.message for p in e.value.problems}


def router(**sections: Any) -> config.Config:
    return build(sections, check_paths=False, base_dir=Path("/base"))


# --- detection --------------------------------------------------------------------------------


def test_models_dir_in_model_args_is_router_mode() -> None:
    cfg = router(model={"args": ["--models-dir", "/srv/models"]})
    assert cfg.router and cfg.gpu.router and cfg.cpu.router
    assert cfg.models_dir == "/srv/models" and cfg.models_preset is None
    assert cfg.model.path == "" and cfg.gpu.model_path == ""


def test_models_preset_is_router_mode() -> None:
    cfg = router(model={"args": ["--models-preset", "/srv/presets.ini"]})
    assert cfg.router
    assert (cfg.models_dir, cfg.models_preset) == (None, "/srv/presets.ini")
    assert cfg.cpu.models_preset == "/srv/presets.ini"


def test_models_dir_in_the_childrens_own_args_is_router_mode() -> None:
    cfg = router(gpu={"args": ["-ngl", "99", "--models-dir", "/m"]},
                 cpu={"args": ["--device", "none", "-ngl", "0", "--models-dir", "/m"]})
    assert cfg.router and cfg.models_dir == "/m" == cfg.cpu.models_dir


def test_neither_model_path_nor_models_is_router_mode_over_the_cache() -> None:
    cfg = router()
    assert cfg.router
    assert (cfg.models_dir, cfg.models_preset) == (None, None)
    assert models_dir.list_models(cfg) == []
    assert any("LLAMA_CACHE" in w for w in models_dir.warnings(cfg))


def test_a_model_path_is_single_model_mode() -> None:
    cfg = router(model={"path": "/m.gguf"})
    assert not cfg.router and not cfg.gpu.router
    assert cfg.models_dir is None


# --- validation -------------------------------------------------------------------------------


def test_model_path_with_models_dir_is_an_error_naming_both_keys() -> None:
    found = problems({"model": {"path": "/m.gguf", "args": ["-c", "1", "--models-dir", "/d"]}})
    assert "model.args[2]" in found["model.path"]
    assert "--models-dir" in found["model.path"]
    found = problems({"model": {"path": "/m.gguf"}, "cpu": {"args": ["--models-preset", "p"]}})
    assert "cpu.args[0]" in found["model.path"]


def test_a_missing_folder_or_preset_is_a_problem_of_its_key(tmp_path: Path) -> None:
    doc = {"model": {"llama_server": "/bin/true",
                     "args": ["-c", "8", "--models-dir", str(tmp_path / "none")]}}
    found = problems(doc, check_paths=True)
    assert found == {"model.args[2]": f"no such folder: {tmp_path / 'none'}"}
    doc = {"model": {"llama_server": "/bin/true",
                     "args": ["--models-preset", str(tmp_path / "none.ini")]}}
    assert "no such file" in problems(doc, check_paths=True)["model.args[0]"]
    # a file is not a folder
    (tmp_path / "f").write_text("")
    doc = {"model": {"llama_server": "/bin/true", "args": ["--models-dir", str(tmp_path / "f")]}}
    assert "no such folder" in problems(doc, check_paths=True)["model.args[0]"]
    # a child's own flag is reported under the child's key
    doc = {"model": {"llama_server": "/bin/true", "args": ["--models-dir", str(tmp_path)]},
           "gpu": {"args": ["-ngl", "99", "--models-dir", str(tmp_path / "x")]},
           "cpu": {"args": ["--models-dir", str(tmp_path / "x")]}}
    found = problems(doc, check_paths=True)
    assert set(found) == {"gpu.args[2]", "cpu.args[0]"}


def test_path_checks_are_skipped_without_check_paths(tmp_path: Path) -> None:
    cfg = build({"model": {"args": ["--models-dir", str(tmp_path / "none"),
                                    "--models-preset", str(tmp_path / "none.ini")]}},
                check_paths=False)
    assert cfg.models_dir == str(tmp_path / "none")


def test_an_existing_folder_and_preset_are_valid(tmp_path: Path) -> None:
    (tmp_path / "p.ini").write_text("[a]\nmodel = /a.gguf\n")
    cfg = build({"model": {"llama_server": "/bin/true",
                           "args": ["--models-dir", str(tmp_path),
                                    "--models-preset", str(tmp_path / "p.ini")]}},
                check_paths=True)
    assert cfg.router


def test_a_preset_llama_server_cannot_parse_is_a_problem(tmp_path: Path) -> None:
    (tmp_path / "p.ini").write_text("[a]\n  c = 4096\n")  # keys start their line
    doc = {"model": {"llama_server": "/bin/true",
                     "args": ["--models-preset", str(tmp_path / "p.ini")]}}
    found = problems(doc, check_paths=True)
    assert f"{tmp_path / 'p.ini'}:2:" in found["model.args[0]"]


def test_router_flags_need_their_values() -> None:
    found = problems({"model": {"args": ["--models-dir", "-c", "1"]},
                      "gpu": {"args": ["--models-max", "many"]},
                      "cpu": {"args": ["--models-max", "-1"]}})
    assert "needs a folder" in found["model.args[0]"]
    assert "'many'" in found["gpu.args[0]"] and "'-1'" in found["cpu.args[0]"]


def test_the_two_routers_must_serve_the_same_models() -> None:
    found = problems({"gpu": {"args": ["--models-dir", "/a"]}})
    assert "same models" in found["gpu.args[0]"]
    found = problems({"model": {"args": ["--models-dir", "/a"]},
                      "cpu": {"args": ["--models-dir", "/b"]}})
    assert "/a" in found["cpu.args[0]"] and "/b" in found["cpu.args[0]"]


# --- the command line -------------------------------------------------------------------------


def test_a_router_command_has_no_model_and_no_autoload() -> None:
    cfg = router(model={"args": ["--models-dir", "/srv/models", "-c", "8192"]})
    gpu = cfg.gpu.command(4000, "k")
    assert "-m" not in gpu and "--model" not in gpu
    assert gpu == ["llama-server", "--models-dir", "/srv/models", "-c", "8192", "-ngl", "99",
                   "-fit", "off", "--no-models-autoload",
                   "--host", "127.0.0.1", "--port", "4000", "--api-key", "k"]
    cpu = cfg.cpu.command(4001, "k")
    assert "-m" not in cpu and "-fit" not in cpu
    assert cpu.count("--no-models-autoload") == 1
    assert cpu[1:9] == ["--models-dir", "/srv/models", "-c", "8192", "--device", "none",
                        "-ngl", "0"]


@pytest.mark.parametrize("given", [["--models-autoload"], ["--no-models-autoload"]])
def test_the_users_own_autoload_is_kept_and_not_doubled(given: list[str]) -> None:
    cfg = router(model={"args": ["--models-dir", "/m", *given]})
    for child in (cfg.gpu, cfg.cpu):
        argv = child.command(1, "k")
        autoloads = [a for a in argv if a.endswith("models-autoload")]
        assert autoloads == given


def test_a_childs_own_autoload_replaces_the_shared_one() -> None:
    cfg = router(model={"args": ["--models-dir", "/m", "--models-autoload"]},
                 cpu={"args": ["--device", "none", "-ngl", "0", "--no-models-autoload"]})
    assert "--models-autoload" in cfg.gpu.args
    assert "--models-autoload" not in cfg.cpu.args
    assert cfg.cpu.args.count("--no-models-autoload") == 1
    assert llama_args.canonical("--no-models-autoload") == "--models-autoload"


def test_a_childs_own_models_max_replaces_the_shared_one() -> None:
    cfg = router(model={"args": ["--models-dir", "/m", "--models-max", "3"]},
                 gpu={"args": ["-ngl", "99", "--models-max", "1"]})
    assert cfg.gpu.args.count("--models-max") == 1
    assert llama_args.flag_value(cfg.gpu.args, "--models-max") == "1"
    assert (cfg.gpu.models_max, cfg.cpu.models_max) == (1, 3)
    assert router().gpu.models_max == 4  # llama-server's default


def test_a_relative_models_folder_and_preset_become_absolute(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "p.ini").write_text("")
    (tmp_path / "spillway.toml").write_text(
        '[model]\nllama_server = "/bin/true"\nargs = ["--models-dir", "models"]\n'
        '[cpu]\nargs = ["--device", "none", "-ngl", "0", "--models-preset=p.ini",'
        ' "--models-dir", "models"]\n'
        '[gpu]\nargs = ["-ngl", "99", "--models-preset", "p.ini"]\n')
    cfg = config.load(tmp_path / "spillway.toml")
    assert cfg.models_dir == str(tmp_path / "models")
    assert cfg.models_preset == str(tmp_path / "p.ini")
    assert cfg.model.args == ("--models-dir", str(tmp_path / "models"))
    gpu = cfg.gpu.command(1, "k")
    assert gpu[gpu.index("--models-dir") + 1] == str(tmp_path / "models")
    assert gpu[gpu.index("--models-preset") + 1] == str(tmp_path / "p.ini")
    assert f"--models-preset={tmp_path / 'p.ini'}" in cfg.cpu.command(1, "k")


def test_single_model_commands_are_unchanged() -> None:
    cfg = build({"model": {"path": "/m.gguf", "args": ["-c", "8192", "-np", "2"]},
                 "cpu": {"args": ["--device", "none", "-ngl", "0", "--models-max", "2"]}},
                check_paths=False)
    assert cfg.gpu.command(41234, "k") == [
        "llama-server", "-m", "/m.gguf", "-c", "8192", "-np", "2", "-ngl", "99", "-fit", "off",
        "--host", "127.0.0.1", "--port", "41234", "--api-key", "k"]
    assert cfg.cpu.command(41235, "k") == [
        "llama-server", "-m", "/m.gguf", "-c", "8192", "-np", "2", "--device", "none", "-ngl",
        "0", "--models-max", "2", "--host", "127.0.0.1", "--port", "41235", "--api-key", "k"]


def test_command_changed_notices_router_changes() -> None:
    base = router(model={"args": ["--models-dir", "/a"]})
    assert not config.command_changed(base.gpu, router(model={"args": ["--models-dir",
                                                                         "/a"]}).gpu)
    assert config.command_changed(base.gpu, router(model={"args": ["--models-dir", "/b"]}).gpu)
    more = router(model={"args": ["--models-dir", "/a"]}, gpu={"args": ["--models-max", "2"]})
    assert config.command_changed(base.gpu, more.gpu)
    assert not config.command_changed(base.cpu, more.cpu)
    single = dataclasses.replace(base.gpu, model_path="/m.gguf")
    assert config.command_changed(base.gpu, single)


# --- the models the routers would serve -------------------------------------------------------


def _touch(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"GGUF")


def test_list_models_follows_llama_cpps_folder_rules(tmp_path: Path) -> None:
    _touch(tmp_path,
           "plain.gguf", "Qwen3-8B-Q4_K_M.gguf",
           "mmproj-F16.gguf", "some-mmproj.gguf",  # projectors: not models
           "mtp-draft.gguf",  # a draft model: not a model on its own
           "notes.txt", "upper.GGUF",  # not .gguf (the suffix is case-sensitive)
           "gemma-3-4b/gemma-3-4b-Q8_0.gguf", "gemma-3-4b/mmproj-F16.gguf",
           "kimi/kimi-00002-of-00003.gguf", "kimi/kimi-00001-of-00003.gguf",
           "kimi/kimi-00003-of-00003.gguf",
           "only-projector/mmproj.gguf",  # no model in it
           "no-gguf/readme.md",
           "deep/inner/x.gguf")  # one level only
    (tmp_path / "linked.gguf").symlink_to(tmp_path / "plain.gguf")
    cfg = router(model={"args": ["--models-dir", str(tmp_path)]})
    assert models_dir.list_models(cfg) == [
        "Qwen3-8B-Q4_K_M", "gemma-3-4b", "kimi", "linked", "plain"]
    by_name = {m.name: m for m in models_dir.find_models(cfg)}
    assert by_name["kimi"].path == str(tmp_path / "kimi" / "kimi-00001-of-00003.gguf")
    assert by_name["gemma-3-4b"].path == str(tmp_path / "gemma-3-4b" / "gemma-3-4b-Q8_0.gguf")
    assert by_name["plain"].sources == (str(tmp_path),)
    assert not [w for w in models_dir.warnings(cfg)]


def test_multi_part_files_directly_in_the_folder_are_listed_each_and_warned_about(
        tmp_path: Path) -> None:
    # llama.cpp's load_from_models_dir handles parts only in a subfolder; directly in the
    # folder each part is a model of its own (and all but the first fail to load).
    _touch(tmp_path, "big-00001-of-00002.gguf", "big-00002-of-00002.gguf")
    cfg = router(model={"args": ["--models-dir", str(tmp_path)]})
    assert models_dir.list_models(cfg) == ["big-00001-of-00002", "big-00002-of-00002"]
    assert any("subfolder" in w for w in models_dir.warnings(cfg))


PRESET = """\
version = 1
; global options, for every model: not a model
[*]
c = 8192

[ggml-org/gemma-3-4b-it-GGUF:q4_k_m]
n-gpu-layers = 123   ; a comment after a value
jinja = true

[custom_model]
model = /srv/my-model-Q4_K_M.gguf

# an empty section is a model too
[plain]
[repo:model-q8_0]
"""


def test_list_models_reads_a_preset(tmp_path: Path) -> None:
    ini = tmp_path / "presets.ini"
    ini.write_text(PRESET)
    cfg = router(model={"args": ["--models-preset", str(ini)]})
    assert models_dir.list_models(cfg) == [
        "custom_model", "ggml-org/gemma-3-4b-it-GGUF:Q4_K_M", "plain", "repo:Q8_0"]
    by_name = {m.name: m for m in models_dir.find_models(cfg)}
    assert by_name["custom_model"].path == "/srv/my-model-Q4_K_M.gguf"
    assert by_name["plain"].sources == (str(ini),)
    parsed = models_dir.read_preset(ini)
    assert parsed.global_options == {"c": "8192"}
    assert parsed.models["ggml-org/gemma-3-4b-it-GGUF:Q4_K_M"]["n-gpu-layers"] == "123"
    assert models_dir.warnings(cfg) == []


def test_keys_before_any_section_are_a_model_named_default_when_they_set_something() -> None:
    assert list(models_dir.parse_preset("version = 1\n[a]\n").models) == ["a"]
    assert list(models_dir.parse_preset("c = 1\n[a]\n").models) == ["a", "default"]
    assert models_dir.parse_preset("[a]\n  c = 1\n").errors[0][0] == 2
    assert models_dir.parse_preset("[a]\nnot a line\n").errors


def test_a_folder_and_a_preset_together(tmp_path: Path) -> None:
    _touch(tmp_path / "models", "a.gguf", "b.gguf")
    ini = tmp_path / "p.ini"
    ini.write_text("[a]\nc = 4096\n[c]\nmodel = /c.gguf\nload-on-startup = true\n"
                   "[d]\nmodel = rel/d.gguf\n")
    cfg = router(model={"args": ["--models-dir", str(tmp_path / "models"),
                                 "--models-preset", str(ini)]})
    found = {m.name: m for m in models_dir.find_models(cfg)}
    assert list(found) == ["a", "b", "c", "d"]
    assert found["a"].sources == (str(tmp_path / "models"), str(ini))
    assert found["a"].path == str(tmp_path / "models" / "a.gguf")
    warnings = models_dir.warnings(cfg)
    assert any("[c] has load-on-startup" in w for w in warnings)
    assert any("[d] model = rel/d.gguf" in w and "absolute" in w for w in warnings)


def test_an_empty_folder_is_warned_about(tmp_path: Path) -> None:
    cfg = router(model={"args": ["--models-dir", str(tmp_path)]})
    assert models_dir.list_models(cfg) == []
    assert any("no models found" in w for w in models_dir.warnings(cfg))


def test_single_model_mode_lists_no_router_models() -> None:
    assert models_dir.list_models(router(model={"path": "/m.gguf"})) == []


# --- check-config -----------------------------------------------------------------------------


def _check_config(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", "check-config", *argv],
                          capture_output=True, text=True, cwd=REPO)


def test_check_config_lists_the_routers_models(tmp_path: Path) -> None:
    _touch(tmp_path / "models", "alpha.gguf", "beta/beta.gguf", "beta/mmproj.gguf")
    (tmp_path / "p.ini").write_text("[gamma]\nmodel = /g.gguf\n")
    conf = tmp_path / "spillway.toml"
    conf.write_text(f'[model]\nllama_server = "{sys.executable}"\n'
                    'args = ["--models-dir", "models", "--models-preset", "p.ini"]\n'
                    '[gpu]\nargs = ["-ngl", "99", "--models-max", "1"]\n')
    result = _check_config("--config", str(conf))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "router mode" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["alpha", "from", f"{tmp_path / 'models'}"] in lines
    assert ["beta", "from", f"{tmp_path / 'models'}"] in lines
    assert ["gamma", "from", f"{tmp_path / 'p.ini'}"] in lines
    assert "mmproj" not in out
    assert "gpu router: at most 1 model" in out and "cpu router: at most 4 model" in out
    gpu_line = next(line for line in out.splitlines() if "gpu child:" in line)
    assert " -m " not in gpu_line and "--no-models-autoload" in gpu_line
    assert result.stderr == ""
    # the positional form still works, the same way
    assert _check_config(str(conf)).stdout == out


def test_check_config_shows_each_smaller_model_and_warns_of_an_unlisted_one(
        tmp_path: Path) -> None:
    _touch(tmp_path / "models", "alpha.gguf", "beta.gguf")
    conf = tmp_path / "spillway.toml"
    conf.write_text(f'[model]\nllama_server = "{sys.executable}"\n'
                    'args = ["--models-dir", "models"]\n'
                    '[small]\nmodels = { alpha = "beta", gamma = "beta" }\n')
    result = _check_config(str(conf))
    assert result.returncode == 0, result.stderr
    assert "smaller model of alpha: beta, kept loaded on the GPU router" in result.stdout
    assert "small.models names 'gamma'" in result.stderr
    assert "'alpha'" not in result.stderr and "'beta'" not in result.stderr


def test_check_config_warns_but_passes_when_no_model_is_found(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    conf = tmp_path / "spillway.toml"
    conf.write_text(f'[model]\nllama_server = "{sys.executable}"\n'
                    'args = ["--models-dir", "models"]\n')
    result = _check_config(str(conf))
    assert result.returncode == 0, result.stderr
    assert "router mode" in result.stdout
    assert "warning: no models found" in result.stderr
    # neither folder nor preset: the cache
    conf.write_text(f'[model]\nllama_server = "{sys.executable}"\n')
    result = _check_config(str(conf))
    assert result.returncode == 0, result.stderr
    assert "router mode" in result.stdout and "LLAMA_CACHE" in result.stderr


def test_check_config_exits_2_on_a_missing_models_folder(tmp_path: Path) -> None:
    conf = tmp_path / "spillway.toml"
    conf.write_text(f'[model]\nllama_server = "{sys.executable}"\n'
                    'args = ["--models-dir", "nowhere"]\n')
    result = _check_config(str(conf))
    assert result.returncode == 2
    assert f"model.args[0]: no such folder: {tmp_path / 'nowhere'}" in result.stderr


def test_check_config_in_single_model_mode_says_nothing_of_routers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    conf = tmp_path / "spillway.toml"
    conf.write_text(f'[model]\nllama_server = "{sys.executable}"\npath = "m.gguf"\n')
    args = cli.build_parser().parse_args(["check-config", str(conf)])
    assert cli.cmd_check_config(args) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "router" not in out
    assert f"gpu child: {sys.executable} -m {tmp_path / 'm.gguf'} -ngl 99 -fit off" in out


def test_the_router_example_is_valid_once_its_paths_exist(tmp_path: Path) -> None:
    shipped = _check_config(str(EXAMPLE))
    assert shipped.returncode == 2
    lines = [line.strip() for line in shipped.stderr.splitlines()[1:]]
    assert len(lines) == 2, shipped.stderr
    assert lines[0].startswith("model.args[0]: no such folder: /srv/models"), shipped.stderr
    assert lines[1].startswith("model.llama_server:"), shipped.stderr
    _touch(tmp_path / "models", "one.gguf")
    text = EXAMPLE.read_text().replace('"/srv/models"', f'"{tmp_path / "models"}"')
    text = text.replace('llama_server = "llama-server"', f'llama_server = "{sys.executable}"')
    local = tmp_path / "router.toml"
    local.write_text(text)
    result = _check_config(str(local))
    assert result.returncode == 0, result.stderr
    assert "one" in result.stdout.split()
    cfg = config.load(local)
    assert (cfg.gpu.models_max, cfg.cpu.models_max) == (1, 2)
