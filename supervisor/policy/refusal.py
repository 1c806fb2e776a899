"""A command llama-server refused: a flag or value it does not take, a file it cannot open, a
model it cannot load (for a reason other than memory), a setup it rejects. Pure.

llama-server reads its command line before it loads anything (common/arg.cpp,
`common_params_parse`) and on a bad flag or value writes one line and exits with code 1:

    error while handling argument "-np": stoi
    error: invalid argument: --no-such-flag
    error: failed to open file '/etc/missing.jinja'

A model file it cannot read ends the load the same way (`llama_model_load: error loading model:
...`, then `exiting due to model loading error`), and so does a setup of the server's own that
fails (`MCP starting failed: ...`, `tools setup failed: ...`). Restarting cannot mend any of
them: the same command fails the same way. This module reads such an end, names the argument
that caused it (as it was given, with its value), and keeps llama-server's own words, so that
the status, the log and `spillway run`'s exit say what to change.

An end that ran out of memory while loading is not a refusal (evidence.py calls it `load_oom`:
the same command may fit once the card has room), nor is one by a signal (a crash).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from . import evidence

# At most this many of llama-server's own lines are kept (the first is the one that decided).
MAX_SAID = 3

# A log line's prefix when llama-server writes with timestamps and levels: "0.01.020.550 E ".
_PREFIX = re.compile(r"^\s*(?:\d+\.\d+\.\d+\.\d+\s+)?(?:[DIWE]\s+)?")

# (pattern, what it names): "flag" (group 1 is a flag), "value" (group 1 is a flag's value:
# a path), "model" (the model file), "last" (the last flag of the command), or a flag itself.
_REFUSALS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r'error while handling argument "([^"]+)"'), "flag"),
    (re.compile(r"error: invalid argument: (\S+)"), "flag"),
    (re.compile(r'error while handling environment variable "([^"]+)"'), "env"),
    (re.compile(r"expected value for argument"), "last"),
    (re.compile(r"error: unknown value for (--?[\w-]+)"), "flag"),
    (re.compile(r"failed to open file '([^']*)'"), "value"),
    (re.compile(r"failed to open GGUF file '([^']*)'"), "value"),
    (re.compile(r"failed to open MCP config file: (.+)$"), "value"),
    (re.compile(r"MCP starting failed"), "--mcp-servers-json --mcp-servers-config"),
    (re.compile(r"tools setup failed"), "--tools"),
    (re.compile(r"error: the supplied chat template is not supported"),
     "--chat-template --chat-template-file"),
    (re.compile(r"failed to load multimodal model|failed to load mmproj"), "--mmproj"),
    (re.compile(r"error loading model|failed to load model"), "model"),
    (re.compile(r"^error: (?!.*\bfailed to allocate\b)"), "none"),
)

# The flags whose value is the model file, under any alias.
_MODEL_FLAGS = ("-m", "--model")


@dataclass(frozen=True)
class Refusal:
    """What llama-server refused, and its own words."""

    argument: str | None  # as given, with its value: "-np abc"; None when no argument is named
    said: tuple[str, ...]  # llama-server's lines, the deciding one first
    unstarted: bool = False  # the program itself could not be started (missing, not runnable)

    def summary(self) -> str:
        """One line for the status and the log."""
        said = "; ".join(self.said)
        if self.unstarted:
            return said
        if self.argument:
            return f"llama-server refused {self.argument}: {said}"
        return f"llama-server refused its command: {said}"

    def to_json(self) -> dict[str, object]:
        return {"argument": self.argument, "said": list(self.said)}


def read_refusal(returncode: int, lines: Sequence[str], argv: Sequence[str]) -> Refusal | None:
    """The refusal an ended start shows, or None: only an exit with a code (not a signal), and
    never one that ran out of memory or lost its device (those may go once the card has room)."""
    if returncode <= 0 or evidence.exit_signal(returncode) is not None:
        return None
    if evidence.classify_exit(returncode, lines).kind is not evidence.FailureKind.CRASH:
        return None  # load_oom, a GPU's error or lost device: not the command's fault
    clean = [_PREFIX.sub("", line).strip() for line in lines]
    for i, line in enumerate(clean):
        for pattern, names in _REFUSALS:
            found = pattern.search(line)
            if found is not None:
                said = _said(clean[i:], pattern)
                return Refusal(_argument(names, found, argv), said)
    return None


def _said(lines: list[str], first: re.Pattern[str]) -> tuple[str, ...]:
    """The deciding line, then the next lines that are errors too (not the usage text that
    follows an argument's error)."""
    said = [lines[0]]
    for line in lines[1:]:
        if len(said) >= MAX_SAID or line.startswith("usage:"):
            break
        if line and line not in said and _is_error(line) and not first.search(line):
            said.append(line)
    return tuple(said)


def _is_error(line: str) -> bool:
    return any(p.search(line) for p, _ in _REFUSALS) or "exiting due to" in line


def _argument(names: str, found: re.Match[str], argv: Sequence[str]) -> str | None:
    if names == "flag":
        return _given(argv, (found.group(1),)) or found.group(1)
    if names == "env":
        return found.group(1)
    if names == "last":
        flags = [t for t in argv if t.startswith("-")]
        return flags[-1] if flags else None
    if names == "value":
        return _with_value(argv, found.group(1).strip()) or found.group(1).strip()
    if names == "model":
        return _given(argv, _MODEL_FLAGS)
    if names == "none":
        return None
    return _given(argv, tuple(names.split()))


def _given(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    """The last of `flags` in the command, with its value if one follows it."""
    for i in range(len(argv) - 1, -1, -1):
        token = argv[i]
        name = token.split("=", 1)[0] if token.startswith("--") else token
        if name in flags or name.replace("_", "-") in flags:
            if "=" in token or i + 1 >= len(argv) or argv[i + 1].startswith("-") and \
                    not _is_number(argv[i + 1]):
                return token
            return f"{token} {argv[i + 1]}"
    return None


def _with_value(argv: Sequence[str], value: str) -> str | None:
    """The flag whose value is `value`, with it."""
    for i in range(len(argv) - 1, 0, -1):
        if argv[i] == value and argv[i - 1].startswith("-"):
            return f"{argv[i - 1]} {value}"
        if argv[i].startswith("--") and argv[i].endswith(f"={value}"):
            return argv[i]
    return None


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True
