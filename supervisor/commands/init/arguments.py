"""`spillway init`'s arguments: only argparse here (and the config schema's choices, which the CLI
loads anyway), so that building the CLI's parser loads none of init's modules (tomlkit, PyYAML)
for the other commands."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...config.schema import SMALL_MODES, SMALL_REQUESTS

SYSTEM_CONFIG = Path("/etc/spillway/spillway.toml")  # where the shipped systemd unit reads it


EXAMPLES = """examples:
  spillway init -- llama-server -m /srv/m.gguf -ngl 99 -c 16384 --host 0.0.0.0 --api-key KEY
  spillway init --from-unit /etc/systemd/system/llama.service
  spillway init --from-llama-swap config.yaml --model qwen --print
  spillway init --small /srv/small.gguf -- llama-server -m /srv/m.gguf -ngl 99

Every key written says where it came from; flags Spillway cannot carry over are comments saying
why. Secrets (the API key, HF_TOKEN) go to an `env` file beside the config, mode 0600, never into
it. The config is checked before anything is written."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EXAMPLES
    p.add_argument("llama_command", nargs=argparse.REMAINDER, metavar="-- LLAMA-SERVER ...",
                   help="the llama-server command line you run (after --; NAME=value words "
                        "before it are its environment)")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--from-unit", metavar="FILE",
                       help="read the command from a systemd unit's ExecStart= (with its "
                            "Environment= and EnvironmentFile=)")
    given.add_argument("--from-llama-swap", metavar="FILE",
                       help="read the command from a llama-swap config's model (cmd, env)")
    p.add_argument("--model", metavar="NAME",
                   help="with --from-llama-swap: the model (needed when it has several)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", metavar="FILE",
                     help=f"where to write the config (default: {SYSTEM_CONFIG} as root, "
                          "else ./spillway.toml); secrets go to an `env` file beside it")
    out.add_argument("--print", action="store_true",
                     help="write the config to stdout instead, and no file")
    p.add_argument("--force", action="store_true",
                   help="replace an existing config (and a different key in the env file)")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="where clients connect (default: from --host/--port, as llama-server "
                        "would listen)")
    p.add_argument("--new-key", action="store_true",
                   help="make a new API key (into the env file) when the source has none, so "
                        "that a non-loopback address can be kept")
    small = p.add_argument_group(
        "the small child", "a third child, serving a smaller model on the GPU's cards to the "
                           "requests that accept another model while the GPU child cannot "
                           "take them (single-model mode only)")
    small.add_argument("--small", metavar="FILE",
                       help="the smaller model's GGUF file: writes a [small] section")
    small.add_argument("--small-mode", choices=SMALL_MODES,
                       help="with --small: resident (the default: always loaded beside the GPU "
                            "child) or on-demand (started when the GPU child dies)")
    small.add_argument("--small-requests", choices=SMALL_REQUESTS,
                       help="with --small: opt-in (the default: only the requests that say "
                            "X-Spillway-Fallback: smaller) or all (every request may get the "
                            "smaller model's answer)")
