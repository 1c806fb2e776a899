"""Running a real Spillway daemon (a subprocess, as systemd would run it) for tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from supervisor.upstreams.owned import state_id

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# How long a wait on a condition may last before the test is called broken. It only bounds a
# broken test; no test measures it: a condition met sooner ends the wait at once, and a busy
# machine (the suite beside a busy loop on every core, issue 37; other builds on the same two
# cores) can take many times as long as a quiet one to start a child, load a model or generate.
PATIENCE_S = 120.0

# max_tokens of a request the drill's arm is to kill as its task launches: the arm acts on the
# child's launch line, read from its output while the child goes on, so the answer must take far
# longer than that read even on a busy machine (a few tokens of the tiny model were answered
# whole before the line was read, and nothing was caught). Within a slot of 1024 tokens.
DOOMED_TOKENS = 800


def write_json(path: Path, **values: Any) -> None:
    """Replace a JSON file in one step (a reader never sees half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values))
    tmp.replace(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def toml_dumps(doc: Mapping[str, Mapping[str, Any]]) -> str:
    """Enough TOML for Spillway configs: tables of scalars, lists and inline tables."""
    out = []
    for section, values in doc.items():
        out.append(f"[{section}]")
        for k, v in values.items():
            out.append(f"{k} = {_toml_value(v)}")
        out.append("")
    return "\n".join(out)


def deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def fake_server_script(folder: Path) -> Path:
    """An executable that runs tests/fake_llama_server.py with this interpreter."""
    path = folder / "fake-llama-server"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{TESTS / "fake_llama_server.py"}" "$@"\n')
    path.chmod(0o755)
    return path


def injector_script(folder: Path) -> Path:
    """An executable that runs tests/gpu_fault_injector.py with this interpreter."""
    path = folder / "gpu-fault-injector"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{TESTS / "gpu_fault_injector.py"}" '
                    '"$@"\n')
    path.chmod(0o755)
    return path


class Spillway:
    """One daemon: `spillway run --config FILE` in a subprocess, its log in a file."""

    def __init__(self, folder: Path, config: Mapping[str, Any],
                 env: Mapping[str, str] | None = None, fake_nvml: Path | None = None,
                 command_prefix: list[str] | None = None) -> None:
        self.folder = folder
        self.command_prefix = list(command_prefix or [])  # e.g. taskset, for the benchmark
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cfg = deep_merge({"server": {"listen": f"127.0.0.1:{self.port}"},
                          "incidents": {"path": str(folder / "incidents.jsonl")}}, config)
        self.config = cfg
        self.config_path = folder / "spillway.toml"
        self.config_path.write_text(toml_dumps(cfg))
        self.log_path = folder / "spillway.log"
        self.env = dict(os.environ)
        self.env.pop("NOTIFY_SOCKET", None)
        self.env.pop("JOURNAL_STREAM", None)
        # No card of this machine's own in a test: the DRM sampler reads an empty sysfs unless
        # the test gives it a fake tree (a machine with an AMD card must pass as CI does).
        empty_sys = folder / "no-sysfs"
        empty_sys.mkdir(exist_ok=True)
        self.env["SPILLWAY_SYSFS_ROOT"] = str(empty_sys)
        # Its state folder (the children's state file, issue 40) is its own, as systemd's
        # StateDirectory= would be: a test's daemon never finds another test's children.
        self.env["STATE_DIRECTORY"] = str(folder / "state")
        self.env.update(env or {})
        paths = [str(REPO)]
        if fake_nvml is not None:
            self.env["FAKE_NVML_FILE"] = str(fake_nvml)
            paths.insert(0, str(TESTS / "fake_nvml"))
        self.env["PYTHONPATH"] = os.pathsep.join(paths)
        self.proc: subprocess.Popen[bytes] | None = None
        self.known_child_pids: set[int] = set()
        self.drill_token: str | None = None  # arm(): the drill window this test opened

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True, timeout: float = PATIENCE_S) -> Spillway:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.command_prefix, sys.executable, "-m", "supervisor", "run", "--config",
             str(self.config_path)],
            cwd=self.folder, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        if wait_ready:
            self.wait_ready(timeout)
        else:
            self.wait_listening(timeout)
        return self

    def get(self, path: str, headers: Mapping[str, str] | None = None,
            timeout: float = 10.0) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, headers=dict(headers or {}))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            body = e.read()
            status = e.code
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode(errors="replace")

    def post(self, path: str, body: Any, headers: Mapping[str, str] | None = None,
             timeout: float = 60.0) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **dict(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw, status = r.read(), r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def arm(self, body: Any, headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
        """`/spillway/drill/arm` as `spillway drill` sends it: inside a drill's window (opened
        here on first use, with its token kept for the next arms)."""
        if self.drill_token is None:
            code, opened = self.post("/spillway/drill/start", {}, headers)
            assert code == 200, (code, opened)
            self.drill_token = str(opened["drill"])
        return self.post("/spillway/drill/arm", body,
                         {**dict(headers or {}), "X-Spillway-Drill": self.drill_token})

    def samples(self, name: str, label: str = "") -> dict[str, float]:
        """The metric's samples named `name` (with its suffix: `_total`, `_count`), by the
        value of their `label` ("" for one without), read by Prometheus's own parser."""
        from prometheus_client.parser import text_string_to_metric_families

        code, page = self.get("/spillway/metrics")
        assert code == 200, page
        return {sample.labels.get(label, ""): sample.value
                for family in text_string_to_metric_families(page)
                for sample in family.samples if sample.name == name}

    def status(self, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        code, body = self.get("/spillway/status", headers)
        assert code == 200, (code, body)
        for child in body["children"].values():
            if child.get("pid"):
                self.known_child_pids.add(child["pid"])
        return dict(body)

    def child(self, name: str, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        return dict(self.status(headers)["children"][name])

    def profiled(self, name: str, key: str = "ctx_per_slot",
                 timeout: float = PATIENCE_S) -> dict[str, Any]:
        """The child's status once its model's figures are known: they come from its /props,
        asked for as it becomes READY, a moment after the status says READY."""
        found = eventually(lambda: (c := self.child(name)).get(key) is not None and c,
                           timeout=timeout)
        assert found, f"the {name} child's {key} is still unknown after {timeout} s"
        return dict(found)

    def tasks_started(self, headers: Mapping[str, str] | None = None) -> int:
        """Executions on both children, as the children count them (`launch_slot_` lines)."""
        return sum(c["tasks_started"] for c in self.status(headers)["children"].values())

    def agent_line(self, timeout: float = 5.0) -> str:
        """The agent-check port's line (balancer.agent_listen), read as HAProxy reads it."""
        host, port = self.config["balancer"]["agent_listen"].rsplit(":", 1)
        data = b""
        with socket.create_connection((host.strip("[]"), int(port)), timeout) as c:
            while b"\n" not in data and (chunk := c.recv(256)):
                data += chunk
        return data.decode().strip()

    def wait_listening(self, timeout: float = PATIENCE_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(OSError):
                code, _ = self.get("/spillway/health", timeout=2)
                if code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"spillway not listening after {timeout} s\n{self.log_tail()}")

    def wait_ready(self, timeout: float = PATIENCE_S, children: tuple[str, ...] = ("gpu", "cpu"),
                   headers: Mapping[str, str] | None = None) -> None:
        """The children READY; in router mode, also the models listed: a router's models are
        read from its /models once it is READY, a moment later (longer on a busy machine)."""
        self.wait_listening(timeout)
        status = self.wait_state(children, ("READY",), timeout, headers)
        if status.get("router"):
            listed = eventually(lambda: self.status(headers)["models"], timeout)
            assert listed, f"the routers listed no model in {timeout} s\n{self.log_tail()}"

    def wait_state(self, children: tuple[str, ...], states: tuple[str, ...],
                   timeout: float = PATIENCE_S, headers: Mapping[str, str] | None = None
                   ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            status = self.status(headers)
            if all(status["children"][c]["state"] in states for c in children):
                return status
            time.sleep(0.05)
        raise TimeoutError(f"{children} not in {states} after {timeout} s: "
                           f"{ {c: status['children'][c]['state'] for c in children} }\n"
                           f"{self.log_tail()}")

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"spillway exited with {self.proc.returncode}\n{self.log_tail()}")

    def incidents(self) -> list[dict[str, Any]]:
        path = Path(self.config["incidents"]["path"])
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def wait_incidents(self, count: int, timeout: float = PATIENCE_S) -> list[dict[str, Any]]:
        """The incident records once there are `count` (records are written when a request's
        answer is complete, a moment after the client has it)."""
        deadline = time.monotonic() + timeout
        while len(records := self.incidents()) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # and no more than that
        records = self.incidents()
        assert len(records) == count, records
        return records

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait; SIGKILL if needed; then make sure no child is left behind."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.status()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.known_child_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


def streamed_chat(client: Any, **body: Any) -> tuple[str, str, str]:
    """A chat completion streamed with the real OpenAI client (`client`, an openai.OpenAI):
    the child that began it (X-Spillway-Child), its whole text, and its finish reason ("" when
    the stream had none)."""
    text, finish = [], ""
    with client.chat.completions.with_streaming_response.create(stream=True, **body) as response:
        child = str(response.headers["X-Spillway-Child"])
        for chunk in response.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    return child, "".join(text), finish


def eventually(check: Any, timeout: float = PATIENCE_S) -> Any:
    """Poll `check()` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


async def eventually_async(check: Any, timeout: float = PATIENCE_S) -> Any:
    """`eventually` for async tests: the check runs in a thread, the loop keeps running."""
    import asyncio
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(check)
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


async def until(check: Any, timeout: float = PATIENCE_S) -> Any:
    """`eventually` for state in the test's own process (no I/O): `check()` polled on the
    event loop, which keeps running whatever is to make it true."""
    import asyncio
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.01)


def settled(read: Any, quiet_s: float = 0.3, timeout: float = 10.0) -> Any:
    """`read()` once two reads `quiet_s` apart agree."""
    deadline = time.monotonic() + timeout
    value = read()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = read()
        if again == value:
            return value
        value = again
    return value


def pid_alive(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: set[int], timeout: float = 15.0) -> set[int]:
    """The pids still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if pid_alive(p)}
        time.sleep(0.05)
    return alive


def llama_servers_left(s: Spillway, binary: Path, model: Path) -> set[int]:
    """The processes still running that are `s`'s children, by the kernel's word: those whose
    environment carries this config's SPILLWAY_OWNER, and those running `binary` on `model`
    (the binary is shared with other tests and other users; the model is this session's)."""
    mark = f"SPILLWAY_OWNER={state_id(str(s.config_path))}:".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not pid_alive(int(entry.name)):
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            runs = os.path.realpath(entry / "exe") == os.path.realpath(binary) and \
                str(model).encode() in (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or another user's
        if runs or any(v.startswith(mark) for v in environ):
            found.add(int(entry.name))
    return found


def router_config(llama_server: Path, models_dir: Path,
                  **sections: Mapping[str, Any]) -> dict[str, Any]:
    """Router mode: both children are real llama-server routers over `models_dir`, each
    instance with one thread (as real_config's children)."""
    cfg = real_config(llama_server, models_dir, **sections)
    model = cfg["model"]
    del model["path"]
    model["args"] = ["--models-dir", str(models_dir), *model["args"]]
    return cfg


def real_config(llama_server: Path, model_path: Path,
                **sections: Mapping[str, Any]) -> dict[str, Any]:
    """Both children on the real llama-server with the tiny model, one thread each (two cores
    shared by two children and the tests)."""
    base: dict[str, Any] = {
        "model": {"llama_server": str(llama_server), "path": str(model_path),
                  "args": ["-c", "2048", "-np", "2", "-t", "1", "-tb", "1"]},
        "gpu": {"args": ["-ngl", "99"]},
        "cpu": {"args": ["--device", "none", "-ngl", "0"]},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 2.0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


def fake_config(fake_server: Path, model_path: Path,
                **sections: Mapping[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"llama_server": str(fake_server), "path": str(model_path), "args": []},
        "gpu": {"args": []},
        "cpu": {"args": []},
        "restart": {"backoff_initial_s": 0.1, "backoff_max_s": 1.0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base
