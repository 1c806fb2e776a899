"""`spillway init`: the command line, unit or llama-swap model a user already runs -> a
commented, valid spillway.toml (and the secrets in an environment file beside it, mode 0600).

The config is validated with config.build before anything is written; on any failure nothing
is. An existing config is replaced only with --force. Exit codes as commands/cli.py: 0 written
(or printed), 1 a file could not be written, 2 the input or the result is not usable.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

from ...config import schema as config
from ...config.files import write_atomically
from ...upstreams.hostcpu import host_cpu
from . import cmdline, envfile, hfcache, llama_swap, render, source, unit
from .arguments import SYSTEM_CONFIG
from .source import InitError

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2


def default_output() -> Path:
    """Where the shipped systemd unit reads it when run as root; else this folder."""
    return SYSTEM_CONFIG if os.geteuid() == 0 else Path("spillway.toml")


def _read_keys(path: str) -> list[str]:
    """An --api-key-file's keys: one a line, `#` lines are comments (as llama-server reads it)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InitError(f"--api-key-file {path}: cannot read ({e.strerror}); run spillway init "
                        "as a user who can, or give the key with --api-key") from e
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _hf_model(repo: str, hf_file: str | None, env: Mapping[str, str],
              home: str) -> hfcache.HfModel:
    return hfcache.find_model(repo, hf_file, hfcache.environment(env), home)


LOOKUPS = cmdline.Lookups(hf_model=_hf_model, read_keys=_read_keys)


def read_source(args: argparse.Namespace) -> source.Source:
    words = args.llama_command
    command = words[1:] if words[:1] == ["--"] else words
    given = [bool(command), bool(args.from_unit), bool(args.from_llama_swap)]
    if sum(given) != 1:
        raise InitError("give one of: a command line after --, --from-unit FILE, "
                        "--from-llama-swap FILE")
    if args.model and not args.from_llama_swap:
        raise InitError("--model picks a model of a llama-swap config: use it with "
                        "--from-llama-swap")
    home, cwd = str(Path.home()), os.getcwd()
    if args.from_unit:
        return unit.read_unit(Path(args.from_unit).absolute())
    if args.from_llama_swap:
        return llama_swap.read_llama_swap(Path(args.from_llama_swap).absolute(), args.model,
                                          os.environ, cwd, home)
    return source.from_command_line(command, cwd, home)


def _size(path: str) -> str:
    size = os.path.getsize(path)
    if size >= 2**30:
        return f"{size / 2**30:.1f} GiB"
    return f"{size / 2**20:.0f} MiB" if size >= 2**20 else f"{size} bytes"


def _check_small(plan: cmdline.Plan) -> None:
    """A small model that is not smaller than the large one is most likely a mistake (the two
    files swapped): said, not refused."""
    if plan.small is None or plan.model_path is None:
        return
    small, large = plan.small.path.value, plan.model_path.value
    try:
        not_smaller = os.path.getsize(small) >= os.path.getsize(large)
    except OSError:
        return  # config.build says which file is missing
    if not_smaller:
        plan.warnings.append(f"--small {small} ({_size(small)}) is not smaller than model.path "
                             f"{large} ({_size(large)}): the small child is for a smaller model "
                             "than the GPU child's")


def _validate(text: str, plan: cmdline.Plan, output: Path | None) -> None:
    """config.build on the text about to be written, with the secrets it will find."""
    where = output or Path.cwd() / "spillway.toml"
    config.build(tomllib.loads(text), source=str(where), base_dir=where.parent,
                 environ={**os.environ, **plan.secrets})
    for name, value in plan.secrets.items():
        # A guard on the one promise that matters most: no secret in the world-readable file.
        if len(value) >= 8 and value in text:
            raise InitError(f"the value of {name} would appear in the config; nothing written")


def _print_config(text: str, plan: cmdline.Plan) -> None:
    sys.stdout.write(text)
    for name, value in plan.secrets.items():
        print(f"spillway init: {name} is not in the config; before `spillway run`: "
              f"export {name}={shlex.quote(value)}", file=sys.stderr)


def _write(output: Path, text: str, plan: cmdline.Plan, force: bool) -> Path | None:
    """The env file (when there are secrets), then the config; the env file's path."""
    if output.exists() and not force:
        raise InitError(f"{output} exists; --force replaces it (or -o names another file)")
    env_path = envfile.beside(output) if plan.secrets else None
    if env_path is not None:
        envfile.write(env_path, plan.secrets, force)
    # The umask's mode (or the replaced file's): the daemon's user must read it.
    write_atomically(output, text)
    return env_path


def _report(output: Path, env_path: Path | None, plan: cmdline.Plan) -> None:
    def say(line: str) -> None:
        print(f"spillway init: {line}", file=sys.stderr)

    say(f"wrote {output}")
    if env_path is not None:
        say(f"{', '.join(plan.secrets)} in {env_path} (mode 0600), not in the config"
            + ("" if env_path == Path("/etc/spillway/env") else
               "; the shipped systemd unit reads /etc/spillway/env: move it there, or export "
               "them before `spillway run`"))
    if plan.secret_origins.get(cmdline.KEY_VARIABLE) == "--new-key":
        say(f"a new API key is in {env_path}: give it to your clients")
    say(f"next: spillway check-config {shlex.quote(str(output))}")
    # The key is in the env file, not the config: a run by hand needs it in its environment
    # (systemd's unit reads /etc/spillway/env itself).
    load = f"set -a; . {shlex.quote(str(env_path))}; set +a; " if env_path is not None else ""
    say(f"then: {load}spillway run --config {shlex.quote(str(output))}")


def run(args: argparse.Namespace) -> int:
    try:
        src = read_source(args)
        options = cmdline.Options(listen=args.listen,
                                  new_key=secrets.token_urlsafe(32) if args.new_key else None,
                                  cpu_has_amx=host_cpu().has_amx,
                                  small=os.path.abspath(os.path.expanduser(args.small))
                                  if args.small else None,
                                  small_mode=args.small_mode,
                                  small_requests=args.small_requests)
        plan = cmdline.make_plan(src, LOOKUPS, options)
        _check_small(plan)
        output = None if args.print else Path(args.output or default_output()).absolute()
        env_path = envfile.beside(output) if output is not None and plan.secrets else None
        text = render.render(plan, str(env_path) if env_path else None)
        _validate(text, plan, output)
        for warning in plan.warnings:
            print(f"spillway init: warning: {warning}", file=sys.stderr)
        if output is None:
            _print_config(text, plan)
            return EXIT_OK
        env_path = _write(output, text, plan, args.force)
    except InitError as e:
        print(f"spillway init: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except config.ConfigError as e:
        print(f"spillway init: nothing written: the config would not be valid "
              f"({len(e.problems)} problem(s)):", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
            if p.path.endswith("llama_server"):
                print("  (name llama-server by its full path on the command line, or put it on "
                      "PATH)", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        print(f"spillway init: cannot write: {e}", file=sys.stderr)
        return EXIT_FAIL
    _report(output, env_path, plan)
    return EXIT_OK
