"""Several Spillways behind the balancers people already run: examples/haproxy.cfg and
examples/nginx.conf, each run as it is (only the addresses, ports, paths and log target
replaced, so the examples cannot rot) by Debian's HAProxy and nginx, run here in the
foreground, never as services, in front of two real Spillways (A and B) on the real
llama-server with the tiny model.

Every request is counted: sent, answered 200, anything else the client saw, and which machine
ran it (each Spillway's request ids share a prefix of its own, and the children count the
tasks they start). `pytest -s` prints one line of figures per scenario."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import (
    PATIENCE_S,
    REPO,
    Spillway,
    deep_merge,
    eventually_async,
    free_port,
    real_config,
    settled,
)

from conftest import SpillwayFactory

pytestmark = [pytest.mark.integration]

EXAMPLES = REPO / "examples"
KEY = "balancer-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
AGENT_INTER_S = 1.0  # examples/haproxy.cfg's agent-inter
CONVERSATIONS = [f"conversation-{i}" for i in range(10)]


def long_chat(tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens,
            "ignore_eos": True, **extra}


# --- the programs ----------------------------------------------------------------------------

def debian_program(name: str, package: str) -> Path:
    """A program from Debian, installed by the test setup when missing (as the chromium fixture
    does), without starting it as a service: a policy-rc.d that says no is in place for the
    length of the install when the machine has none."""

    def find() -> str | None:
        return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")

    found = find()
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        policy = Path("/usr/sbin/policy-rc.d")
        ours = not policy.exists()
        if ours:
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
        try:
            subprocess.run(["apt-get", "update", "-qq"], check=False, env=env,
                           capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "-qq", package], check=True, env=env,
                           capture_output=True)
        finally:
            if ours:
                policy.unlink()
        found = find()
    assert found is not None, f"these tests need Debian's {package} (apt-get install {package})"
    return Path(found)


@pytest.fixture(scope="session")
def haproxy() -> Path:
    return debian_program("haproxy", "haproxy")


@pytest.fixture(scope="session")
def nginx() -> Path:
    return debian_program("nginx", "nginx")


def _sub(name: str, pattern: str, repl: str, text: str, count: int = 1) -> str:
    """Replace what the example has, and fail loudly when it no longer has it."""
    new, n = re.subn(pattern, repl, text, flags=re.M)
    assert n == count, f"examples/{name}: {pattern!r} found {n} times, expected {count}"
    return new


def render_haproxy(listen: str, stats: str, machines: list[tuple[str, int]]) -> str:
    """examples/haproxy.cfg with this test's addresses; logs to stdout, no chroot or user (the
    test runs it in the foreground), the CLI on a TCP port."""
    name = "haproxy.cfg"
    text = (EXAMPLES / name).read_text()
    text = _sub(name, r"^\s*log /dev/log local0$", "    log stdout format raw local0 info",
                text)
    for keyword in ("chroot", "user", "group", "daemon"):
        text = _sub(name, rf"^\s*{keyword}\b.*\n", "", text)
    text = _sub(name, r"^\s*stats socket .*$", f"    stats socket ipv4@{stats} level admin",
                text)
    text = _sub(name, r"^(\s*)bind :8080$", rf"\g<1>bind {listen}", text)
    for i, (address, agent_port) in enumerate(machines, 1):
        # the agent-check line (one agent port each here: both machines are this one)...
        text = _sub(name, rf"^(\s*server m{i}) 10\.0\.0\.{i}:8080$",
                    rf"\g<1> {address} agent-port {agent_port}", text)
        # ...its backup line, and both lines in the routed backend
        text = _sub(name, rf"^(\s*server m{i}(-cpu)?) 10\.0\.0\.{i}:8080 ", rf"\g<1> {address} ",
                    text, 3)
    return text


def render_nginx(folder: Path, listen: str, machines: list[str]) -> str:
    """examples/nginx.conf with this test's addresses and a prefix of its own."""
    name = "nginx.conf"
    text = (EXAMPLES / name).read_text()
    text = _sub(name, r"^user www-data;$", "user root;" if os.geteuid() == 0 else "", text)
    text = _sub(name, r"^pid /run/nginx\.pid;$", f"pid {folder / 'nginx.pid'};", text)
    text = _sub(name, r"^error_log /var/log/nginx/error\.log;$",
                f"error_log {folder / 'error.log'} info;", text)
    temp = "".join(f"    {kind}_temp_path {folder / kind};\n"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text = _sub(name, r"^http \{\n", "http {\n" + temp, text)
    text = _sub(name, r"access_log /var/log/nginx/access\.log ",
                f"access_log {folder / 'access.log'} ", text)
    text = _sub(name, r"^(\s*)listen 8080;$", rf"\g<1>listen {listen};", text)
    for i, address in enumerate(machines, 1):
        text = _sub(name, rf"^(\s*server) 10\.0\.0\.{i}:8080 ", rf"\g<1> {address} ", text)
    return text


class Balancer:
    """A balancer in the foreground, a child of the test; its output in a file."""

    kind = ""

    def __init__(self, folder: Path, argv: list[str], port: int,
                 env: Mapping[str, str] | None = None) -> None:
        self.folder, self.argv, self.port = folder, argv, port
        self.env = {**os.environ, **(env or {})}
        self.log_path = folder / "output.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = PATIENCE_S) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=self.folder)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.kind} exited\n{self.log_tail()}"
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), 0.5):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.kind} not listening\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def retries(self) -> int:
        raise NotImplementedError

    def in_rotation(self, server: str) -> bool:
        return True  # nginx has no view of its own to wait for


_RETRIES = re.compile(r" \d+/\d+/\d+/\d+/(\+?\d+) \d+/\d+ ")


class HAProxy(Balancer):
    kind = "haproxy"

    def __init__(self, program: Path, folder: Path, machines: list[Spillway]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        port, self.stats_port = free_port(), free_port()
        config = folder / "haproxy.cfg"
        config.write_text(render_haproxy(
            f"127.0.0.1:{port}", f"127.0.0.1:{self.stats_port}",
            [(f"127.0.0.1:{s.port}", agent_port(s)) for s in machines]))
        checked = subprocess.run([str(program), "-c", "-f", str(config)], capture_output=True,
                                 text=True, env={**os.environ, "SPILLWAY_API_KEY": KEY})
        assert checked.returncode == 0, checked.stdout + checked.stderr
        super().__init__(folder, [str(program), "-f", str(config), "-db"], port,
                         {"SPILLWAY_API_KEY": KEY})

    def cli(self, command: str) -> str:
        with socket.create_connection(("127.0.0.1", self.stats_port), 5) as c:
            c.sendall(command.encode() + b"\n")
            out = b""
            while chunk := c.recv(65536):
                out += chunk
        return out.decode()

    def servers(self) -> dict[str, dict[str, str]]:
        """`show stat`, one row per server, keyed backend/server."""
        lines = self.cli("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(","), strict=False))
            if row.get("svname") not in (None, "FRONTEND", "BACKEND"):
                rows[f"{row['pxname']}/{row['svname']}"] = row
        return rows

    def server(self, name: str) -> dict[str, str]:
        return self.servers()[f"spillways/{name}"]

    def in_rotation(self, server: str) -> bool:
        row = self.server(server)
        return row["status"] == "UP" and row["weight"] == "100" and \
            row["agent_status"] == "L7OK" and row["check_status"] == "L7OK"

    def retries(self) -> int:
        """Requests HAProxy tried more than once: the retries field of its log lines
        (`%ac/%fc/%bc/%sc/%rc`, "+1" when the retry went to another server)."""
        fields = (_RETRIES.search(line) for line in self.log_path.read_text().splitlines()
                  if "/v1/" in line)
        return sum(1 for f in fields if f is not None and f.group(1) != "0")


class Nginx(Balancer):
    kind = "nginx"

    def __init__(self, program: Path, folder: Path, machines: list[Spillway]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        config = folder / "nginx.conf"
        config.write_text(render_nginx(folder, f"127.0.0.1:{port}",
                                       [f"127.0.0.1:{s.port}" for s in machines]))
        argv = [str(program), "-p", str(folder), "-e", str(folder / "error.log"), "-c",
                str(config)]
        checked = subprocess.run([*argv, "-t"], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        super().__init__(folder, [*argv, "-g", "daemon off;"], port)

    def access(self) -> list[str]:
        path = self.folder / "access.log"
        return path.read_text().splitlines() if path.exists() else []

    def retries(self) -> int:
        """Requests nginx sent to a second machine: `status=503, 200` in its access log."""
        return sum(1 for line in self.access()
                   if "," in line.split(" status=", 1)[1].split(" rid=", 1)[0])

    def log_tail(self, lines: int = 40) -> str:
        error = self.folder / "error.log"
        tail = error.read_text(errors="replace").splitlines()[-lines:] if error.exists() else []
        return super().log_tail(lines) + "\n" + "\n".join(tail)


BalancerFactory = Callable[[str, list[Spillway]], Balancer]


@pytest.fixture
def balancer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BalancerFactory]:
    """Start a balancer ("haproxy" or "nginx") in front of machines; stopped at teardown."""
    made: list[Balancer] = []

    def make(kind: str, machines: list[Spillway]) -> Balancer:
        program = request.getfixturevalue(kind)
        cls = HAProxy if kind == "haproxy" else Nginx
        b = cls(program, tmp_path / f"{kind}{len(made)}", machines)
        made.append(b)
        b.start()
        return b

    yield make
    for b in made:
        b.stop()


# --- the machines ----------------------------------------------------------------------------

def machine_config(llama_server: Path, tiny_model: Path,
                   **sections: Mapping[str, Any]) -> dict[str, Any]:
    """A machine as examples/haproxy.cfg expects one: a key, and the agent on a port."""
    cfg = real_config(llama_server, tiny_model, server={"api_key": KEY},
                      balancer={"agent_listen": f"127.0.0.1:{free_port()}"})
    return deep_merge(cfg, sections)


def agent_port(s: Spillway) -> int:
    return int(s.config["balancer"]["agent_listen"].rsplit(":", 1)[1])


def start_machines(spillway: SpillwayFactory, *configs: dict[str, Any]) -> list[Spillway]:
    made = [spillway(cfg, start=False) for cfg in configs]
    for s in made:  # both start at once
        s.start(wait_ready=False)
    for s in made:
        s.wait_ready(headers=AUTH)
    return made


def agent_line_or_none(s: Spillway, starting: str) -> str | None:
    """The agent's line if it starts so (None if not, or if the port is closed)."""
    with contextlib.suppress(OSError):
        line = s.agent_line()
        if line.startswith(starting):
            return line
    return None


def tasks(s: Spillway) -> int:
    return int(settled(lambda: s.tasks_started(AUTH), quiet_s=0.2))


# --- the client ------------------------------------------------------------------------------

@dataclass
class Answer:
    status: int  # 0: the client saw no HTTP answer (a transport error)
    headers: Mapping[str, str]
    body: Any
    machine: str  # "A", "B", or "?" (from the request id's per-Spillway prefix)
    seconds: float

    @property
    def replayed(self) -> bool:
        return self.headers.get("Idempotent-Replayed") == "true"


async def conversation_homes(client: Client, url: str, tally: Tally) -> dict[str, str]:
    """Where each conversation lives: the machine that served its first request."""
    home = {}
    for c in CONVERSATIONS:
        answer = await client.send(url, headers=conversation(c))
        tally.add(answer)
        home[c] = answer.machine
    return home


@dataclass
class Tally:
    """Every request of a scenario, counted."""

    answers: list[Answer] = field(default_factory=list)

    def add(self, *answers: Answer) -> None:
        self.answers.extend(answers)

    @property
    def sent(self) -> int:
        return len(self.answers)

    @property
    def ok(self) -> int:
        return sum(1 for a in self.answers if a.status == 200)

    @property
    def errors(self) -> list[tuple[int, Any]]:
        return [(a.status, a.body) for a in self.answers if a.status != 200]

    def machines(self) -> Counter[str]:
        return Counter(a.machine for a in self.answers)


class Client:
    def __init__(self, http: aiohttp.ClientSession, machines: dict[str, Spillway]) -> None:
        self.http, self.machines = http, machines
        self.prefixes: dict[str, str] = {}

    async def learn(self) -> None:
        """Each machine's request-id prefix: a new id is 16 hex digits of the process's own
        and a 16-digit counter (supervisor/proxy/identity.py)."""
        for name, s in self.machines.items():
            async with self.http.get(f"{s.url}/v1/models", headers=AUTH) as r:
                assert r.status == 200
                self.prefixes[r.headers["X-Request-Id"][:16]] = name

    async def send(self, url: str, body: dict[str, Any] | None = None,
                   headers: Mapping[str, str] | None = None, path: str = "/v1/chat/completions",
                   timeout: float = 60.0) -> Answer:
        started = time.monotonic()
        try:
            async with self.http.post(url + path, json=CHAT if body is None else body,
                                      headers={**AUTH, **dict(headers or {})},
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                raw = await r.read()
                try:
                    data = json.loads(raw)
                except ValueError:
                    data = raw.decode(errors="replace")
                rid = r.headers.get("X-Request-Id", "")
                return Answer(r.status, r.headers, data, self.prefixes.get(rid[:16], "?"),
                              time.monotonic() - started)
        except (aiohttp.ClientError, TimeoutError) as e:
            return Answer(0, {}, repr(e), "?", time.monotonic() - started)


def conversation(name: str) -> dict[str, str]:
    return {"X-Session-Affinity": name}


def summary(scenario: str, tally: Tally, retries: int, **figures: Any) -> None:
    more = ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" if isinstance(v, float)
                     else f"{k.replace('_', ' ')} {v}" for k, v in figures.items())
    print(f"\n[{scenario}] requests {tally.sent}, 200s {tally.ok}, client-visible errors "
          f"{len(tally.errors)}, retries by the balancer {retries}, served by "
          f"{dict(sorted(tally.machines().items()))}; {more}")


# --- a: the agent drains a machine whose GPU is paused ---------------------------------------

async def test_haproxy_sends_new_work_away_from_a_paused_gpu_and_back_after_resume(
        spillway: SpillwayFactory, balancer: BalancerFactory, llama_server: Path,
        tiny_model: Path) -> None:
    a, b = start_machines(spillway, machine_config(llama_server, tiny_model),
                          machine_config(llama_server, tiny_model))
    ha = balancer("haproxy", [a, b])
    assert isinstance(ha, HAProxy)
    assert await eventually_async(lambda: ha.in_rotation("m1") and ha.in_rotation("m2"))
    assert a.agent_line() == "up ready 100%"
    tally = Tally()
    async with aiohttp.ClientSession() as http:
        client = Client(http, {"A": a, "B": b})
        await client.learn()
        # Where each conversation lives while both machines are up.
        home = await conversation_homes(client, ha.url, tally)
        assert set(home.values()) == {"A", "B"}, home  # the ten spread over both

        paused = await client.send(a.url, {}, path="/spillway/gpu/pause")
        assert paused.status == 200, paused.body
        t0 = time.monotonic()
        assert a.agent_line() == "up drain"
        agent_s = time.monotonic() - t0
        assert await eventually_async(lambda: ha.server("m1")["status"] == "DRAIN (agent)")
        drained_s = time.monotonic() - t0
        assert drained_s < AGENT_INTER_S + 1.0
        assert ha.servers()["spillways-by-route/m1"]["status"].startswith("DRAIN")

        during = Tally()
        for _ in range(10):
            during.add(await client.send(ha.url))
        for c in CONVERSATIONS:
            during.add(await client.send(ha.url, headers=conversation(c)))
        tally.add(*during.answers)
        assert during.ok == 20, during.errors
        plain, routed = Tally(during.answers[:10]), Tally(during.answers[10:])
        assert plain.machines()["B"] >= 9 and routed.machines()["B"] >= 9, \
            (plain.machines(), routed.machines())
        assert all(x.headers["X-Spillway-Child"] == "gpu" for x in during.answers
                   if x.machine == "B")

        # Both GPUs paused: both machines drained, and the backup lines let the CPU
        # children serve (HAProxy sends nothing to a drained server).
        assert (await client.send(b.url, {}, path="/spillway/gpu/pause")).status == 200
        assert await eventually_async(lambda: ha.server("m2")["status"] == "DRAIN (agent)")
        on_cpu = Tally()
        for _ in range(6):
            on_cpu.add(await client.send(ha.url))
        tally.add(*on_cpu.answers)
        assert on_cpu.ok == 6, on_cpu.errors
        assert {x.headers["X-Spillway-Child"] for x in on_cpu.answers} == {"cpu"}
        assert (await client.send(b.url, {}, path="/spillway/gpu/resume")).status == 200
        await asyncio.to_thread(b.wait_state, ("gpu",), ("READY",), 30.0, AUTH)
        assert await eventually_async(lambda: ha.in_rotation("m2"))

        resumed = await client.send(a.url, {}, path="/spillway/gpu/resume")
        assert resumed.status == 200, resumed.body
        t1 = time.monotonic()
        await asyncio.to_thread(a.wait_state, ("gpu",), ("READY",), 30.0, AUTH)
        gpu_back_s = time.monotonic() - t1
        assert await eventually_async(lambda: ha.in_rotation("m1"))
        back_s = time.monotonic() - t1

        after = Tally()
        for _ in range(10):
            after.add(await client.send(ha.url))
        moved_back = 0
        for c in CONVERSATIONS:
            answer = await client.send(ha.url, headers=conversation(c))
            after.add(answer)
            moved_back += answer.machine == home[c]
        tally.add(*after.answers)
    assert after.ok == 20, after.errors
    assert Tally(after.answers[:10]).machines()["A"] >= 3, after.machines()
    assert moved_back == len(CONVERSATIONS)  # consistent hashing: each back on its machine
    assert tally.ok == tally.sent
    summary("haproxy a: GPU paused", tally, ha.retries(),
            agent_says_drain_after=agent_s, haproxy_drains_after=drained_s,
            B_served_during_the_pause=f"{during.machines()['B']}/20",
            both_paused_served_by_the_cpu_children=f"{on_cpu.ok}/6 {dict(on_cpu.machines())}",
            gpu_ready_again_after=gpu_back_s, back_in_rotation_after=back_s,
            A_served_after_resume=f"{Tally(after.answers[:10]).machines()['A']}/10 plain",
            conversations_back_home=f"{moved_back}/{len(CONVERSATIONS)}")


# --- b: a full machine's 503s are retried on the other ---------------------------------------

@pytest.mark.parametrize("kind", ["haproxy", "nginx"])
async def test_a_full_machines_503s_are_retried_on_the_other_and_the_client_sees_none(
        kind: str, spillway: SpillwayFactory, balancer: BalancerFactory, llama_server: Path,
        tiny_model: Path) -> None:
    # A: one slot per child, and no waiting line: two long requests fill it.
    # --context-shift: its long answers go on past the context, for as long as the burst takes
    # (a full machine can take seconds to refuse large bodies: see docs/operations.md).
    full = machine_config(llama_server, tiny_model,
                          model={"args": ["-c", "4096", "-np", "1", "-t", "1", "-tb", "1",
                                          "--context-shift"]},
                          gpu={"max_concurrency": 1}, cpu={"max_concurrency": 1},
                          queue={"max_waiting": 0})
    a, b = start_machines(spillway, full, machine_config(llama_server, tiny_model))
    lb = balancer(kind, [a, b])
    assert await eventually_async(lambda: lb.in_rotation("m1") and lb.in_rotation("m2"))
    tally = Tally()
    async with aiohttp.ClientSession() as http:
        client = Client(http, {"A": a, "B": b})
        await client.learn()
        # Occupy both of A's children with long streams, straight to A.
        occupy = [asyncio.create_task(client.send(a.url, long_chat(60000, stream=True),
                                                  timeout=120)) for _ in range(2)]
        assert await eventually_async(lambda: a.tasks_started(AUTH) == 2 and {
            c["busy"] for c in a.status(AUTH)["children"].values()} == {1}, 10)
        refused = await client.send(a.url)
        assert refused.status == 503 and refused.headers["x-should-retry"] == "true"
        assert refused.body["error"]["src"] == "spillway" and "Retry-After" in refused.headers
        retries_before, a_before = lb.retries(), a.tasks_started(AUTH)
        t0 = time.monotonic()
        # Conversations hash to both machines; plain requests spread (HAProxy: by the weights
        # the agent gave, which may not yet say that A is full; nginx: by a random id).
        # The conversations' bodies are over 16 KiB (HAProxy's default buffer, nginx's body
        # buffer): they are retried too.
        burst = [client.send(lb.url, {**CHAT, "padding": "x" * 40_000},
                             headers=conversation(c)) for c in CONVERSATIONS]
        burst += [client.send(lb.url) for _ in range(10)]
        tally.add(*await asyncio.gather(*burst))
        burst_s = time.monotonic() - t0
        still_busy = {c["busy"] for c in a.status(AUTH)["children"].values()} == {1}
        a_after = tasks(a)
        for task in occupy:
            task.cancel()
        await asyncio.gather(*occupy, return_exceptions=True)
    retries = await asyncio.to_thread(settled, lb.retries)
    assert still_busy, "A's long requests ended before the burst did: make them longer"
    assert tally.ok == tally.sent == 20, tally.errors
    assert tally.machines() == Counter({"B": 20})
    assert a_after == a_before  # A ran none of them
    assert retries - retries_before >= 1, lb.log_tail()
    summary(f"{kind} b: one machine full", tally, retries - retries_before,
            burst_took=burst_s, refused_by_A_and_retried_on_B=retries - retries_before)


# --- c: SIGTERM while requests are in flight -------------------------------------------------

@pytest.mark.parametrize("kind", ["haproxy", "nginx"])
async def test_a_machine_stopped_mid_flight_finishes_its_requests_and_none_is_lost(
        kind: str, spillway: SpillwayFactory, balancer: BalancerFactory, llama_server: Path,
        tiny_model: Path) -> None:
    roomy = {"model": {"args": ["-c", "4096", "-np", "2", "-t", "1", "-tb", "1"]}}
    a, b = start_machines(spillway, machine_config(llama_server, tiny_model, **roomy),
                          machine_config(llama_server, tiny_model, **roomy))
    lb = balancer(kind, [a, b])
    assert await eventually_async(lambda: lb.in_rotation("m1") and lb.in_rotation("m2"))
    tally = Tally()
    async with aiohttp.ClientSession() as http:
        client = Client(http, {"A": a, "B": b})
        await client.learn()
        home = await conversation_homes(client, lb.url, tally)
        on_a = [c for c in CONVERSATIONS if home[c] == "A"]
        on_b = [c for c in CONVERSATIONS if home[c] == "B"]
        assert on_a and on_b, home
        # Two long requests in flight on each machine, through the balancer.
        a_before = tasks(a)
        flights = [asyncio.create_task(client.send(lb.url, long_chat(1500),
                                                   headers=conversation(c), timeout=120))
                   for c in (on_a * 2)[:2] + (on_b * 2)[:2]]
        assert await eventually_async(lambda: a.tasks_started(AUTH) >= a_before + 2)
        a.signal(signal.SIGTERM)
        t0 = time.monotonic()
        says_down = await eventually_async(lambda: agent_line_or_none(a, "down"))
        out_s: float | None = None
        exited_s: float | None = None
        # New requests while A drains and after it exits: plain ones, and conversations
        # whose home is A.
        i = 0
        while time.monotonic() - t0 < 6.0 and (
                exited_s is None or (out_s is None and kind == "haproxy")
                or time.monotonic() - t0 < exited_s + 1.0):
            headers = conversation(on_a[i % len(on_a)]) if i % 2 else {}
            tally.add(await client.send(lb.url, headers=headers, timeout=30))
            i += 1
            await asyncio.sleep(0.02)
            if out_s is None and kind == "haproxy":
                assert isinstance(lb, HAProxy)
                if lb.server("m1")["status"].startswith("DOWN"):
                    out_s = time.monotonic() - t0
            if exited_s is None and a.proc is not None and a.proc.poll() is not None:
                exited_s = time.monotonic() - t0
        landed = await asyncio.gather(*flights)
        tally.add(*landed)
        new_on_a = sum(1 for x in tally.answers[len(CONVERSATIONS):-len(landed)]
                       if x.machine == "A")
        assert a.proc is not None
        assert a.proc.wait(30) == 0, a.log_tail()
        # Both machines gone: the balancer's own 503, shaped as Spillway's.
        b.signal(signal.SIGTERM)
        assert b.proc is not None and b.proc.wait(30) == 0
        if kind == "haproxy":
            assert isinstance(lb, HAProxy)
            assert await eventually_async(lambda: lb.server("m2")["status"].startswith("DOWN"))
        nobody = await client.send(lb.url)
    assert says_down == "down #spillway is stopping"
    assert [x.status for x in landed] == [200] * 4, [x.body for x in landed]
    assert all(x.body["usage"]["completion_tokens"] == 1500 for x in landed)
    assert [x.machine for x in landed] == ["A", "A", "B", "B"]  # A finished its own
    assert tally.ok == tally.sent, tally.errors  # none lost
    assert nobody.status == 503 and nobody.headers["x-should-retry"] == "true", nobody.body
    assert nobody.body["error"]["src"] == kind and "Retry-After" in nobody.headers
    summary(f"{kind} c: SIGTERM mid-flight", tally, lb.retries(),
            in_flight_on_A_completed=f"{sum(x.status == 200 for x in landed[:2])}/2",
            new_requests_A_took_while_stopping=new_on_a,
            **({"out_of_rotation_after": out_s} if out_s is not None else {}),
            A_exited_after=exited_s if exited_s is not None else "-")


# --- d: Idempotency-Key across machines ------------------------------------------------------

@pytest.mark.parametrize("kind", ["haproxy", "nginx"])
async def test_a_keyed_retry_reaches_the_machine_that_holds_its_answer(
        kind: str, spillway: SpillwayFactory, balancer: BalancerFactory, llama_server: Path,
        tiny_model: Path) -> None:
    a, b = start_machines(spillway, machine_config(llama_server, tiny_model),
                          machine_config(llama_server, tiny_model))
    lb = balancer(kind, [a, b])
    assert await eventually_async(lambda: lb.in_rotation("m1") and lb.in_rotation("m2"))
    keys = [f"key-{i}-{os.getpid()}" for i in range(6)]
    tally = Tally()
    async with aiohttp.ClientSession() as http:
        client = Client(http, {"A": a, "B": b})
        await client.learn()
        before = tasks(a) + tasks(b)
        first = {k: await client.send(lb.url, headers={"Idempotency-Key": k}) for k in keys}
        again = {k: await client.send(lb.url, headers={"Idempotency-Key": k}) for k in keys}
        tally.add(*first.values(), *again.values())
        ran = tasks(a) + tasks(b) - before
        # Where a keyed retry lands when its machine is out of rotation (HAProxy: the agent
        # drains a machine whose GPU is paused): it runs again there, once.
        elsewhere: Answer | None = None
        ran_elsewhere = 0
        if kind == "haproxy":
            assert isinstance(lb, HAProxy)
            key = keys[0]
            holder = {"A": a, "B": b}[first[key].machine]
            paused = await client.send(holder.url, {}, path="/spillway/gpu/pause")
            assert paused.status == 200
            m = "m1" if holder is a else "m2"
            assert await eventually_async(lambda: lb.server(m)["status"] == "DRAIN (agent)")
            before_elsewhere = tasks(a) + tasks(b)
            elsewhere = await client.send(lb.url, headers={"Idempotency-Key": key})
            tally.add(elsewhere)
            ran_elsewhere = tasks(a) + tasks(b) - before_elsewhere
    assert tally.ok == tally.sent, tally.errors
    assert not any(x.replayed for x in first.values())
    assert all(again[k].replayed for k in keys), {k: dict(again[k].headers) for k in keys}
    assert all(again[k].machine == first[k].machine for k in keys)
    assert all(again[k].body == first[k].body for k in keys)
    assert ran == len(keys)  # each key ran once, over both machines
    if elsewhere is not None:
        assert not elsewhere.replayed and elsewhere.machine != first[keys[0]].machine
        assert ran_elsewhere == 1
    summary(f"{kind} d: Idempotency-Key", tally, lb.retries(),
            keys=len(keys), keys_per_machine=dict(Counter(x.machine for x in first.values())),
            replayed=f"{sum(x.replayed for x in again.values())}/{len(keys)}",
            executions=ran,
            **({"holder_drained_retry_ran_again_elsewhere": ran_elsewhere}
               if elsewhere is not None else {}))
