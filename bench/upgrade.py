"""An upgrade in place against a restart, under steady traffic (issue 40): the longest any request
waited across each, the requests refused or lost, and whether the children were kept.

Real llama-server children (SmolLM2-135M-Instruct, Q4_1; the GPU child CPU-only on a machine
without a GPU, every child with one thread: `-c 2048 -np 2 -t 1 -tb 1`), one daemon a round.
Three client loops send chat completions of 16 tokens, streamed and plain in turn, each on a new
connection (a refused connection is counted and tried again after 50 ms, as a client would).
After `--settle` seconds, one of:

- upgrade: `spillway upgrade --config FILE` (the daemon bound its own socket);
- restart (socket activation): the listening socket is held here, as systemd's spillway.socket
  holds it; SIGTERM, and once the daemon has exited a new one is started on the same socket;
- restart (no socket activation): SIGTERM, then `spillway run` again, binding its own.

The traffic goes on until `--after` seconds past the moment the new daemon serves with both
children READY (and, at an upgrade, the old one has exited). Per round: the longest time a
request took among those in flight at any moment of the change (from the action until the
traffic's end), the longest of the steady state before it (the reference), how long from the
action until the new daemon serves (an upgrade: until `spillway upgrade` returns), the refused
connections, the requests that failed (anything but a 200 and a whole answer), and whether
both children kept their pids.

    PYTHONPATH=. /work/main/.venv/bin/python -m bench.upgrade [--rounds 3] [--settle 4]
        [--after 4] [--model PATH]

Prints the table and writes bench/results/upgrade.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness import PATIENCE_S, Spillway, eventually, real_config, wait_gone  # noqa: E402

from supervisor.commands import bootstrap  # noqa: E402

TOKENS = 16
PROMPT = "Name three rivers and say where each one meets the sea."
SCENARIOS = ("upgrade", "restart, socket activation", "restart, no socket activation")

# What systemd does between fork and exec for spillway.socket: the socket to fd 3, LISTEN_FDS=1
# and LISTEN_PID the process's own pid (exec keeps it).
ACTIVATE = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="spillway")
os.execv(sys.executable, [sys.executable, "-m", "supervisor", "run", "--config", sys.argv[2]])
"""


@dataclass
class Traffic:
    port: int
    loops: int = 3
    done: list[tuple[float, float, str]] = field(default_factory=list)  # began, took, outcome
    refused: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _one(self, stream: bool) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=PATIENCE_S)
        try:
            while True:
                try:
                    conn.connect()
                    break
                except ConnectionRefusedError:
                    self.refused += 1
                    if self._stop.wait(0.05):
                        return "stopped"
            conn.request("POST", "/v1/chat/completions", json.dumps(
                {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
                 "stream": stream}), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            return f"status {resp.status}: {body[:120].decode(errors='replace')}"
        if stream and b"data: [DONE]" not in body:
            return "stream cut"
        return "ok"

    def _loop(self, n: int) -> None:
        stream = n % 2 == 0
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                outcome = self._one(stream)
            except Exception as e:  # noqa: BLE001 - a reset or a timeout is a finding
                outcome = type(e).__name__
            if outcome != "stopped":
                self.done.append((began, time.monotonic() - began, outcome))
            stream = not stream

    def start(self) -> None:
        for n in range(self.loops):
            t = threading.Thread(target=self._loop, args=(n,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(PATIENCE_S)


def start_activated(s: Spillway, sock: socket.socket) -> None:
    fd = sock.fileno()
    s._log = open(s.log_path, "ab")
    s.proc = subprocess.Popen([sys.executable, "-c", ACTIVATE, str(fd), str(s.config_path)],
                              cwd=s.folder, env=s.env, stdout=s._log, stderr=subprocess.STDOUT,
                              pass_fds=(fd,))


def pids(s: Spillway) -> dict[str, int]:
    return {n: c["pid"] for n, c in s.status()["children"].items()}


def one_round(scenario: str, cfg: dict[str, Any], folder: Path, settle: float,
              after: float) -> dict[str, Any]:
    s = Spillway(folder, cfg)
    held = None
    extra: list[int] = []
    try:
        if scenario == "restart, socket activation":
            held = socket.create_server(("127.0.0.1", s.port), backlog=1024)
            start_activated(s, held)
        else:
            s.start(wait_ready=False)
        s.wait_ready()
        before = pids(s)
        traffic = Traffic(s.port)
        traffic.start()
        time.sleep(settle)  # the steady state: the reference
        acted = time.monotonic()
        assert s.proc is not None
        if scenario == "upgrade":
            done = subprocess.run([sys.executable, "-m", "supervisor", "upgrade", "--config",
                                   str(s.config_path)], env=s.env, capture_output=True,
                                  text=True, timeout=PATIENCE_S)
            assert done.returncode == 0, done.stderr
            serving = time.monotonic()  # `spillway upgrade` returns once the new one serves
            extra.append(s.status()["daemon"]["pid"])
            s.proc.wait(PATIENCE_S)
            s._log.close()
            s.proc = None  # the new daemon is not the harness's process (stopped below)
        else:
            s.proc.send_signal(signal.SIGTERM)
            s.proc.wait(PATIENCE_S)
            s._log.close()
            if held is not None:
                start_activated(s, held)
            else:
                s.start(wait_ready=False)
            s.wait_ready()
            serving = time.monotonic()
        s.wait_ready()
        ended = time.monotonic()
        assert eventually(lambda: time.monotonic() - ended > after, timeout=after + 5)
        traffic.stop()
        after_pids = pids(s)
    finally:
        for pid in extra:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        wait_gone(set(extra), 30)
        s.stop()
        if held is not None:
            held.close()
    steady = [took for began, took, _ in traffic.done if began + took < acted]
    across = [took for began, took, _ in traffic.done if began + took >= acted]
    return {
        "scenario": scenario,
        "requests": len(traffic.done),
        "failed": len([1 for *_, outcome in traffic.done if outcome != "ok"]),
        "failures": dict(Counter(outcome for *_, outcome in traffic.done if outcome != "ok")),
        "refused_connections": traffic.refused,
        "longest_steady_s": round(max(steady, default=0.0), 3),
        "longest_across_s": round(max(across, default=0.0), 3),
        "change_to_serving_s": round(serving - acted, 3),
        "children_kept": before == after_pids,
    }


def table(rounds: list[dict[str, Any]]) -> str:
    lines = ["| scenario | rounds | longest wait across it, s (median, max) | longest in the "
             "steady state, s (max) | change to serving, s (median) | refused connections | "
             "failed requests | children kept |", "|---|---|---|---|---|---|---|---|"]
    for scenario in SCENARIOS:
        rs = [r for r in rounds if r["scenario"] == scenario]
        if not rs:
            continue
        across = [r["longest_across_s"] for r in rs]
        lines.append(
            f"| {scenario} | {len(rs)} | {statistics.median(across):.3f}, {max(across):.3f} | "
            f"{max(r['longest_steady_s'] for r in rs):.3f} | "
            f"{statistics.median(r['change_to_serving_s'] for r in rs):.2f} | "
            f"{sum(r['refused_connections'] for r in rs)} | "
            f"{sum(r['failed'] for r in rs)} of {sum(r['requests'] for r in rs)} | "
            f"{sum(r['children_kept'] for r in rs)} of {len(rs)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=4.0)
    parser.add_argument("--after", type=float, default=4.0)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    binary = bootstrap.ensure_llama_server()
    model = Path(args.model) if args.model else bootstrap.ensure_model()
    cfg = real_config(binary, model)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-upgrade-") as tmp:
        for n in range(args.rounds):
            for scenario in SCENARIOS:
                r = one_round(scenario, cfg, Path(tmp) / f"{n}-{len(rounds)}", args.settle,
                              args.after)
                rounds.append(r)
                print(json.dumps(r), flush=True)
    text = table(rounds)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    header = (f"`python -m bench.upgrade --rounds {args.rounds}`, {model.name}, on {cpu} "
              f"({os.cpu_count()} cores)")
    print(f"\n{header}\n\n{text}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "upgrade.json").write_text(json.dumps({"machine": cpu, "model": model.name,
                                                  "rounds": rounds}, indent=1) + "\n")
    (out / "upgrade.md").write_text(f"{header}\n\n{text}\n")


if __name__ == "__main__":
    main()
