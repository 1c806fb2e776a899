"""Spillway's benchmarks, one command, every figure side by side with its reference in the same
run (so ratios hold on a noisy machine):

    .venv/bin/python -m bench [--quick] [--out bench/results]

- added latency (p50, p99) and throughput at concurrency 1, 16 and 64: straight to the
  upstream, through Spillway, through nginx (Debian's package, a plain keep-alive reverse proxy)
  and through LiteLLM's proxy (PyPI, its own virtual environment, a plain pass-through); once
  with an upstream that answers at once (nginx posing as llama-server, to isolate the proxy) and
  once with the real llama-server and the tiny model. Load comes from wrk (Debian's package,
  with a Lua script for the POST body), pinned to its own core with taskset;
- streams: added time to first token and added delay per SSE event (each event carries the time
  it was sent; its arrival is compared straight and through Spillway);
- the failover penalty: from the GPU child's death to the first byte from the CPU child, minus
  the same request sent straight to a CPU llama-server, the CPU child hot;
- Spillway's resident memory idle and with 256 open streams;
- keyed throughput: every request with a fresh Idempotency-Key (32 connections, the instant
  upstream), the key store empty and full at idempotency.max_keys (3,000 and the default
  10,000), as a ratio. `--baseline REV` measures the same against the
  `supervisor` package of a git revision too, in the same run (`--only idempotency` runs just
  this part and writes bench/results/idempotency.{json,md});
- the hot path against the bare aiohttp pass-through (bench/bare_proxy.py, the framework's own
  floor), with the instant upstream: Spillway's req/s at concurrency 64 as a fraction of the
  pass-through's (target >= 0.75) and its added p50 at concurrency 1 (p50 minus the straight
  p50) as a multiple of the pass-through's (target <= 1.25). The full run gives both for its
  instant section; `--only hotpath` measures straight, the pass-through, Spillway and, with
  `--baseline REV`, Spillway at that revision, in 3 interleaved rounds (`--rounds N`; their
  order rotating),
  each figure the median of the rounds, and writes bench/results/hotpath.{json,md}.

Needs root (or the tools already installed) for `apt-get install nginx wrk`. Writes
bench/results/latest.json and prints the table (docs/performance.md carries the latest one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness import Spillway, fake_server_script, free_port  # noqa: E402
from tinymodel import write_tiny_model  # noqa: E402

from supervisor.commands import bootstrap  # noqa: E402

BODY = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# LiteLLM's proxy refuses to start without a master key; every target gets the header (the
# others ignore it).
BENCH_KEY = "sk-spillway-bench"
SERVER_CORE = "0"
LOAD_CORE = "1"
CACHE = bootstrap.cache_dir() / "bench"
INSTANT = REPO / "bench" / "instant-upstream.sh"
MEASURES = (("p50 ms", "p50_ms", "{:.3f}"), ("p99 ms", "p99_ms", "{:.3f}"),
            ("req/s", "rps", "{:.0f}"))
# The hot path against the bare aiohttp pass-through: Spillway's req/s at c=64 over the
# pass-through's, at least; Spillway's added p50 at c=1 over the pass-through's, at most.
HOTPATH_TARGETS = {"throughput_ratio_c64": 0.75, "added_p50_ratio_c1": 1.25}
HOTPATH_CONCURRENCY = (1, 64)
HOTPATH_ROUNDS = 3


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def cores() -> int:
    return os.cpu_count() or 1


def pin(core: str) -> list[str]:
    """taskset when there are two cores or more: load and server apart."""
    return ["taskset", "-c", core] if cores() >= 2 and shutil.which("taskset") else []


def ensure_tools() -> None:
    missing = [p for p, cmd in (("nginx", "nginx"), ("wrk", "wrk")) if shutil.which(cmd) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise SystemExit(f"the benchmark needs {', '.join(missing)} (apt-get install "
                             f"{' '.join(missing)})")
        say(f"installing {', '.join(missing)} from Debian's packages")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], env=env, check=True,
                       capture_output=True)


def litellm_binary() -> Path | None:
    """LiteLLM's proxy in a virtual environment of its own (installed once, cached)."""
    venv = CACHE / "litellm-venv"
    binary = venv / "bin" / "litellm"
    if not binary.exists():
        say("installing LiteLLM's proxy into its own virtual environment (once)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        result = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                                 "litellm[proxy]"], capture_output=True, text=True)
        if result.returncode != 0:
            say(f"LiteLLM could not be installed; left out: {result.stderr[-300:]}")
            return None
    return binary


class Stack:
    """Processes started for the benchmark, all stopped at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.daemons: list[Spillway] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="spillway-bench-"))

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        for d in self.daemons:
            d.stop()
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)

    def start(self, argv: list[str], env: dict[str, str] | None = None,
              core: str = SERVER_CORE) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([*pin(core), *argv], env={**os.environ, **(env or {})},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def serve(self, argv: Callable[[int], list[str]], health: str | None = "/health",
              env: dict[str, str] | None = None, timeout: float = 60) -> int:
        """Start a server on a free port (``argv`` gets the port) and wait until it answers:
        at ``health`` over HTTP, or, where it has none, by accepting a connection."""
        port = free_port()
        self.start(argv(port), env=env)
        if health is None:
            wait_port(port, timeout)
        elif not wait_http(f"http://127.0.0.1:{port}{health}", timeout):
            raise RuntimeError(f"{argv(port)[0]} did not answer {health} on port {port}")
        return port

    def spillway(self, name: str, config: dict[str, Any], code: Path | None = None,
                 env: dict[str, str] | None = None) -> Spillway:
        """A daemon pinned, with its children, to the server core; `code`: a folder holding
        another `supervisor` package to run instead of this tree's; `env`: added to its
        environment."""
        s = Spillway(self.tmp / name, config, env=env, command_prefix=pin(SERVER_CORE))
        if code is not None:
            s.env["PYTHONPATH"] = str(code)
        s.start()
        self.daemons.append(s)
        return s

    def targets(self, upstream: int, spillway: Spillway,
                **more: int) -> dict[str, str]:
        """The chat route straight, through Spillway, nginx, the extra ports named, and
        LiteLLM (when it starts)."""
        ports = {"direct": upstream, "nginx": self.nginx_proxy(upstream), **more}
        litellm = self.litellm(upstream)
        if litellm is not None:
            ports["litellm"] = litellm
        out = {name: f"http://127.0.0.1:{port}/v1/chat/completions"
               for name, port in ports.items()}
        out["spillway"] = f"{spillway.url}/v1/chat/completions"
        return {k: out[k] for k in ("direct", "spillway", "nginx", *more, "litellm") if k in out}

    def bare_proxy(self, upstream_port: int) -> int:
        """The bare aiohttp pass-through (bench/bare_proxy.py) in front of the upstream."""
        return self.serve(lambda port: [sys.executable, str(REPO / "bench" / "bare_proxy.py"),
                                        f"http://127.0.0.1:{upstream_port}", str(port)],
                          health=None)

    def nginx_proxy(self, upstream_port: int) -> int:
        port = free_port()
        d = self.tmp / f"nginx-{port}"
        d.mkdir()
        (d / "nginx.conf").write_text(f"""
worker_processes 1;
pid {d}/nginx.pid;
error_log stderr error;
daemon off;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {d};
  proxy_temp_path {d};
  upstream u {{ server 127.0.0.1:{upstream_port}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://u;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
""")
        self.start(["nginx", "-c", str(d / "nginx.conf"), "-p", str(d)])
        wait_port(port)
        return port

    def litellm(self, upstream_port: int) -> int | None:
        binary = litellm_binary()
        if binary is None:
            return None
        port = free_port()
        cfg = self.tmp / f"litellm-{port}.yaml"
        cfg.write_text(f"""model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench
      api_base: http://127.0.0.1:{upstream_port}/v1
      api_key: none
""")
        self.start([str(binary), "--config", str(cfg), "--host", "127.0.0.1", "--port",
                    str(port), "--num_workers", "1"],
                   env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
                        "LITELLM_MASTER_KEY": BENCH_KEY})
        if not wait_http(f"http://127.0.0.1:{port}/health/liveliness", 240):
            say("LiteLLM did not start; left out")
            return None
        return port


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def wait_http(url: str, timeout: float) -> bool:
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        time.sleep(0.3)
    return False


def _ms(value: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", value.strip())
    if not m:
        return float("nan")
    n, unit = float(m.group(1)), m.group(2)
    return n / 1000 if unit == "us" else n if unit == "ms" else n * 1000


def wrk(url: str, connections: int, seconds: float, lua: Path,
        args: tuple[str, ...] = ()) -> dict[str, float]:
    """`args` go to the script's init()."""
    threads = max(1, min(connections, 2))
    out = subprocess.run([*pin(LOAD_CORE), "wrk", "-t", str(threads), "-c", str(connections),
                          "-d", f"{max(1, round(seconds))}s", "--latency", "-s", str(lua), url,
                          *(("--", *args) if args else ())],
                         capture_output=True, text=True, timeout=seconds + 60).stdout
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)\b", out)
    return {"p50_ms": _ms(p50.group(1)) if p50 else float("nan"),
            "p99_ms": _ms(p99.group(1)) if p99 else float("nan"),
            "rps": float(rps.group(1)) if rps else 0.0,
            "non_2xx": int(errors.group(1)) if errors else 0,
            "requests": int(done.group(1)) if done else 0,
            "elapsed_s": (float(done.group(2)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
                          [done.group(3)]) if done else 0.0}


def latency_matrix(targets: dict[str, str], seconds: float, lua: Path,
                   concurrency: tuple[int, ...]) -> dict[str, dict[str, dict[str, float]]]:
    results: dict[str, dict[str, dict[str, float]]] = {}
    for c in concurrency:
        for name, url in targets.items():
            wrk(url, c, min(2.0, seconds), lua)  # warm up
            r = wrk(url, c, seconds, lua)
            results.setdefault(name, {})[str(c)] = r
            errors = f"  ({r['non_2xx']} non-2xx)" if r["non_2xx"] else ""
            say(f"  {name:9s} c={c:<3d} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
                f"{r['rps']:.0f} req/s{errors}")
    return results


async def stream_timings(url: str, n: int) -> dict[str, list[float]]:
    """Time to first event, and each event's delay from its send time (`fake.t`)."""
    ttft: list[float] = []
    delays: list[float] = []
    body = {**BODY, "stream": True, "max_tokens": 64}
    async with aiohttp.ClientSession() as http:
        for _ in range(n):
            began = time.time()
            async with http.post(url, json=body) as r:
                first = True
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    now = time.time()
                    event = json.loads(line[6:])
                    if first:
                        ttft.append(now - began)
                        first = False
                    if "fake" in event:
                        delays.append(now - event["fake"]["t"])
    return {"ttft": ttft, "delays": delays}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))] if values else 0.0


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": cores(), "memory_gib": round(psutil.virtual_memory().total /
                                                              2**30), "python":
            platform.python_version(), "kernel": platform.release()}


@contextlib.contextmanager
def lua_body(body: dict[str, Any]) -> Iterator[Path]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\n')
        f.write(f"wrk.body = {json.dumps(json.dumps(body))}\n")
        f.write('wrk.headers["Content-Type"] = "application/json"\n')
        f.write(f'wrk.headers["Authorization"] = "Bearer {BENCH_KEY}"\n')
    try:
        yield Path(f.name)
    finally:
        os.unlink(f.name)


@contextlib.contextmanager
def lua_keyed(body: dict[str, Any]) -> Iterator[Path]:
    """Every request with an Idempotency-Key of its own: the run's name (init's argument), the
    thread and a counter."""
    with lua_body(body) as plain, tempfile.NamedTemporaryFile(
            "w", suffix=".lua", delete=False) as f:
        f.write(plain.read_text())
        f.write("""
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local run, n = "run", 0
function init(args)
  run = args[1] or run
end
function request()
  n = n + 1
  wrk.headers["Idempotency-Key"] = run .. "-" .. tostring(tid) .. "-" .. tostring(n)
  return wrk.format()
end
""")
    try:
        yield Path(f.name)
    finally:
        os.unlink(f.name)


IDEMPOTENCY_CLIENTS = 32


def settle(pid: int, timeout: float = 60) -> None:
    """Wait until a daemon is idle: the requests it read before wrk left are answered, so that
    they do not slow the next run (of the other daemon, on the same core)."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(proc.cpu_times()[:2])
        time.sleep(0.2)
        if sum(proc.cpu_times()[:2]) - before < 0.01:
            return


def keyed_throughput(empty: Spillway, full: Spillway, max_keys: int, rounds: int, plain: Path,
                     keyed: Path) -> dict[str, Any]:
    """Fresh keys against two daemons alike but for their stores: one whose keys expire at
    once (ttl_s 1 ms), so that its store stays empty, and one whose store is first filled to
    max_keys, so that each new key evicts one. Runs of 1 s alternate between the two (a noisy
    machine slows both alike), each once the other is idle; each side's figure is its best run
    (other work on the machine only ever lowers a run), its median kept beside it."""
    assert empty.proc is not None and full.proc is not None
    names = (f"k{i}" for i in range(1_000_000))
    empty_url, full_url = (f"{d.url}/v1/chat/completions" for d in (empty, full))
    pids = {empty_url: empty.proc.pid, full_url: full.proc.pid}
    for url in (empty_url, full_url):
        wrk(url, IDEMPOTENCY_CLIENTS, 1, plain)  # warm, no key: the stores stay empty
    stored = 0  # keys sent to the full one with a 2xx answer: stored, until it is full
    rate = 500.0
    while stored <= max_keys:
        r = wrk(full_url, IDEMPOTENCY_CLIENTS, max(1, round((max_keys - stored) / rate + 0.5)),
                keyed, (next(names),))
        stored += int(r["requests"] - r["non_2xx"])
        rate = max(r["rps"], 50.0)
    settle(pids[full_url])
    samples: dict[str, list[float]] = {"empty": [], "full": []}
    non_2xx = 0
    for _ in range(rounds):
        for side, url in (("empty", empty_url), ("full", full_url)):
            r = wrk(url, IDEMPOTENCY_CLIENTS, 1, keyed, (next(names),))
            samples[side].append(r["requests"] / r["elapsed_s"] if r["elapsed_s"] else 0.0)
            non_2xx += int(r["non_2xx"])
            settle(pids[url])
    empty_rps, full_rps = max(samples["empty"]), max(samples["full"])
    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {"empty_rps": round(empty_rps, 1), "full_rps": round(full_rps, 1),
            "ratio": round(full_rps / empty_rps, 3) if empty_rps else float("nan"),
            "median_ratio": round(medians["full"] / medians["empty"], 3) if medians["empty"]
            else float("nan"),
            "samples": {k: [round(v) for v in vs] for k, vs in samples.items()},
            "non_2xx": non_2xx}


def baseline_code(rev: str) -> Path:
    """The `supervisor` package of a git revision, in a folder of its own."""
    folder = Path(tempfile.mkdtemp(prefix="spillway-bench-baseline-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "supervisor"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def short_rev(rev: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev],
                          capture_output=True, text=True, check=True).stdout.strip()


def instant_config(model: Path, **more: Any) -> dict[str, Any]:
    """Spillway's default configuration in front of the instant upstream, but for the caps that
    would refuse wrk's load (1024 in flight per child, 1024 waiting)."""
    return {"model": {"llama_server": str(INSTANT), "path": str(model), "args": []},
            "gpu": {"args": [], "max_concurrency": 1024},
            "cpu": {"args": [], "max_concurrency": 1024},
            "queue": {"max_waiting": 1024}, **more}


def idempotency_section(st: Stack, model: Path, seconds: float,
                        baseline: str | None) -> dict[str, Any]:
    codes: dict[str, Path | None] = {"current": None}
    if baseline:
        codes = {f"baseline {short_rev(baseline)}": baseline_code(baseline), **codes}
    out: dict[str, Any] = {"clients": IDEMPOTENCY_CLIENTS}
    rounds = max(5, round(seconds))
    with lua_body(BODY) as plain, lua_keyed(BODY) as keyed:
        for max_keys in (3000, 10000):
            for label, code in codes.items():
                daemons = [st.spillway(
                    f"keys-{max_keys}-{label.split()[0]}-{ttl:g}",
                    instant_config(model, idempotency={"max_keys": max_keys, "ttl_s": ttl}),
                    code=code) for ttl in (0.001, 86400.0)]
                empty, full = daemons
                r = keyed_throughput(empty, full, max_keys=max_keys, rounds=rounds, plain=plain,
                                     keyed=keyed)
                for d in daemons:
                    d.stop()
                    st.daemons.remove(d)
                out.setdefault(label, {})[str(max_keys)] = r
                say(f"  {label:>16s} max_keys={max_keys:<5d} empty {r['empty_rps']:.0f} req/s, "
                    f"full {r['full_rps']:.0f} req/s, full/empty {r['ratio']:.2f}")
    return out


def hotpath_ratios(data: dict[str, Any], name: str, bare: str = "aiohttp") -> dict[str, float]:
    """Spillway (`name`) against the bare pass-through, from figures at concurrency 1 and 64
    that include "direct": req/s at c=64 over the pass-through's; added p50 at c=1 (p50 minus
    direct's) over the pass-through's added p50."""
    direct_p50 = data["direct"]["1"]["p50_ms"]
    bare_rps = data[bare]["64"]["rps"]
    bare_added = data[bare]["1"]["p50_ms"] - direct_p50
    added = data[name]["1"]["p50_ms"] - direct_p50
    return {"throughput_ratio_c64": round(data[name]["64"]["rps"] / bare_rps, 3) if bare_rps
            else float("nan"),
            "added_p50_ratio_c1": round(added / bare_added, 3) if bare_added > 0
            else float("nan")}


def _median_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    return {"p50_ms": round(statistics.median(r["p50_ms"] for r in runs), 3),
            "p99_ms": round(statistics.median(r["p99_ms"] for r in runs), 3),
            "rps": round(statistics.median(r["rps"] for r in runs), 1),
            "non_2xx": sum(int(r["non_2xx"]) for r in runs)}


def hotpath_rounds(urls: dict[str, str], pids: dict[str, int], seconds: float,
                   rounds: int) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Each target at each concurrency once per round (warmed first, the next run once it is
    idle), the targets' order rotating from round to round: a slow spell on the machine falls
    on each side in turn."""
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {str(c): [] for c in HOTPATH_CONCURRENCY} for name in urls}
    names = list(urls)
    with lua_body(BODY) as lua:
        for k in range(rounds):
            order = names[k % len(names):] + names[:k % len(names)]
            say(f"  round {k + 1} of {rounds}")
            for c in HOTPATH_CONCURRENCY:
                for name in order:
                    wrk(urls[name], c, min(2.0, seconds), lua)  # warm up
                    r = wrk(urls[name], c, seconds, lua)
                    settle(pids[name])
                    runs[name][str(c)].append(r)
                    errors = f"  ({r['non_2xx']} non-2xx)" if r["non_2xx"] else ""
                    say(f"    {name:9s} c={c:<3d} p50 {r['p50_ms']:.3f} ms  p99 "
                        f"{r['p99_ms']:.3f} ms  {r['rps']:.0f} req/s{errors}")
    return runs


def hotpath_section(st: Stack, model: Path, seconds: float, baseline: str | None,
                    rounds: int = HOTPATH_ROUNDS) -> dict[str, Any]:
    """POST /v1/chat/completions, the instant upstream: straight, the bare aiohttp
    pass-through, Spillway and (with `baseline`) Spillway at that revision; the median of each
    figure over the rounds, and the two ratios for each Spillway."""
    up = st.serve(lambda port: [str(INSTANT), "--port", str(port)], health=None)
    pids = {"direct": st.procs[-1].pid}
    bare = st.bare_proxy(up)
    pids["aiohttp"] = st.procs[-1].pid
    urls = {"direct": f"http://127.0.0.1:{up}/v1/chat/completions",
            "aiohttp": f"http://127.0.0.1:{bare}/v1/chat/completions"}
    daemons = {"spillway": st.spillway("hotpath", instant_config(model))}
    if baseline:
        daemons["baseline"] = st.spillway("hotpath-baseline", instant_config(model),
                                          code=baseline_code(baseline))
    for name, d in daemons.items():
        assert d.proc is not None
        urls[name] = f"{d.url}/v1/chat/completions"
        pids[name] = d.proc.pid
    runs = hotpath_rounds(urls, pids, seconds, rounds)
    out: dict[str, Any] = {"rounds": rounds, "targets": HOTPATH_TARGETS}
    for name, by_c in runs.items():
        out[name] = {c: _median_figures(rs) for c, rs in by_c.items()}
    for name in daemons:
        out[name].update(hotpath_ratios(out, name))
        # The ratios of each round by itself, to show their spread.
        out[name]["ratios_by_round"] = [
            hotpath_ratios({n: {c: rs[k] for c, rs in by_c.items()} for n, by_c in runs.items()},
                           name) for k in range(rounds)]
        say(f"  {name}: req/s at c=64 {out[name]['throughput_ratio_c64']:.2f} of aiohttp's, "
            f"added p50 at c=1 {out[name]['added_p50_ratio_c1']:.2f}x aiohttp's")
    if baseline:
        out["baseline"]["rev"] = short_rev(baseline)
    return out


def run_only(only: str, quick: bool, seconds: float, baseline: str | None,
             rounds: int = HOTPATH_ROUNDS) -> dict[str, Any]:
    """One part by itself (`--only`)."""
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
        "quick": quick, "seconds": seconds}
    with Stack() as st:
        model = write_tiny_model(st.tmp / "tiny.gguf")
        if only == "idempotency":
            say("keyed throughput: a fresh Idempotency-Key per request, store empty and full")
            report["idempotency"] = idempotency_section(st, model, seconds, baseline)
        else:
            say(f"hot path: straight, aiohttp pass-through, Spillway"
                f"{', baseline ' + baseline if baseline else ''} ({rounds} rounds)")
            report["hotpath"] = hotpath_section(st, model, seconds, baseline, rounds)
    return report


def run(quick: bool, only: str | None = None, baseline: str | None = None,
        rounds: int = HOTPATH_ROUNDS) -> dict[str, Any]:
    ensure_tools()
    seconds = 3.0 if quick else 10.0
    if only is not None:
        return run_only(only, quick, seconds, baseline, rounds)
    concurrency = (1, 16, 64)
    llama = bootstrap.ensure_llama_server()
    fake = fake_server_script(Path(tempfile.mkdtemp(prefix="spillway-bench-fake-")))
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "machine": machine(), "quick": quick, "seconds": seconds}
    with Stack() as st, lua_body(BODY) as lua:
        model = write_tiny_model(st.tmp / "tiny.gguf")
        # 1. An upstream that answers at once.
        say("instant upstream: straight, Spillway, nginx, LiteLLM")
        up = st.serve(lambda port: [str(INSTANT), "--port", str(port)], health=None)
        sp = st.spillway("instant", instant_config(model))
        bare = st.bare_proxy(up)
        targets = st.targets(up, sp, aiohttp=bare)
        report["instant"] = latency_matrix(targets, seconds, lua, concurrency)
        report["instant_ratios"] = hotpath_ratios(report["instant"], "spillway")
        report["spillway_rss_idle_mib"] = round(rss_mib(sp.proc.pid), 1)  # type: ignore[union-attr]

        # 2. The real llama-server with the tiny model.
        say("real llama-server (tiny model): straight, Spillway, nginx, LiteLLM")
        args = ["-c", "4096", "-np", "4", "-t", "1", "-tb", "1"]
        lp = st.serve(lambda port: [str(llama), "-m", str(model), *args, "--host", "127.0.0.1",
                                    "--port", str(port)])
        sp2 = st.spillway("llama", {
            "model": {"llama_server": str(llama), "path": str(model), "args": args},
            "gpu": {"args": ["-ngl", "99"]}, "cpu": {"args": ["--device", "none", "-ngl", "0"]},
            "queue": {"max_waiting": 1024, "max_wait_s": 300}})
        targets = st.targets(lp, sp2)
        report["llama"] = latency_matrix(targets, seconds, lua, concurrency)

        # 3. Streams: time to first token and delay per event.
        say("streams: straight and through Spillway")
        env = {"FAKE_TOKEN_DELAY_S": "0.002", "FAKE_TOKENS": "64"}
        fp = st.serve(lambda port: [str(fake), "--port", str(port)], env=env)
        sp3 = st.spillway("streams", {
            "model": {"llama_server": str(fake), "path": str(model), "args": []},
            "gpu": {"args": [], "env": env}, "cpu": {"args": [], "env": env}})
        n = 20 if quick else 100
        direct = asyncio.run(stream_timings(f"http://127.0.0.1:{fp}/v1/chat/completions", n))
        via = asyncio.run(stream_timings(f"{sp3.url}/v1/chat/completions", n))
        report["streams"] = {
            "ttft_p50_ms": {"direct": pct(direct["ttft"], 0.5) * 1000,
                            "spillway": pct(via["ttft"], 0.5) * 1000},
            "event_delay_ms": {k: {"p50": pct(v["delays"], 0.5) * 1000,
                                   "p99": pct(v["delays"], 0.99) * 1000}
                               for k, v in (("direct", direct), ("spillway", via))},
        }

        # 4. Resident memory with 256 open streams.
        say("memory: 256 open streams")
        slow = {"FAKE_TOKEN_DELAY_S": "0.5", "FAKE_TOKENS": "60", "FAKE_SLOTS": "1024"}
        sp4 = st.spillway("memory", {
            "model": {"llama_server": str(fake), "path": str(model), "args": []},
            "gpu": {"args": [], "env": slow}, "cpu": {"args": [], "env": slow},
            "queue": {"max_waiting": 1024}})
        report["memory"] = asyncio.run(open_streams(sp4, 256))

        # 5. The failover penalty.
        say("failover penalty")
        report["failover"] = failover_penalty(st, llama, model, 3 if quick else 7)

        # 6. Keyed throughput, the Idempotency-Key store empty and full.
        say("keyed throughput: a fresh Idempotency-Key per request, store empty and full")
        report["idempotency"] = idempotency_section(st, model, seconds, baseline)
    return report


async def open_streams(s: Spillway, count: int) -> dict[str, float]:
    assert s.proc is not None
    idle = rss_mib(s.proc.pid)
    started = asyncio.Event()
    opened = 0

    async def one(http: aiohttp.ClientSession) -> None:
        nonlocal opened
        async with http.post(f"{s.url}/v1/chat/completions",
                             json={**BODY, "stream": True, "max_tokens": 60}) as r:
            await r.content.readline()
            opened += 1
            if opened == count:
                started.set()
            await r.read()

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        tasks = [asyncio.create_task(one(http)) for _ in range(count)]
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.sleep(1)
        peak = rss_mib(s.proc.pid)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"idle_mib": round(idle, 1), "with_streams_mib": round(peak, 1), "streams": count}


def failover_penalty(st: Stack, llama: Path, model: Path, runs: int) -> dict[str, float]:
    args = ["-c", "4096", "-np", "2", "-t", "1", "-tb", "1"]
    s = st.spillway("failover", {
        "model": {"llama_server": str(llama), "path": str(model), "args": args},
        "gpu": {"args": ["-ngl", "99"]}, "cpu": {"args": ["--device", "none", "-ngl", "0"]},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0}})
    cp = st.serve(lambda port: [str(llama), "-m", str(model), *args, "--device", "none", "-ngl",
                                "0", "--host", "127.0.0.1", "--port", str(port)])
    import itertools
    serial = itertools.count()

    async def first_byte(url: str, headers: dict[str, str] | None = None) -> tuple[float, float]:
        # A prompt of its own each time: llama-server's prompt cache must not flatter a side.
        body = {**BODY, "stream": True, "max_tokens": 8, "messages": [
            {"role": "user", "content": f"request {next(serial)}: " + "the same words " * 20}]}
        async with aiohttp.ClientSession() as http:
            began = time.time()
            async with http.post(url, json=body, headers=headers or {}) as r:
                await r.content.readline()
                return began, time.time()

    raw: list[float] = []
    asyncio.run(first_byte(f"{s.url}/v1/chat/completions"))  # warm
    for _ in range(runs):
        s.wait_state(("gpu",), ("READY",), timeout=60)
        s.post("/spillway/drill/arm", {})
        began, got = asyncio.run(first_byte(f"{s.url}/v1/chat/completions"))
        _, events = s.get(f"/spillway/timeline?since={began - 1}")
        deaths = [e["time"] for e in events["events"]
                  if e["child"] == "gpu" and e["state"] == "EXITED" and e["time"] >= began]
        if deaths:
            raw.append(got - deaths[0])
    reference = []
    asyncio.run(first_byte(f"http://127.0.0.1:{cp}/v1/chat/completions"))  # warm
    for _ in range(runs):
        began, got = asyncio.run(first_byte(f"http://127.0.0.1:{cp}/v1/chat/completions"))
        reference.append(got - began)
    death_to_first = statistics.median(raw) * 1000 if raw else float("nan")
    cpu_ttft = statistics.median(reference) * 1000
    return {"death_to_first_byte_ms": round(death_to_first, 2),
            "cpu_direct_ttft_ms": round(cpu_ttft, 2),
            "penalty_ms": round(death_to_first - cpu_ttft, 2), "runs": len(raw)}


def table(r: dict[str, Any]) -> str:
    lines = [f"Spillway benchmark, {r['date']}: {r['machine']['cpu']}, {r['machine']['cores']} "
             f"cores, {r['machine']['memory_gib']} GiB, Python {r['machine']['python']}"
             f"{' (quick)' if r['quick'] else ''}", ""]
    for upstream, title in (("instant", "upstream that answers at once"),
                            ("llama", "real llama-server, tiny model")):
        if upstream in r:
            lines.extend(_matrix_lines(title, r[upstream]))
        if upstream == "instant" and "instant_ratios" in r:
            lines.extend([*_ratio_lines({"spillway": r["instant_ratios"]}), ""])
    if "hotpath" in r:
        lines.extend(_hotpath_lines(r["hotpath"]))
    if "streams" in r:
        lines.extend(_other_lines(r))
    if "idempotency" in r:
        lines.extend(_idempotency_lines(r["idempotency"]))
    return "\n".join(lines)


def _matrix_lines(title: str, data: dict[str, Any]) -> list[str]:
    names = list(data)
    lines = [f"{title}:",
             "| concurrency | measure | " + " | ".join(names) + " | Spillway − direct |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for c in ("1", "16", "64"):
        for measure, key, fmt in MEASURES:
            cells = [fmt.format(data[n][c][key]) for n in names]
            diff = data["spillway"][c][key] - data["direct"][c][key]
            lines.append(f"| {c} | {measure} | " + " | ".join(cells) +
                         f" | {fmt.format(diff)} |")
    return [*lines, ""]


def _ratio_lines(by_label: dict[str, dict[str, Any]]) -> list[str]:
    """The hot-path ratios of each Spillway against the bare aiohttp pass-through."""
    least, most = (HOTPATH_TARGETS[k] for k in ("throughput_ratio_c64", "added_p50_ratio_c1"))
    lines = [f"| against the bare aiohttp pass-through | req/s at c=64 / aiohttp's (target ≥ "
             f"{least:.2f}) | added p50 at c=1 / aiohttp's (target ≤ {most:.2f}) |",
             "|---|---|---|"]
    for label, m in by_label.items():
        rps, p50 = m["throughput_ratio_c64"], m["added_p50_ratio_c1"]
        lines.append(f"| {label} | {rps:.2f} ({'met' if rps >= least else 'missed'}) | "
                     f"{p50:.2f} ({'met' if p50 <= most else 'missed'}) |")
    return lines


def _hotpath_lines(d: dict[str, Any]) -> list[str]:
    names = [n for n in ("direct", "aiohttp", "spillway", "baseline") if n in d]
    heads = {n: f"baseline {d[n]['rev']}" if n == "baseline" else n for n in names}
    lines = [f"hot path (POST /v1/chat/completions, instant upstream; each figure the median of "
             f"{d['rounds']} interleaved rounds):",
             "| concurrency | measure | " + " | ".join(heads.values()) + " |",
             "|---|---|" + "---|" * len(names)]
    for c in (str(c) for c in HOTPATH_CONCURRENCY):
        for measure, key, fmt in MEASURES:
            lines.append(f"| {c} | {measure} | " +
                         " | ".join(fmt.format(d[n][c][key]) for n in names) + " |")
    lines.append("")
    lines.extend(_ratio_lines({heads[n]: d[n] for n in ("spillway", "baseline") if n in d}))
    return [*lines, ""]


def _idempotency_lines(d: dict[str, Any]) -> list[str]:
    lines = [f"keyed throughput ({d['clients']} clients, a fresh Idempotency-Key per request, "
             "instant upstream; req/s: each side's best 1-s run, alternating):",
             "| code | max_keys | empty store req/s | full store req/s | full / empty | "
             "full / empty, medians |",
             "|---|---|---|---|---|---|"]
    for label, by_keys in d.items():
        if label == "clients":
            continue
        for max_keys, m in by_keys.items():
            lines.append(f"| {label} | {max_keys} | {m['empty_rps']:.0f} | "
                         f"{m['full_rps']:.0f} | {m['ratio']:.2f} | {m['median_ratio']:.2f} |")
    return lines


def _other_lines(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    s = r["streams"]
    delay = s["event_delay_ms"]
    lines.append(
        f"streams: time to first token p50 {s['ttft_p50_ms']['direct']:.2f} ms straight, "
        f"{s['ttft_p50_ms']['spillway']:.2f} ms through Spillway (+"
        f"{s['ttft_p50_ms']['spillway'] - s['ttft_p50_ms']['direct']:.2f} ms); delay per event "
        f"p50 {delay['direct']['p50']:.3f} / {delay['spillway']['p50']:.3f} ms, "
        f"p99 {delay['direct']['p99']:.3f} / {delay['spillway']['p99']:.3f} ms "
        "(straight / through Spillway)")
    f = r["failover"]
    lines.append(f"failover penalty: {f['death_to_first_byte_ms']:.1f} ms from the GPU child's "
                 f"death to the CPU child's first byte, minus {f['cpu_direct_ttft_ms']:.1f} ms "
                 f"for the same request straight to a CPU llama-server = {f['penalty_ms']:.1f} ms"
                 f" (median of {f['runs']})")
    m = r["memory"]
    lines.append(f"memory: Spillway idle {m['idle_mib']:.0f} MiB, with {m['streams']} open "
                 f"streams {m['with_streams_mib']:.0f} MiB")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 s per figure instead of 10")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--only", choices=("idempotency", "hotpath"),
                        help="just this part (written to <out>/<part>.json and .md)")
    parser.add_argument("--rounds", type=int, default=HOTPATH_ROUNDS,
                        help="interleaved rounds of --only hotpath (each figure their median)")
    parser.add_argument("--baseline", metavar="REV",
                        help="also measure keyed throughput (and, with --only hotpath, the hot "
                             "path) with this git revision's code")
    args = parser.parse_args()
    result = run(args.quick, args.only, args.baseline, args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.only or "latest"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (out / f"{name}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
