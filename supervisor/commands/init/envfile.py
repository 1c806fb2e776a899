"""The environment file the secrets go to: NAME=value lines that systemd's EnvironmentFile= reads
(the shipped unit reads /etc/spillway/env) and that a shell can source, mode 0600.

Values are written in single quotes (verbatim for both systemd and a shell), or, when they hold
one, in double quotes with `\\ " ` $` escaped. An existing file keeps its other lines; a variable
it already sets to another value is replaced only with --force.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from ...config.files import write_atomically
from .source import InitError
from .unit import parse_env_file


def beside(config: Path) -> Path:
    """Where the secrets of the config at `config` go: `env` in its folder (for
    /etc/spillway/spillway.toml, /etc/spillway/env, which the shipped unit reads)."""
    return config.parent / "env"


def quote(value: str) -> str:
    if "'" not in value:
        return f"'{value}'"
    return '"' + re.sub(r'([\\"`$])', r"\\\1", value) + '"'


def merged(existing: str, secrets: Mapping[str, str]) -> str:
    """The file's text with `secrets` set: its lines that set them replaced, the rest kept."""
    ours = re.compile(r"^\s*(?:export\s+)?(" + "|".join(map(re.escape, secrets)) + r")\s*=")
    kept = [line for line in existing.splitlines() if not ours.match(line)]
    return "".join(line + "\n" for line in kept) + "".join(
        f"{name}={quote(value)}\n" for name, value in secrets.items())


def conflicts(existing: str, secrets: Mapping[str, str]) -> list[str]:
    """The variables the file already sets to another value."""
    current = dict(parse_env_file(existing))
    return [name for name, value in secrets.items()
            if name in current and current[name] != value]


def write(path: Path, secrets: Mapping[str, str], force: bool) -> bool:
    """Set `secrets` in the file at `path` (created, or updated, mode 0600); whether anything
    changed. InitError when it would replace another value without `force`."""
    try:
        existing = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        existing = ""
    except OSError as e:
        raise InitError(f"{path}: cannot read: {e}") from e
    clash = conflicts(existing, secrets)
    if clash and not force:
        raise InitError(f"{path} already sets {', '.join(clash)} to another value; --force "
                        "replaces it")
    text = merged(existing, secrets)
    if text == existing:
        os.chmod(path, 0o600)
        return False
    write_atomically(path, text, mode=0o600)  # never readable by others, not even briefly
    return True
