"""`spillway init`'s readers: a systemd unit (ExecStart=, Environment=, EnvironmentFile=) read as
systemd reads it, a llama-swap config as llama-swap reads it, llama-server's LLAMA_ARG_*
variables as arg.cpp reads them, and the environment file written for systemd and a shell."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from supervisor.commands.init import envfile, hfcache, llama_env, llama_swap, unit
from supervisor.commands.init.source import InitError, from_command_line

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "init"


# --- systemd ----------------------------------------------------------------------------------


def test_logical_lines_join_continuations_and_drop_comment_lines() -> None:
    # systemd.syntax(7)'s own example: comment lines inside a continued line are ignored
    text = "[Section C]\nKeyThree=value 3\\\n# this line is ignored\n; this line is ignored " \
           "too\n       value 3 continued\n"
    assert unit.logical_lines(text) == ["[Section C]", "KeyThree=value 3 value 3 continued"]


@pytest.mark.parametrize("text, words", [
    ('a "b c" \'d e\' f', ["a", "b c", "d e", "f"]),
    (r'one\ two "x\"y" \x41\101\t', ["one two", 'x"y', "AA\t"]),
    ('--chat-template-kwargs \'{"enable_thinking": false}\'',
     ["--chat-template-kwargs", '{"enable_thinking": false}']),
    ('pre"quoted"post ""', ["prequotedpost", ""]),
])
def test_words_split_as_systemd_splits_them(text: str, words: list[str]) -> None:
    assert unit.split_words(text) == words


def test_an_unbalanced_quote_is_an_error() -> None:
    with pytest.raises(InitError, match="unbalanced"):
        unit.split_words('-m "/srv/m.gguf')


@pytest.mark.parametrize("value, argv", [
    ("-/usr/bin/llama-server -c 4096", ["/usr/bin/llama-server", "-c", "4096"]),
    ("+!/usr/bin/llama-server -c 4096", ["/usr/bin/llama-server", "-c", "4096"]),
    # `@`: the second word is argv[0]
    ("@/usr/bin/llama-server llama -c 4096", ["/usr/bin/llama-server", "-c", "4096"]),
    # $VAR as a word: split at whitespace; ${VAR}: one word, within a word too
    ("/bin/ls $ARGS ${ONE} -m=${DIR}/m.gguf $$x", ["/bin/ls", "-c", "8", "a b", "-m=/srv/m.gguf",
                                                   "$x"]),
    ("/bin/ls $UNSET x", ["/bin/ls", "x"]),
    # `:`: no expansion at all
    (":/bin/ls $ARGS", ["/bin/ls", "$ARGS"]),
])
def test_exec_start_prefixes_and_variables(value: str, argv: list[str]) -> None:
    env = {"ARGS": "-c   8", "ONE": "a b", "DIR": "/srv"}
    assert unit.exec_argv(value, env) == argv


def test_environment_lines_and_files_in_systemds_order(tmp_path: Path) -> None:
    text = """[Service]
Environment="A=one two" B=2
Environment=C=3
Environment=
Environment=D=4 "E=five \\"5\\"" not-an-assignment
EnvironmentFile=-/etc/default/missing
EnvironmentFile=/etc/default/llama
ExecStart=/usr/bin/llama-server
"""
    files = {"/etc/default/llama": "# comment\n; comment\nD=from-file\nF='x y'\nG=\"a\\$b\"\n"
                                   "H=a\\\\b\n  \nJUNK\n"}
    parsed = unit.parse_unit(text, "/u.service")
    env = unit.environment(parsed, {"%": "%"}, files.get)
    # the empty Environment= resets; the file overrides Environment=, in order
    assert [(v.name, v.value) for v in env] == [
        ("D", "from-file"), ("E", 'five "5"'), ("F", "x y"), ("G", "a$b"), ("H", "a\\b")]
    assert env[0].origin == "in EnvironmentFile=/etc/default/llama in /u.service"
    assert env[1].origin == "in Environment= in /u.service"


def test_a_required_environment_file_that_is_missing_is_an_error() -> None:
    parsed = unit.parse_unit("[Service]\nEnvironmentFile=/nope\nExecStart=/x\n", "/u.service")
    with pytest.raises(InitError, match="EnvironmentFile=/nope in /u.service: no such file"):
        unit.environment(parsed, {"%": "%"}, lambda path: None)


def test_exec_start_reset_drop_ins_specifiers_and_working_directory(tmp_path: Path) -> None:
    units = tmp_path / "system"
    (units / "llama.service.d").mkdir(parents=True)
    path = units / "llama.service"
    path.write_text("[Unit]\nExecStart=/not/the/service\n[Service]\nUser=nobody\n"
                    "WorkingDirectory=-~/work\nExecStart=/old/llama-server\n")
    (units / "llama.service.d" / "override.conf").write_text(
        "[Service]\nExecStart=\nExecStart=%h/bin/llama-server -m models/m.gguf --alias "
        "%N-100%%\n")
    source = unit.read_unit(path)
    home = unit._home("nobody")
    assert source.argv == (f"{home}/bin/llama-server", "-m", "models/m.gguf", "--alias",
                           "llama-100%")
    assert source.where == f"in ExecStart= in {units / 'llama.service.d' / 'override.conf'}"
    assert source.workdir == f"{home}/work"
    assert source.home == home


def test_several_exec_start_lines_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "llama.service"
    path.write_text("[Service]\nType=oneshot\nExecStart=/a\nExecStart=/b\n")
    with pytest.raises(InitError, match="2 ExecStart= lines"):
        unit.read_unit(path)


def test_the_unit_fixture_reads_as_systemd_would(tmp_path: Path) -> None:
    units = tmp_path / "etc" / "systemd" / "system"
    (units / "llama.service.d").mkdir(parents=True)
    for name in ("llama.service", "llama.service.d/10-slots.conf"):
        (units / name).write_text((FIXTURES / name).read_text().replace("@ROOT@", str(tmp_path)))
    (tmp_path / "etc" / "default").mkdir()
    (tmp_path / "etc" / "default" / "llama-server").write_text(
        (FIXTURES / "llama-server.env").read_text())

    source = unit.read_unit(units / "llama.service")

    assert source.argv == (
        f"{tmp_path}/bin/llama-server", "-m", f"{tmp_path}/models/Qwen3-8B-Q4_K_M.gguf",
        "--host", "0.0.0.0", "--port", "8080", "-ngl", "99", "--jinja",
        "--cache-reuse", "256", "-fa", "on")
    env = {v.name: v.value for v in source.env}
    assert env["LLAMA_ARG_N_PARALLEL"] == "4"  # the drop-in's
    assert env["LLAMA_API_KEY"] == "sk-unit-secret-0123456789"
    assert source.workdir == f"{tmp_path}/srv"
    assert set(source.expanded) == {"MODEL", "EXTRA_ARGS"}


@pytest.mark.parametrize("value", [
    "plain", "with space", "it's", 'dq"inside', "back\\slash", "$dollar `tick`", "a'b\"c$d\\e",
    "",
])
def test_env_file_values_read_back_by_systemds_rules_and_by_a_shell(value: str,
                                                                    tmp_path: Path) -> None:
    text = envfile.merged("", {"KEY": value})
    assert unit.parse_env_file(text) == [("KEY", value)]
    path = tmp_path / "env"
    path.write_text(text)
    shell = subprocess.run(["sh", "-c", f'. "{path}"; printf %s "$KEY"'], capture_output=True,
                           text=True, timeout=10)
    assert shell.stdout == value


def test_the_env_file_is_created_0600(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "env"
    assert envfile.write(path, {"SPILLWAY_API_KEY": "k"}, force=False)
    assert path.stat().st_mode & 0o777 == 0o600
    assert not envfile.write(path, {"SPILLWAY_API_KEY": "k"}, force=False)  # nothing to change


# --- llama-swap -------------------------------------------------------------------------------


def swap(tmp_path: Path) -> object:
    return yaml.safe_load((FIXTURES / "llama-swap.yaml").read_text()
                          .replace("@ROOT@", str(tmp_path)))


def test_llama_swap_macros_comments_and_continuations(tmp_path: Path) -> None:
    source = llama_swap.from_config(swap(tmp_path), "c.yaml", "qwen",
                                    {"SPILLWAY_TEST_MODELS": "/models"}, "/cwd", "/home/u")
    # the model's default_ctx over the global one, inside default_args (a macro in a macro);
    # the comment line dropped before the folded macro's newline could break it
    assert source.argv == (f"{tmp_path}/bin/llama-server", "--port", "${PORT}",
                           "--model", "/models/qwen.gguf", "--ctx-size", "16384",
                           "--temperature", "0.7", "-ngl", "99", "--jinja")
    assert [(v.name, v.value) for v in source.env] == [
        ("CUDA_VISIBLE_DEVICES", "0"), ("LLAMA_ARG_FLASH_ATTN", "on"),
        ("GGML_CUDA_ENABLE_UNIFIED_MEMORY", "0")]
    assert source.env[0].origin == "in models.qwen.env in c.yaml"
    assert source.api_keys == ("sk-hunter2-swap-0123456789",)
    assert not source.clients_connect_here and source.listen == "0.0.0.0:8080"
    assert source.name == "qwen,gpt-4o-mini"
    assert source.notes and "ttl" in source.notes[0]


def test_llama_swap_model_by_alias_and_model_id_macro() -> None:
    data = {"macros": {"flag": True},
            "models": {"a": {"cmd": "llama-server -m /m/${MODEL_ID}.gguf --jinja=${flag}",
                             "aliases": [{"id": "other"}]},
                       "b": {"cmd": "llama-server"}}}
    source = llama_swap.from_config(data, "c.yaml", "other", {}, "/", "/")
    assert source.argv == ("llama-server", "-m", "/m/a.gguf", "--jinja=true")


@pytest.mark.parametrize("data, message", [
    ({"models": {"a": {"cmd": "llama-server ${nope}"}}}, "macro ${nope}, defined nowhere"),
    ({"models": {"a": {"cmd": "llama-server -m ${env.SPILLWAY_UNSET_VARIABLE}"}}},
     "SPILLWAY_UNSET_VARIABLE}: the variable is not set"),
    ({"models": {"a": {"cmd": "llama-server --alias m-${PORT}"}}}, "uses ${PORT} in 'm-${PORT}'"),
    ({"models": {"a": {"cmd": "llama-server", "env": ["NOEQUALS"]}}}, "is not NAME=value"),
    ({"models": {"a": {"cmd": "llama-server"}}, "x": 1}, None),
    ({"nothing": 1}, "not a llama-swap config"),
])
def test_llama_swap_refusals(data: object, message: str | None) -> None:
    if message is None:
        assert llama_swap.from_config(data, "c.yaml", None, {}, "/", "/").argv == ("llama-server",)
        return
    with pytest.raises(InitError) as e:
        llama_swap.from_config(data, "c.yaml", "a" if "models" in str(data) else None, {},
                               "/", "/")
    assert message in str(e.value)


def test_llama_swap_unknown_model_lists_the_names() -> None:
    data = {"models": {"b": {"cmd": "x"}, "a": {"cmd": "y"}}}
    with pytest.raises(InitError, match="no model 'c'; its models: a, b"):
        llama_swap.from_config(data, "c.yaml", "c", {}, "/", "/")


# --- LLAMA_ARG_* --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, value, args", [
    ("LLAMA_ARG_MODEL", "/m.gguf", ["-m", "/m.gguf"]),
    ("LLAMA_ARG_CTX_SIZE", "4096", ["-c", "4096"]),
    ("LLAMA_ARG_N_GPU_LAYERS", "99", ["-ngl", "99"]),
    ("LLAMA_ARG_HOST", "0.0.0.0", ["--host", "0.0.0.0"]),
    ("LLAMA_ARG_PORT", "8081", ["--port", "8081"]),
    ("LLAMA_API_KEY", "k", ["--api-key", "k"]),
    ("LLAMA_ARG_HF_REPO", "ggml-org/x-GGUF", ["-hf", "ggml-org/x-GGUF"]),
    ("LLAMA_ARG_ENDPOINT_METRICS", "1", ["--metrics"]),  # a switch, truthy
    ("LLAMA_ARG_ENDPOINT_METRICS", "no", []),  # a switch, anything else: nothing
    ("LLAMA_ARG_CONT_BATCHING", "off", ["-nocb"]),  # a bool, falsey: its negative
    ("LLAMA_ARG_JINJA", "enabled", ["--jinja"]),
    ("LLAMA_ARG_NO_CONT_BATCHING", "anything", ["-nocb"]),  # LLAMA_ARG_NO_*: set at all
    ("LLAMA_ARG_MODELS_DIR", "/srv/models", ["--models-dir", "/srv/models"]),
    ("MTMD_BACKEND_DEVICE", "none", ["-mmdev", "none"]),
])
def test_llama_variables_are_the_flags_arg_cpp_reads_them_as(name: str, value: str,
                                                             args: list[str]) -> None:
    assert llama_env.is_llama_variable(name)
    assert llama_env.flag_args(name, value) == args


def test_a_bool_variable_with_another_value_is_refused_as_llama_server_does() -> None:
    with pytest.raises(ValueError, match="llama-server takes one of"):
        llama_env.flag_args("LLAMA_ARG_JINJA", "yes")


def test_other_variables_are_not_llama_servers() -> None:
    for name in ("HF_TOKEN", "CUDA_VISIBLE_DEVICES", "LLAMA_CACHE", "LLAMA_ARG_NO_CTX_SIZE"):
        assert not llama_env.is_llama_variable(name)


def test_command_line_environment_words() -> None:
    source = from_command_line(["--", "LLAMA_ARG_CTX_SIZE=4096", "A=b=c", "llama-server", "X=1"],
                               "/cwd", "/home/u")
    assert source.argv == ("llama-server", "X=1")
    assert [(v.name, v.value) for v in source.env] == [("LLAMA_ARG_CTX_SIZE", "4096"),
                                                       ("A", "b=c")]
    with pytest.raises(InitError, match="no command line"):
        from_command_line(["A=1"], "/", "/")


# --- -hf in llama.cpp's cache -----------------------------------------------------------------

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def cached_repo(cache: Path, repo: str, files: list[str], ref: str = "main") -> Path:
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / ref).write_text(COMMIT + "\n")
    snapshot = folder / "snapshots" / COMMIT
    for name in files:
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(b"GGUF")
    return snapshot


def test_cache_folder_as_llama_cpp_picks_it() -> None:
    assert hfcache.cache_dir({"HF_HOME": "/hf", "XDG_CACHE_HOME": "/x"}, "/h") == Path(
        "/hf/hub")
    assert hfcache.cache_dir({"LLAMA_CACHE": "/l", "HF_HOME": "/hf"}, "/h") == Path("/l")
    assert hfcache.cache_dir({"XDG_CACHE_HOME": "/x"}, "/h") == Path("/x/huggingface/hub")
    assert hfcache.cache_dir({}, "/h") == Path("/h/.cache/huggingface/hub")


def test_split_models_subfolders_and_hf_file(tmp_path: Path) -> None:
    snapshot = cached_repo(tmp_path, "unsloth/Big-GGUF", [
        "Q4_K_M/Big-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/Big-Q4_K_M-00001-of-00002.gguf",
        "Q4_K_M/mmproj-F16.gguf", "mmproj-BF16.gguf", "Big-Q8_0.gguf", "imatrix.gguf"],
        ref="dev")
    env = {"LLAMA_CACHE": str(tmp_path)}
    found = hfcache.find_model("unsloth/Big-GGUF", None, env, "/h")
    assert found.path == str(snapshot / "Q4_K_M/Big-Q4_K_M-00001-of-00002.gguf")
    assert found.mmproj == str(snapshot / "Q4_K_M/mmproj-F16.gguf")  # the deepest shared folder
    q8 = hfcache.find_model("unsloth/Big-GGUF:q8_0", None, env, "/h")
    assert q8.path == str(snapshot / "Big-Q8_0.gguf")
    assert q8.mmproj == str(snapshot / "mmproj-BF16.gguf")
    named = hfcache.find_model("unsloth/Big-GGUF", "Big-Q8_0.gguf", env, "/h")
    assert named.path == str(snapshot / "Big-Q8_0.gguf")
    with pytest.raises(InitError, match="a model file for IQ1_S is not in"):
        hfcache.find_model("unsloth/Big-GGUF:IQ1_S", None, env, "/h")
    with pytest.raises(InitError, match="expected user/model"):
        hfcache.find_model("no-slash", None, env, "/h")
