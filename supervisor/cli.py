"""The `spillway` command. The only module that exits the process.

Exit codes: 0 success, 1 failure, 2 bad configuration or usage, 3 daemon not answering.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from . import __version__, bootstrap, config, logs

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_CONFIG = 2
EXIT_UNREACHABLE = 3


def _print_problems(err: config.ConfigError) -> None:
    print(f"{err.source}: {len(err.problems)} problem(s):", file=sys.stderr)
    for p in err.problems:
        print(f"  {p}", file=sys.stderr)


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        cfg = config.load(args.file)
    except config.ConfigError as e:
        _print_problems(e)
        return EXIT_CONFIG
    print(f"{cfg.path}: valid")
    for name in config.CHILD_NAMES:
        child = cfg.child(name)
        print(f"  {name} child: {' '.join(child.command(0, '')[:-6])}")
    return EXIT_OK


def _run_daemon(cfg: config.Config) -> int:
    from .daemon import Daemon  # imported late: `check-config` and `version` stay light

    logs.setup(cfg.server.log_level)

    async def main() -> int:
        return await Daemon(cfg).run()

    return asyncio.run(main())


def cmd_run(args: argparse.Namespace) -> int:
    try:
        cfg = config.load(args.config)
    except config.ConfigError as e:
        _print_problems(e)
        return EXIT_CONFIG
    return _run_daemon(cfg)


def cmd_version(args: argparse.Namespace) -> int:
    print(f"spillway {__version__}")
    return EXIT_OK


def cmd_quickstart(args: argparse.Namespace) -> int:
    """Provide llama-server and a small model, write a config, run the daemon."""
    try:
        binary = bootstrap.ensure_llama_server(args.llama_server)
        model = bootstrap.ensure_model()
    except (bootstrap.BootstrapError, OSError) as e:
        print(f"spillway quickstart: {e}", file=sys.stderr)
        return EXIT_FAIL
    devices = bootstrap.list_devices(str(binary))
    path = Path(args.config).expanduser()
    if not path.exists() or args.rewrite_config:
        bootstrap.write_default_config(path, binary, model, devices, listen=args.listen)
        print(f"spillway: wrote {path}", file=sys.stderr)
    else:
        print(f"spillway: using the existing {path} (--rewrite-config replaces it)",
              file=sys.stderr)
    if devices:
        print(f"spillway: GPU child on {devices[0]}", file=sys.stderr)
    else:
        print("spillway: this llama-server lists no GPU device, so the GPU child runs "
              "CPU-only; failover, admission and the drill still work (the drill says "
              "\"simulated\")", file=sys.stderr)
    try:
        cfg = config.load(path)
    except config.ConfigError as e:
        _print_problems(e)
        return EXIT_CONFIG
    return _run_daemon(cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spillway",
        description="Keeps a home llama-server answering when its GPU runs out of memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the daemon")
    p.add_argument("--config", "-c", required=True, help="the TOML configuration file")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check-config", help="validate a configuration file (exit 0 or 2)")
    p.add_argument("file")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=cmd_version)

    default_config = bootstrap.cache_dir() / "quickstart.toml"
    p = sub.add_parser("quickstart", help="build/fetch llama-server and a small model, write "
                                          "a default config, run on 127.0.0.1:8080")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                   help="use this llama-server binary instead of building one "
                        "(default: $LLAMA_SERVER)")
    p.add_argument("--config", default=str(default_config),
                   help=f"where the default config is written (default: {default_config})")
    p.add_argument("--listen", default="127.0.0.1:8080",
                   help="the address written into a new config (default: 127.0.0.1:8080)")
    p.add_argument("--rewrite-config", action="store_true",
                   help="write the default config even if the file exists")
    p.set_defaults(func=cmd_quickstart)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
