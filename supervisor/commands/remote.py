"""Talking to a running daemon from the command line (`spillway status`, `incidents`, `gpu`).

The address and key come from the daemon's own config file (so `spillway status` on the server
needs no flags), or from --url and --api-key / $SPILLWAY_API_KEY. When the file no longer loads
(an edit the daemon refused at its reload: it serves on the config it last loaded), the daemon
is still found by the file's path alone: its control socket (service/handover.py), named for
that path in its run folder, which answers its own user and root.
"""

from __future__ import annotations

import json
import os
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import bootstrap
from ..config import schema as config

DEFAULT_CONFIG = "/etc/spillway/spillway.toml"


class Unreachable(Exception):
    """The daemon did not answer."""


class RequestFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class Target:
    url: str
    api_key: str | None


LOCAL_CONFIG = "spillway.toml"  # in the current folder, where `spillway init` writes it


def find_config(given: str | None) -> str:
    """The config a command means: --config, else $SPILLWAY_CONFIG, else ./spillway.toml
    (`spillway init`'s, when not root), else /etc/spillway/spillway.toml (the service's), else
    the one `spillway quickstart` last ran. Raises ConfigError saying which flag to add when
    there is none."""
    if given:
        return given
    from_env = os.environ.get("SPILLWAY_CONFIG")
    if from_env:
        return from_env
    if os.path.isfile(LOCAL_CONFIG):
        return os.path.abspath(LOCAL_CONFIG)
    if os.path.exists(DEFAULT_CONFIG):
        return DEFAULT_CONFIG
    quickstart = bootstrap.last_quickstart_config()
    if quickstart is not None:
        return str(quickstart)
    raise config.ConfigError(DEFAULT_CONFIG, [config.Problem(
        "", f"no config given, none here ({LOCAL_CONFIG}) or at this path, and no quickstart "
            "has run: add --config FILE (the daemon's TOML; `spillway init` writes one), or "
            "set SPILLWAY_CONFIG")])


ENV_FILE = "env"  # beside the config: the unit's EnvironmentFile, where `spillway init` writes


def _load_for_client(path: str, given_key: str | None) -> config.Config:
    """The config, for its address and key. The key's variable (server.api_key_env) is often
    set only in the daemon's environment (systemd reads /etc/spillway/env): a key given here
    stands in for it, else the environment file beside the config is read when it can be."""
    try:
        return config.load(path, check_paths=False)
    except config.ConfigError as e:
        if not e.problems or any(p.path != "server.api_key_env" for p in e.problems):
            raise
        missing = e
    from .init.unit import parse_env_file

    variable = _key_variable(path)
    if given_key is not None and variable:
        return config.load(path, environ={**os.environ, variable: given_key},
                           check_paths=False)
    env_file = Path(path).resolve().parent / ENV_FILE
    try:
        found = dict(parse_env_file(env_file.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError):
        found = {}
    if not found.get(variable or ""):
        raise config.ConfigError(missing.source, [*missing.problems, config.Problem(
            "", f"give the key with --api-key or $SPILLWAY_API_KEY, export {variable}, or run "
                f"as a user who can read {env_file}")])
    return config.load(path, environ={**os.environ, **found}, check_paths=False)


def _key_variable(path: str) -> str | None:
    """server.api_key_env's value, read from the file as it is."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    value = raw.get("server", {}).get("api_key_env")
    return value if isinstance(value, str) else None


def target_from(url: str | None, config_path: str | None, api_key: str | None) -> Target:
    """--url wins; else the first listen address of the config (see find_config)."""
    key = api_key or os.environ.get("SPILLWAY_API_KEY") or None
    if url:
        return Target(url.rstrip("/"), key)
    cfg = _load_for_client(find_config(config_path), key)
    addr = cfg.server.listen[0]
    host = addr.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1" if host != "::" else "::1"
    host = f"[{host}]" if ":" in host else host
    return Target(f"http://{host}:{addr.port}", key or cfg.server.api_key)


def call(target: Target, method: str, path: str, timeout: float = 10.0,
         body: bytes | None = None) -> Any:
    headers = {"Accept": "application/json"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    if body is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(target.url + path, method=method, headers=headers, data=body)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text[:200]
        raise RequestFailed(e.code, message) from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"no answer from Spillway at {target.url}: {reason}") from e


def control_sockets(config_path: str) -> list[Path]:
    """Where the daemon running `config_path` has its control socket: in this user's state
    folder ($STATE_DIRECTORY under systemd), or the shipped unit's (/var/lib/spillway) for root
    in a shell."""
    from ..service.handover import control_path
    from ..upstreams.owned import run_folder, state_id

    found: list[Path] = []
    for folder in dict.fromkeys([run_folder(), Path("/var/lib/spillway/run")]):
        path = control_path(state_id(config_path), folder)
        if path not in found:
            found.append(path)
    return found


def status_by_control(config_path: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """The status of the daemon running `config_path`, asked on its control socket (no address
    or key needed); None when none answers there."""
    from ..service.handover import ask

    for path in control_sockets(config_path):
        if not path.exists():
            continue
        try:
            answer = ask(path, {"op": "status"}, timeout)
        except (OSError, ValueError):
            continue
        if answer.get("ok") and isinstance(answer.get("status"), dict):
            return dict(answer["status"])
    return None
