"""The chat page through Spillway: real llama-server children given the quickstart's `--path`
(the built web UI) serve its page and its bundle at Spillway's port, through the catch-all
proxy and the browser checks (a loopback listener checks Host on every route), and the page's
own API requests come through too."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from harness import real_config

from conftest import SpillwayFactory
from supervisor.commands import webui
from supervisor.commands.webui_plan import with_ui

pytestmark = [pytest.mark.integration]


def fetch(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def test_the_chat_page_and_its_bundle_come_through_spillway(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, web_ui: Path) -> None:
    cfg = real_config(llama_server, tiny_model)
    # As the quickstart gives it: in model.args, so both children serve it.
    cfg["model"]["args"] = with_ui(cfg["model"]["args"], web_ui, webui.is_ours)
    assert "--path" in cfg["model"]["args"]
    s = spillway(cfg)
    status, kind, page = fetch(s.url + "/")
    assert status == 200 and kind.startswith("text/html"), (status, kind)
    html = page.decode()
    assert page == (web_ui / "index.html").read_bytes()
    # The page loads the UI as one module bundle and one stylesheet under _app/immutable.
    bundle = re.search(r'import\("\./(_app/immutable/[\w.\-]+\.js)"\)', html)
    assert bundle is not None, html[-800:]
    status, kind, js = fetch(f"{s.url}/{bundle.group(1)}")
    assert status == 200 and "javascript" in kind, (status, kind)
    assert js == (web_ui / bundle.group(1)).read_bytes() and len(js) > 100_000
    css = re.search(r'href="\./(_app/immutable/assets/[\w.\-]+\.css)"', html)
    assert css is not None
    assert fetch(f"{s.url}/{css.group(1)}")[:2] == (200, "text/css")
    # The manifest names the app: llama.cpp's UI, not some other page.
    assert b'"name":"llama-ui"' in fetch(s.url + "/manifest.webmanifest")[2]
    # The API the page talks to, beside it, as the page's own requests come (a browser's
    # same-origin fetch: Origin and Sec-Fetch-Site, which the browser checks look at).
    page_origin = {"Origin": s.url, "Sec-Fetch-Site": "same-origin"}
    assert s.get("/props", headers=page_origin)[0] == 200
    status, answer = s.post("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                            headers=page_origin)
    assert status == 200 and answer["choices"][0]["message"]["content"] is not None, answer


def test_a_file_of_the_page_caught_in_a_gpu_death_comes_from_the_cpu_child(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, web_ui: Path,
        injector: Path, tmp_path: Path) -> None:
    """The page loads some seventy files; one in flight when the GPU child dies is read again
    from the CPU child (a GET changes nothing), not a 502."""
    cfg = real_config(llama_server, tiny_model)
    cfg["model"]["args"] = with_ui(cfg["model"]["args"], web_ui, webui.is_ours)
    cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector),
                  "env": {"REAL_LLAMA_SERVER": str(llama_server),
                          "FAULT_ON_PATH": "/manifest.webmanifest",
                          "FAULT_ONCE_FILE": str(tmp_path / "fired")}}
    s = spillway(cfg)
    with urllib.request.urlopen(s.url + "/manifest.webmanifest", timeout=60) as r:
        assert r.status == 200 and r.headers["X-Spillway-Child"] == "cpu"
        assert r.headers["X-Spillway-Attempts"] == "2"
        assert b'"name":"llama-ui"' in r.read()
    assert (tmp_path / "fired").exists()  # the GPU child did die on it
    incident, = s.get("/spillway/incidents")[1]["incidents"]
    assert incident["decision"] == "replayed" and incident["replay_child"] == "cpu", incident
