"""The children Spillway owns, written down: the state file, one per config.

The children outlive the daemon by design (an upgrade in place hands them to the next daemon;
a crash leaves them for the next start), so the daemon keeps, in its state folder, a record of
each child process it runs: its name, pid, start time (the kernel's, in clock ticks since boot,
and the boot's id), command line, port, API key, media marker, the value of its
`SPILLWAY_OWNER` environment variable, and a fingerprint of the command its config asked for.
The next daemon for the same config reads it and adopts a process only when every identity
check holds (adopted.py); anything else is never touched.

The file is `<state folder>/run/<id>.json`, mode 0600 (it holds the children's keys) in a
folder of mode 0700; `<id>` is a hash of the config file's real path, so that two Spillways
with two configs keep two files. The state folder is systemd's `$STATE_DIRECTORY`, else
`$XDG_STATE_HOME/spillway`, else `~/.local/state/spillway` (where the incidents go too).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config.files import write_atomically
from ..config.schema import ChildConfig

log = logging.getLogger("spillway.child")

OWNER_ENV = "SPILLWAY_OWNER"  # in every child's environment: "<state id>:<name>:<nonce>"
MEDIA_MARKER_ENV = "LLAMA_MEDIA_MARKER"  # tools/server/server-common.cpp get_media_marker
VERSION = 1


def state_folder() -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=), $XDG_STATE_HOME/spillway or
    ~/.local/state/spillway."""
    state = os.environ.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "spillway"


def state_id(config_path: str) -> str:
    """The config's own id: a hash of its real path."""
    real = os.path.realpath(config_path)
    return hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def run_folder() -> Path:
    return state_folder() / "run"


def fingerprint(cfg: ChildConfig) -> str:
    """What a child's process was started for, in the terms of a reload
    (config.schema.command_changed): its command line, environment and card."""
    what = json.dumps([cfg.command(0, ""), sorted(cfg.env.items()), cfg.device])
    return hashlib.sha256(what.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class ChildRecord:
    """One child process, as its daemon started it."""

    name: str
    pid: int
    start_ticks: int  # /proc/PID/stat's starttime: clock ticks after boot
    boot_id: str  # /proc/sys/kernel/random/boot_id
    # As started (the key is in its environment, not here): what the log and a refusal's
    # reading show, not its identity (a wrapper script that execs llama-server changes it).
    argv: tuple[str, ...]
    port: int
    api_key: str
    owner: str  # its SPILLWAY_OWNER value
    media_marker: str  # its LLAMA_MEDIA_MARKER
    fingerprint: str  # of the command its config asked for (fingerprint())
    started: float  # wall time
    daemon_pid: int  # the Spillway that started it

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["argv"] = list(self.argv)
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ChildRecord:
        names = {f.name for f in fields(cls)}
        missing = names - raw.keys()
        if missing:
            raise ValueError(f"a child record without {', '.join(sorted(missing))}")
        values = {k: raw[k] for k in names}
        values["argv"] = tuple(str(a) for a in raw["argv"])
        return cls(**values)


@dataclass(frozen=True)
class State:
    """The file's content: the daemon that wrote it, and its children."""

    daemon_pid: int
    media_marker: str
    children: tuple[ChildRecord, ...]
    # The stopped children whose card is lent (service/fleet.Lent's fields, by child name):
    # an upgrade's new daemon keeps them so, instead of starting them.
    lent: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "daemon_pid": self.daemon_pid,
                "media_marker": self.media_marker,
                "children": [c.to_json() for c in self.children],
                **({"lent": {n: dict(v) for n, v in self.lent.items()}} if self.lent else {})}


class StateFile:
    """One config's state file."""

    def __init__(self, config_path: str, folder: Path | None = None) -> None:
        self.id = state_id(config_path)
        self.folder = folder or run_folder()
        self.path = self.folder / f"{self.id}.json"

    def read(self) -> State | None:
        """What the file says, or None (no file; a file that cannot be read or understood is
        logged, and nothing in it is acted on)."""
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("state file %s cannot be read (%s): no child is adopted from it",
                        self.path, e)
            return None
        try:
            if raw.get("version") != VERSION:
                raise ValueError(f"version {raw.get('version')!r}, not {VERSION}")
            children = tuple(ChildRecord.from_json(c) for c in raw["children"])
            lent = raw.get("lent") or {}
            if not isinstance(lent, dict) or not all(isinstance(v, dict) for v in lent.values()):
                raise ValueError("lent is not a table of tables")
            return State(int(raw["daemon_pid"]), str(raw.get("media_marker") or ""), children,
                         lent)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("state file %s is not one this Spillway understands (%s): no child is "
                        "adopted from it", self.path, e)
            return None

    def write(self, state: State) -> None:
        """Replace the file (mode 0600, in a 0700 folder); an empty one is removed."""
        if not state.children:
            self.remove()
            return
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomically(self.path, json.dumps(state.to_json(), indent=1) + "\n", mode=0o600)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def records_by_name(records: Iterable[ChildRecord]) -> dict[str, ChildRecord]:
    return {r.name: r for r in records}


def names(records: Sequence[ChildRecord]) -> str:
    return ", ".join(f"{r.name} (pid {r.pid})" for r in records) or "none"
