"""An upgrade in place (issue 40): `spillway upgrade --config FILE`, under steady traffic of
streamed and plain requests against real children, hands over to a new daemon process: no
connection refused, no request lost, both children's pids kept (no model reload), the daemon's
pid and uptime new, and the next turn of a conversation still finds its prompt in the child's
cache. And an upgrade that cannot be done leaves the old daemon serving."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from harness import Spillway, eventually, fake_config, llama_servers_left, pid_alive, \
    real_config, wait_gone

from conftest import SpillwayFactory
from supervisor.upstreams.owned import state_id

pytestmark = pytest.mark.integration

# A conversation's first turn: long enough that its prompt in the cache is plain to see.
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SYSTEM = ("You are a careful assistant who answers questions about rivers, dams and spillways "
          "in plain words. " * 12)


def upgrade(s: Spillway, *extra: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    """`spillway upgrade --config FILE`, as an operator (or ExecReload=) runs it."""
    return subprocess.run([sys.executable, "-m", "supervisor", "upgrade", "--config",
                           str(s.config_path), *extra], env=s.env, capture_output=True,
                          text=True, timeout=timeout)


@dataclass
class Traffic:
    """Clients sending streamed and plain requests in a loop, each on a new connection; every
    request's outcome and how long it took."""

    port: int
    threads: int = 3
    results: list[tuple[float, float, str]] = field(default_factory=list)  # start, took, outcome
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def one(self, stream: bool) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(
                {"messages": [{"role": "user", "content": "Count to three."}],
                 "max_tokens": 8, "stream": stream}), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            return f"status {resp.status}: {body[:200]!r}"
        if stream and b"data: [DONE]" not in body:
            return f"a stream without [DONE]: {body[-200:]!r}"
        return "ok"

    def _run(self, n: int) -> None:
        stream = n % 2 == 0
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                outcome = self.one(stream)
            except Exception as e:  # noqa: BLE001 - a refused or reset connection is a finding
                outcome = f"{type(e).__name__}: {e}"
            self.results.append((began, time.monotonic() - began, outcome))
            stream = not stream

    def start(self) -> None:
        for n in range(self.threads):
            worker = threading.Thread(target=self._run, args=(n,), daemon=True)
            worker.start()
            self._workers.append(worker)

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(150)

    def failures(self) -> list[str]:
        return [outcome for _, _, outcome in self.results if outcome != "ok"]

    def longest(self, since: float = 0.0) -> float:
        return max((took for began, took, _ in self.results if began + took >= since),
                   default=0.0)


def turn(s: Spillway, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any], str]:
    """One turn of the conversation: (the answer's text, its timings, the child)."""
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"messages": messages, "max_tokens": 8, "temperature": 0}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, body
    return (body["choices"][0]["message"]["content"], body["timings"],
            resp.getheader("X-Spillway-Child") or "")


@pytest.mark.parametrize("binary", ["llama_server", "wrapped_llama_server"])
def test_an_upgrade_under_steady_traffic_keeps_the_children_and_refuses_nothing(
        spillway: SpillwayFactory, request: pytest.FixtureRequest, llama_server: Path,
        tiny_model: Path, new_daemons: list[int], binary: str) -> None:
    """Issue 47: the same with a llama-server that is a wrapper script exec'ing the real
    binary (its command line is not the one Spillway started): the children are the same
    processes, by the kernel's word."""
    s = spillway(real_config(request.getfixturevalue(binary), tiny_model))
    assert s.proc is not None
    old_pid = s.proc.pid
    children = {n: s.child(n)["pid"] for n in ("gpu", "cpu")}
    conversation = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "What does a spillway do?"}]
    answer, first, child = turn(s, conversation)
    assert first["prompt_n"] > 100  # the first turn's prompt was processed in full
    keyed = {"Idempotency-Key": "upgrade-1", "Content-Type": "application/json"}
    code, once = s.post("/v1/chat/completions", {**HI, "max_tokens": 6}, keyed)
    assert code == 200, once

    traffic = Traffic(s.port)
    traffic.start()
    try:
        assert eventually(lambda: len(traffic.results) >= 6)
        asked = time.monotonic()
        done = upgrade(s)
        assert done.returncode == 0, (done.stdout, done.stderr, s.log_tail())
        assert f"pid {old_pid} -> pid " in done.stdout
        status = s.status()
        new_pid = status["daemon"]["pid"]
        new_daemons.append(new_pid)
        assert new_pid != old_pid
        # The old daemon finishes its requests in flight and exits 0.
        assert s.proc.wait(60) == 0
        assert eventually(lambda: len([r for r in traffic.results if r[0] > asked + 1]) >= 6)
    finally:
        traffic.stop()
    refused = sum(outcome.startswith("status 503") for _, _, outcome in traffic.results)
    print(f"\nupgrade under traffic ({binary}): {len(traffic.results)} requests, {refused} "
          f"answered 503, the longest {traffic.longest(asked):.3f} s from the upgrade on")
    assert traffic.failures() == [], traffic.failures()[:5]
    assert len(traffic.results) >= 12

    status = s.status()
    assert {n: c["pid"] for n, c in status["children"].items()} == children  # no reload
    assert all(c["state"] == "READY" and c["restarts"] == 0
               for c in status["children"].values())
    daemon = status["daemon"]
    assert daemon["pid"] == new_pid and daemon["upgraded_from_pid"] == old_pid
    assert daemon["adopted"] == children and daemon["adopted_how"] == "upgrade"
    assert daemon["upgrade"]["kept"] == children and daemon["upgrade"]["took_over"]
    assert status["uptime_s"] < time.monotonic() - asked + 1  # its own, from the upgrade on
    assert not pid_alive(old_pid)
    # The next turn finds the conversation's prompt in the same child's cache.
    conversation += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "And a dam?"}]
    _, second, child_again = turn(s, conversation)
    assert child_again == child
    cached = second["cache_n"] / (second["cache_n"] + second["prompt_n"])
    print(f"the next turn found {second['cache_n']} of {second['cache_n'] + second['prompt_n']}"
          f" prompt tokens cached ({cached:.0%})")
    assert cached >= 0.8, (first, second)
    # A retry with an Idempotency-Key the old daemon answered is answered from the store the
    # new one was handed, not run again.
    again = urllib.request.urlopen(urllib.request.Request(
        s.url + "/v1/chat/completions", data=json.dumps({**HI, "max_tokens": 6}).encode(),
        headers=keyed), timeout=60)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert json.loads(again.read()) == once
    assert daemon["upgrade"]["answers_kept"] >= 1
    # What the upgrade kept is on record: the log and the incidents.
    log = s.log_text()
    assert f"upgrade: done: this daemon (pid {new_pid}) took over from spillway pid " \
           f"{old_pid}" in log
    adopted = [r for r in s.incidents() if r["decision"] == "adopted"]
    assert {r["child"] for r in adopted} == {"gpu", "cpu"}
    assert all(r["reason"].startswith(f"upgrade from spillway pid {old_pid}") for r in adopted)

    # `spillway upgrade` again reaches the new daemon (its control socket), and a stop of it
    # stops the children it adopted.
    again = upgrade(s)
    assert again.returncode == 0, again.stderr
    newer = s.status()["daemon"]["pid"]
    new_daemons.append(newer)
    assert newer not in (old_pid, new_pid)
    assert wait_gone({new_pid}, 60) == set()
    os.kill(newer, signal.SIGTERM)
    assert wait_gone({newer, *children.values()}, 60) == set()
    assert llama_servers_left(s, llama_server, tiny_model) == set()


def test_an_upgrade_that_cannot_be_done_leaves_the_old_daemon_serving(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path) -> None:
    s = spillway(real_config(llama_server, tiny_model))
    assert s.proc is not None
    children = {n: s.child(n)["pid"] for n in ("gpu", "cpu")}
    good = s.config_path.read_text()
    # A config that is not valid: refused before anything starts.
    s.config_path.write_text(good + "\n[queue]\nmax_waiting = \"many\"\n")
    bad = upgrade(s)
    assert bad.returncode == 1 and "is not valid" in bad.stderr, bad.stderr
    assert "queue.max_waiting" in bad.stderr
    s.config_path.write_text(good)
    # A new daemon that does not serve in time: killed, said, and the old one serves on with
    # its children.
    slow = upgrade(s, "--timeout", "0.01")
    assert slow.returncode == 1 and "did not serve within" in slow.stderr, slow.stderr
    assert s.proc.poll() is None  # the old daemon serves on
    status = s.status()
    assert status["daemon"]["pid"] == s.proc.pid
    assert {n: c["pid"] for n, c in status["children"].items()} == children
    assert s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 4})[0] == 200
    # The new daemon it started was killed, and it started or ended no process.
    assert "upgrade: started the new daemon, pid" in s.log_text()
    started = int(s.log_text().rsplit("upgrade: started the new daemon, pid ", 1)[1].split()[0])
    assert wait_gone({started}, 30) == set()
    assert all(pid_alive(p) for p in children.values())
    # With no daemon at all: exit 3, said.
    assert s.stop() == 0
    none = upgrade(s)
    assert none.returncode == 3 and "no spillway runs" in none.stderr, none.stderr


def test_systemd_follows_the_new_daemon_and_hears_nothing_more_from_the_old(
        tmp_path: Path, fake_server: Path, tiny_model: Path,
        new_daemons: list[int]) -> None:
    """MAINPID=<new pid> with READY=1 from the new daemon (NotifyAccess=all), before the old
    one exits; and no STOPPING=1 (nor anything else) from the old one once it handed over: that
    would stop the service the new one runs."""
    from test_service import NotifySocket  # the notify socket systemd would read

    notify = NotifySocket(tmp_path / "notify.sock")
    s = Spillway(tmp_path / "spillway", fake_config(fake_server, tiny_model),
                 env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"})
    try:
        s.start()
        assert s.proc is not None
        old_pid = s.proc.pid
        assert eventually(lambda: notify.fields("READY"))
        done = upgrade(s)
        assert done.returncode == 0, (done.stderr, s.log_tail())
        new_pid = s.status()["daemon"]["pid"]
        new_daemons.append(new_pid)
        assert new_pid != old_pid
        (at, main), = notify.fields("MAINPID")
        assert int(main) == new_pid
        assert any(t == at for t, _ in notify.fields("READY"))  # in the same message
        assert s.proc.wait(60) == 0
        exited = time.monotonic()
        assert not notify.fields("STOPPING")  # the old one said nothing of its stop
        # The new one pings the watchdog (WATCHDOG_PID was the old one's: not passed on).
        assert eventually(lambda: [t for t, _ in notify.fields("WATCHDOG") if t > exited])
        assert s.get("/spillway/health")[0] == 200
    finally:
        for pid in new_daemons:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        wait_gone(set(new_daemons), 30)
        s.stop()
        notify.close()


def test_a_new_daemon_stopped_while_the_old_one_drains_stops_the_children(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        new_daemons: list[int]) -> None:
    """Once the new daemon has said it serves, the old one has let go of the children: a stop
    of the new one (systemd's, say) stops them, even while the old one still drains. Nothing
    is left running."""
    cfg = fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_TOKEN_DELAY_S": "0.5"}},
                      server={"drain_timeout_s": 60})
    s = spillway(cfg)
    assert s.proc is not None
    children = {s.child(n)["pid"] for n in ("gpu", "cpu")}
    got: dict[str, Any] = {}

    def long_request() -> None:
        try:
            got["answer"] = s.post("/v1/chat/completions", {**HI, "max_tokens": 40,
                                                            "stream": True}, timeout=120)
        except Exception as e:  # noqa: BLE001 - cut when its child is stopped
            got["error"] = e

    running = threading.Thread(target=long_request, daemon=True)
    running.start()
    assert eventually(lambda: s.child("gpu")["busy"] == 1)
    done = upgrade(s)
    assert done.returncode == 0, (done.stderr, s.log_tail())
    new_pid = s.status()["daemon"]["pid"]
    new_daemons.append(new_pid)
    assert s.proc.poll() is None  # the old one drains its request
    os.kill(new_pid, signal.SIGTERM)
    assert wait_gone({new_pid, *children}, 60) == set(), s.log_tail()
    assert s.proc.wait(60) == 0  # its request ended with its child; then it exits
    running.join(60)
    after = s.log_text().rsplit("SIGTERM: stopping", 1)[1]
    assert "[gpu] READY -> STOPPING: daemon shutting down" in after  # the new one stopped it


def test_children_the_new_daemon_does_not_adopt_are_ended_by_the_old_one(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path,
        new_daemons: list[int]) -> None:
    """Issue 47: an upgrade in which the new daemon did not adopt the children (here: the
    state file names another owner mark than theirs, so the new daemon leaves them alone) is
    not completed by letting go of them. The old daemon ends them once its requests are done,
    and the new one starts its own once the old one has exited: nothing runs unowned."""
    s = spillway(fake_config(fake_server, tiny_model))
    assert s.proc is not None
    children = {n: s.child(n)["pid"] for n in ("gpu", "cpu")}
    path = s.folder / "state" / "run" / f"{state_id(str(s.config_path))}.json"
    doc = json.loads(path.read_text())
    for record in doc["children"]:
        record["owner"] += "-not-theirs"
    path.write_text(json.dumps(doc))

    done = upgrade(s)
    assert done.returncode == 0, (done.stderr, s.log_tail())
    new_pid = s.status()["daemon"]["pid"]
    new_daemons.append(new_pid)
    assert "kept no child" in done.stdout, done.stdout
    assert s.proc.wait(60) == 0
    assert wait_gone(set(children.values()), 30) == set(), s.log_tail()
    assert f"ends gpu (pid {children['gpu']}), cpu (pid {children['cpu']})" in done.stdout
    assert f"did not adopt gpu (pid {children['gpu']})" in s.log_text()
    # The new daemon has its own children, and only those.
    assert eventually(lambda: all(c["state"] == "READY" and c["pid"] not in children.values()
                                  for c in s.status()["children"].values()))
    daemon = s.status()["daemon"]
    assert {e["pid"] for e in daemon["left_alone"]} == set(children.values())
    assert daemon["adopted"] == {}
    own = {c["pid"] for c in s.status()["children"].values()}
    os.kill(new_pid, signal.SIGTERM)
    assert wait_gone({new_pid, *own}, 60) == set()
