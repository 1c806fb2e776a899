"""A llama-server command line (a `Source`) -> the plan of a Spillway config (a `Plan`).

Every flag lands somewhere, with where it came from:
- `-m` is model.path; `-hf` too, as the file in llama.cpp's cache (hfcache.py); neither, or
  `--models-dir` / `--models-preset`: router mode, the router flags in model.args;
- `--host` / `--port` are server.listen (clients keep their URL; llama-server's defaults are
  127.0.0.1 and 8080), or the upstream's address under llama-swap (dropped, with why);
- `--api-key` / `--api-key-file` (and llama-swap's apiKeys) are a key in the environment file,
  named by server.api_key_env: never in the config, which anyone on the machine may read. More
  than one key: the first, with a warning (Spillway checks one). A listen address beyond this
  machine without a key is refused by Spillway, so it falls back to loopback on the same port,
  with a comment and a warning (or keeps the address with `--new-key`, a fresh key);
- GPU-only flags (flags.GPU_ONLY) are gpu.args; `-ngl 99` is added when the source sets no
  layers (Spillway's default). The CUDA cards llama-server would use become gpu.device, which
  shows the GPU child those alone, in the same order (`_device`): `-dev CUDA0,CUDA1`, or the one
  card of `-sm none` (`-mg`'s), counted in CUDA_VISIBLE_DEVICES when that is set, or
  CUDA_VISIBLE_DEVICES itself. Without them (`-ts 1,1`, `-mg` with a layer or row split, no
  flag at all) llama-server uses every card it sees, and so does the GPU child with gpu.device
  left unset;
- flags Spillway cannot carry over (flags.NOT_CARRIED) are comments saying why;
- everything else is model.args, given to both children, paths made absolute;
- `LLAMA_ARG_*` variables are the flags they stand for (llama_env.py), the command line's own
  flag winning as in llama-server; secrets go to the environment file; other variables to the
  children's env (GPU-vendor ones to the GPU child's alone);
- `spillway init --small FILE` (not the source) gives the small child, a smaller model on the
  GPU's cards (single-model mode only): its own `-ngl 99`, the GPU child's `-dev` (the same
  card), the GPU child's environment; it leaves out model.args' flags naming the large model's
  files or name (config.LARGE_MODEL_ONLY), as config.build does.

Pure: the two questions that need the file system (a `-hf` model in the cache, the keys in an
`--api-key-file`) are asked through `Lookups`.
"""

from __future__ import annotations

import csv
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from ...config import schema as config, llama_args
from . import flags, llama_env
from .hfcache import HfModel
from .known_flags import KNOWN_FLAGS
from .source import EnvVar, InitError, Source

KEY_VARIABLE = "SPILLWAY_API_KEY"  # what the shipped unit's EnvironmentFile= comment names
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", "8080"  # llama-server's (common.h)
_CUDA = re.compile(r"^CUDA(\d+)$")


@dataclass(frozen=True)
class Setting:
    value: Any
    comment: str  # where it came from, as a phrase: "from -ngl 99 on the command line"


@dataclass(frozen=True)
class ArgLine:
    tokens: tuple[str, ...]
    comment: str = ""  # only where the key's own comment does not say it all


@dataclass(frozen=True)
class SmallPlan:
    """The small child's section (spillway init --small)."""

    path: Setting
    mode: Setting
    requests: Setting
    args: list[ArgLine] = field(default_factory=list)  # after Spillway's -ngl 99
    # model.args' flags the small child does not get (they name the large model's files or name)
    left_out: list[ArgLine] = field(default_factory=list)


@dataclass
class Plan:
    origin: str  # where the command line came from: "the command line", "ExecStart= in F"
    llama_server: Setting
    model_path: Setting | None
    listen: Setting
    api_key_env: Setting | None = None
    model_args: list[ArgLine] = field(default_factory=list)
    gpu_args: list[ArgLine] = field(default_factory=list)
    cpu_args: list[ArgLine] = field(default_factory=list)  # after Spillway's CPU defaults
    gpu_device: Setting | None = None
    env: dict[str, Setting] = field(default_factory=dict)  # both children's
    gpu_env: dict[str, Setting] = field(default_factory=dict)
    small: SmallPlan | None = None  # spillway init --small
    secrets: dict[str, str] = field(default_factory=dict)  # for the environment file
    secret_origins: dict[str, str] = field(default_factory=dict)
    not_carried: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def router(self) -> bool:
        return self.model_path is None


@dataclass(frozen=True)
class Options:
    listen: str | None = None  # --listen: where clients connect, whatever the source says
    new_key: str | None = None  # --new-key: a fresh key, made by the caller
    cpu_has_amx: bool = False  # this machine's CPU has AMX (llama.cpp#20824 crashes it)
    small: str | None = None  # --small: the smaller model's GGUF file (absolute)
    small_mode: str | None = None  # --small-mode (None: the schema's default)
    small_requests: str | None = None  # --small-requests (None: the schema's default)


@dataclass(frozen=True)
class Lookups:
    # (user/model[:quant], --hf-file or None, environment, home) -> the cached file
    hf_model: Callable[[str, str | None, Mapping[str, str], str], HfModel]
    read_keys: Callable[[str], list[str]]  # an --api-key-file's keys


@dataclass(frozen=True)
class _Group:
    """One flag with its values, and where it came from."""

    tokens: tuple[str, ...]
    described: str  # "-ngl 99 on the command line", "LLAMA_ARG_N_GPU_LAYERS=99 in ..."
    from_env: bool = False

    @property
    def flag(self) -> str:
        return flags.canonical(self.tokens[0])

    @property
    def spelling(self) -> str:
        return flags.spelling(self.tokens[0])

    @property
    def value(self) -> str:
        return self.tokens[1] if len(self.tokens) > 1 else ""


def _split_equals(argv: tuple[str, ...]) -> list[str]:
    """`--flag=value` as two words, a long flag's underscores as dashes."""
    out: list[str] = []
    for word in argv:
        if word.startswith("--") and llama_args.is_flag(word):
            name, sep, value = word.partition("=")
            out += [flags.spelling(name), value] if sep else [flags.spelling(name)]
        else:
            out.append(word)
    return out


def _shown(tokens: tuple[str, ...] | list[str]) -> str:
    """A flag as a comment shows it: a secret's value masked."""
    if flags.is_secret(tokens[0]):
        return tokens[0]  # the value is a secret
    return shlex.join(tokens)


# The flags without a value, as llama_env's table knows them (a switch, or either form of a bool).
_SWITCHES = frozenset(
    name for spec in llama_env.ENV_FLAGS.values() if spec.kind != llama_env.VALUE
    for name in (spec.flag, spec.negative) if name)


def _width(flag: str) -> int:
    """How many words a flag and its values take: one value at most in llama-server's arg.cpp,
    but for --control-vector-layer-range START END; none for a known switch."""
    if flag in _SWITCHES:
        return 1
    return 3 if flag == "--control-vector-layer-range" else 2


def _csv(value: str) -> list[str]:
    """llama-server's comma-separated values (parse_csv_row), empty ones left out."""
    row = next(csv.reader([value], skipinitialspace=True), [])
    return [item.strip() for item in row if item.strip()]


class _Planner:
    def __init__(self, source: Source, lookups: Lookups, options: Options) -> None:
        self.source, self.lookups, self.options = source, lookups, options
        origin = source.where.removeprefix("on ").removeprefix("in ")
        self.plan = Plan(origin=origin, llama_server=Setting("", ""), model_path=None,
                         listen=Setting("", ""))
        self.one: dict[str, _Group] = {}  # the flags Spillway owns: the last one given
        self.keys: list[tuple[str, str]] = []  # (key, described)
        self.cuda_visible: EnvVar | None = None
        self.dev: _Group | None = None  # -dev naming CUDA devices alone: CUDA0,CUDA1
        self.other_dev = False  # a -dev of another backend's devices (kept in gpu.args)
        self.mg: _Group | None = None  # -mg n
        self.sm: _Group | None = None  # -sm (in gpu.args too)
        self.handlers: dict[str, Callable[[_Group], None]] = {
            "--host": self._owned, "--port": self._owned, "-m": self._owned,
            "-hf": self._owned, "-hff": self._owned,
            "--api-key": self._api_key, "--api-key-file": self._api_key_file,
            "-hft": self._hf_token, "-mu": self._cannot_download, "-dr": self._cannot_download,
            "-mmu": self._cannot_download, "--mmproj-url": self._cannot_download,
            **{spelling: self._hf_draft for spelling in flags.HF_DRAFT},
        }

    # --- the steps ----------------------------------------------------------------------------

    def run(self) -> Plan:
        self._executable()
        for group in self._merged(self._environment(), self._command_line()):
            self._take(group)
        self._model()
        self._device()
        self._gpu_defaults()
        self._cpu_defaults()
        self._small()
        self._listen_and_key()
        self.plan.not_carried += list(self.source.notes)
        return self.plan

    def _cpu_defaults(self) -> None:
        """On a CPU with AMX, the CPU child (the safety net) keeps its weights out of llama.cpp's
        AMX buffers, whose matmul crashes at the first compute (llama.cpp#20824)."""
        given = {token for line in self.plan.model_args for token in line.tokens}
        if self.options.cpu_has_amx and not given & {"--no-repack", "-nr"}:
            self.plan.cpu_args.append(ArgLine(("--no-repack",), (
                "this CPU has AMX, and llama.cpp's AMX matmul crashes at the first compute on "
                "Q4_K weights (https://github.com/ggml-org/llama.cpp/issues/20824): the CPU "
                "child, the safety net, keeps its weights out of AMX buffers. Take it out once "
                "your llama-server is fixed or built without AMX")))
            self.plan.warnings.append("this CPU has AMX: the CPU child gets --no-repack "
                                      "(llama.cpp#20824; see cpu.args)")

    def _executable(self) -> None:
        exe = self.source.argv[0]
        if PurePosixPath(exe).name in flags.WRAPPERS:
            raise InitError(f"{exe} {self.source.where} runs llama-server through "
                            f"{PurePosixPath(exe).name}; Spillway runs llama-server itself, as "
                            "two children: give the llama-server command line it runs instead")
        if "/" in exe:  # a path stays a path, absolute: the config's folder is not the source's
            exe = self._absolute(exe)
        self.plan.llama_server = Setting(exe, f"from the executable {self.source.where}")

    def _environment(self) -> list[_Group]:
        groups = []
        for var in self.source.env:
            if var.name == "CUDA_VISIBLE_DEVICES":
                self.cuda_visible = var
            elif llama_env.is_llama_variable(var.name):
                groups += self._variable_flag(var)
            else:
                self._variable(var)
        return groups

    def _variable_flag(self, var: EnvVar) -> list[_Group]:
        spec = llama_env.ENV_FLAGS.get(var.name)
        secret = spec is not None and flags.is_secret(spec.flag)
        described = f"{var.name if secret else f'{var.name}={var.value}'} {var.origin}"
        try:
            tokens = llama_env.flag_args(var.name, var.value)
        except ValueError as e:
            raise InitError(f"{e} ({var.origin})") from e
        if not tokens:
            self.plan.not_carried.append(f"{described}: llama-server ignores it (the value is "
                                         f"not one of {', '.join(llama_env.TRUTHY)})")
            return []
        return [_Group(tuple(tokens), described, from_env=True)]

    def _variable(self, var: EnvVar) -> None:
        described = f"{var.name}={var.value} {var.origin}"
        if var.name in self.source.expanded:
            self.plan.not_carried.append(f"{var.name} {var.origin}: expanded into the command "
                                         "line above, and llama-server does not read it")
        elif var.name in flags.OWNED_ENV:
            self.plan.not_carried.append(f"{described}: {flags.OWNED_ENV[var.name]}")
        elif var.name == flags.HF_TOKEN or flags.secret_variable(var.name):
            self._secret(var.name, var.value, f"{var.name} {var.origin}")
        elif var.name in flags.GPU_ENV:
            self.plan.gpu_env[var.name] = Setting(var.value, f"from {described}")
        else:
            self.plan.env[var.name] = Setting(var.value, f"from {described}")

    def _command_line(self) -> list[_Group]:
        groups = []
        for g in llama_args.group_args(_split_equals(self.source.argv[1:])):
            if not llama_args.is_flag(g.tokens[0]) or g.tokens[0] == "--":
                raise InitError(f"{g.tokens[0]!r} {self.source.where}: llama-server takes no "
                                "positional arguments (is a flag misspelt, or a value quoted "
                                "apart from its flag?)")
            stray = g.tokens[_width(g.tokens[0]):]
            if stray:
                raise InitError(f"{stray[0]!r} after {_shown(g.tokens[:1])} "
                                f"{self.source.where}: llama-server takes no positional "
                                "arguments, and that flag takes no more values")
            groups.append(_Group(g.tokens, f"{_shown(g.tokens)} {self.source.where}"))
        return groups

    def _merged(self, from_env: list[_Group], given: list[_Group]) -> list[_Group]:
        """The environment's flags, then the command line's, which win (as in llama-server)."""
        on_line = {g.flag for g in given}
        kept = []
        for g in from_env:
            if g.flag in on_line:
                self.plan.not_carried.append(f"{g.described}: the command line gives "
                                             f"{g.tokens[0]} too, and llama-server takes that")
            else:
                kept.append(g)
        return kept + given

    def _take(self, g: _Group) -> None:
        handler = self.handlers.get(g.flag)
        if handler is not None:
            handler(g)
        elif g.spelling in flags.INFO_ONLY:
            raise InitError(f"{g.described}: {g.tokens[0]} prints something and exits; give "
                            "the command line that runs the server")
        elif g.spelling in flags.NOT_CARRIED:
            self._not_carried(g, flags.NOT_CARRIED[g.spelling])
        elif g.spelling in flags.GPU_ONLY:
            self._gpu(g)
        else:
            line = self._line(g)
            if g.spelling not in KNOWN_FLAGS:
                why = ("not a flag llama-server (llama.cpp 11434) knows, a typo or a newer "
                       "flag: carried as given")
                self.plan.warnings.append(f"{g.described}: {why}")
                line = ArgLine(line.tokens, f"{line.comment}; {why}" if line.comment else why)
            elif g.flag == llama_args.MODELS_MAX and not line.comment:
                line = ArgLine(line.tokens, "each router keeps at most this many models loaded; "
                                            "a card often holds fewer than RAM: a --models-max "
                                            "in gpu.args replaces this for the GPU router")
            self.plan.model_args.append(line)

    # --- single flags -------------------------------------------------------------------------

    def _line(self, g: _Group) -> ArgLine:
        tokens = g.tokens
        if g.spelling in flags.PATH_VALUED and g.value:
            tokens = (tokens[0], self._absolute(g.value), *tokens[2:])
        note = f"from {g.described}" if g.from_env else ""
        if tokens != g.tokens and not note:
            note = f"from {g.described} (made absolute: the children run elsewhere)"
        return ArgLine(tokens, note)

    def _absolute(self, path: str) -> str:
        if path.startswith("~") and self.source.home:
            path = self.source.home + path[1:]
        p = PurePosixPath(path)
        return str(p if p.is_absolute() else PurePosixPath(self.source.workdir) / p)

    def _not_carried(self, g: _Group, why: str) -> None:
        self.plan.not_carried.append(f"{g.described}: {why}")

    def _owned(self, g: _Group) -> None:
        previous = self.one.get(g.flag)
        if previous is not None:
            self._not_carried(previous, f"{g.described} comes later, and llama-server takes "
                                        "the last one")
        self.one[g.flag] = g

    def _api_key(self, g: _Group) -> None:
        self.keys += [(key, g.described) for key in _csv(g.value)]

    def _api_key_file(self, g: _Group) -> None:
        path = self._absolute(g.value)
        self.keys += [(key, g.described) for key in self.lookups.read_keys(path)]

    def _hf_draft(self, g: _Group) -> None:
        """-hfd: the draft model's file in the cache, as -md (the children download nothing)."""
        env = {v.name: v.value for v in self.source.env}
        found = self.lookups.hf_model(g.value, None, env, self.source.home)
        self.plan.model_args.append(ArgLine(("-md", found.path), f"from {g.described}: the "
                                                                 "file in llama.cpp's cache"))

    def _hf_token(self, g: _Group) -> None:
        self._secret(flags.HF_TOKEN, g.value, g.described)

    def _secret(self, name: str, value: str, described: str) -> None:
        self.plan.secrets[name] = value
        self.plan.secret_origins[name] = described

    def _cannot_download(self, g: _Group) -> None:
        raise InitError(f"{g.described}: Spillway's children load a model file and download "
                        "nothing (a restart must not depend on the network); download it once "
                        "and give -m with the file instead")

    def _gpu(self, g: _Group) -> None:
        """gpu.args, but for -dev naming CUDA devices and -mg n: which cards those name is
        worked out once every flag is known (`_device`), as llama-server takes the last."""
        names = _csv(g.value) if g.flag == "-dev" else []
        if names and all(_CUDA.match(d) for d in names):
            self.dev = g
            return
        if g.flag == "-mg" and g.value.isdigit():
            self.mg = g
            return
        if g.flag == "-sm":
            self.sm = g
        if g.flag == "-dev" and g.value == "none":
            self.plan.warnings.append(f"{g.described}: the GPU child would run without a "
                                      "card; Spillway's GPU child is meant to use one")
        elif g.flag == "-dev":
            self.other_dev = True
        self.plan.gpu_args.append(self._line(g))

    # --- what the flags add up to -------------------------------------------------------------

    def _model(self) -> None:
        model, hf, hf_file = self.one.get("-m"), self.one.get("-hf"), self.one.get("-hff")
        if model is not None:
            path = self._absolute(model.value)
            self.plan.model_path = Setting(path, f"from {model.described}")
            for other in (hf, hf_file):
                if other is not None:
                    self._not_carried(other, "-m names the model file")
        elif hf is not None:
            env = {v.name: v.value for v in self.source.env}
            found = self.lookups.hf_model(hf.value, hf_file.value if hf_file else None, env,
                                          self.source.home)
            self.plan.model_path = Setting(found.path, f"from {hf.described}: the file "
                                                       "llama-server downloaded into its cache")
            self._projector(found)
        elif hf_file is not None:
            self._not_carried(hf_file, "a file of the -hf repository, and there is none")
        if self.plan.model_path is None:
            return
        if self.source.name and not any(flags.canonical(a.tokens[0]) == "-a"
                                        for a in self.plan.model_args):
            self.plan.model_args.append(ArgLine(
                ("-a", self.source.name), "the model's ID (and aliases) in llama-swap: "
                                          "/v1/models names it as clients know it"))
        self._readable(self.plan.model_path.value)

    def _readable(self, path: str) -> None:
        if re.match(r"^/(root|home)(/|$)", path):
            self.plan.warnings.append(f"{path}: the shipped systemd unit runs Spillway as user "
                                      "spillway with ProtectHome=read-only; make sure that "
                                      "user can read it")

    def _projector(self, found: HfModel) -> None:
        given = {flags.spelling(a.tokens[0]) for a in self.plan.model_args}
        if found.mmproj and not given & {"-mm", "--mmproj", "-mmu", "--mmproj-url",
                                         "--no-mmproj", "--no-mmproj-auto"}:
            self.plan.model_args.append(ArgLine(
                ("-mm", found.mmproj), "the projector llama-server loads with -hf, from the "
                                       "same cache"))

    def _used(self) -> list[int] | None:
        """The CUDA devices llama-server would use, by its own numbers, or None for every one
        it sees. As llama.cpp's llama_model_load_from_file_impl: -dev's list (or every GPU),
        of which -sm none keeps -mg's alone; a layer or row split uses them all."""
        names = None if self.dev is None else [
            int(m.group(1)) for m in (_CUDA.match(d) for d in _csv(self.dev.value)) if m]
        if self.sm is None or self.sm.value != "none":
            return names
        main = int(self.mg.value) if self.mg else 0
        if names is None:
            return [main]
        if main >= len(names):
            assert self.mg is not None and self.dev is not None
            raise InitError(f"{self.mg.described}: with -sm none the main GPU is device "
                            f"{main} of the {len(names)} that -dev {self.dev.value} names, "
                            "counted from 0")
        return [names[main]]

    def _device(self) -> None:
        """gpu.device: the cards llama-server would use, where the command line says which
        (the GPU child then sees those alone, in the same order: no CUDA context on the
        others, llama.cpp#20595). Every card it sees leaves gpu.device unset, which gives the
        child every card, as llama-server alone. -mg stays in gpu.args unless the child is
        shown one card (then that card is its CUDA0, the main GPU by default)."""
        visible = _csv(self.cuda_visible.value) if self.cuda_visible else []
        used = None if self.other_dev else self._used()  # another backend counts its own
        if self.mg is not None and (used is None or len(used) > 1):
            self.plan.gpu_args.append(self._line(self.mg))
        if used is None and not visible:
            return
        one = self.sm is not None and self.sm.value == "none"
        deciding = (self.dev, self.sm, self.mg) if one else (self.dev,)
        said = [g.described for g in deciding if g is not None and used is not None]
        said += [f"CUDA_VISIBLE_DEVICES={v.value} {v.origin}" for v in (self.cuda_visible,) if v]
        cards = self._named(visible, used, said)
        indices = all(c.isdigit() for c in cards)
        value: int | str = int(cards[0]) if len(cards) == 1 and indices else ",".join(cards)
        names = [f"CUDA{i}" for i in range(len(cards))]
        seen = "the card the GPU child sees (as CUDA0)" if len(cards) == 1 else (
            f"the cards the GPU child sees (as {', '.join(names[:-1])} and {names[-1]}, in "
            "this order)")
        note = "" if not indices else (
            "; an index as nvidia-smi numbers cards (CUDA numbers them fastest first unless "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID): check `nvidia-smi -L`")
        self.plan.gpu_device = Setting(value, f"from {' and '.join(said)}: {seen}{note}")

    def _named(self, visible: list[str], used: list[int] | None, said: list[str]) -> list[str]:
        """The cards as gpu.device names them: CUDA's numbers counted in CUDA_VISIBLE_DEVICES
        when that is set (its entries as given), else as they are."""
        if used is None:
            return visible
        if not visible:
            return [str(i) for i in used]
        for i in used:
            if i >= len(visible):
                raise InitError(f"{' and '.join(said)}: card {i} of {len(visible)} visible")
        return [visible[i] for i in used]

    def _gpu_defaults(self) -> None:
        if not any(flags.canonical(a.tokens[0]) == "-ngl" for a in self.plan.gpu_args):
            self.plan.gpu_args.insert(0, ArgLine(("-ngl", "99"), "no -ngl in the source: every "
                                                                 "layer on the card (Spillway's "
                                                                 "default)"))

    def _small(self) -> None:
        """--small: the small child's section, beside the GPU child; single-model mode only."""
        o = self.options
        if o.small is None:
            for flag, value in (("--small-mode", o.small_mode),
                                ("--small-requests", o.small_requests)):
                if value is not None:
                    raise InitError(f"{flag} {value} sets up the small child: give --small FILE "
                                    "too (the smaller model's GGUF file)")
            return
        if self.plan.model_path is None:
            raise InitError(f"--small {o.small}: a small child is for single-model mode "
                            f"(model.path), and {self.plan.origin} names no model: router mode, "
                            "whose two routers serve many models and have no third child. "
                            "Leave out --small, or give the source -m FILE")
        defaults = config.SCHEMA[config.SMALL_CHILD]

        def chosen(flag: str, value: str | None, name: str, why: str) -> Setting:
            if value is not None:
                return Setting(value, f"from {flag} given to spillway init. {why}")
            return Setting(defaults[name].default, f"Spillway's default (spillway init {flag} "
                                                   f"gives another). {why}")

        large_only = {llama_args.canonical(f) for f in config.LARGE_MODEL_ONLY}
        self.plan.small = SmallPlan(
            path=Setting(o.small, "from --small given to spillway init: the smaller model's "
                                  "GGUF file. The small child serves it on the GPU's cards, for "
                                  "the requests that accept another model, while the GPU child "
                                  "cannot take them: they are answered at GPU speed instead of "
                                  "the CPU child's"),
            mode=chosen("--small-mode", o.small_mode, "mode", (
                "\"resident\": always loaded beside the GPU child (keep room on the card for "
                "both); \"on-demand\": started into the VRAM a death of the GPU child freed, "
                "and stopped before the GPU child starts again")),
            requests=chosen("--small-requests", o.small_requests, "requests", (
                "\"opt-in\": only the requests that say `X-Spillway-Fallback: smaller`; "
                "\"all\": every request may get the smaller model's answer. Either way a "
                "stream that has started is never continued on another model")),
            args=[ArgLine(line.tokens, "as in gpu.args: the small child runs beside the GPU "
                                       "child, on its card")
                  for line in self.plan.gpu_args if flags.canonical(line.tokens[0]) == "-dev"],
            left_out=[line for line in self.plan.model_args
                      if llama_args.canonical(line.tokens[0]) in large_only])
        self._readable(o.small)

    def _listen(self) -> tuple[list[str], str]:
        host, port = self.one.get("--host"), self.one.get("--port")
        if self.options.listen:
            for g in (host, port):
                if g is not None:
                    self._not_carried(g, "spillway init --listen says where clients connect")
            return [self.options.listen], "from --listen given to spillway init"
        if not self.source.clients_connect_here:
            for g in (host, port):
                if g is not None:
                    self._not_carried(g, "the upstream's address in llama-swap; Spillway picks "
                                         "its children's ports, and clients connect to "
                                         "server.listen")
            return [self.source.listen], self.source.listen_origin
        port_value = port.value if port else DEFAULT_PORT
        addresses = []
        for h in _csv(host.value) if host else [DEFAULT_HOST]:
            if h.endswith(".sock"):
                self.plan.warnings.append(f"--host {h}: Spillway listens on TCP only, not on "
                                          "a UNIX socket")
                continue
            addresses.append(f"[{h}]:{port_value}" if ":" in h else f"{h}:{port_value}")
        said = self._address_said(host, port)
        return addresses or [f"{DEFAULT_HOST}:{port_value}"], \
            f"from {said}: clients keep their URL"

    def _address_said(self, host: _Group | None, port: _Group | None) -> str:
        given = [g for g in (host, port) if g is not None]
        if not given:
            return f"llama-server's default address (no --host or --port {self.source.where})"
        if all(not g.from_env for g in given):
            return f"{' '.join(_shown(g.tokens) for g in given)} {self.source.where}"
        return " and ".join(g.described for g in given)

    def _listen_and_key(self) -> None:
        addresses, comment = self._listen()
        for a in addresses:
            try:
                config.parse_listen(a)
            except ValueError as e:
                raise InitError(f"listen address {a!r}: {e}") from e
        keys = self.keys + [(k, self.source.keys_origin.removeprefix("from "))
                            for k in self.source.api_keys]
        if keys:
            self._secret(KEY_VARIABLE, keys[0][0], keys[0][1])
            self.plan.api_key_env = Setting(KEY_VARIABLE, f"from {keys[0][1]}")
            if len(keys) > 1:
                origins = ", ".join(sorted({d for _, d in keys}))
                self.plan.warnings.append(f"{len(keys)} API keys ({origins}); Spillway checks "
                                          "one, the first: clients using the others get 401")
        elif self.options.new_key:
            self._secret(KEY_VARIABLE, self.options.new_key, "--new-key")
            self.plan.api_key_env = Setting(KEY_VARIABLE, "a new key made by --new-key: give "
                                                          "it to your clients")
        else:
            addresses, comment = self._loopback_without_key(addresses, comment)
        value: str | list[str] = addresses[0] if len(addresses) == 1 else addresses
        self.plan.listen = Setting(value, comment)

    def _loopback_without_key(self, addresses: list[str],
                              comment: str) -> tuple[list[str], str]:
        """Spillway refuses to listen beyond this machine without a key: loopback instead."""
        public = [a for a in addresses if not config.parse_listen(a).is_loopback]
        if not public:
            return addresses, comment
        if self.options.listen:
            raise InitError(f"--listen {self.options.listen}: Spillway listens beyond this "
                            "machine only with an API key, and the source has none; add "
                            "--new-key to make one")
        kept: list[str] = []
        for a in addresses:
            address = a if a not in public else f"{DEFAULT_HOST}:{config.parse_listen(a).port}"
            if address not in kept:
                kept.append(address)
        why = (f"{', '.join(public)} came without an API key, and Spillway listens beyond this "
               "machine only with one: loopback until you set server.api_key_env (or run "
               "spillway init again with --new-key)")
        self.plan.warnings.append(why)
        return kept, f"{comment}; but {why}"


def make_plan(source: Source, lookups: Lookups, options: Options | None = None) -> Plan:
    """The plan of the config for `source`; InitError when it cannot be made."""
    return _Planner(source, lookups, options or Options()).run()
