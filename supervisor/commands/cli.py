"""The `spillway` command. The only module that exits the process.

Exit codes: 0 success, 1 failure, 2 bad configuration or usage, 3 daemon not answering.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import __version__
from . import bootstrap, remote as client, tables
from ..config import schema as config, edit as config_edit
from ..gpu.llama_devices import list_devices
from ..service import logs

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_CONFIG = 2
EXIT_UNREACHABLE = 3


def _print_problems(err: config.ConfigError) -> None:
    print(f"{err.source}: {len(err.problems)} problem(s):", file=sys.stderr)
    for p in err.problems:
        print(f"  {p}", file=sys.stderr)


def _print_router_models(cfg: config.Config) -> None:
    """Router mode: the models the routers would serve, one a line with where it comes from;
    warnings (to stderr) never make the config invalid."""
    from ..config import models_dir

    print("  router mode: both children are llama-server routers over the same models, one "
          "instance per model, routed by the request's \"model\"")
    found = models_dir.find_models(cfg)
    if found:
        width = max(len(m.name) for m in found)
        print(f"  models ({len(found)}; and any in llama.cpp's cache, LLAMA_CACHE):")
        for m in found:
            print(f"    {m.name.ljust(width)}  from {', '.join(m.sources)}")
    for name in cfg.order:
        child = cfg.child(name)
        most = child.models_max or "no limit"
        print(f"  {name} router: at most {most} model(s) loaded at once (--models-max)")
    names = {m.name for m in found}
    for large, smaller in cfg.smaller_models.items():
        print(f"  smaller model of {large}: {smaller}, kept loaded on the GPU router")
        for model in (large, smaller):
            if found and model not in names:
                print(f"warning: small.models names {model!r}, which the models folder or "
                      "preset does not list (a model in llama.cpp's cache is not checked here)",
                      file=sys.stderr)
    for warning in models_dir.warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)


def cmd_check_config(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.config is None):
        print("spillway check-config: name the file once: check-config FILE or "
              "check-config --config FILE", file=sys.stderr)
        return EXIT_CONFIG
    try:
        cfg = config.load(args.file or args.config)
    except config.ConfigError as e:
        _print_problems(e)
        return EXIT_CONFIG
    print(f"{cfg.path}: valid")
    if cfg.router:
        _print_router_models(cfg)
    for name in cfg.order:
        child = cfg.child(name)
        print(f"  {name} child: {' '.join(child.command(0, '')[:-6])}")
        if child.smaller:
            whom = ("every request that may change model" if child.requests == "all" else
                    "the requests that say X-Spillway-Fallback: smaller")
            print(f"    {child.mode}; serves {whom}, while the GPU child cannot")
    return EXIT_OK


def _run_daemon(cfg: config.Config,
                on_ready: Callable[[Sequence[str]], None] | None = None) -> int:
    from ..service.daemon import Daemon  # imported late: `check-config` and `version` stay light

    logs.setup(cfg.server.log_level)

    async def main() -> int:
        return await Daemon(cfg, on_ready=on_ready).run()

    return asyncio.run(main())


def cmd_run(args: argparse.Namespace) -> int:
    try:
        path = client.find_config(args.config)
        cfg = config.load(path)
    except config.ConfigError as e:
        _print_problems(e)
        return EXIT_CONFIG
    if args.config is None:
        print(f"spillway: running {cfg.path}", file=sys.stderr)
    return _run_daemon(cfg)


def cmd_upgrade(args: argparse.Namespace) -> int:
    """Hand the running daemon's sockets and children to a new daemon running the code
    installed now: no model reload, no connection refused (service/handover.py)."""
    from ..service.handover import UPGRADE_TIMEOUT_S, ask

    try:
        path = os.path.realpath(client.find_config(args.config))
    except config.ConfigError as e:
        _print_problems(e)
        return EXIT_CONFIG
    timeout = args.timeout or UPGRADE_TIMEOUT_S
    candidates = client.control_sockets(path)
    sockets = [p for p in candidates if p.exists()]
    if not sockets:
        print(f"spillway upgrade: no spillway runs {path} here (no control socket at "
              f"{' or '.join(map(str, candidates))})", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        answer = ask(sockets[0], {"op": "upgrade", "config": path, "timeout_s": timeout},
                     timeout + 30)
    except OSError as e:
        print(f"spillway upgrade: no answer on {sockets[0]}: {e} (is the daemon running?)",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    if not answer.get("ok"):
        print(f"spillway upgrade: {answer.get('error')}; the running spillway serves on",
              file=sys.stderr)
        return EXIT_FAIL
    kept = answer.get("adopted") or {}
    ended = answer.get("ended") or {}
    print(f"spillway upgraded: pid {answer.get('old_pid')} -> pid {answer.get('pid')}, "
          f"serving; kept {', '.join(f'{n} (pid {p})' for n, p in kept.items()) or 'no child'}"
          f"; pid {answer.get('old_pid')} finishes its requests in flight"
          + (f", ends {', '.join(f'{n} (pid {p})' for n, p in ended.items())} (not adopted: "
             "the new daemon starts its own)" if ended else "") + " and exits")
    return EXIT_OK


def cmd_version(args: argparse.Namespace) -> int:
    print(f"spillway {__version__}")
    return EXIT_OK


def cmd_init(args: argparse.Namespace) -> int:
    """Turn a llama-server command line, unit or llama-swap model into a config."""
    from . import init  # imported late: the other commands stay light

    return init.run(args)


def cmd_quickstart(args: argparse.Namespace) -> int:
    """Provide llama-server, a small model and the chat page, write a config, run the daemon."""
    from . import webui

    if args.router and args.small:
        print("spillway quickstart: --small and --router do not go together (router mode has "
              "no small child)", file=sys.stderr)
        return EXIT_CONFIG
    path = _quickstart_config(args)
    reuse = path.exists() and not args.rewrite_config
    # Before the build: a taken port found after five minutes of compiling is a poor start.
    listen = _quickstart_listen(args.listen, path if reuse else None)
    if listen is None:
        return EXIT_CONFIG
    try:
        binary = bootstrap.ensure_llama_server(args.llama_server)
        model = bootstrap.ensure_model()
        # With --small, SmolLM2 is the small child's and Gemma 3 270M the larger model.
        small = model if args.small else None
        model = bootstrap.ensure_gemma() if args.small else model
    except (bootstrap.BootstrapError, OSError) as e:
        print(f"spillway quickstart: {e}", file=sys.stderr)
        return EXIT_FAIL
    # After the binary and the model: the chat page is optional, and says so when it fails.
    ui = webui.web_ui_for_quickstart(binary)
    devices = list_devices(str(binary))
    if not reuse:
        bootstrap.write_default_config(path, binary, model, devices, listen=listen,
                                       router=args.router, small_model=small)
        print(f"spillway: wrote {path}", file=sys.stderr)
    else:
        print(f"spillway: using the existing {path} (--rewrite-config replaces it)",
              file=sys.stderr)
        if listen != _config_listen(path):
            config_edit.edit(path, "server.listen", json.dumps(listen))
            print(f"spillway: server.listen = {listen!r} in {path}", file=sys.stderr)
        hint = bootstrap.outdated_quickstart_config(path)
        if hint:
            print(f"spillway: {hint}", file=sys.stderr)
    try:
        changed = webui.serve_in_config(path, ui)
    except (OSError, config_edit.EditError, ValueError) as e:
        changed = f"could not give {path} the chat page's --path: {e}"
    if changed:
        print(f"spillway: {changed}", file=sys.stderr)
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
    if args.small and cfg.small_child is None:
        print(f"spillway: {path} has no small child ([small] path); --rewrite-config writes "
              "one", file=sys.stderr)
    bootstrap.remember_quickstart_config(path)
    return _run_daemon(cfg, on_ready=_quickstart_welcome(cfg, model if cfg.router else None,
                                                         webui.serves_chat_page(cfg)))


def _quickstart_config(args: argparse.Namespace) -> Path:
    """Where the quickstart's config goes: --config; by default quickstart.toml, which stays
    single-model on the embedded model, and beside it one for --router and one for --small."""
    path = Path(args.config).expanduser()
    if args.config != str(bootstrap.cache_dir() / "quickstart.toml"):
        return path
    if args.router:
        return path.with_name("quickstart-router.toml")
    if args.small:
        return path.with_name("quickstart-small.toml")
    return path


def _config_listen(path: Path) -> str | None:
    """The first server.listen of a config file, as written (None if it has none)."""
    try:
        doc = config_edit.read(path)
    except (OSError, config_edit.EditError, ValueError):
        return None
    listen = doc.get("server", {}).get("listen")
    if isinstance(listen, list):
        listen = listen[0] if listen else None
    return str(listen) if listen is not None else None


def _quickstart_listen(wanted: str | None, reused: Path | None) -> str | None:
    """The address the quickstart will listen on: --listen, else the reused config's, else
    127.0.0.1:8080. When it is taken: who holds it, and the next free port (asked on a
    terminal, printed as a --listen line otherwise). None: do not go on."""
    from . import ports, quickstart

    listen = wanted or (reused and _config_listen(reused)) or quickstart.DEFAULT_LISTEN
    try:
        addr = config.parse_listen(listen)
        taken = ports.check(addr.host, addr.port)
    except (ValueError, OSError) as e:
        print(f"spillway quickstart: cannot listen on {listen}: {e}", file=sys.stderr)
        return None
    if taken is None:
        return listen
    print(quickstart.port_taken(taken, quickstart.own_command()), file=sys.stderr)
    if taken.next_free is None or not sys.stdin.isatty():
        return None
    instead = quickstart.address(taken.host, taken.next_free)
    answer = input(f"Listen on {instead} instead? [Y/n] ").strip().lower()
    return instead if answer in ("", "y", "yes") else None


def _quickstart_welcome(cfg: config.Config, model: Path | None,
                        chat_page: bool = False) -> Callable[[Sequence[str]], None]:
    """Once Spillway serves: the newcomer's lines (a chat, the status, the page, and the chat
    page when the children serve one)."""
    from . import quickstart

    try:
        found = client.find_config(None)
    except config.ConfigError:
        found = None
    # The client commands find this config by themselves unless the service's is there too.
    same = found is not None and cfg.path is not None and \
        Path(found).resolve() == Path(cfg.path)
    flag = "" if same else f" --config {shlex.quote(str(cfg.path))}"

    def show(listening: Sequence[str]) -> None:
        text = quickstart.welcome(cfg, listening, quickstart.own_command(), flag,
                                  model=model.stem if model else None, chat_page=chat_page)
        print(f"\n{text}\n", file=sys.stderr, flush=True)

    return show


def _target(args: argparse.Namespace) -> client.Target:
    return client.target_from(args.url, args.config, args.api_key)


def _remote(args: argparse.Namespace, method: str, path: str) -> tuple[int, object]:
    """(exit code, answer); prints the reason when the daemon did not answer."""
    try:
        target = _target(args)
    except config.ConfigError as e:
        _print_problems(e)
        return EXIT_CONFIG, None
    return _call(target, method, path)


def _call(target: client.Target, method: str, path: str) -> tuple[int, object]:
    try:
        return EXIT_OK, client.call(target, method, path)
    except client.Unreachable as e:
        print(f"spillway: {e} (is the daemon running? `systemctl status spillway`)",
              file=sys.stderr)
        return EXIT_UNREACHABLE, None
    except client.RequestFailed as e:
        print(f"spillway: {e}", file=sys.stderr)
        return EXIT_FAIL, None


def _gib(value: object) -> str:
    return f"{value / 1073741824:.1f} GiB" if isinstance(value, int | float) else "-"


def _format_card(card: dict[str, Any]) -> str:
    """`GPU 0000:01:00.0 NVIDIA RTX 4090 (nvidia, nvml): 2.1 GiB free of 24.0 GiB; GPU child
    uses 18.3 GiB`: the GPU child's use on its own cards, "not the GPU child's" on the others
    it was given, "not given to the GPU child" on those it was not (gpu.device's choice)."""
    memory = " VRAM+GTT" if card.get("memory") == "vram+gtt" else ""
    line = (f"GPU {card.get('pci_bus_id')} {card.get('name')} ({card.get('vendor')}, "
            f"{card.get('source')}): {_gib(card.get('free_bytes'))} free of "
            f"{_gib(card.get('total_bytes'))}{memory}")
    if card.get("estimated"):
        line += " (estimate)"
    if card.get("given_to_gpu_child") is False:  # absent from a daemon that does not say
        return line + "; not given to the GPU child"
    if not card.get("used_by_gpu_child"):
        return line + "; not the GPU child's"
    used = (card.get("children_used_bytes") or {}).get("gpu")
    return line + ("; GPU child uses " + _gib(used) if used is not None else
                   "; the GPU child's, no process of it running")


def format_gpu(status: dict[str, Any]) -> list[str]:
    """A line per card, with several the cards the GPU child is given and why, and how the
    cards it uses are known when that is assumed or when it uses none; `GPU: none (why)`
    without figures."""
    gpu = status.get("gpu")
    if not gpu:
        return [f"GPU: none ({status.get('gpu_note')})"]
    cards = gpu.get("devices")
    if cards is None and gpu.get("pci_bus_id"):  # an older daemon: its one card at the top
        cards = [{**gpu, "used_by_gpu_child": True}]
    out = [_format_card(card) for card in cards or []]
    given = gpu.get("gpu_child_given")
    if given and len(cards or []) > 1:  # which of several cards it has, and why those
        out.append(f"GPU child is given: {', '.join(given['pci_bus_ids']) or 'none'} "
                   f"({given['why']})")
    chosen = gpu.get("gpu_child_devices") or {}
    why = chosen.get("why")
    if chosen and not chosen.get("pci_bus_ids"):
        out.append(f"GPU child's cards: none ({why})")
    elif chosen.get("how") == "config (assumed)":
        out.append(f"GPU child's cards: {', '.join(chosen['pci_bus_ids'])}, by config "
                   f"(assumed): {why}")
    note = status.get("gpu_note")
    if note and note != why:
        out.append(f"GPU note: {note}")
    return out


def _child_lines(name: str, c: dict[str, Any]) -> list[str]:
    """One child's lines under the table: its reason, and what else its status says."""
    out = [f"{name}: {c.get('reason', '')}"]
    if c.get("why"):
        out.append(f"  {c['why']}")
    known = c.get("diagnosis")
    if known:
        out += [f"  known crash {known['signature']}: {known['what']}",
                f"  fix: {known['remedy']}", f"  see: {known['upstream']}"]
    refusal = (c.get("last_exit") or {}).get("refusal")
    if refusal and c.get("state") != "READY":
        out.append(f"  llama-server refused {refusal['argument'] or 'its command'}: "
                   f"{'; '.join(refusal['said'])}")
    rejected = c.get("rejected_command")
    if rejected:
        what = rejected["argument"] or "its new command"
        out.append(f"  new command rolled back at {rejected['time']}: {what}: "
                   f"{rejected['why']}")
    if c.get("runs_on"):
        out.append(f"  runs on: {c['runs_on']}")
    if c.get("smaller_model"):
        whom = ("every request" if c.get("requests") == "all"
                else "requests with X-Spillway-Fallback: smaller")
        out.append(f"  smaller model: {c['smaller_model']} ({c.get('mode')}; for {whom})")
    told = c.get("offload")  # the GPU child's: how much of it is on the GPU
    if told:
        out.append(f"  on the GPU: {told['state']}: {told['why']}")
    lent = c.get("lent")  # the GPU child's card lent to other programs
    if lent:
        woken = {"idle": "; the next request wakes it",
                 "yield": "; back once the card has room and that program is done"}.get(
            lent["why"], "; spillway gpu resume brings it back")
        whom = f" to {lent['to_whom']}" if lent.get("to_whom") else ""
        vram = f" ({lent['vram']})" if lent.get("vram") else ""
        out.append(f"  GPU lent ({lent['why']}){whom} since {lent['since']}, "
                   f"{lent['for_s']:.0f} s{vram}: {lent['answered_by_cpu']} answered by the "
                   f"CPU child meanwhile{woken}")
    lent_models = c.get("lent_models")  # router mode: models whose GPU instance is lent
    if lent_models:
        out.append("  lent when idle: " + ", ".join(
            f"{name} (since {m['since']}, {m['answered_by_cpu']} answered by the CPU router)"
            for name, m in lent_models.items()) + "; the next request for each loads it again")
    return out


def _format_rollout(rollout: dict[str, Any]) -> str:
    """The last reload's new commands: `reload: new commands, one child at a time: cpu ready,
    gpu taking it`, and where it stopped."""
    done = [f"{name} {rollout['outcomes'][name]}" for name in rollout["order"]
            if name in rollout["outcomes"]]
    if rollout.get("current"):
        done.append(f"{rollout['current']} taking it")
    line = f"reload at {rollout['started']}: new commands, one child at a time: {', '.join(done)}"
    if rollout.get("kept"):
        line += f"; stopped there: {', '.join(rollout['kept'])} kept their command"
    return line


def _daemon_lines(daemon: dict[str, Any]) -> list[str]:
    """What the daemon took over at its start: an upgrade's handover, or the children a crashed
    one left."""
    out = []
    upgrade = daemon.get("upgrade")
    adopted = ", ".join(f"{n} (pid {p})" for n, p in (daemon.get("adopted") or {}).items())
    if upgrade:
        out.append(f"upgraded at {upgrade.get('serving')} from pid {upgrade.get('pid')} "
                   f"(pid {daemon.get('pid')} now): kept {adopted or 'no child'}")
    elif adopted:
        out.append(f"started at {daemon.get('started')} after pid {daemon.get('adopted_from_pid')}"
                   f" ended without stopping its children: adopted {adopted}")
    for ended in daemon.get("ended") or []:
        out.append(f"ended pid {ended['pid']} ({ended['child']}): {ended['why']}")
    return out


def format_status(status: dict[str, Any]) -> str:
    rows = []
    for name, c in status["children"].items():
        last = c.get("last_exit")
        rows.append([name, c["state"], c.get("pid") or "-", c.get("port") or "-",
                     c.get("restarts"), c.get("in_flight"),
                     f"{last['kind']}: {last['evidence']}"[:60] if last else "-"])
    out = [f"spillway {status.get('version')}  up {status.get('uptime_s', 0):.0f} s  "
           f"listening on {', '.join(status.get('listen', []))}",
           *_daemon_lines(status.get("daemon") or {}),
           "", tables.render(["child", "state", "pid", "port", "restarts", "in flight",
                              "last exit"], rows), ""]
    for name, c in status["children"].items():
        out += _child_lines(name, c)
    if status.get("router"):
        out += ["", _format_models(status), ""]
    out += format_gpu(status)
    out.append(f"waiting: {status.get('waiting', 0)}")
    streams = status.get("streams") or {}
    if streams.get("live") or streams.get("finished"):
        out.append(f"resumable streams: {streams['live']} live, {streams['finished']} finished "
                   f"({streams['held_bytes'] / 1048576:.1f} MiB held)")
    if not status.get("serving"):
        out.append(f"NOT SERVING: {status.get('why_not_serving')}")
    cfg = status.get("config", {})
    if cfg.get("error"):
        out.append(f"config: {cfg.get('path')}: the last reload was refused: {cfg['error']}")
    if cfg.get("rollout"):
        out.append(_format_rollout(cfg["rollout"]))
    last = (status.get("incidents") or {}).get("last") or []
    if last:
        out += ["", "last incidents:", format_incidents(last)]
    return "\n".join(out)


def _format_models(status: dict[str, Any]) -> str:
    """Router mode: each model on each child."""
    rows = []
    for model in status.get("models") or []:
        for name, c in status["children"].items():
            m = (c.get("models") or {}).get(model)
            if m is None:
                continue
            last = m.get("last_exit")
            rows.append([model, name, m["state"], m.get("pid") or "-",
                         f"{m.get('busy', 0)}/{m.get('cap', '-')}", m.get("loads"),
                         m.get("failures"),
                         f"{last['kind']}: {last['evidence']}"[:50] if last else
                         (m.get("reason") or "")[:50]])
    return tables.render(["model", "child", "state", "pid", "busy", "loads", "failures",
                          "last exit or reason"], rows)


def format_incidents(records: list[dict[str, Any]]) -> str:
    rows = [[r.get("time", "")[:19], r.get("request_id", "")[:18], r.get("child"),
             r.get("kind"), r.get("decision"), r.get("status"),
             f"{r.get('latency_s', 0):.2f}", "yes" if r.get("client_connected") else "no",
             (r.get("evidence") or "")[:50]] for r in records]
    return tables.render(["time", "request", "child", "kind", "decision", "status",
                          "latency s", "client", "evidence"], rows)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        target = _target(args)
    except config.ConfigError as e:
        return _status_without_the_file(args, e)
    code, answer = _call(target, "GET", "/spillway/status")
    if isinstance(answer, dict):
        print(json.dumps(answer, indent=1) if args.json else format_status(answer))
    return code


def _status_without_the_file(args: argparse.Namespace, error: config.ConfigError) -> int:
    """The config file does not load (say an edit the daemon refused at its reload): the daemon
    that runs it is found by its path (its control socket), and its status shown with what is
    wrong with the file. A daemon that answers is a status shown: exit 0, as when the daemon
    itself reports a refused reload; with none, the file's problems and exit 2."""
    try:
        path = os.path.realpath(client.find_config(args.config))
    except config.ConfigError:
        _print_problems(error)
        return EXIT_CONFIG
    status = client.status_by_control(path)
    if status is None:
        _print_problems(error)
        print(f"spillway: and no spillway running {path} answers here (no control socket at "
              f"{' or '.join(map(str, client.control_sockets(path)))})", file=sys.stderr)
        return EXIT_CONFIG
    refused = [str(p) for p in error.problems]
    if args.json:
        status["config_on_disk"] = {"path": path, "problems": refused}
        print(json.dumps(status, indent=1))
    else:
        print(format_status(status))
        print(f"config on disk: {path} does not load, so the daemon serves on the config it "
              f"last loaded: {'; '.join(refused)}")
    return EXIT_OK


def cmd_incidents(args: argparse.Namespace) -> int:
    code, answer = _remote(args, "GET", f"/spillway/incidents?limit={args.limit}")
    if not isinstance(answer, dict):
        return code
    records = answer["incidents"]
    if args.json:
        print(json.dumps(records, indent=1))
    elif not records:
        print(f"no incidents recorded ({answer.get('path')})")
    else:
        print(format_incidents(records))
    return EXIT_OK


def cmd_gpu(args: argparse.Namespace) -> int:
    code, answer = _remote(args, "POST", f"/spillway/gpu/{args.action}")
    if isinstance(answer, dict):
        print(answer["message"])
    return code


def cmd_drill(args: argparse.Namespace) -> int:
    from . import drill  # the drill's modules load only when it runs
    from .drill import profiles, report

    try:
        target = _target(args)
        cfg = config.load(args.config, check_paths=False) if args.config else None
    except config.ConfigError as e:
        _print_problems(e)
        return EXIT_CONFIG
    only = tuple(int(n) for n in args.only.split(",")) if args.only else drill.ALL
    try:
        result = asyncio.run(drill.run(
            target, how=args.ballast, only=only, prompt_tokens=args.prompt_tokens,
            model_path=cfg.model.path or None if cfg else None,
            binary=cfg.gpu.llama_server if cfg else None, model=args.model,
            second_model=args.second_model))
        if args.profiles:
            if cfg is None:
                print("spillway drill --profiles needs --config (the model and llama-server)",
                      file=sys.stderr)
                return EXIT_CONFIG
            if cfg.router:
                print("spillway drill --profiles needs single-model mode (model.path)",
                      file=sys.stderr)
                return EXIT_CONFIG
            result["profiles"] = asyncio.run(profiles.run(cfg, target))
    except client.Unreachable as e:
        print(f"spillway drill: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (RuntimeError, client.RequestFailed) as e:
        print(f"spillway drill: {e}", file=sys.stderr)
        return EXIT_FAIL
    print(report.table(result))
    if result.get("profiles"):
        print()
        print(profiles.table(result["profiles"]))
    json_path, html_path = drill.write(result, Path(args.out))
    print(f"\n{'PASSED' if result['passed'] else 'FAILED'}"
          f"{' (simulated: no GPU here)' if result['simulated'] else ''}; report: {html_path} "
          f"and {json_path}")
    return EXIT_OK if result["passed"] else EXIT_FAIL


def cmd_config(args: argparse.Namespace) -> int:
    """get|set|unset one key of the TOML file, keeping its comments and layout."""
    try:
        path = Path(client.find_config(args.config))
        if args.action == "get":
            value, found = config_edit.get(path, args.key)
            if value is None:
                print(f"{args.key} is not set in {path} and has no default", file=sys.stderr)
                return EXIT_FAIL
            print(value)
            if not found:
                print(f"({args.key} is not set in {path}: that is its default)", file=sys.stderr)
            return EXIT_OK
        if args.action == "set" and args.value is None:
            print("spillway config set KEY VALUE: give the value", file=sys.stderr)
            return EXIT_CONFIG
        if args.action == "set" and args.key in config_edit.SECRET_KEYS:
            return _set_secret(path, args.key, args.value)
        change = config_edit.edit(path, args.key, args.value if args.action == "set" else None)
    except config.ConfigError as e:
        _print_problems(e)
        return EXIT_CONFIG
    except config_edit.EditError as e:
        print(f"spillway config: {e}", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        print(f"spillway config: cannot write {path}: {e}", file=sys.stderr)
        return EXIT_FAIL
    _report_change(path, change)
    return EXIT_OK


def _set_secret(path: Path, key: str, value: str) -> int:
    """`config set server.api_key K`: K goes where `spillway init` puts it, the environment
    file beside the config (mode 0600), never into the config, which others may read; `-`
    reads K from stdin, so that it is not in `ps` or the shell's history either."""
    from .init import envfile
    from .init.source import InitError

    env_path = envfile.beside(path)
    if value == "-":
        value = sys.stdin.readline().strip()
    try:
        change = config_edit.set_secret(
            path, key, value, lambda name, v: envfile.write(env_path, {name: v}, force=True))
    except (InitError, OSError) as e:
        print(f"spillway config: {key}: cannot write {env_path}: {e}; nothing was changed",
              file=sys.stderr)
        return EXIT_FAIL
    names = change.names
    print(f"{key}: in {env_path} as {change.variable} (mode 0600), not in {path}, which "
          "others on this machine may read")
    print(f"  {names.key} = {names.after}" + (
        " (already)" if names.unchanged else f" (was {names.before or 'not set'})") +
          (f"; the key that was in {path} is gone from it" if change.removed else ""))
    print(f"  it takes effect when spillway restarts with {change.variable} set: "
          + ("the shipped systemd unit reads /etc/spillway/env (systemctl restart spillway)"
             if env_path == Path("/etc/spillway/env") else
             f"by hand, set -a; . {shlex.quote(str(env_path))}; set +a; before spillway run "
             "(the shipped systemd unit reads /etc/spillway/env: move it there)"))
    for p in names.already_wrong:
        print(f"  warning, already in the file: {p}", file=sys.stderr)
    return EXIT_OK


def _report_change(path: Path, change: config_edit.Change) -> None:
    if change.unchanged:
        print(f"{change.key} is already {change.after or 'unset'} in {path}; nothing written")
        return
    was = change.before if change.before is not None else "not set"
    now = change.after if change.after is not None else "unset (its default)"
    print(f"{change.key} = {now} (was {was}) in {path}")
    section_key = ".".join(change.key.split(".")[:2])
    if section_key in config.RESTART_KEYS:
        print(f"  {section_key} takes effect when spillway restarts "
              "(`systemctl restart spillway`)")
    else:
        print("  a running spillway reloads the file by itself (or: systemctl reload spillway)")
    for p in change.already_wrong:
        print(f"  warning, already in the file: {p}", file=sys.stderr)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None,
                   help=f"the daemon's config, for its address and key (default: "
                        f"$SPILLWAY_CONFIG, ./{client.LOCAL_CONFIG}, {client.DEFAULT_CONFIG}, "
                        "or the one `spillway quickstart` last ran)")
    p.add_argument("--url", default=None, help="the daemon's address, e.g. "
                                               "http://127.0.0.1:8080 (instead of --config)")
    p.add_argument("--api-key", default=None, help="the key (default: $SPILLWAY_API_KEY or "
                                                   "the config's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spillway",
        description="Keeps a home llama-server answering when its GPU runs out of memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the daemon")
    p.add_argument("--config", "-c", default=None,
                   help=f"the TOML configuration file (default: $SPILLWAY_CONFIG, "
                        f"./{client.LOCAL_CONFIG}, {client.DEFAULT_CONFIG}, or the one "
                        "`spillway quickstart` last ran)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("upgrade", help="run the code installed now without a model reload: "
                                       "the running daemon hands its listening sockets and "
                                       "children to a new daemon (exit 0 once it serves, else "
                                       "1 with why, the old one serving on)")
    p.add_argument("--config", "-c", default=None,
                   help="the running daemon's TOML file (default: as for run)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds for the new daemon to serve (default: 120)")
    p.set_defaults(func=cmd_upgrade)

    p = sub.add_parser("check-config", help="validate a configuration file (exit 0 or 2); in "
                                            "router mode, list the models it finds")
    p.add_argument("file", nargs="?", default=None)
    p.add_argument("--config", "-c", default=None, help="the file (instead of FILE)")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=cmd_version)

    from .init import arguments as init_arguments  # argparse only: the rest loads on use

    p = sub.add_parser("init", help="write a config from the llama-server command line you run "
                                    "(after --), a systemd unit (--from-unit) or a llama-swap "
                                    "model (--from-llama-swap)")
    init_arguments.add_arguments(p)
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("status", help="children, states, GPU memory, waiting line, incidents "
                                      "(exit 3 when the daemon does not answer)")
    _add_target(p)
    p.add_argument("--json", action="store_true", help="the raw JSON, for scripts")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("incidents", help="the recorded incidents, newest last")
    _add_target(p)
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_incidents)

    p = sub.add_parser("gpu", help="operator control of the GPU child")
    p.add_argument("action", choices=("restart", "drain", "pause", "resume"),
                   help="restart: now; drain: finish its requests, then restart; pause: stop "
                        "it and free the VRAM (the CPU child serves); resume: start it again")
    _add_target(p)
    p.set_defaults(func=cmd_gpu)

    p = sub.add_parser("drill", help="the deliberate memory test: provoke a GPU failure and "
                                     "prove the failover; writes a report (exit 1 when a "
                                     "scenario falls short)")
    _add_target(p)
    p.add_argument("--out", default="drill-report", help="where the JSON and HTML reports go")
    p.add_argument("--ballast", default="auto",
                   choices=("auto", "simulate", "torch", "llama-server"),
                   help="how to run the GPU out of memory (auto: PyTorch if importable, else "
                        "a second llama-server; simulated when there is no GPU)")
    p.add_argument("--only", default=None, help="scenarios to run, e.g. 1,2 (default: all "
                                                "eleven; 6 runs in router mode only, 8 with a "
                                                "[small] child only, 9 with a projector "
                                                "(--mmproj) only, 10 with a warm CPU child "
                                                "(cpu.mirror, a hot CPU child) only; 11 is "
                                                "skipped where the GPU child is not faster)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="the size of the request over the GPU's profile (default: 60%% of a "
                        "slot's context, at most 24000)")
    p.add_argument("--profiles", action="store_true",
                   help="also compare GPU-resident, split and CPU profiles on one prompt set")
    p.add_argument("--model", default=None,
                   help="router mode: the model every request names (default: the routers' "
                        "first)")
    p.add_argument("--second-model", default=None,
                   help="router mode: the model scenario 6 loads next to it (default: the "
                        "routers' second)")
    p.set_defaults(func=cmd_drill)

    p = sub.add_parser("config", help="read or change one key of the config file in place, "
                                      "keeping its comments; a change is validated first and "
                                      "a running spillway reloads it")
    p.add_argument("action", choices=("get", "set", "unset"),
                   help="get: print the value as TOML (its default when unset); set: change "
                        "it; unset: remove it from the file (back to its default)")
    p.add_argument("key", help="section.name, e.g. queue.max_waiting or gpu.env.NAME")
    p.add_argument("value", nargs="?", default=None,
                   help="for set: a TOML value (7, true, \"hot\", [\"-ngl\", \"99\"]); a bare "
                        "word for a string key. server.api_key goes to the env file beside "
                        "the config, as init puts it (- reads it from stdin)")
    p.add_argument("--config", "-c", default=None,
                   help=f"the file (default: $SPILLWAY_CONFIG, ./{client.LOCAL_CONFIG}, "
                        f"{client.DEFAULT_CONFIG}, or the quickstart's)")
    p.set_defaults(func=cmd_config)

    default_config = bootstrap.cache_dir() / "quickstart.toml"
    p = sub.add_parser("quickstart", help="build/fetch llama-server and a small model, write "
                                          "a default config, run on 127.0.0.1:8080")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                   help="use this llama-server binary instead of building one "
                        "(default: $LLAMA_SERVER)")
    p.add_argument("--config", default=str(default_config),
                   help=f"where the default config is written (default: {default_config})")
    p.add_argument("--listen", default=None,
                   help="where to listen (default: the existing config's address, else "
                        "127.0.0.1:8080); a taken port is named with its holder before "
                        "anything is built")
    p.add_argument("--rewrite-config", action="store_true",
                   help="write the default config even if the file exists")
    p.add_argument("--router", action="store_true",
                   help="router mode: both children as llama-server routers over a models "
                        "folder (the embedded model; add your own .gguf files to it); the "
                        "config goes to quickstart-router.toml unless --config says otherwise")
    p.add_argument("--small", action="store_true",
                   help="two models: the GPU and CPU children serve Gemma 3 270M (fetched "
                        "once, 253 MB) and a third child, the small child, the embedded "
                        "SmolLM2-135M, for requests that say X-Spillway-Fallback: smaller "
                        "while the GPU child cannot take them; the config goes to "
                        "quickstart-small.toml unless --config says otherwise")
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
