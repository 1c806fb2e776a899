"""`spillway config get|set|unset`: one key edited in place, comments and layout kept, checked by
the daemon's own rules before anything is written, written atomically, and picked up by a
running daemon's watcher."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from harness import REPO, eventually, fake_config

from conftest import SpillwayFactory
from supervisor.config import edit as config_edit, schema as config

CONFIG = """\
# My Spillway: edited by hand, and the comments matter.
[server]
listen = "127.0.0.1:8099"   # where the clients go

[model]
llama_server = "{binary}"
path = "model.gguf"
args = ["-c", "8192", "-np", "2"]   # both children

[queue]
max_waiting = 32   # how many may wait
# the next key is left at its default on purpose
"""


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    path = tmp_path / "spillway.toml"
    path.write_text(CONFIG.format(binary=binary))
    path.chmod(0o640)
    return path


def spillway_config(*args: str, env: dict[str, str] | None = None
                    ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", "config", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_get_prints_the_bare_toml_value_or_the_default(cfg_file: Path) -> None:
    assert config_edit.get(cfg_file, "queue.max_waiting") == ("32", True)
    assert config_edit.get(cfg_file, "server.listen") == ('"127.0.0.1:8099"', True)
    assert config_edit.get(cfg_file, "model.args") == ('["-c", "8192", "-np", "2"]', True)
    assert config_edit.get(cfg_file, "cpu.mode") == ('"hot"', False)  # the default
    assert config_edit.get(cfg_file, "queue.max_wait_s") == ("60.0", False)
    out = spillway_config("get", "queue.max_waiting", "--config", str(cfg_file))
    assert (out.returncode, out.stdout) == (0, "32\n")
    out = spillway_config("get", "cpu.mode", "--config", str(cfg_file))
    assert (out.returncode, out.stdout) == (0, '"hot"\n')
    assert "not set" in out.stderr and "default" in out.stderr


def test_set_changes_one_line_and_keeps_every_comment(cfg_file: Path) -> None:
    before = cfg_file.read_text()
    out = spillway_config("set", "queue.max_waiting", "7", "--config", str(cfg_file))
    assert out.returncode == 0, out.stderr
    assert "queue.max_waiting = 7 (was 32)" in out.stdout
    after = cfg_file.read_text()
    assert after == before.replace("max_waiting = 32   #", "max_waiting = 7   #")
    assert config_edit.get(cfg_file, "queue.max_waiting") == ("7", True)


def test_a_bare_word_is_a_string_for_a_string_key(cfg_file: Path) -> None:
    config_edit.edit(cfg_file, "cpu.mode", "on-demand")
    config_edit.edit(cfg_file, "gpu.env.CUDA_VISIBLE_DEVICES", "1")
    config_edit.edit(cfg_file, "gpu.args", '["-ngl", "40"]')
    assert config_edit.get(cfg_file, "cpu.mode") == ('"on-demand"', True)
    assert config_edit.get(cfg_file, "gpu.env.CUDA_VISIBLE_DEVICES") == ('"1"', True)
    assert config_edit.get(cfg_file, "gpu.args") == ('["-ngl", "40"]', True)
    assert "# My Spillway" in cfg_file.read_text()


def test_an_invalid_value_is_refused_with_its_key_path_and_nothing_is_written(
        cfg_file: Path) -> None:
    before = cfg_file.read_bytes()
    mtime = cfg_file.stat().st_mtime_ns
    for key, value, said in [
            ("queue.max_waiting", "-1", "queue.max_waiting: must be 0 or more"),
            ("cpu.mode", "lukewarm", "cpu.mode: must be one of 'hot', 'on-demand'"),
            ("server.listen", "0.0.0.0:8080", "server.listen: 0.0.0.0:8080 is not a loopback"),
            ("gpu.args", '["--port", "9000"]', "gpu.args[0]: '--port' is chosen by Spillway"),
            ("queue.max_wait_s", "soon", "not a TOML value"),
            ("queue.max_waitin", "3", "did you mean 'max_waiting'"),
            ("queu.max_waiting", "3", "did you mean 'queue'")]:
        out = spillway_config("set", key, value, "--config", str(cfg_file))
        assert out.returncode == 2, (key, out.stdout, out.stderr)
        assert said in out.stderr, (key, out.stderr)
    assert cfg_file.read_bytes() == before
    assert cfg_file.stat().st_mtime_ns == mtime
    # No temporary file is left behind either.
    assert sorted(p.name for p in cfg_file.parent.iterdir()) == [
        "llama-server", "model.gguf", "spillway.toml"]


def test_the_write_is_atomic_and_keeps_the_mode_and_a_symlink(cfg_file: Path) -> None:
    link = cfg_file.parent / "link.toml"
    link.symlink_to(cfg_file)
    inode = cfg_file.stat().st_ino
    config_edit.edit(link, "queue.max_waiting", "5")
    assert link.is_symlink()  # the file it points to was replaced, not the link
    assert cfg_file.stat().st_ino != inode  # a new file renamed over the old
    assert stat.S_IMODE(cfg_file.stat().st_mode) == 0o640
    assert config_edit.get(cfg_file, "queue.max_waiting") == ("5", True)


def test_unset_goes_back_to_the_default(cfg_file: Path) -> None:
    change = config_edit.edit(cfg_file, "queue.max_waiting", None)
    assert (change.before, change.after) == ("32", None)
    assert config_edit.get(cfg_file, "queue.max_waiting") == ("32", False)  # the default
    assert "max_waiting" not in cfg_file.read_text()
    assert config_edit.edit(cfg_file, "queue.max_waiting", None).unchanged


def test_a_problem_already_in_the_file_does_not_block_an_unrelated_edit(cfg_file: Path) -> None:
    """The daemon's key may come from a variable only systemd sets (api_key_env): editing
    another key from a shell without it is still allowed, and the old problem is reported."""
    text = cfg_file.read_text().replace('listen = "127.0.0.1:8099"',
                                        'listen = "127.0.0.1:8099"\napi_key_env = "SW_KEY_X"')
    cfg_file.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "SW_KEY_X"}
    out = subprocess.run([sys.executable, "-m", "supervisor", "config", "set",
                          "queue.max_waiting", "9", "--config", str(cfg_file)],
                         capture_output=True, text=True, timeout=60,
                         env={**env, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "warning, already in the file: server.api_key_env" in out.stderr
    assert config_edit.get(cfg_file, "queue.max_waiting") == ("9", True)


def test_restart_keys_say_so(cfg_file: Path) -> None:
    out = spillway_config("set", "server.listen", "127.0.0.1:8100", "--config", str(cfg_file))
    assert out.returncode == 0, out.stderr
    assert "takes effect when spillway restarts" in out.stdout


def test_the_config_is_found_as_the_other_client_commands_find_it(cfg_file: Path) -> None:
    out = spillway_config("get", "queue.max_waiting", env={"SPILLWAY_CONFIG": str(cfg_file)})
    assert (out.returncode, out.stdout) == (0, "32\n")


def test_a_running_daemon_picks_up_a_set_through_its_watcher(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    assert s.status()["queue"]["max_waiting"] == 32
    out = spillway_config("set", "queue.max_waiting", "7", "--config", str(s.config_path))
    assert out.returncode == 0, out.stderr
    eventually(lambda: s.status()["queue"]["max_waiting"] == 7)
    assert s.status()["config"]["error"] is None
    # A refused value leaves the daemon's config (and the file) as they were.
    out = spillway_config("set", "queue.max_waiting", "-3", "--config", str(s.config_path))
    assert out.returncode == 2
    assert s.status()["queue"]["max_waiting"] == 7


SECTIONS = """\
[model]
llama_server = "{binary}"
path = "model.gguf"

[gpu]
args = ["-ngl", "99"]
# the CPU child: my notes on it
[cpu]
mode = "hot"

[queue]
max_waiting = 32
"""


@pytest.fixture
def with_cpu(cfg_file: Path) -> Path:
    (cfg_file.parent / "small.gguf").write_bytes(b"GG")
    binary = cfg_file.parent / "llama-server"
    cfg_file.write_text(SECTIONS.format(binary=binary))
    return cfg_file


def test_small_keys_add_the_section_before_cpu(with_cpu: Path) -> None:
    before = with_cpu.read_text()
    assert config_edit.get(with_cpu, "small.path") == ('""', False)  # no small child
    assert config_edit.get(with_cpu, "small.mode") == ('"resident"', False)
    assert config_edit.get(with_cpu, "small.requests") == ('"opt-in"', False)

    out = spillway_config("set", "small.path", "small.gguf", "--config", str(with_cpu))
    assert out.returncode == 0, out.stderr
    assert 'small.path = "small.gguf" (was not set)' in out.stdout
    # after [gpu], above the comment that is [cpu]'s own
    assert with_cpu.read_text() == before.replace(
        "# the CPU child", '\n[small]\npath = "small.gguf"\n\n# the CPU child')

    config_edit.edit(with_cpu, "small.mode", "on-demand")
    config_edit.edit(with_cpu, "small.requests", "all")
    config_edit.edit(with_cpu, "small.env.CUDA_SCALE_LAUNCH_QUEUES", "4x")
    assert config_edit.get(with_cpu, "small.mode") == ('"on-demand"', True)
    text = with_cpu.read_text()
    assert text == before.replace(
        "# the CPU child", '\n[small]\npath = "small.gguf"\nmode = "on-demand"\n'
        'requests = "all"\nenv = {CUDA_SCALE_LAUNCH_QUEUES = "4x"}\n\n# the CPU child')
    cfg = config.load(with_cpu)
    assert cfg.order == ("gpu", "small", "cpu")
    assert (cfg.small.mode, cfg.small.requests) == ("on-demand", "all")
    assert cfg.small.model_path == str(with_cpu.parent / "small.gguf")

    # set again: the line changes in place
    config_edit.edit(with_cpu, "small.mode", "resident")
    assert with_cpu.read_text() == text.replace('mode = "on-demand"', 'mode = "resident"')


def test_a_new_section_goes_where_the_schema_orders_it(with_cpu: Path) -> None:
    config_edit.edit(with_cpu, "restart.backoff_max_s", "60")  # after [cpu], before [queue]
    config_edit.edit(with_cpu, "balancer.agent_listen", "127.0.0.1:9100")  # the last: at the end
    config_edit.edit(with_cpu, "server.listen", "127.0.0.1:8098")  # the first: before [model]
    assert re.findall(r"^\[(\w+)\]", with_cpu.read_text(), re.M) == [
        "server", "model", "gpu", "cpu", "restart", "queue", "balancer"]
    assert with_cpu.read_text().startswith('[server]\nlisten = "127.0.0.1:8098"\n\n[model]\n')
    config.load(with_cpu)


def test_a_header_inside_a_string_is_not_taken_for_one(with_cpu: Path) -> None:
    """A line that reads as [cpu]'s header inside a multi-line string: the new section goes at
    the end (tomlkit's place) rather than into the string."""
    with_cpu.write_text(with_cpu.read_text().replace(
        "# the CPU child", '[gpu.env]\nNOTE = """\n[cpu]\n"""\n# the CPU child'))
    before = tomllib.loads(with_cpu.read_text())
    assert before["gpu"]["env"] == {"NOTE": "[cpu]\n"}
    config_edit.edit(with_cpu, "small.path", "small.gguf")
    text = with_cpu.read_text()
    after = tomllib.loads(text)
    assert after["gpu"]["env"] == before["gpu"]["env"]
    assert after["small"] == {"path": "small.gguf"}
    assert text.endswith('\n[small]\npath = "small.gguf"\n')
    assert config.load(with_cpu).order == ("gpu", "small", "cpu")


def test_bad_small_values_are_refused_and_the_file_is_untouched(with_cpu: Path) -> None:
    before = with_cpu.read_bytes()
    mtime = with_cpu.stat().st_mtime_ns
    for key, value, said in [
            ("small.mode", "hot", "small.mode: must be one of 'resident', 'on-demand' "
                                  "(got 'hot')"),
            ("small.requests", "some", "small.requests: must be one of 'opt-in', 'all'"),
            ("small.mode", "on-demand", "small.path: is required for small.mode"),
            ("small.path", "missing.gguf", "small.path: no such file"),
            ("small.idle_stop_s", "5", "unknown key small.idle_stop_s"),  # cpu's alone
            ("small.mod", "resident", "did you mean 'mode'")]:
        out = spillway_config("set", key, value, "--config", str(with_cpu))
        assert out.returncode == 2, (key, out.stdout, out.stderr)
        assert said in out.stderr, (key, out.stderr)
    assert with_cpu.read_bytes() == before
    assert with_cpu.stat().st_mtime_ns == mtime

    config_edit.edit(with_cpu, "small.path", "small.gguf")
    text = with_cpu.read_text()
    with pytest.raises(config_edit.EditError) as refused:
        config_edit.edit(with_cpu, "small.mode", "hot")
    assert [str(p) for p in refused.value.problems] == [
        "small.mode: must be one of 'resident', 'on-demand' (got 'hot')"]
    assert with_cpu.read_text() == text


def test_router_mode_refuses_a_small_child(with_cpu: Path) -> None:
    with_cpu.write_text(with_cpu.read_text().replace('path = "model.gguf"\n', ""))
    before = with_cpu.read_bytes()
    with pytest.raises(config_edit.EditError) as refused:
        config_edit.edit(with_cpu, "small.path", "small.gguf")
    assert "small.path: a small child is for single-model mode" in str(
        refused.value.problems[0])
    assert with_cpu.read_bytes() == before


def test_unset_in_a_section_the_file_lacks_writes_nothing(with_cpu: Path) -> None:
    before = with_cpu.read_bytes()
    mtime = with_cpu.stat().st_mtime_ns
    change = config_edit.edit(with_cpu, "small.mode", None)
    assert change.unchanged and change.before is None
    assert config_edit.edit(with_cpu, "restart.backoff_max_s", None).unchanged
    assert with_cpu.read_bytes() == before  # no empty [small] or [restart] added
    assert with_cpu.stat().st_mtime_ns == mtime


def test_a_new_key_goes_after_the_last_key_not_under_the_next_sections_comment(
        with_cpu: Path) -> None:
    before = with_cpu.read_text()
    config_edit.edit(with_cpu, "gpu.device", "1")
    assert with_cpu.read_text() == before.replace(
        'args = ["-ngl", "99"]\n', 'args = ["-ngl", "99"]\ndevice = 1\n')
    with_cpu.write_text(before.replace("# the CPU child", '[gpu.env]\nA = "1"\n# the CPU child'))
    config_edit.edit(with_cpu, "gpu.env.B", "2")
    assert '[gpu.env]\nA = "1"\nB = "2"\n# the CPU child: my notes on it\n[cpu]\n' in \
        with_cpu.read_text()
    assert dict(config.load(with_cpu).gpu.env) == {"A": "1", "B": "2"}


def test_set_api_key_puts_the_key_where_init_does_never_in_the_config(cfg_file: Path) -> None:
    """The config is 0644 (anyone on the machine may read it); `spillway init` keeps keys out of
    it, in the environment file beside it (mode 0600), and so does `config set`."""
    cfg_file.chmod(0o644)
    env_file = cfg_file.parent / "env"
    env_file.write_text("HF_TOKEN='other-secret'\n")  # another line of the file stays
    secret = "sk-set-from-the-command-line-42"
    out = spillway_config("set", "server.api_key", secret, "--config", str(cfg_file))
    assert out.returncode == 0, out.stderr
    assert secret not in cfg_file.read_text() and secret not in out.stdout + out.stderr
    assert config_edit.get(cfg_file, "server.api_key_env") == ('"SPILLWAY_API_KEY"', True)
    assert env_file.read_text() == f"HF_TOKEN='other-secret'\nSPILLWAY_API_KEY='{secret}'\n"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(cfg_file.stat().st_mode) == 0o644
    assert f"server.api_key: in {env_file} as SPILLWAY_API_KEY (mode 0600)" in out.stdout
    assert "takes effect when spillway restarts" in out.stdout
    # The daemon reads it from there: the config is valid with the variable set.
    built = config.build(tomllib.loads(cfg_file.read_text()), base_dir=cfg_file.parent,
                         environ={"SPILLWAY_API_KEY": secret})
    assert built.server.api_key == secret
    # A new key replaces the old one in the file, and the config is left as it is.
    text = cfg_file.read_text()
    out = spillway_config("set", "server.api_key", "sk-the-next-one", "--config", str(cfg_file))
    assert out.returncode == 0, out.stderr
    assert cfg_file.read_text() == text and "(already)" in out.stdout
    assert env_file.read_text().endswith("SPILLWAY_API_KEY='sk-the-next-one'\n")


def test_set_api_key_moves_a_key_out_of_the_config_into_the_variable_it_names(
        cfg_file: Path) -> None:
    text = cfg_file.read_text()
    cfg_file.write_text(text.replace('listen = "127.0.0.1:8099"',
                                     'listen = "127.0.0.1:8099"\napi_key = "sk-in-the-file-1"'))
    out = subprocess.run([sys.executable, "-m", "supervisor", "config", "set", "server.api_key",
                          "-", "--config", str(cfg_file)], input="sk-from-stdin-2\n",
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "sk-in-the-file-1" not in cfg_file.read_text()
    assert "is gone from it" in out.stdout
    assert (cfg_file.parent / "env").read_text() == "SPILLWAY_API_KEY='sk-from-stdin-2'\n"
    # A config that names its own variable keeps it.
    cfg_file.write_text(text.replace('listen = "127.0.0.1:8099"',
                                     'listen = "127.0.0.1:8099"\napi_key_env = "MY_KEY"'))
    out = spillway_config("set", "server.api_key", "sk-mine-3", "--config", str(cfg_file))
    assert out.returncode == 0, out.stderr
    assert config_edit.get(cfg_file, "server.api_key_env") == ('"MY_KEY"', True)
    assert (cfg_file.parent / "env").read_text().endswith("MY_KEY='sk-mine-3'\n")
    # An empty key is refused, and nothing is written.
    before = cfg_file.read_text()
    out = spillway_config("set", "server.api_key", "", "--config", str(cfg_file))
    assert out.returncode == 2 and "empty" in out.stderr
    assert cfg_file.read_text() == before
