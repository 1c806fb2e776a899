"""TOML configuration -> frozen dataclasses.

Every problem is collected (not just the first) and names its key path, e.g. `gpu.args[3]`, so
that `spillway check-config` and a refused reload can list them all. Unknown keys are errors
that suggest the nearest known key: a typo must never be silently ignored in a file people edit
by hand.

Each TOML key is declared once, on the dataclass field it fills: `field(metadata=key(...))`
gives its kind, default, check, TOML name (when it differs, e.g. `max_body_mib` filling
`max_body_bytes`) and conversion. The sections are `Config`'s fields in order; `SCHEMA` (what
is read and checked) and the construction of each section (`_make`) are derived from those
declarations. A field marked `derived(...)` is worked out by `build` itself from its keys and
others (the listen addresses, the API key, a child's merged args and binary).
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import shutil
import sys
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from . import flag_values, llama_args, models_dir
from ..policy import pings, vertex
from ..policy.browser import normal_origin, valid_host_entry
from ..policy.vertex import Contract as VertexContract
from ..policy.lifecycle import DRAIN_TIMEOUT_S
from ..policy.release import DEFAULT_WAIT_S as DEFAULT_RELEASE_WAIT_S

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the package requires 3.11, tomli is the documented fallback
    import tomli as tomllib

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# The children, by their sections' names, in the order of preference: the first serves; a
# request that fails on one is taken over by the next that serves the same model
# (policy/replay.takeover). The first is given the GPU (its card's figures, the VRAM headroom
# rule, -fit off); the last runs without one. Between them, when [small] names a model, the
# small child: a smaller model on the GPU's cards, for the requests that accept another model
# (X-Spillway-Fallback: smaller). Said here once: elsewhere the order and what each child is
# come from the config (Config.order).
GPU_CHILD = "gpu"
SMALL_CHILD = "small"
CPU_CHILD = "cpu"
CHILDREN = (GPU_CHILD, SMALL_CHILD, CPU_CHILD)  # every child section, in the order of preference
ROUTERS = (GPU_CHILD, CPU_CHILD)  # router mode's two children (the small child is not one)
LABELS = {GPU_CHILD: "GPU child", SMALL_CHILD: "small child", CPU_CHILD: "CPU child"}

# Changes a reload cannot apply: noted in status, they take effect when spillway restarts.
RESTART_KEYS = ("server.listen", "gpu.device", "balancer.agent_listen")
CPU_MODES = ("hot", "on-demand")
# resident: always loaded beside the GPU child (its VRAM is taken from what the GPU child has);
# on-demand: started into the VRAM a death of the GPU child freed, drained before it starts again
SMALL_MODES = ("resident", "on-demand")
# who the small child serves: requests that say X-Spillway-Fallback: smaller, or every request
# that may change model (for a server whose users accepted it)
SMALL_REQUESTS = ("opt-in", "all")
# Flags of model.args that name the large model's own files or name: the small child, serving
# another model, does not take them (llama-server answers with its alias as the "model").
LARGE_MODEL_ONLY = ("-a", "--mmproj", "--lora", "--lora-scaled", "-md", "--chat-template",
                    "--chat-template-file")


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


# --- keys -------------------------------------------------------------------------------------

Check = Callable[[Any], str | None]
# (a valid TOML value, the config file's folder) -> the field's value
Convert = Callable[[Any, Path], Any]

KEYS = "spillway.keys"  # field metadata: the TOML keys the field is read from
DERIVED = "spillway.derived"  # field metadata: `build` works the value out itself


@dataclass(frozen=True)
class Key:
    """One TOML key: what `_read_sections` accepts, and how `_make` turns it into its field."""

    # "str", "int", "number", "bool", "str_list", "str_table", "str_or_list", "int_or_str",
    # "number_or_auto" ("auto" becomes None)
    kind: str
    default: Any = None
    required: bool = False
    check: Check | None = None
    name: str | None = None  # the TOML name, when it is not the field's name
    convert: Convert | None = None  # by default by kind: float, int, bool, tuple, dict, str
    only: str | None = None  # a child field: the one child section ("gpu", ...) with this key


def key(kind: str, default: Any = None, *, required: bool = False, check: Check | None = None,
        name: str | None = None, convert: Convert | None = None,
        only: str | None = None) -> dict[str, Any]:
    """Field metadata: the field is its one TOML key's value, converted."""
    return {KEYS: (Key(kind, default, required, check, name, convert, only),)}


def derived(*keys: Key) -> dict[str, Any]:
    """Field metadata: `build` works the value out (from these keys, other sections or the
    environment); the keys are still read and checked like any other."""
    return {KEYS: keys, DERIVED: True}


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be greater than 0"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be 0 or more"


def _share(v: Any) -> str | None:
    return None if 0 <= v <= 1 else "must be between 0 and 1"


def _at_least_one(v: Any) -> str | None:
    return None if v >= 1 else "must be at least 1"


def _one_of(*choices: str) -> Check:
    def check(v: Any) -> str | None:
        return None if v in choices else f"must be one of {', '.join(map(repr, choices))}"

    return check


def _host_names(v: Any) -> str | None:
    """server.allowed_hosts: names, addresses, ".suffix" entries, or "*"."""
    bad = [n for n in v if not valid_host_entry(n)]
    return None if not bad else (
        f"{bad[0]!r} is not a host name or address (a name, an address, \".example.lan\" for "
        "every name under it, or \"*\" for any; no port, no scheme)")


def _origins(v: Any) -> str | None:
    """server.allowed_origins: "scheme://host[:port]" each."""
    bad = [o for o in v if normal_origin(o) is None]
    return None if not bad else (
        f"{bad[0]!r} is not an origin: write it as the browser sends it, "
        "\"http://host:port\" (no path; \"*\" is not allowed)")


def _mib(value: float) -> int:
    return int(float(value) * 1024 * 1024)


def _from_mib(value: Any, base_dir: Path) -> int:
    return _mib(value)


def _expand(value: str, base_dir: Path, must_have_sep: bool = False) -> str:
    """Expand `~` and make relative paths relative to the config file's folder.

    With must_have_sep, a bare name (no slash) stays a name to look up on PATH.
    """
    if must_have_sep and os.sep not in value and not value.startswith("~"):
        return value
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base_dir / p))


def _file(value: Any, base_dir: Path) -> str:
    """A path relative to the config file's folder; empty stays empty."""
    return _expand(value, base_dir) if value else ""


def _command(value: Any, base_dir: Path) -> str:
    """A path relative to the config file's folder, or a bare name to look up on PATH."""
    return _expand(value, base_dir, must_have_sep=True)


def _arg_paths(args: list[str] | tuple[str, ...], base_dir: Path) -> list[str]:
    """The args with the values of --models-dir and --models-preset relative to the config
    file's folder made absolute: the children run in another working folder."""
    return llama_args.map_values(args, llama_args.ROUTER_SOURCES,
                                 lambda value: _expand(value, base_dir))


def _args(value: Any, base_dir: Path) -> tuple[str, ...]:
    return tuple(_arg_paths(value, base_dir))


_BY_KIND: dict[str, Callable[[Any], Any]] = {
    "number": float, "int": int, "bool": bool, "str_list": tuple, "str_table": dict,
    "int_or_str": str, "number_or_auto": lambda v: None if v == "auto" else float(v),
}


def _convert(k: Key, value: Any, base_dir: Path) -> Any:
    if k.convert is not None:
        return k.convert(value, base_dir)
    if value is None:  # an optional key left out
        return None
    return _BY_KIND.get(k.kind, lambda v: v)(value)


# --- the sections -----------------------------------------------------------------------------


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
    listen: tuple[ListenAddress, ...] = field(
        metadata=derived(Key("str_or_list", "127.0.0.1:8080")))
    # server.api_key, or the variable server.api_key_env names
    api_key: str | None = field(metadata=derived(Key("str"), Key("str", name="api_key_env")))
    max_body_bytes: int = field(metadata=key("number", 64, name="max_body_mib", check=_positive,
                                             convert=_from_mib))
    read_timeout_s: float = field(metadata=key("number", 600.0, check=_positive))
    connect_timeout_s: float = field(metadata=key("number", 5.0, check=_positive))
    drain_timeout_s: float = field(metadata=key("number", 30.0, check=_non_negative))
    idle_timeout_s: float = field(metadata=key("number", 15.0, check=_positive))
    body_timeout_s: float = field(metadata=key("number", 30.0, check=_positive))
    # Names Spillway's own routes answer to beside the listen addresses, localhost and loopback
    # (the DNS-rebinding guard): "spillway.lan", ".lan" (every name under it), "*" (any).
    allowed_hosts: tuple[str, ...] = field(metadata=key("str_list", [], check=_host_names))
    # Web pages (origins) that may use the routes that change something, beside Spillway's own.
    allowed_origins: tuple[str, ...] = field(metadata=key("str_list", [], check=_origins))
    log_level: str = field(metadata=key("str", "info",
                                        check=_one_of("debug", "info", "warning", "error")))
    access_log: bool = field(metadata=key("bool", True))
    # Vertex AI's contract (AIP_MODE=PREDICTION in the environment; policy/vertex.py): its port
    # is every listen address's, and the app answers its predict and health routes.
    vertex: VertexContract | None = field(default=None, metadata=derived())

    def unguarded(self, addresses: Iterable[ListenAddress]) -> ListenAddress | None:
        """The first of `addresses` beyond loopback that this server's key does not guard."""
        return unguarded(self.api_key, self.vertex, addresses)


@dataclass(frozen=True)
class ModelConfig:
    llama_server: str = field(metadata=key("str", "llama-server", convert=_command))
    # The one model both children serve; empty: router mode (see Config.router).
    path: str = field(metadata=key("str", "", convert=_file))
    # --models-dir and --models-preset values are made absolute (relative to the config file)
    args: tuple[str, ...] = field(metadata=key("str_list", [], convert=_args))


@dataclass(frozen=True)
class ChildConfig:
    """Everything one child needs; `args` are already merged with `model.args`.

    One class for the [gpu], [small] and [cpu] sections: a key with `only` is in that section
    alone, and the other children get the field's default.
    """

    name: str = field(metadata=derived())  # its section's: "gpu", "small" or "cpu"
    # model.args, then this child's own (a flag here replaces the same flag there)
    args: tuple[str, ...] = field(metadata=derived(
        Key("str_list", ["-ngl", "99"], only=GPU_CHILD),
        Key("str_list", ["-ngl", "99"], only=SMALL_CHILD),
        Key("str_list", ["--device", "none", "-ngl", "0"], only=CPU_CHILD)))
    llama_server: str = field(metadata=derived(Key("str")))  # else model.llama_server
    # model.path (empty in router mode); the small child's is small.path (empty: no small child)
    model_path: str = field(metadata=derived(Key("str", "", name="path", only=SMALL_CHILD)))
    env: Mapping[str, str] = field(metadata=key("str_table", {}))
    start_timeout_s: float = field(metadata=key("number", 300.0, check=_positive))
    stop_grace_s: float = field(metadata=key("number", 10.0, check=_non_negative))
    max_concurrency: int | None = field(metadata=key("int", check=_positive))  # None: slots
    # gpu only. The cards it is given: an index, address or UUID, a list of them, or "all".
    # Unset (None): every card of its build's vendors it can see, as llama-server alone uses
    # them, so that its own -dev/-ts/-mg/-sm split them as on the command line.
    device: str | None = field(default=None, metadata=key("int_or_str", None, only=GPU_CHILD))
    vram_headroom_mib: int = field(default=0, metadata=key("int", 1024, check=_non_negative,
                                                           only=GPU_CHILD))
    # With fewer of its layers on the GPU than asked (none, or some), it failed its start
    require_offload: bool = field(default=False, metadata=key("bool", False, only=GPU_CHILD))
    # The warm GPU child after its restart (serving/mirror.py, the rewarm lane): the
    # conversations it served before its death and those the CPU child served meanwhile are
    # prefilled into it in its idle time, newest first, where its measured prefill pays.
    rewarm: bool = field(default=True, metadata=key("bool", True, only=GPU_CHILD))
    # The GPU lent back to the card when idle (service/fleet.py): after this many seconds with
    # no request for the model, the GPU child is stopped and its VRAM freed while the CPU child
    # answers; the next request wakes it. 0: never (the default).
    idle_release_s: float = field(default=0.0, metadata=key("number", 0.0, check=_non_negative,
                                                            only=GPU_CHILD))
    # The GPU child gives way to another program on its cards (service/lending.py): when that
    # program grows while the card's free memory is under the headroom, the GPU child is
    # stopped (its answers in flight go on on the CPU child), and it starts again once the card
    # has room for it and the others' memory has held still for yield_quiet_s.
    yield_to_other_processes: bool = field(default=False, metadata=key("bool", False,
                                                                       only=GPU_CHILD))
    yield_quiet_s: float = field(default=10.0, metadata=key("number", 10.0, check=_non_negative,
                                                            only=GPU_CHILD))
    # cpu and small
    mode: str = field(default="hot", metadata={KEYS: (
        Key("str", "hot", check=_one_of(*CPU_MODES), only=CPU_CHILD),
        Key("str", "resident", check=_one_of(*SMALL_MODES), only=SMALL_CHILD))})
    # cpu only
    idle_stop_s: float = field(default=600.0, metadata=key("number", 600.0, check=_positive,
                                                           only=CPU_CHILD))
    # The warm CPU child (serving/mirror.py): the conversations the GPU child served are sent
    # to it in its idle time, so a failed-over turn finds its prefix cached. Off for an
    # on-demand CPU child (it is stopped when idle). mirror_share: at most this share of a
    # sliding minute of its time; a conversation over mirror_max_prompt_tokens is not sent;
    # the conversations waiting hold at most mirror_max_queued_mib of bodies (the oldest go).
    mirror: bool = field(default=True, metadata=key("bool", True, only=CPU_CHILD))
    mirror_share: float = field(default=0.5, metadata=key("number", 0.5, check=_share,
                                                          only=CPU_CHILD))
    mirror_max_prompt_tokens: int = field(default=32768, metadata=key(
        "int", 32768, check=_positive, only=CPU_CHILD))
    mirror_max_queued_bytes: int = field(default=8 * 1024 * 1024, metadata=key(
        "number", 8, name="mirror_max_queued_mib", check=_positive, convert=_from_mib,
        only=CPU_CHILD))
    # small only
    requests: str = field(default="opt-in", metadata=key(
        "str", "opt-in", check=_one_of(*SMALL_REQUESTS), only=SMALL_CHILD))
    # Router mode: each model's smaller model, both served by the GPU router (no third process)
    models: Mapping[str, str] = field(default_factory=dict, metadata=key(
        "str_table", {}, only=SMALL_CHILD))
    # The smaller model's own projector (its --mmproj): model.args' is the large model's, kept
    # from it. With one, the small child takes the images or audio it takes; without, a
    # request with media that accepts a smaller model goes where a plain one goes.
    mmproj: str = field(default="", metadata=key("str", "", only=SMALL_CHILD))

    @property
    def on_gpu(self) -> bool:
        """Given the GPU: its card is watched, the VRAM headroom rule applies, its deaths are
        judged with the card's figures."""
        return self.name == GPU_CHILD

    @property
    def smaller(self) -> bool:
        """Serves a smaller model than the others: only requests that accept another model
        go to it, and a stream is never continued on it (or from it on another)."""
        return self.name == SMALL_CHILD

    @property
    def uses_gpu(self) -> bool:
        """Runs on the GPU's cards (the GPU child's, and the small child beside it): it sees
        the cards the GPU child sees, and its memory there is counted as the children's."""
        return self.on_gpu or self.smaller

    @property
    def label(self) -> str:
        """What people are told it is: "GPU child", "CPU child"."""
        return LABELS.get(self.name, f"{self.name} child")

    @property
    def on_demand(self) -> bool:
        """Started when needed, not at boot (cpu.mode or small.mode = "on-demand"): the CPU
        child for a request, stopped when idle; the small child when the GPU child dies,
        drained before the GPU child starts again."""
        return self.mode == "on-demand"

    def command(self, port: int, api_key: str) -> list[str]:
        """The full argv; Spillway owns the model, host, port and key. A router gets no model:
        its models come from the --models-dir / --models-preset in its args (or the cache)."""
        return [
            self.llama_server,
            *(("-m", self.model_path) if self.model_path else ()),
            *self.args,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--api-key", api_key,
        ]

    @property
    def prefills_assistant(self) -> bool:
        """Whether it continues a final assistant message of its own accord (llama-server's
        default); /v1/messages streams are continued only on a child that does."""
        off = ("0", "false", "off", "no", "disabled")
        return "--no-prefill-assistant" not in self.args and \
            self.env.get("LLAMA_ARG_PREFILL_ASSISTANT", "").strip().lower() not in off

    @property
    def sse_ping_interval(self) -> int | None:
        """Its `--sse-ping-interval` (else `LLAMA_ARG_SSE_PING_INTERVAL`) as the operator set
        it; None: not set (llama-server's built-in 30 s, which Spillway does not take as an
        ask: policy/pings.py)."""
        given = llama_args.flag_value(self.args, "--sse-ping-interval")
        return pings.flag_value(given if given is not None else
                                self.env.get("LLAMA_ARG_SSE_PING_INTERVAL"))

    @property
    def router(self) -> bool:
        """A llama-server router over many models (no model.path), not a server of one."""
        return not self.model_path

    def _router_value(self, flag: str) -> str | None:
        return (llama_args.flag_value(self.args, flag) or None) if self.router else None

    @property
    def models_dir(self) -> str | None:
        """The router's --models-dir (absolute), or None."""
        return self._router_value(llama_args.MODELS_DIR)

    @property
    def models_preset(self) -> str | None:
        """The router's --models-preset INI file (absolute), or None."""
        return self._router_value(llama_args.MODELS_PRESET)

    @property
    def models_max(self) -> int:
        """How many models the router keeps loaded at once (--models-max; 0: no limit)."""
        value = self._router_value(llama_args.MODELS_MAX)
        return int(value) if value is not None else llama_args.DEFAULT_MODELS_MAX


@dataclass(frozen=True)
class RestartConfig:
    backoff_initial_s: float = field(metadata=key("number", 0.5, check=_positive))
    backoff_max_s: float = field(metadata=key("number", 30.0, check=_positive))
    quick_failure_s: float = field(metadata=key("number", 10.0, check=_non_negative))
    max_quick_failures: int = field(metadata=key("int", 5, check=_positive))
    hang_timeout_s: float = field(metadata=key("number", 120.0, check=_non_negative))
    fatal_retry_max_s: float = field(metadata=key("number", 300.0, check=_at_least_one))
    # No progress (no byte, no change in /slots) with work in flight for this long: stalled.
    # None ("auto"): from the child's own measured speeds (policy/progress.py); 0: off.
    stall_timeout_s: float | None = field(default=None,
                                          metadata=key("number_or_auto", "auto"))
    # This many 5xx answers in a row, to different requests, from a child that answers /health:
    # sick, drained and restarted (policy/sickness.py); 0: off.
    sick_after_errors: int = field(default=3, metadata=key("int", 3, check=_non_negative))
    # After a GPU child's unplanned end, its next start waits until the card has the dead
    # process's memory back, at most this long (policy/release.py); 0: off.
    release_wait_s: float = field(default=DEFAULT_RELEASE_WAIT_S,
                                  metadata=key("number", DEFAULT_RELEASE_WAIT_S,
                                               check=_non_negative))


@dataclass(frozen=True)
class FailoverConfig:
    replay: bool = field(metadata=key("bool", True))
    max_replay_body_bytes: int = field(metadata=key("number", 16, name="max_replay_body_mib",
                                                    check=_non_negative, convert=_from_mib))
    # The large bodies (with images or audio, or over 1 MiB) held at once across requests for
    # their replays; past it, a request gets a controlled 503 (0: no bound).
    max_held_bytes: int = field(metadata=key("number", 128, name="max_held_mib",
                                             check=_non_negative, convert=_from_mib))
    stream_hold_s: float = field(metadata=key("number", 30.0, check=_non_negative))
    # A stream whose child dies after bytes went out goes on from the other child.
    continue_streams: bool = field(metadata=key("bool", True))
    drain_timeout_s: float = field(metadata=key("number", DRAIN_TIMEOUT_S, check=_non_negative))
    # During an outage, a request the CPU child could take waits for the GPU child on its way
    # back when that is expected to answer clearly sooner (admission's 5w, the earliest expected
    # finish); false: the CPU child takes it now, as before 5w.
    wait_for_gpu: bool = field(default=True, metadata=key("bool", True))
    # A stream the CPU child answers because the GPU child was down moves back to the GPU child
    # once it is READY, when the rest is expected to end clearly sooner there (fail-back).
    fail_back: bool = field(default=True, metadata=key("bool", True))


@dataclass(frozen=True)
class QueueConfig:
    max_waiting: int = field(metadata=key("int", 32, check=_non_negative))
    max_wait_s: float = field(metadata=key("number", 60.0, check=_non_negative))


@dataclass(frozen=True)
class IncidentsConfig:
    # empty: $STATE_DIRECTORY or ~/.local/state/spillway
    path: str = field(metadata=key("str", "", convert=_file))
    max_bytes: int = field(metadata=key("number", 16, name="max_mib", check=_positive,
                                        convert=_from_mib))
    backups: int = field(metadata=key("int", 3, check=_non_negative))


@dataclass(frozen=True)
class IdempotencyConfig:
    ttl_s: float = field(metadata=key("number", 86400.0, check=_positive))
    max_keys: int = field(metadata=key("int", 10000, check=_positive))
    max_response_bytes: int = field(metadata=key("number", 8, name="max_response_mib",
                                                 check=_non_negative, convert=_from_mib))
    max_total_bytes: int = field(metadata=key("number", 256, name="max_total_mib",
                                              check=_non_negative, convert=_from_mib))


@dataclass(frozen=True)
class StreamsConfig:
    # Resumable streams (X-Conversation-Id): each one's replay buffer, as llama-server's.
    buffer_bytes: int = field(metadata=key("number", 4, name="buffer_mib", check=_positive,
                                           convert=_from_mib))
    ttl_s: float = field(metadata=key("number", 300.0, check=_non_negative))
    max_total_bytes: int = field(metadata=key("number", 64, name="max_total_mib",
                                              check=_non_negative, convert=_from_mib))
    # Finished streams kept for readers, at most (the oldest go first), whatever their bytes.
    max_finished: int = field(metadata=key("int", 4096, check=_positive))


@dataclass(frozen=True)
class GpuMonitorConfig:
    sample_interval_s: float = field(metadata=key("number", 1.0, check=_positive))


def _address_or_off(v: Any) -> str | None:
    if v == "":
        return None
    try:
        parse_listen(v)
    except ValueError as e:
        return f"{e}; or \"\" for off"
    return None


@dataclass(frozen=True)
class BalancerConfig:
    # HAProxy's agent-check on a TCP port of its own ("host:port"); "" is off.
    agent_listen: str = field(metadata=key("str", "", check=_address_or_off))


@dataclass(frozen=True)
class Config:
    """One field per TOML section, in the order they are read and listed."""

    path: str | None  # the file's; not a section
    server: ServerConfig
    model: ModelConfig
    gpu: ChildConfig
    small: ChildConfig  # a child only when small.path names a model (see `order`)
    cpu: ChildConfig
    restart: RestartConfig
    failover: FailoverConfig
    queue: QueueConfig
    incidents: IncidentsConfig
    idempotency: IdempotencyConfig
    streams: StreamsConfig
    monitor: GpuMonitorConfig
    balancer: BalancerConfig

    def child(self, name: str) -> ChildConfig:
        child: ChildConfig = getattr(self, name)
        return child

    @property
    def children(self) -> tuple[ChildConfig, ...]:
        """Every child, in the order of preference (`order`)."""
        return tuple(self.child(name) for name in self.order)

    @property
    def order(self) -> tuple[str, ...]:
        """The children's names, in the order of preference: the small child's only when
        small.path names its model."""
        return tuple(n for n in CHILDREN if n != SMALL_CHILD or self.small.model_path)

    @property
    def small_child(self) -> str | None:
        """The child serving a smaller model, when there is one."""
        return next((c.name for c in self.children if c.smaller), None)

    @property
    def smaller_models(self) -> Mapping[str, str]:
        """Router mode: each model's smaller model on the GPU router (small.models)."""
        return self.small.models if self.router else {}

    @property
    def gpu_child(self) -> str:
        """The child given the GPU (the first that is)."""
        return next(c.name for c in self.children if c.on_gpu)

    @property
    def gpu_settings(self) -> ChildConfig:
        """The section of the child given the GPU: the card (gpu.device), the headroom."""
        return self.child(self.gpu_child)

    @property
    def cpu_child(self) -> str:
        """The child without a GPU (the first that is): its RAM is what the RAM guard weighs."""
        return next(c.name for c in self.children if not c.on_gpu)

    def keeping_restart_keys(self, running: Config, changes: list[str]) -> Config:
        """This config with the running one's values of the RESTART_KEYS that changed: until
        Spillway restarts it listens where it did, and the GPU child keeps the card it started
        with (the monitor keeps watching it)."""
        new = self
        if "server.listen" in changes:
            new = dataclasses.replace(new, server=dataclasses.replace(
                new.server, listen=running.server.listen))
        key = f"{running.gpu_child}.device"
        if key in changes:
            section = dataclasses.replace(new.gpu_settings,
                                          device=running.gpu_settings.device)
            changed: dict[str, Any] = {running.gpu_child: section}
            new = dataclasses.replace(new, **changed)
        return new

    @property
    def router(self) -> bool:
        """Router mode: both children are llama-server routers over the same models (from
        --models-dir, --models-preset, or, with neither, llama.cpp's cache), each loading one
        instance per model and routing a request by its "model" field. Chosen by giving no
        model.path (model.path with --models-dir / --models-preset is an error)."""
        return not self.model.path

    @property
    def models_dir(self) -> str | None:
        """The routers' models folder (absolute; both children have the same), or None."""
        return self.gpu.models_dir

    @property
    def models_preset(self) -> str | None:
        """The routers' preset INI file (absolute; both children have the same), or None."""
        return self.gpu.models_preset


# --- the schema, derived ----------------------------------------------------------------------

# section -> its dataclass, in Config's order
_HINTS = typing.get_type_hints(Config)
SECTIONS: dict[str, type[Any]] = {
    f.name: _HINTS[f.name] for f in dataclasses.fields(Config) if f.name != "path"
}


def section_keys(cls: type[Any], section: str) -> Iterator[tuple[str, Key, dataclasses.Field[Any]]]:
    """(TOML name, key, field) for each key of `section`, in field order."""
    for f in dataclasses.fields(cls):
        if KEYS not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} declares no TOML key: give it "
                            "field(metadata=key(...)) or field(metadata=derived(...))")
        for k in f.metadata[KEYS]:
            if k.only in (None, section):
                yield k.name or f.name, k, f


SCHEMA: dict[str, dict[str, Key]] = {
    section: {name: k for name, k, _ in section_keys(cls, section)}
    for section, cls in SECTIONS.items()
}

T = TypeVar("T", bound="DataclassInstance")


def _make(cls: type[T], section: str, values: Mapping[str, Any], base_dir: Path,
          **worked_out: Any) -> T:
    """A section's dataclass from its validated values: each field is its key's value,
    converted; `worked_out` gives the derived ones. A field whose key belongs to the other
    child section keeps its default."""
    fields = dict(worked_out)
    for name, k, f in section_keys(cls, section):
        if f.name not in fields:
            assert not f.metadata.get(DERIVED), f"{section}.{f.name} is worked out by build"
            fields[f.name] = _convert(k, values[name], base_dir)
    return cls(**fields)


# --- reading ----------------------------------------------------------------------------------


def suggest(name: str, known: list[str]) -> str:
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
        return None if ok else ("expected a device index, a PCI address or UUID string, a "
                                "comma-separated list of them, or \"all\"")
    if kind == "number_or_auto":
        ok = value == "auto" or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                 and value >= 0)
        return None if ok else "expected \"auto\", or a number of seconds (0: off)"
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
    for section in raw:
        if section not in SCHEMA:
            problems.append(Problem(section, "unknown section" + suggest(section, list(SCHEMA))))
    return {section: _read_section(section, keys, raw.get(section, {}), problems)
            for section, keys in SCHEMA.items()}


def _read_section(section: str, keys: dict[str, Key], given: Any,
                  problems: list[Problem]) -> dict[str, Any]:
    if not isinstance(given, dict):
        problems.append(Problem(section, "expected a table ([" + section + "])"))
        given = {}
    for name in given:
        if name not in keys:
            problems.append(
                Problem(f"{section}.{name}", "unknown key" + suggest(name, list(keys)))
            )
    out: dict[str, Any] = {}
    for name, spec in keys.items():
        path = f"{section}.{name}"
        if name in given:
            out[name] = _read_value(path, spec, given[name], problems)
        else:
            if spec.required:
                problems.append(Problem(path, "is required"))
            out[name] = spec.default
    return out


def _read_value(path: str, spec: Key, value: Any, problems: list[Problem]) -> Any:
    """The value when it is good; else its problems are reported and the default stands in."""
    wrong = _check_type(spec.kind, value)
    if wrong is None:
        before = len(problems)
        wrong = _check_items(spec.kind, path, value, problems)
        if len(problems) > before:  # bad elements, each reported under its own path
            return spec.default
    if wrong is None and spec.check is not None:
        wrong = spec.check(value)
    if wrong is not None:
        problems.append(Problem(path, f"{wrong} (got {value!r})"))
        return spec.default
    return value


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


# --- what build works out itself, and the checks across keys -----------------------------------


def _listen(s: Mapping[str, Any], problems: list[Problem]) -> list[ListenAddress]:
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
    return listen


def _vertex(environ: Mapping[str, str], listen: list[ListenAddress],
            problems: list[Problem]) -> tuple[VertexContract | None, list[ListenAddress]]:
    """Vertex AI's contract, and the listen addresses under it: each host as given, on
    AIP_HTTP_PORT, as llama-server keeps --host and takes that port."""
    try:
        contract = vertex.read(environ)
    except ValueError as e:
        problems.append(Problem("server.listen", f"{e} (Vertex AI's contract: "
                                                 f"{vertex.MODE}={vertex.PREDICTION})"))
        return None, listen
    if contract is None:
        return None, listen
    moved = [ListenAddress(a.host, contract.port) for a in listen]
    return contract, [a for i, a in enumerate(moved) if a not in moved[:i]]


def _api_key(s: Mapping[str, Any], environ: Mapping[str, str], listen: list[ListenAddress],
             problems: list[Problem], contract: VertexContract | None = None) -> str | None:
    """server.api_key or the variable server.api_key_env names; none only on loopback, or
    under Vertex AI's contract (its front end is what clients reach: it authenticates them,
    and sends the container no key of Spillway's)."""
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
    beyond = unguarded(api_key, contract, listen)
    if beyond is not None:
        problems.append(Problem("server.listen", f"{beyond} is not a loopback address; "
                                                 f"{KEY_NEEDED}"))
    return api_key


KEY_NEEDED = "set server.api_key (or api_key_env) before listening beyond this machine"


def unguarded(api_key: str | None, contract: VertexContract | None,
              addresses: Iterable[ListenAddress]) -> ListenAddress | None:
    """The key rule: the first address beyond loopback that no key would guard. None with a
    key, or under Vertex AI's contract (its front end authenticates the clients). Applied to
    server.listen here, and by the daemon to every socket it serves (a socket systemd or the
    last daemon passed it is served whatever server.listen says: service/listen_fds.py)."""
    if api_key is not None or contract is not None:
        return None
    return next((addr for addr in addresses if not addr.is_loopback), None)


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
        wrong = flag_values.value_problem(token, llama_args.flag_value(group.tokens, token))
        if wrong is not None:
            problems.append(Problem(path, f"{wrong}: llama-server would refuse it and not "
                                          "start"))
        if flag in llama_args.RESERVED_FLAGS:
            instead = llama_args.RESERVED_FLAGS[flag]
            if instead is None:
                problems.append(Problem(path, f"{token!r} is chosen by Spillway (children listen "
                                              "on loopback ports it picks); remove it"))
            else:
                problems.append(Problem(path, f"{token!r} is set by Spillway; use {instead} "
                                              "instead"))


def _check_across(values: Mapping[str, Mapping[str, Any]], problems: list[Problem]) -> None:
    for section in ("model", *CHILDREN):
        args = values[section]["args"]
        if all(isinstance(a, str) for a in args):
            _check_child_args(section, args, problems)
    _check_small(values, problems)
    r = values["restart"]
    if r["backoff_max_s"] < r["backoff_initial_s"]:
        problems.append(Problem("restart.backoff_max_s", "must be at least "
                                                         "restart.backoff_initial_s"))


def _check_small(values: Mapping[str, Mapping[str, Any]], problems: list[Problem]) -> None:
    """[small]: small.path in single-model mode (a third child), small.models in router mode
    (each model's smaller one on the GPU router, resident), and what goes with each."""
    small, defaults = values[SMALL_CHILD], SCHEMA[SMALL_CHILD]
    given = [k for k in defaults if k not in ("path", "models")
             and small[k] != defaults[k].default]
    if values["model"]["path"]:
        if small["models"]:
            problems.append(Problem(f"{SMALL_CHILD}.models", "is router mode's (no model.path); "
                                    "in single-model mode give small.path, the smaller "
                                    "model's GGUF file"))
        elif not small["path"] and given:
            problems.append(Problem(f"{SMALL_CHILD}.path", f"is required for small.{given[0]}: "
                                    "the smaller model's GGUF file"))
        return
    if small["path"]:
        problems.append(Problem(f"{SMALL_CHILD}.path", "a small child is for single-model mode "
                                "(model.path); in router mode map each model to its smaller "
                                "one with small.models"))
    process = [k for k in given if k not in ("mode", "requests")]
    if small["models"] and process:
        problems.append(Problem(f"{SMALL_CHILD}.{process[0]}", "router mode has no small "
                                "process: the smaller models are the GPU router's own"))
    if small["models"] and small["mode"] == "on-demand":
        problems.append(Problem(f"{SMALL_CHILD}.mode", "router mode keeps the smaller models "
                                "loaded on the GPU router (\"resident\"); \"on-demand\" is "
                                "single-model mode's"))
    models = small["models"] if isinstance(small["models"], dict) else {}
    for large, smaller in models.items():
        if smaller == large:
            problems.append(Problem(f"{SMALL_CHILD}.models.{large}", "a model cannot be its own "
                                    "smaller model"))
        elif smaller in models:
            problems.append(Problem(f"{SMALL_CHILD}.models.{large}", f"{smaller!r} has a smaller "
                                    "model of its own: one step only"))


def _resolve_executable(name: str) -> str | None:
    if os.sep in name:
        p = Path(name).expanduser()
        return str(p) if p.is_file() and os.access(p, os.X_OK) else None
    return shutil.which(name)


def _build_child(name: str, v: Mapping[str, Any], model: ModelConfig,
                 base_dir: Path) -> ChildConfig:
    """Special: a child's args are merged with model.args (and the GPU child's get -fit off; a
    router's get --no-models-autoload), its binary falls back to model.llama_server, and its
    model is model.path."""
    shared = list(model.args)
    model_path = model.path
    if name == SMALL_CHILD:
        shared = llama_args.without(shared, LARGE_MODEL_ONLY)
        model_path = _file(v["path"], base_dir) if v["path"] else ""
        if v["mmproj"]:
            shared += ["--mmproj", _file(v["mmproj"], base_dir)]
    merged = llama_args.merge_args(shared, _arg_paths(v["args"], base_dir))
    if name in (GPU_CHILD, SMALL_CHILD) and llama_args.find_flag(merged, "-fit") is None:
        # With fit on, llama-server quietly shrinks the load to the free VRAM, turning a clean
        # load-time OOM into a slow partial offload.
        merged += ["-fit", "off"]
    if not model.path and llama_args.find_flag(merged, llama_args.MODELS_AUTOLOAD) is None:
        # Router mode: Spillway loads each model itself (POST /models/load), so that a load
        # that fails on the card is a failure Spillway sees, backs off from and fails over
        # around. With autoload on, the router would load a model on any request naming it,
        # again after each failed load and each restart: an OOM on the card repeated by every
        # request, a crash loop Spillway neither started nor could stop. Either spelling in
        # the user's args wins (their choice, said explicitly).
        merged += [llama_args.NO_MODELS_AUTOLOAD]
    server = v["llama_server"] or model.llama_server
    return _make(ChildConfig, name, v, base_dir, name=name, args=tuple(merged),
                 llama_server=_expand(server, base_dir, must_have_sep=True),
                 model_path=model_path)


def _flag_key(values: Mapping[str, Mapping[str, Any]], child: str, flag: str) -> str:
    """The key path a child's value of `flag` comes from: its own args, else model.args."""
    for section in (child, "model"):
        args = values[section]["args"]
        if all(isinstance(a, str) for a in args):
            group = llama_args.find_flag(args, flag)
            if group is not None:
                return f"{section}.args[{group.index}]"
    return f"{child}.args"


_ROUTER_VALUES = {  # the router flags that take a value, and what it is
    llama_args.MODELS_DIR: "a folder", llama_args.MODELS_PRESET: "an INI file",
    llama_args.MODELS_MAX: "a number of models (0: no limit)",
}


def _check_router(values: Mapping[str, Mapping[str, Any]],
                  children: Mapping[str, ChildConfig], problems: list[Problem]) -> None:
    """Router mode against single-model mode, the router flags' values, and the one set of
    models both routers must serve."""
    model_path = values["model"]["path"]
    for section in ("model", *ROUTERS):
        args = values[section]["args"]
        if not all(isinstance(a, str) for a in args):
            continue
        for group in llama_args.group_args(args):
            if group.flag not in _ROUTER_VALUES:
                continue
            path, token = f"{section}.args[{group.index}]", group.tokens[0]
            flag = llama_args.canonical(token)
            value = llama_args.flag_value(group.tokens, flag)
            if model_path and flag in llama_args.ROUTER_SOURCES:
                problems.append(Problem("model.path", f"model.path serves one model, and "
                                        f"{token} in {path} makes the children routers over "
                                        "many: set one or the other"))
            if not value:
                problems.append(Problem(path, f"{token} needs {_ROUTER_VALUES[flag]}"))
            elif flag == llama_args.MODELS_MAX and not value.isdigit():
                problems.append(Problem(path, f"{token} needs {_ROUTER_VALUES[flag]} "
                                              f"(got {value!r})"))
    if model_path:
        return
    for flag in llama_args.ROUTER_SOURCES:
        ours = [llama_args.flag_value(children[n].args, flag) or None for n in ROUTERS]
        if len(set(ours)) > 1:
            own = [n for n in ROUTERS if llama_args.find_flag(values[n]["args"], flag)]
            said = " and ".join(f"{v or 'not given'} for the {children[n].label}"
                                for n, v in zip(ROUTERS, ours))
            problems.append(Problem(
                _flag_key(values, (own or list(ROUTERS))[0], flag),
                f"both routers serve the same models, but {flag} is {said}; give it once in "
                "model.args"))


def _path_problems(values: Mapping[str, Mapping[str, Any]], model: ModelConfig,
                   children: Mapping[str, ChildConfig]) -> list[Problem]:
    """The model file (or the routers' models folder and preset) and each child's binary
    must exist (check-config, start, reload)."""
    problems = []
    if model.path and not Path(model.path).is_file():
        problems.append(Problem("model.path", f"no such file: {model.path}"))
    small = children[SMALL_CHILD]
    if small.model_path and not Path(small.model_path).is_file():
        problems.append(Problem(f"{SMALL_CHILD}.path", f"no such file: {small.model_path}"))
    small_mmproj = llama_args.flag_value(small.args, "--mmproj") if small.mmproj else None
    if small.model_path and small_mmproj and not Path(small_mmproj).is_file():
        problems.append(Problem(f"{SMALL_CHILD}.mmproj", f"no such file: {small_mmproj}"))
    children = {n: c for n, c in children.items() if n != SMALL_CHILD or c.model_path}
    for name, child in children.items():
        if child.models_dir and not Path(child.models_dir).is_dir():
            problems.append(Problem(_flag_key(values, name, llama_args.MODELS_DIR),
                                    f"no such folder: {child.models_dir}"))
        preset = child.models_preset
        if preset and not Path(preset).is_file():
            problems.append(Problem(_flag_key(values, name, llama_args.MODELS_PRESET),
                                    f"no such file: {preset}"))
        elif preset:
            for line, message in models_dir.preset_errors(preset):
                where = f"{preset}:{line}" if line else preset
                problems.append(Problem(_flag_key(values, name, llama_args.MODELS_PRESET),
                                        f"{where}: {message}"))
    for name, child in children.items():
        key = f"{name}.llama_server" if values[name]["llama_server"] else "model.llama_server"
        if _resolve_executable(child.llama_server) is None:
            problems.append(Problem(key, f"{child.llama_server!r} is not an executable "
                                         "file or a command on PATH"))
    return problems


def build(raw: Mapping[str, Any], source: str = "<config>", base_dir: Path | None = None,
          environ: Mapping[str, str] | None = None, check_paths: bool = True) -> Config:
    """Validate a parsed TOML document; raises ConfigError listing every problem."""
    environ = os.environ if environ is None else environ
    base_dir = base_dir or Path.cwd()
    problems: list[Problem] = []
    values = _read_sections(raw, problems)

    contract, listen = _vertex(environ, _listen(values["server"], problems), problems)
    api_key = _api_key(values["server"], environ, listen, problems, contract)
    model = _make(ModelConfig, "model", values["model"], base_dir)
    _check_across(values, problems)
    children = {name: _build_child(name, values[name], model, base_dir) for name in CHILDREN}
    _check_router(values, children, problems)
    if check_paths:
        problems = _dedupe(problems + _path_problems(values, model, children))
    if problems:
        raise ConfigError(source, problems)

    special = {"server", "model", *CHILDREN}
    sections = {name: _make(cls, name, values[name], base_dir)
                for name, cls in SECTIONS.items() if name not in special}
    server = _make(ServerConfig, "server", values["server"], base_dir, listen=tuple(listen),
                   api_key=api_key, vertex=contract)
    return Config(path=None, server=server, model=model, gpu=children[GPU_CHILD],
                  small=children[SMALL_CHILD], cpu=children[CPU_CHILD], **sections)


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
    "RestartConfig", "GpuMonitorConfig", "BalancerConfig", "FailoverConfig",
    "IncidentsConfig", "QueueConfig",
    "IdempotencyConfig", "StreamsConfig", "ListenAddress", "load", "build",
    "known_keys", "parse_listen", "SCHEMA", "SECTIONS", "Key", "key", "derived",
    "section_keys", "RESTART_KEYS", "suggest", "diff", "command_changed", "unguarded",
    "KEY_NEEDED",
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


# What a child's process is started with: a change to any of them is a new command.
COMMAND_FIELDS = ("llama_server", "model_path", "args", "env", "device")


def command_changed(old: ChildConfig, new: ChildConfig) -> bool:
    """Whether the child must be restarted to take the new config: its command line or
    environment (or card) differ."""
    return (old.command(0, ""), dict(old.env), old.device) != (
        new.command(0, ""), dict(new.env), new.device)


def with_command_of(cfg: ChildConfig, other: ChildConfig) -> ChildConfig:
    """`cfg`'s settings, with `other`'s command (a new command kept back, or rolled back)."""
    return dataclasses.replace(cfg, **{f: getattr(other, f) for f in COMMAND_FIELDS})
