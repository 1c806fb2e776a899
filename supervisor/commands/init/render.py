"""A `Plan` -> the TOML text of the config, with tomlkit: real TOML comments, values quoted as
TOML wants, sections in config.SECTIONS' order. Only the keys the source gave, and the few a
user needs to read (server.listen, model.*, gpu.args, cpu.args, cpu.mode; with --small the
small child's path, args, mode and requests), each with a comment above it saying where it came
from. Pure.

Without --small, the header says how to add the small child. It is not a commented-out [small]
section between [gpu] and [cpu]: comments above a table's header belong, for tomlkit, to the
table before it, so `spillway config set gpu.device 1` would then put its new line under them.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

import tomlkit
from tomlkit.items import Array, Table

from ...config import schema as config
from .cmdline import ArgLine, Plan, Setting

WIDTH = 98  # "# " + this: the project's line length
CPU_ARGS = ("--device", "none", "-ngl", "0")  # config/schema.py's default for the CPU child
SMALL_ARGS = ("-ngl", "99")  # and for the small child


def _comment(table: Table | tomlkit.TOMLDocument, text: str, indent: str = "") -> None:
    for line in textwrap.wrap(text, WIDTH, break_on_hyphens=False, break_long_words=False,
                              subsequent_indent=indent):
        table.add(tomlkit.comment(line))


def _set(table: Table, key: str, setting: Setting) -> None:
    _comment(table, setting.comment)
    table.add(key, setting.value)


def _args(lines: Iterable[ArgLine]) -> Array:
    """One flag a line; a line's own comment above it."""
    array = tomlkit.array()
    for line in lines:
        for part in textwrap.wrap(line.comment, WIDTH - 4, break_on_hyphens=False,
                                  break_long_words=False):
            array.add_line(comment=part)
        array.add_line(*line.tokens)
    array.add_line(indent="")
    return array


def key_note(variable: str, env_file: str | None) -> str:
    """Where the key is, since it is not in the config."""
    if env_file is None:
        return (f"The key is not in this file, which anyone on the machine can read: export "
                f"{variable} before `spillway run` (or put it in an environment file, mode "
                "0600, that the systemd unit reads).")
    return (f"The key is not in this file, which anyone on the machine can read: it is "
            f"{variable} in {env_file} (mode 0600), which the shipped systemd unit reads "
            f"(EnvironmentFile=/etc/spillway/env); export it to run spillway by hand.")


def _header(doc: tomlkit.TOMLDocument, plan: Plan, env_file: str | None) -> None:
    _comment(doc, f"Spillway configuration, written by `spillway init` from {plan.origin}. Each "
                  "key says where it came from; every other key, with its default, is in "
                  "examples/spillway.toml. Check this file with `spillway check-config FILE`.")
    if plan.not_carried:
        doc.add(tomlkit.comment(""))
        doc.add(tomlkit.comment("Not carried over:"))
        for item in plan.not_carried:
            _comment(doc, f"- {item}.", indent="  ")
    others = {k: v for k, v in plan.secret_origins.items() if plan.api_key_env is None
              or k != plan.api_key_env.value}
    if others:
        doc.add(tomlkit.comment(""))
        where = env_file or "an environment file (mode 0600) or your shell's environment"
        for name, origin in others.items():
            _comment(doc, f"The value of {origin} is a secret, so it is not in this file: it is "
                          f"{name} in {where}; the children inherit it from Spillway.")
    if plan.small is None and not plan.router:
        doc.add(tomlkit.comment(""))
        _comment(doc, "No small child: a [small] section would add one, a smaller model on the "
                      "GPU's cards for the requests that accept another model (those that say "
                      "`X-Spillway-Fallback: smaller`, or all of them with small.requests = "
                      "\"all\"), answering them at GPU speed while the GPU child cannot, instead "
                      "of the CPU child. `spillway config set small.path FILE` adds it (or "
                      "`spillway init --small FILE`); its keys are in examples/spillway.toml.")
    doc.add(tomlkit.nl())


def _server(plan: Plan, env_file: str | None) -> Table:
    t = tomlkit.table()
    _set(t, "listen", plan.listen)
    if plan.api_key_env is not None:
        key = plan.api_key_env
        _set(t, "api_key_env", Setting(key.value, f"{key.comment}. "
                                                  f"{key_note(key.value, env_file)}"))
    return t


def _model(plan: Plan) -> Table:
    t = tomlkit.table()
    exe = plan.llama_server
    kind = "a name, looked up on PATH" if "/" not in exe.value else "a path"
    _set(t, "llama_server", Setting(exe.value, f"{exe.comment} ({kind})"))
    if plan.model_path is not None:
        _set(t, "path", plan.model_path)
    else:
        _comment(t, "No path: router mode. Both children are llama-server routers over the "
                    "same models (from --models-dir, --models-preset, or llama.cpp's cache), "
                    "each loading one instance per model, at most --models-max at once "
                    "(llama-server's default: 4); see examples/router.toml.")
        t.add(tomlkit.nl())
    if plan.model_args:
        _comment(t, f"from {plan.origin}: the flags both children get (a flag in gpu.args or "
                    "cpu.args replaces the same flag here)")
        t.add("args", _args(plan.model_args))
    return t


def _env(settings: dict[str, Setting]) -> Table:
    t = tomlkit.table()
    for name, setting in settings.items():
        _set(t, name, setting)
    return t


def _gpu(plan: Plan) -> Table:
    t = tomlkit.table()
    if plan.gpu_device is not None:
        _set(t, "device", plan.gpu_device)
    _comment(t, f"from {plan.origin}: the flags for the GPU child alone. Spillway adds -fit "
                "off unless -fit is here: with fit on, llama-server quietly shrinks the load to "
                "the free VRAM, turning a clean out-of-memory failure (which Spillway fails "
                "over from) into a slow partial offload.")
    t.add("args", _args(plan.gpu_args))
    env = {**plan.env, **plan.gpu_env}
    if env:
        t.add("env", _env(env))
    return t


def _small(plan: Plan) -> Table | None:
    small = plan.small
    if small is None:
        return None
    t = tomlkit.table()
    _set(t, "path", small.path)
    left_out = ", ".join(" ".join(line.tokens) for line in small.left_out)
    _comment(t, "the flags for the small child alone, after model.args" + (
        f" less those that name the large model's files or name ({left_out})" if left_out
        else "") + ": every layer on the card. Spillway adds -fit off unless -fit is here, as "
                   "for the GPU child.")
    t.add("args", _args([ArgLine(SMALL_ARGS), *small.args]) if small.args else
          list(SMALL_ARGS))
    _set(t, "mode", small.mode)
    _set(t, "requests", small.requests)
    env = {**plan.env, **plan.gpu_env}  # on the GPU's cards, as the GPU child
    if env:
        t.add("env", _env(env))
    return t


def _cpu(plan: Plan) -> Table:
    t = tomlkit.table()
    _comment(t, "the CPU child (Spillway's default): no card, no layers on one; it serves "
                "while the GPU child cannot")
    t.add("args", _args([ArgLine(tuple(CPU_ARGS)), *plan.cpu_args]) if plan.cpu_args else
          list(CPU_ARGS))
    _comment(t, "\"hot\": always loaded, so a failover finds it ready; \"on-demand\": started "
                "when first needed (its RAM free until then, a model load at the first "
                "failover)")
    t.add("mode", "hot")
    if plan.env:
        t.add("env", _env(plan.env))
    return t


def render(plan: Plan, env_file: str | None) -> str:
    """The config's text; `env_file` is where the secrets go (None: nowhere, --print)."""
    doc = tomlkit.document()
    _header(doc, plan, env_file)
    sections = {"server": _server(plan, env_file), "model": _model(plan), "gpu": _gpu(plan),
                "small": _small(plan), "cpu": _cpu(plan)}
    for name in config.SECTIONS:
        table = sections.get(name)
        if table is not None:
            doc.add(name, table)
    return tomlkit.dumps(doc)
