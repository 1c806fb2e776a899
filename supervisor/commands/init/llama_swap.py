"""A llama-swap config -> one model's llama-server command line, and its environment.

Read as llama-swap reads it (mostlygeek/llama-swap, config.example.yaml and
proxy/config/config.go):
- `${env.VAR}` is the variable from the environment (llama-swap refuses a config naming an
  unset one, and so does this);
- `models.ID.cmd`: comment lines dropped (StripComments); then macros substituted:
  `${MODEL_ID}`, the global `macros:`, the model's own `macros:` over them, last defined first
  (so a macro may use the ones before it); then a trailing backslash joins the next line, and
  the words are split like a POSIX shell's (SanitizeCommand);
- `${PORT}` is llama-swap's port for the upstream: Spillway picks its children's ports, so the
  `--port ${PORT}` (and `--host`) in cmd are the upstream's address, not where clients connect.
  Clients connect to llama-swap's own `--listen`, which is not in the config (default `:8080`,
  every address);
- `models.ID.env`: a list of NAME=value;
- `apiKeys`: the keys clients present.
Relative paths in cmd are relative to the folder llama-swap ran in, taken to be this one.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from . import flags
from .source import EnvVar, InitError, Source

_ENV_MACRO = re.compile(r"\$\{env\.([A-Za-z_][A-Za-z0-9_]*)\}")
_MACRO = re.compile(r"\$\{([A-Za-z0-9_-]+)\}")
PORT = "${PORT}"
DEFAULT_LISTEN = "0.0.0.0:8080"  # llama-swap's `-listen` default, ":8080": every address
# A model's settings that are llama-swap's own business, with no Spillway equivalent.
_SWAP_ONLY = ("ttl", "filters", "useModelName", "concurrencyLimit", "checkEndpoint", "cmdStop",
              "proxy", "unlisted", "metadata", "timeouts", "sendLoadingState")


def _env_macros(value: Any, environ: Mapping[str, str]) -> Any:
    """`${env.VAR}` replaced in every string of the parsed config."""
    if isinstance(value, str):
        def one(m: re.Match[str]) -> str:
            if m.group(1) not in environ:
                raise InitError(f"${{env.{m.group(1)}}}: the variable is not set here (llama-swap "
                                "refuses the config without it too); set it and run spillway "
                                "init again")
            return environ[m.group(1)]

        return _ENV_MACRO.sub(one, value)
    if isinstance(value, dict):
        return {k: _env_macros(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_env_macros(v, environ) for v in value]
    return value


def _go_string(value: Any) -> str:
    """A macro's value as llama-swap's fmt.Sprintf("%v") writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _macros(config: Mapping[str, Any], model_id: str, model: Mapping[str, Any]) -> list[Any]:
    merged: list[list[Any]] = [["MODEL_ID", model_id]]
    merged += [[k, v] for k, v in (config.get("macros") or {}).items()]
    for name, value in (model.get("macros") or {}).items():
        for entry in merged:
            if entry[0] == name:
                entry[1] = value
                break
        else:
            merged.append([name, value])
    return merged


def substitute(cmd: str, macros: list[Any]) -> str:
    """The macros in cmd, last defined first (llama-swap's order); ${PORT} stays."""
    for name, value in reversed(macros):
        cmd = cmd.replace("${" + str(name) + "}", _go_string(value))
    unknown = [m for m in _MACRO.findall(cmd) if m != "PORT"]
    if unknown:
        raise InitError(f"cmd uses the macro ${{{unknown[0]}}}, defined nowhere (llama-swap "
                        "refuses it too)")
    return cmd


def strip_comments(cmd: str) -> str:
    """StripComments: llama-swap drops cmd's comment lines before it substitutes macros."""
    return "\n".join(line for line in cmd.split("\n") if not line.strip().startswith("#"))


def split_command(cmd: str) -> list[str]:
    """SanitizeCommand: comment lines out, trailing backslashes joined, POSIX words."""
    lines = []
    for line in cmd.split("\n"):
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        lines.append(stripped[:-1] + " " if stripped.endswith("\\") else line)
    try:
        return shlex.split("\n".join(lines))
    except ValueError as e:
        raise InitError(f"cmd: {e}") from e


def _choose(models: Mapping[str, Any], wanted: str | None, path: str) -> str:
    names = sorted(models)
    if wanted is None:
        if len(names) == 1:
            return names[0]
        raise InitError(f"{path} has {len(names)} models; name one with --model: "
                        f"{', '.join(names)}")
    if wanted in models:
        return wanted
    for name, model in models.items():
        for alias in (model or {}).get("aliases") or []:
            if wanted in (alias, alias.get("id") if isinstance(alias, dict) else None):
                return str(name)
    raise InitError(f"{path}: no model {wanted!r}; its models: {', '.join(names)}")


def _argv(cmd: str, model_id: str) -> list[str]:
    argv = split_command(cmd)
    if argv and PurePosixPath(argv[0]).name in flags.WRAPPERS:
        return argv  # not llama-server itself: cmdline.py says so
    for i, word in enumerate(argv):
        port_value = word == PORT and i > 0 and argv[i - 1] == "--port"
        if PORT in word and not port_value and word != f"--port={PORT}":
            raise InitError(f"models.{model_id}.cmd uses ${{PORT}} in {word!r}; Spillway picks "
                            "its children's ports, and only `--port ${PORT}` can be left to it")
    return argv


def from_config(data: Any, path: str, wanted: str | None, environ: Mapping[str, str],
                cwd: str, home: str) -> Source:
    """One model of a parsed llama-swap config as a Source."""
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict) \
            or not data["models"]:
        raise InitError(f"{path}: not a llama-swap config (no models:)")
    data = _env_macros(data, environ)
    model_id = _choose(data["models"], wanted, path)
    model = data["models"][model_id] or {}
    if not isinstance(model.get("cmd"), str):
        raise InitError(f"{path}: models.{model_id} has no cmd")
    cmd = substitute(strip_comments(model["cmd"]), _macros(data, model_id, model))
    argv = _argv(cmd, model_id)
    env = []
    for item in model.get("env") or []:
        name, sep, value = str(item).partition("=")
        if not sep:
            raise InitError(f"models.{model_id}.env: {item!r} is not NAME=value")
        env.append(EnvVar(name.strip(), value, f"in models.{model_id}.env in {path}"))
    keys = tuple(str(k) for k in data.get("apiKeys") or [])
    aliases = [str(a.get("id") if isinstance(a, dict) else a) for a in model.get("aliases") or []]
    unused = [k for k in _SWAP_ONLY if k in model]
    notes = (f"llama-swap's {', '.join(unused)} (models.{model_id}): llama-swap's own, with no "
             "Spillway equivalent",) if unused else ()
    return Source(argv=tuple(argv), where=f"in models.{model_id}.cmd in {path}", env=tuple(env),
                  workdir=cwd, home=home, clients_connect_here=False, listen=DEFAULT_LISTEN,
                  listen_origin="from llama-swap's default --listen :8080 (every address; it is "
                                "not in its config: give spillway init --listen ADDR if you run "
                                "llama-swap with another)",
                  api_keys=keys, keys_origin=f"from apiKeys in {path}",
                  name=",".join([model_id, *aliases]),
                  notes=notes)


def read_llama_swap(path: Path, wanted: str | None, environ: Mapping[str, str], cwd: str,
                    home: str) -> Source:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InitError(f"{path}: cannot read: {e}") from e
    except yaml.YAMLError as e:
        raise InitError(f"{path}: not valid YAML: {e}") from e
    return from_config(data, str(path), wanted, environ, cwd, home)
