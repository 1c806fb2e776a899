"""What an operator does: `spillway status`, `incidents`, `gpu restart|drain|pause|resume`; and
the GPU child's return after load-time OOMs once the card has room."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO, Spillway, eventually, fake_config, free_port, write_json

from conftest import SpillwayFactory

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def spillway_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, env=env)


def chat_child(s: Spillway) -> str:
    import urllib.request
    req = urllib.request.Request(f"{s.url}/v1/chat/completions", data=json.dumps(CHAT).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return str(r.headers["X-Spillway-Child"])


def test_status_command_reads_the_config_and_prints_a_table(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    table = spillway_cli("status", "--config", str(s.config_path))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert any(line.split()[:2] == ["gpu", "READY"] for line in lines)
    assert any(line.split()[:2] == ["cpu", "READY"] for line in lines)
    assert "GPU: none" in table.stdout
    as_json = spillway_cli("status", "--url", s.url, "--json")
    assert json.loads(as_json.stdout)["children"]["cpu"]["state"] == "READY"


def test_status_command_exits_3_when_the_daemon_does_not_answer() -> None:
    result = spillway_cli("status", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 3
    assert "no answer from Spillway" in result.stderr


def test_status_finds_the_daemon_when_its_config_file_no_longer_loads(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    """Right after a refused reload the file cannot give the address or the key: the daemon is
    found by the file's path (its control socket), its status shown (it serves on its last good
    config), and the file's problem said; exit 0, since a daemon's status is shown."""
    key = "operator-test-key"
    s = spillway(fake_config(fake_server, tiny_model, server={"api_key": key}), start=False)
    s.start(wait_ready=False)
    auth = {"Authorization": f"Bearer {key}"}
    s.wait_ready(headers=auth)
    good = s.config_path.read_text()
    s.config_path.write_text(good + "\n[idempotency\n")  # an edit cut short: not TOML
    error = eventually(lambda: s.status(auth)["config"]["error"])
    assert error and "not valid TOML" in error, error  # the reload was refused
    shown = spillway_cli("status", "--config", str(s.config_path), env=s.env)
    assert shown.returncode == 0, (shown.returncode, shown.stderr)
    lines = shown.stdout.splitlines()
    assert f"listening on 127.0.0.1:{s.port}" in lines[0]
    assert any(line.split()[:2] == ["gpu", "READY"] for line in lines)
    assert any(line.split()[:2] == ["cpu", "READY"] for line in lines)
    assert "the last reload was refused" in shown.stdout  # the daemon's own word
    said = [line for line in lines if line.startswith("config on disk:")]
    assert len(said) == 1 and "does not load, so the daemon serves on the config it last " \
        "loaded: not valid TOML" in said[0], shown.stdout
    as_json = spillway_cli("status", "--config", str(s.config_path), "--json", env=s.env)
    answer = json.loads(as_json.stdout)
    assert as_json.returncode == 0 and answer["children"]["gpu"]["state"] == "READY"
    assert answer["config_on_disk"]["path"] == str(s.config_path.resolve())
    assert answer["config_on_disk"]["problems"]
    # With no daemon for it, the file's problem is all there is to say: exit 2, as before.
    other = s.folder / "other.toml"
    other.write_text("[model\n")
    alone = spillway_cli("status", "--config", str(other), env=s.env)
    assert alone.returncode == 2 and "no spillway running" in alone.stderr, alone.stderr


def test_incidents_command_lists_the_records(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model, gpu={"env": {"FAKE_CRASH_AFTER": "1"}}))
    assert chat_child(s) == "cpu"  # the GPU child died on it; the CPU child answered
    s.wait_incidents(1)
    table = spillway_cli("incidents", "--url", s.url)
    assert table.returncode == 0
    assert "runtime_oom" in table.stdout and "replayed" in table.stdout
    records = json.loads(spillway_cli("incidents", "--url", s.url, "--json").stdout)
    assert records[0]["decision"] == "replayed"
    code, body = s.get("/spillway/incidents?limit=1")
    assert code == 200 and len(body["incidents"]) == 1


def test_gpu_pause_frees_it_and_resume_brings_it_back(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    gpu_pid = s.child("gpu")["pid"]
    paused = spillway_cli("gpu", "pause", "--url", s.url)
    assert paused.returncode == 0, paused.stderr
    gpu = s.child("gpu")
    assert gpu["state"] == "STOPPED" and gpu["paused"] is True and gpu["pid"] is None
    assert chat_child(s) == "cpu"
    assert spillway_cli("gpu", "resume", "--url", s.url).returncode == 0
    s.wait_state(("gpu",), ("READY",))
    assert s.child("gpu")["pid"] != gpu_pid
    assert chat_child(s) == "gpu"


def test_gpu_drain_and_restart(spillway: SpillwayFactory, fake_server: Path,
                               tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model))
    assert spillway_cli("gpu", "drain", "--url", s.url).returncode == 0
    eventually(lambda: s.child("gpu")["restarts"] == 1)
    s.wait_state(("gpu",), ("READY",))
    assert spillway_cli("gpu", "restart", "--url", s.url).returncode == 0
    eventually(lambda: s.child("gpu")["restarts"] == 2)
    s.wait_state(("gpu",), ("READY",))


def test_gpu_commands_need_the_key(spillway: SpillwayFactory, fake_server: Path,
                                   tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model, server={"api_key": "sekret"}), start=False)
    s.start(wait_ready=False)
    s.wait_ready(headers={"Authorization": "Bearer sekret"})
    refused = spillway_cli("gpu", "restart", "--url", s.url, "--api-key", "wrong")
    assert refused.returncode == 1 and "401" in refused.stderr
    # With the config, the key comes along.
    assert spillway_cli("gpu", "restart", "--config", str(s.config_path)).returncode == 0



def test_after_load_ooms_the_gpu_child_returns_when_the_card_has_room(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, total_mib=24576, free_mib=100)
    no_room = tmp_path / "no-room"
    no_room.write_text("the card is full")
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_EXIT_AT_START_FILE": str(no_room)},
                           "vram_headroom_mib": 512},
                      # The crash-loop back-off's first try is 30 s away: only the card's
                      # memory can bring the child back within this test.
                      restart={"max_quick_failures": 2, "backoff_max_s": 30},
                      monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, fake_nvml=nvml, wait_ready=False)
    gpu = s.wait_state(("gpu",), ("FATAL",))["children"]["gpu"]
    assert gpu["last_exit"]["kind"] == "load_oom"
    assert "serving from the CPU child" in gpu["why"]
    s.wait_state(("cpu",), ("READY",))
    assert chat_child(s) == "cpu"
    # The game that held the VRAM quits: the card has room, and the GPU child comes back.
    no_room.unlink()
    time.sleep(0.5)
    assert s.child("gpu")["state"] == "FATAL"  # not yet: the card is still full
    write_json(nvml, total_mib=24576, free_mib=20000)
    s.wait_state(("gpu",), ("READY",))
    assert "free again" in s.log_text()
    assert chat_child(s) == "gpu"


def test_a_gpu_child_that_crash_loops_at_start_heals_itself_and_says_when(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    # A CUDA abort during the load, three starts in a row; then the card works again.
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_FAIL_STARTS": "3",
                                   "FAKE_FAIL_STARTS_FILE": str(tmp_path / "starts")}},
                      restart={"backoff_initial_s": 0.05, "backoff_max_s": 1.5,
                               "max_quick_failures": 2, "fatal_retry_max_s": 3})
    s = spillway(cfg, wait_ready=False)
    status = s.wait_state(("gpu",), ("FATAL",))
    gpu = status["children"]["gpu"]
    assert gpu["last_exit"]["kind"] == "cuda_error"
    assert 0 < gpu["next_try_in_s"] <= 1.5
    assert "tried again in" in gpu["why"] and "serving from the CPU child" in gpu["why"]
    table = spillway_cli("status", "--config", str(s.config_path))
    assert "tried again in" in table.stdout
    # Nobody does anything: the back-off tries again (once more FATAL, then READY).
    s.wait_state(("gpu",), ("READY",))
    assert "try 2 from FATAL (crash-loop back-off)" in s.log_text()
    assert s.child("gpu")["next_try_in_s"] is None
    assert chat_child(s) == "gpu"


def test_a_fatal_gpu_child_is_tried_at_once_when_another_process_frees_the_card(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path, tmp_path: Path) -> None:
    nvml = tmp_path / "nvml.json"
    write_json(nvml, total_mib=24576, free_mib=12000)
    cfg = fake_config(fake_server, tiny_model,
                      gpu={"env": {"FAKE_FAIL_STARTS": "2",
                                   "FAKE_FAIL_STARTS_FILE": str(tmp_path / "starts")},
                           "vram_headroom_mib": 512},
                      restart={"backoff_initial_s": 0.05, "backoff_max_s": 300,
                               "max_quick_failures": 2},
                      monitor={"sample_interval_s": 0.1})
    s = spillway(cfg, fake_nvml=nvml, wait_ready=False)
    gpu = s.wait_state(("gpu",), ("FATAL",))["children"]["gpu"]
    assert gpu["next_try_in_s"] > 200  # the back-off alone would wait minutes
    # The card has room, but nothing was freed since it went FATAL: no retry on every tick.
    time.sleep(1.0)
    assert s.child("gpu")["state"] == "FATAL"
    # Another process (a game, another model) quits and frees 8 GiB: tried at once.
    write_json(nvml, total_mib=24576, free_mib=20000)
    s.wait_state(("gpu",), ("READY",))
    assert "MiB freed since it went FATAL" in s.log_text()
