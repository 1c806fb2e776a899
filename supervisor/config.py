"""TOML configuration -> frozen dataclasses.

Every problem is collected (not just the first) and names its key path, e.g. `gpu.args[3]`, so
that `spillway check-config` and a refused reload can list them all. Unknown keys are errors
that suggest the nearest known key: a typo must never be silently ignored in a file people edit
by hand.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import llama_args

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the package requires 3.11, tomli is the documented fallback
    import tomli as tomllib

CHILD_NAMES = ("gpu", "cpu")
CPU_MODES = ("hot", "on-demand")


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """A configuration that cannot be used; `problems` lists every reason."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(str(p) for p in problems))


@dataclass(frozen=True)
class ListenAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True)
class ServerConfig:
    listen: tuple[ListenAddress, ...]
    api_key: str | None
    max_body_bytes: int
    read_timeout_s: float
    connect_timeout_s: float
    drain_timeout_s: float
    idle_timeout_s: float
    body_timeout_s: float
    log_level: str
    access_log: bool


@dataclass(frozen=True)
class ModelConfig:
    llama_server: str
    path: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class ChildConfig:
    """Everything one child needs; `args` are already merged with `model.args`."""

    name: str
    llama_server: str
    model_path: str
    args: tuple[str, ...]
    env: Mapping[str, str]
    start_timeout_s: float
    stop_grace_s: float
    max_concurrency: int | None  # None: the child's slot count
    # gpu only
    device: str | None = None
    vram_headroom_mib: int = 0
    # cpu only
    mode: str = "hot"
    idle_stop_s: float = 600.0

    def command(self, port: int, api_key: str) -> list[str]:
        """The full argv; Spillway owns the model, host, port and key."""
        return [
            self.llama_server,
            "-m", self.model_path,
            *self.args,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--api-key", api_key,
        ]


@dataclass(frozen=True)
class RestartConfig:
    backoff_initial_s: float
    backoff_max_s: float
    quick_failure_s: float
    max_quick_failures: int
    hang_timeout_s: float
    fatal_retry_max_s: float


@dataclass(frozen=True)
class GpuMonitorConfig:
    sample_interval_s: float


@dataclass(frozen=True)
class FailoverConfig:
    replay: bool
    max_replay_body_bytes: int
    stream_hold_s: float
    drain_timeout_s: float


@dataclass(frozen=True)
class QueueConfig:
    max_waiting: int
    max_wait_s: float


@dataclass(frozen=True)
class IncidentsConfig:
    path: str  # empty: $STATE_DIRECTORY or ~/.local/state/spillway
    max_bytes: int
    backups: int


@dataclass(frozen=True)
class IdempotencyConfig:
    ttl_s: float
    max_keys: int
    max_response_bytes: int
    max_total_bytes: int


@dataclass(frozen=True)
class Config:
    path: str | None
    server: ServerConfig
    model: ModelConfig
    gpu: ChildConfig
    cpu: ChildConfig
    restart: RestartConfig
    monitor: GpuMonitorConfig
    failover: FailoverConfig
    queue: QueueConfig
    incidents: IncidentsConfig
    idempotency: IdempotencyConfig

    def child(self, name: str) -> ChildConfig:
        return self.gpu if name == "gpu" else self.cpu


# --- schema -----------------------------------------------------------------------------------

Check = Callable[[Any], str | None]


@dataclass(frozen=True)
class Key:
    # "str", "int", "number", "bool", "str_list", "str_table", "str_or_list", "int_or_str"
    kind: str
    default: Any = None
    required: bool = False
    check: Check | None = None


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be greater than 0"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be 0 or more"


def _at_least_one(v: Any) -> str | None:
    return None if v >= 1 else "must be at least 1"


def _one_of(*choices: str) -> Check:
    def check(v: Any) -> str | None:
        return None if v in choices else f"must be one of {', '.join(map(repr, choices))}"

    return check


_CHILD_COMMON: dict[str, Key] = {
    "args": Key("str_list", []),
    "llama_server": Key("str"),
    "env": Key("str_table", {}),
    "start_timeout_s": Key("number", 300.0, check=_positive),
    "stop_grace_s": Key("number", 10.0, check=_non_negative),
    "max_concurrency": Key("int", check=_positive),
}

SCHEMA: dict[str, dict[str, Key]] = {
    "server": {
        "listen": Key("str_or_list", "127.0.0.1:8080"),
        "api_key": Key("str"),
        "api_key_env": Key("str"),
        "max_body_mib": Key("number", 64, check=_positive),
        "read_timeout_s": Key("number", 600.0, check=_positive),
        "connect_timeout_s": Key("number", 5.0, check=_positive),
        "drain_timeout_s": Key("number", 30.0, check=_non_negative),
        "idle_timeout_s": Key("number", 15.0, check=_positive),
        "body_timeout_s": Key("number", 30.0, check=_positive),
        "log_level": Key("str", "info", check=_one_of("debug", "info", "warning", "error")),
        "access_log": Key("bool", True),
    },
    "model": {
        "llama_server": Key("str", "llama-server"),
        "path": Key("str", required=True),
        "args": Key("str_list", []),
    },
    "gpu": {
        **_CHILD_COMMON,
        "args": Key("str_list", ["-ngl", "99"]),
        "device": Key("int_or_str", 0),
        "vram_headroom_mib": Key("int", 1024, check=_non_negative),
    },
    "cpu": {
        **_CHILD_COMMON,
        "args": Key("str_list", ["--device", "none", "-ngl", "0"]),
        "mode": Key("str", "hot", check=_one_of(*CPU_MODES)),
        "idle_stop_s": Key("number", 600.0, check=_positive),
    },
    "restart": {
        "backoff_initial_s": Key("number", 0.5, check=_positive),
        "backoff_max_s": Key("number", 30.0, check=_positive),
        "quick_failure_s": Key("number", 10.0, check=_non_negative),
        "max_quick_failures": Key("int", 5, check=_positive),
        "hang_timeout_s": Key("number", 120.0, check=_non_negative),
        "fatal_retry_max_s": Key("number", 300.0, check=_at_least_one),
    },
    "failover": {
        "replay": Key("bool", True),
        "max_replay_body_mib": Key("number", 16, check=_non_negative),
        "stream_hold_s": Key("number", 30.0, check=_non_negative),
        "drain_timeout_s": Key("number", 60.0, check=_non_negative),
    },
    "queue": {
        "max_waiting": Key("int", 32, check=_non_negative),
        "max_wait_s": Key("number", 60.0, check=_non_negative),
    },
    "incidents": {
        "path": Key("str", ""),
        "max_mib": Key("number", 16, check=_positive),
        "backups": Key("int", 3, check=_non_negative),
    },
    "idempotency": {
        "ttl_s": Key("number", 86400.0, check=_positive),
        "max_keys": Key("int", 10000, check=_positive),
        "max_response_mib": Key("number", 8, check=_non_negative),
        "max_total_mib": Key("number", 256, check=_non_negative),
    },
    "monitor": {
        "sample_interval_s": Key("number", 1.0, check=_positive),
    },
}


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"


def _check_type(kind: str, value: Any) -> str | None:
    """None when `value` has the kind, else what was expected."""
    if kind == "str":
        return None if isinstance(value, str) else "expected a string"
    if kind == "bool":
        return None if isinstance(value, bool) else "expected true or false"
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else "expected a whole number"
    if kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "expected a number"
    if kind == "int_or_str":
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
        return None if ok else "expected a device index or a PCI bus id / UUID string"
    if kind == "str_or_list":
        ok = isinstance(value, (str, list))
        return None if ok else "expected an address string or a list of them"
    if kind == "str_list":
        return None if isinstance(value, list) else "expected a list of strings"
    if kind == "str_table":
        return None if isinstance(value, dict) else "expected a table of strings"
    raise AssertionError(kind)


def _read_sections(raw: Mapping[str, Any], problems: list[Problem]) -> dict[str, dict[str, Any]]:
    """Validate names and types against SCHEMA; returns values with defaults filled in."""
    values: dict[str, dict[str, Any]] = {}
    for section in raw:
        if section not in SCHEMA:
            problems.append(Problem(section, "unknown section" + _suggest(section, list(SCHEMA))))
    for section, keys in SCHEMA.items():
        given = raw.get(section, {})
        if not isinstance(given, dict):
            problems.append(Problem(section, "expected a table ([" + section + "])"))
            given = {}
        out: dict[str, Any] = {}
        for key in given:
            if key not in keys:
                problems.append(
                    Problem(f"{section}.{key}", "unknown key" + _suggest(key, list(keys)))
                )
        for key, spec in keys.items():
            path = f"{section}.{key}"
            if key not in given:
                if spec.required:
                    problems.append(Problem(path, "is required"))
                out[key] = spec.default
                continue
            value = given[key]
            wrong = _check_type(spec.kind, value)
            if wrong is None:
                before = len(problems)
                wrong = _check_items(spec.kind, path, value, problems)
                if len(problems) > before:  # bad elements, each reported under its own path
                    out[key] = spec.default
                    continue
            if wrong is None and spec.check is not None:
                wrong = spec.check(value)
            if wrong is not None:
                problems.append(Problem(path, f"{wrong} (got {value!r})"))
                out[key] = spec.default
            else:
                out[key] = value
        values[section] = out
    return values


def _check_items(kind: str, path: str, value: Any, problems: list[Problem]) -> str | None:
    """Element checks for lists and tables; reports each bad element by its own path."""
    if kind == "str_list":
        for i, item in enumerate(value):
            if not isinstance(item, str):
                problems.append(Problem(f"{path}[{i}]", f"expected a string (got {item!r})"))
    elif kind == "str_table":
        for k, item in value.items():
            if not isinstance(item, str):
                problems.append(Problem(f"{path}.{k}", f"expected a string (got {item!r})"))
    elif kind == "str_or_list" and isinstance(value, list):
        if not value:
            return "expected at least one address"
        for i, item in enumerate(value):
            if not isinstance(item, str):
                problems.append(Problem(f"{path}[{i}]", f"expected a string (got {item!r})"))
    return None


def parse_listen(text: str) -> ListenAddress:
    """`host:port`, `[v6]:port` or `:port` (all loopback? no: `:port` means 127.0.0.1)."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError("expected [address]:port")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError("expected host:port")
        if ":" in host:
            raise ValueError("write an IPv6 address as [address]:port")
    host = host or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"port must be 1-65535 (got {port!r})")
    return ListenAddress(host, int(port))


def _check_child_args(
    section: str, args: list[str], problems: list[Problem]
) -> None:
    for group in llama_args.group_args(args):
        path = f"{section}.args[{group.index}]"
        token = group.tokens[0]
        if not llama_args.is_flag(token):
            problems.append(Problem(path, f"{token!r} is not a flag; llama-server takes no "
                                          "positional arguments"))
            continue
        flag = llama_args.canonical(token)
        if flag in llama_args.RESERVED_FLAGS:
            instead = llama_args.RESERVED_FLAGS[flag]
            if instead is None:
                problems.append(Problem(path, f"{token!r} is chosen by Spillway (children listen "
                                              "on loopback ports it picks); remove it"))
            else:
                problems.append(Problem(path, f"{token!r} is set by Spillway; use {instead} "
                                              "instead"))


def _resolve_executable(name: str) -> str | None:
    if os.sep in name:
        p = Path(name).expanduser()
        return str(p) if p.is_file() and os.access(p, os.X_OK) else None
    return shutil.which(name)


def _build_child(
    name: str, values: dict[str, Any], model: ModelConfig, base_dir: Path
) -> ChildConfig:
    v = values[name]
    own_args: list[str] = v["args"]
    merged = llama_args.merge_args(list(model.args), own_args)
    if name == "gpu" and llama_args.find_flag(merged, "-fit") is None:
        # With fit on, llama-server quietly shrinks the load to the free VRAM, turning a clean
        # load-time OOM into a slow partial offload.
        merged += ["-fit", "off"]
    server = v["llama_server"] or model.llama_server
    device = v.get("device")
    return ChildConfig(
        name=name,
        llama_server=_expand(server, base_dir, must_have_sep=True),
        model_path=model.path,
        args=tuple(merged),
        env=dict(v["env"]),
        start_timeout_s=float(v["start_timeout_s"]),
        stop_grace_s=float(v["stop_grace_s"]),
        max_concurrency=v["max_concurrency"],
        device=None if device is None else str(device),
        vram_headroom_mib=int(v.get("vram_headroom_mib", 0)),
        mode=v.get("mode", "hot"),
        idle_stop_s=float(v.get("idle_stop_s", 600.0)),
    )


def _expand(value: str, base_dir: Path, must_have_sep: bool = False) -> str:
    """Expand `~` and make relative paths relative to the config file's folder.

    With must_have_sep, a bare name (no slash) stays a name to look up on PATH.
    """
    if must_have_sep and os.sep not in value and not value.startswith("~"):
        return value
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base_dir / p))


def build(raw: Mapping[str, Any], source: str = "<config>", base_dir: Path | None = None,
          environ: Mapping[str, str] | None = None, check_paths: bool = True) -> Config:
    """Validate a parsed TOML document; raises ConfigError listing every problem."""
    environ = os.environ if environ is None else environ
    base_dir = base_dir or Path.cwd()
    problems: list[Problem] = []
    values = _read_sections(raw, problems)

    s = values["server"]
    listen_values = s["listen"] if isinstance(s["listen"], list) else [s["listen"]]
    listen: list[ListenAddress] = []
    for i, item in enumerate(listen_values):
        path = "server.listen" if isinstance(s["listen"], str) else f"server.listen[{i}]"
        if not isinstance(item, str):
            continue
        try:
            listen.append(parse_listen(item))
        except ValueError as e:
            problems.append(Problem(path, f"{e} (got {item!r})"))

    api_key: str | None = s["api_key"] or None
    if s["api_key"] is not None and s["api_key_env"]:
        problems.append(Problem("server.api_key_env", "set either server.api_key or "
                                                      "server.api_key_env, not both"))
    elif s["api_key_env"]:
        api_key = environ.get(s["api_key_env"]) or None
        if api_key is None:
            problems.append(Problem("server.api_key_env",
                                    f"environment variable {s['api_key_env']!r} is not set or "
                                    "empty"))
    elif s["api_key"] is not None and not s["api_key"]:
        problems.append(Problem("server.api_key", "is empty; remove it to run without a key"))
    if api_key is None:
        for addr in listen:
            if not addr.is_loopback:
                problems.append(Problem("server.listen", f"{addr} is not a loopback address; "
                                                         "set server.api_key (or api_key_env) "
                                                         "before listening beyond this machine"))
                break

    m = values["model"]
    model_path = _expand(m["path"], base_dir) if m["path"] else ""
    model = ModelConfig(
        llama_server=_expand(m["llama_server"], base_dir, must_have_sep=True),
        path=model_path,
        args=tuple(m["args"]),
    )
    for section in ("model", "gpu", "cpu"):
        args = values[section]["args"]
        if all(isinstance(a, str) for a in args):
            _check_child_args(section, args, problems)

    r = values["restart"]
    if r["backoff_max_s"] < r["backoff_initial_s"]:
        problems.append(Problem("restart.backoff_max_s", "must be at least "
                                                         "restart.backoff_initial_s"))

    gpu = _build_child("gpu", values, model, base_dir)
    cpu = _build_child("cpu", values, model, base_dir)

    if check_paths:
        if model_path and not Path(model_path).is_file():
            problems.append(Problem("model.path", f"no such file: {model_path}"))
        for child, section_value in ((gpu, values["gpu"]), (cpu, values["cpu"])):
            key = (f"{child.name}.llama_server" if section_value["llama_server"]
                   else "model.llama_server")
            if _resolve_executable(child.llama_server) is None:
                problems.append(Problem(key, f"{child.llama_server!r} is not an executable "
                                             "file or a command on PATH"))
        problems = _dedupe(problems)

    if problems:
        raise ConfigError(source, problems)
    f = values["failover"]
    return Config(
        path=None,
        server=ServerConfig(
            listen=tuple(listen),
            api_key=api_key,
            max_body_bytes=_mib(s["max_body_mib"]),
            read_timeout_s=float(s["read_timeout_s"]),
            connect_timeout_s=float(s["connect_timeout_s"]),
            drain_timeout_s=float(s["drain_timeout_s"]),
            idle_timeout_s=float(s["idle_timeout_s"]),
            body_timeout_s=float(s["body_timeout_s"]),
            log_level=s["log_level"],
            access_log=bool(s["access_log"]),
        ),
        model=model,
        gpu=gpu,
        cpu=cpu,
        restart=RestartConfig(
            backoff_initial_s=float(r["backoff_initial_s"]),
            backoff_max_s=float(r["backoff_max_s"]),
            quick_failure_s=float(r["quick_failure_s"]),
            max_quick_failures=int(r["max_quick_failures"]),
            hang_timeout_s=float(r["hang_timeout_s"]),
            fatal_retry_max_s=float(r["fatal_retry_max_s"]),
        ),
        monitor=GpuMonitorConfig(sample_interval_s=float(values["monitor"]["sample_interval_s"])),
        failover=FailoverConfig(
            replay=bool(f["replay"]),
            max_replay_body_bytes=_mib(f["max_replay_body_mib"]),
            stream_hold_s=float(f["stream_hold_s"]),
            drain_timeout_s=float(f["drain_timeout_s"]),
        ),
        queue=QueueConfig(
            max_waiting=int(values["queue"]["max_waiting"]),
            max_wait_s=float(values["queue"]["max_wait_s"]),
        ),
        incidents=IncidentsConfig(
            path=_expand(values["incidents"]["path"], base_dir) if values["incidents"]["path"]
            else "",
            max_bytes=_mib(values["incidents"]["max_mib"]),
            backups=int(values["incidents"]["backups"]),
        ),
        idempotency=IdempotencyConfig(
            ttl_s=float(values["idempotency"]["ttl_s"]),
            max_keys=int(values["idempotency"]["max_keys"]),
            max_response_bytes=_mib(values["idempotency"]["max_response_mib"]),
            max_total_bytes=_mib(values["idempotency"]["max_total_mib"]),
        ),
    )


def _mib(value: float) -> int:
    return int(float(value) * 1024 * 1024)


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[Problem] = set()
    out = []
    for p in problems:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def load(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None,
         check_paths: bool = True) -> Config:
    """Read and validate a TOML file; raises ConfigError (never OSError or TOMLDecodeError)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(p), [Problem("", f"cannot read: {e}")]) from e
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(p), [Problem("", f"not valid TOML: {e}")]) from e
    config = build(raw, source=str(p), base_dir=p.resolve().parent, environ=environ,
                   check_paths=check_paths)
    return dataclasses.replace(config, path=str(p.resolve()))


def known_keys() -> list[str]:
    """Every `section.key`, for documentation checks."""
    return [f"{s}.{k}" for s, keys in SCHEMA.items() for k in keys]


__all__ = [
    "Config", "ConfigError", "Problem", "ChildConfig", "ServerConfig", "ModelConfig",
    "RestartConfig", "GpuMonitorConfig", "FailoverConfig", "IncidentsConfig", "QueueConfig",
    "IdempotencyConfig", "ListenAddress", "load", "build",
    "known_keys", "parse_listen", "SCHEMA", "CHILD_NAMES", "diff", "command_changed",
]


def diff(old: Config, new: Config) -> list[str]:
    """`section.field` for every value that differs (the path excepted)."""
    changed = []
    for f in dataclasses.fields(Config):
        if f.name == "path":
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        for g in dataclasses.fields(a):
            if getattr(a, g.name) != getattr(b, g.name):
                changed.append(f"{f.name}.{g.name}")
    return changed


def command_changed(old: ChildConfig, new: ChildConfig) -> bool:
    """Whether the child must be restarted to take the new config: its command line or
    environment (or card) differ."""
    return (old.llama_server, old.model_path, old.args, dict(old.env), old.device) != (
        new.llama_server, new.model_path, new.args, dict(new.env), new.device)
