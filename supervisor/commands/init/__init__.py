"""`spillway init`: turn what a user already runs (a llama-server command line, a systemd unit,
a llama-swap model) into a commented, valid spillway.toml.

- source.py, unit.py, llama_swap.py: each input form -> a `Source` (a command line, its
  environment, and where each came from);
- llama_env.py: llama-server's LLAMA_ARG_* variables -> the flags they stand for;
- flags.py: where each flag goes (shared, GPU-only, owned by Spillway, not carried);
- cmdline.py: a Source -> a `Plan` (pure); hfcache.py: `-hf` -> the file in llama.cpp's cache;
- render.py: a Plan -> the TOML text (tomlkit, comments included);
- envfile.py: the secrets' file (mode 0600);
- arguments.py: the command's arguments; command.py: the command itself (loaded on use).
"""

from __future__ import annotations

import argparse

from .arguments import add_arguments


def run(args: argparse.Namespace) -> int:
    from .command import run as run_init

    return run_init(args)


__all__ = ["add_arguments", "run"]
