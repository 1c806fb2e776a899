"""What `spillway quickstart` tells a newcomer once Spillway serves: three things to try (and,
with a small child, how to see it answer).

Pure text from the config and the listening addresses; the quickstart prints it once, when the
daemon first serves (after its "listening" line), so that the log that follows is not all a
newcomer sees.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from ..config.schema import Config
from .ports import PortTaken

DEFAULT_LISTEN = "127.0.0.1:8080"
# The request header that accepts an answer from the small child's smaller model.
FALLBACK_HEADER = "X-Spillway-Fallback"
# The welcome's question, asked greedily (temperature 0): on the pinned build the embedded
# SmolLM2-135M-Instruct answers "The capital of France is Paris." and ends its turn.
QUESTION = "What is the capital of France? Answer in one word."


def own_command(argv0: str | None = None) -> str:
    """How to run `spillway` again from this shell: `spillway` when that is what PATH finds,
    else the path the user ran (`.venv/bin/spillway`), else `python -m supervisor`."""
    argv0 = argv0 if argv0 is not None else sys.argv[0]
    if Path(argv0).name == "__main__.py":
        return f"{shlex.quote(sys.executable)} -m supervisor"
    on_path = shutil.which("spillway")
    if on_path and os.path.realpath(on_path) == os.path.realpath(argv0):
        return "spillway"
    return shlex.quote(argv0)


def base_url(listen: str) -> str:
    """A URL a local client can use for a listening address (0.0.0.0 means this machine too)."""
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "[::]":
        host = "[::1]"
    return f"http://{host}:{port}"


# A bound on the answer all the same: a small model now and then talks on, and a newcomer's
# first try should come back in a second or two, not after the slot's whole context.
MAX_TOKENS = 64


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def port_taken(taken: PortTaken, command: str) -> str:
    """What to say when the quickstart's address is in use: by whom, and what to do."""
    where = address(taken.host, taken.port)
    lines = [f"spillway quickstart: {where} is in use by {taken.holder}."]
    if "spillway" in taken.holder:
        lines.append(f"  A Spillway already serves there: `{command} status` shows it.")
    if taken.next_free is not None:
        lines.append(f"  The next free port is {taken.next_free}: "
                     f"{command} quickstart --listen {address(taken.host, taken.next_free)}")
    else:
        lines.append(f"  Choose a free address: {command} quickstart --listen HOST:PORT")
    return "\n".join(lines)


def chat_body(model: str | None) -> str:
    body: dict[str, object] = {"messages": [{"role": "user", "content": QUESTION}],
                               "max_tokens": MAX_TOKENS, "temperature": 0}
    if model:
        body = {"model": model, **body}
    return json.dumps(body)


def welcome(cfg: Config, listening: Sequence[str], command: str, config_flag: str,
            model: str | None = None, chat_page: bool = False) -> str:
    """The lines printed once Spillway serves. `config_flag` is what the client commands need
    to find this config (empty when they find it by themselves); `model` names the model a
    router-mode request must ask for; `chat_page`: the children serve llama.cpp's web UI at
    `/` (named only then: without it `/` is llama-server's 404)."""
    url = base_url(listening[0])
    auth = " -H \"Authorization: Bearer $SPILLWAY_API_KEY\"" if cfg.server.api_key else ""
    lines = [
        f"Spillway is serving on {url}. Try:",
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f"       -d '{chat_body(model)}'",
        f"  {command} status{config_flag}    # children, GPU memory, waiting line, incidents",
        f"  {url}/spillway/    # the status page, in a browser",
    ]
    if chat_page:
        lines.append(f"  {url}/    # the chat page (llama.cpp's web UI), in a browser")
    if not cfg.router and not cfg.gpu_settings.idle_release_s:
        where = f" in {cfg.path}" if cfg.path else ""
        lines.append(f"To lend the GPU to other programs while the model is idle (the CPU child "
                     f"answers meanwhile): set [gpu] idle_release_s = 300{where} (read again "
                     f"when saved)")
    if cfg.small_child is not None:
        small = Path(cfg.child(cfg.small_child).model_path).stem
        lines += [
            f"The small child serves a smaller model, {small}, to the requests that say "
            f"`{FALLBACK_HEADER}: smaller`",
            "when the GPU child cannot take them (reloading after an OOM, or paused). "
            "To see it answer:",
            f"  {command} gpu pause{config_flag}    # the GPU child steps aside",
            f"  curl -si {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-H '{FALLBACK_HEADER}: smaller'{auth} \\",
            f"       -d '{chat_body(model)}'    # X-Spillway-Child says which child answered",
            f"  {command} gpu resume{config_flag}",
        ]
    return "\n".join(lines)
