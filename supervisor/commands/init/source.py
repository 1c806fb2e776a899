"""What `spillway init` reads, in one shape: a llama-server command line, its environment, and
where each came from (for the comments). Each input form (the command line here, a systemd unit
in unit.py, a llama-swap config in llama_swap.py) produces a `Source`; cmdline.py plans the
config from it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field


class InitError(Exception):
    """An input that cannot become a valid config: the message says why, and what to do."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    origin: str  # where it was set, as a phrase: "in Environment= in /etc/.../llama.service"


@dataclass(frozen=True)
class Source:
    argv: tuple[str, ...]  # the executable first
    # where the command line came from, as a phrase: "on the command line",
    # "in ExecStart= in /etc/systemd/system/llama.service"
    where: str
    env: tuple[EnvVar, ...] = ()
    workdir: str = "/"  # the folder the command ran in: relative paths are relative to it
    home: str = ""  # the home folder of the user it ran as: `~`, and llama.cpp's cache
    # Whether --host/--port are where clients connect. Not for llama-swap: there they are the
    # upstream's address, and clients connect to llama-swap's own --listen (`listen`).
    clients_connect_here: bool = True
    listen: str = ""
    listen_origin: str = ""
    api_keys: tuple[str, ...] = ()  # keys from outside the command line (llama-swap's apiKeys)
    keys_origin: str = ""
    name: str = ""  # the model's name to clients (llama-swap's model ID), if any
    # Variables the command line was expanded from ($VAR in ExecStart=): not the children's.
    expanded: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())  # settings of the source with no equivalent


_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def from_command_line(words: Sequence[str], cwd: str, home: str) -> Source:
    """The user's own command line, as a shell would run it: leading NAME=value words are its
    environment (`LLAMA_ARG_CTX_SIZE=4096 llama-server ...`)."""
    words = list(words)
    if words and words[0] == "--":
        words = words[1:]
    env = []
    while words and _ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env.append(EnvVar(name, value, "on the command line"))
    if not words:
        raise InitError("no command line: give the one you run, after --, e.g. "
                        "`spillway init -- llama-server -m /srv/model.gguf -ngl 99`")
    return Source(argv=tuple(words), where="on the command line", env=tuple(env), workdir=cwd,
                  home=home)
