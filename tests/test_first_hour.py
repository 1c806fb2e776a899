"""The operator's first hour, end to end, as the README tells it: a llama-server command line
becomes a config (`spillway init -- ...`), Spillway runs it by the line init printed, clients
keep their URL and key, a key is edited with `spillway config set`, and the status page shows
it all. Real llama-server children, the real OpenAI client, headless Chromium."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from cdp import Browser
from harness import REPO, eventually, free_port
from test_status_page import card, updated

from supervisor.commands import remote as client

pytestmark = [pytest.mark.integration]

KEY = "first-hour-key-0123456789"


def status(url: str) -> dict[str, object]:
    answer = client.call(client.Target(url, KEY), "GET", "/spillway/status")
    assert isinstance(answer, dict)
    return answer


async def watch(url: str, chromium: Path, folder: Path) -> None:
    """The status page asks for the key once and shows both children and the edited limit."""
    async with Browser.launch(chromium, folder) as page:
        await page.navigate(f"{url}/spillway/")
        await page.wait_for("!document.querySelector('#key-panel').hidden")
        await page.type_text("#key-input", KEY)
        await page.press("Enter")
        await updated(page)
        for child in ("gpu", "cpu"):
            assert (await page.wait_for(card(child)))["state"] == "READY"
        await page.wait_for("document.querySelector('#queue-limit').textContent"
                            ".includes('at most 7,')")


def test_from_a_llama_server_command_line_to_a_watched_spillway(
        tmp_path: Path, llama_server: Path, tiny_model: Path, chromium: Path) -> None:
    home = tmp_path / "server"
    home.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("SPILLWAY_CONFIG", "NOTIFY_SOCKET")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(REPO))
    # What the user ran until now (one thread per child: two cores are shared with the tests).
    theirs = [str(llama_server), "-m", str(tiny_model), "-c", "2048", "-np", "2", "-t", "1",
              "-tb", "1", "-ngl", "99", "--host", "127.0.0.1", "--port", str(port),
              "--api-key", KEY]
    init = subprocess.run(["spillway", "init", "-o", "spillway.toml", "--", *theirs], cwd=home,
                          env=env, capture_output=True, text=True, timeout=60)
    assert init.returncode == 0, init.stderr
    assert KEY not in (home / "spillway.toml").read_text()
    # Run it the way init said to (the key comes from the env file beside the config).
    then = next(line for line in init.stderr.splitlines() if "then: " in line)
    command = then.split("then: ", 1)[1].replace("spillway run", "exec spillway run")
    log = open(tmp_path / "spillway.log", "wb")
    proc = subprocess.Popen(["bash", "-c", command], cwd=home, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "spillway.log").read_text()[-3000:]
            try:
                children = status(url)["children"]
            except client.Unreachable:
                return False
            assert isinstance(children, dict)
            return all(c["state"] == "READY" for c in children.values())
        eventually(ready)
        # The clients keep their URL and their key.
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        raw = oa.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert raw.headers["X-Spillway-Child"] == "gpu"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        # `spillway status` in this folder, with the key only in init's env file.
        shown = subprocess.run(["spillway", "status"], cwd=home, env=env, capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert f"listening on 127.0.0.1:{port}" in shown.stdout
        # A key edited from the command line, found in this folder, reloaded by the daemon.
        edit = subprocess.run(["spillway", "config", "set", "queue.max_waiting", "7"],
                              cwd=home, env=env, capture_output=True, text=True, timeout=60)
        assert edit.returncode == 0, edit.stderr
        eventually(lambda: status(url)["queue"]["max_waiting"] == 7)  # type: ignore[index]
        asyncio.run(watch(url, chromium, tmp_path))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        log.close()
