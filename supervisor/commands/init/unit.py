"""A systemd service unit -> the llama-server command line it runs, and its environment.

Read as systemd reads it (systemd.syntax(7), systemd.service(5), systemd.exec(5)), for what a
llama-server unit uses:
- the unit file, then its drop-ins (`NAME.service.d/*.conf`, in name order); comment lines
  (`#`, `;`) and lines continued with a trailing backslash;
- `ExecStart=`: the last one (an empty assignment resets the list); the prefixes `-@:+!` on the
  executable (`@`: the second word is argv[0], dropped here); words split at whitespace with
  "double" and 'single' quotes and C-style backslash escapes; then `${VAR}` replaced within a
  word, `$VAR` as a word of its own replaced by its value split at whitespace, `$$` a dollar
  (not with the `:` prefix);
- `Environment=`: several NAME=value words a line, quoted like ExecStart=; an empty assignment
  resets; `EnvironmentFile=` (`-` prefix: optional), whose values override Environment='s;
- the specifiers %% %h %u %n %N %p %i in those settings;
- `WorkingDirectory=` (relative paths in the command line are relative to it; `-` and `~`
  allowed) and `User=` (whose home holds llama.cpp's cache).
Parsing is pure; `read_unit` alone touches the file system.
"""

from __future__ import annotations

import pwd
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .source import EnvVar, InitError, Source

_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
            "s": " ", "\\": "\\", '"': '"', "'": "'"}
_VAR_WORD = re.compile(r"^\$([A-Za-z_][A-Za-z0-9_]*)$")
_VAR_BRACED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$\$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Unit:
    """The [Service] settings a llama-server unit's command needs, each with the file it was in."""

    exec_start: list[tuple[str, str]] = field(default_factory=list)  # (value, file)
    environment: list[tuple[str, str]] = field(default_factory=list)
    environment_files: list[tuple[str, str]] = field(default_factory=list)
    working_directory: str = ""
    user: str = ""


def logical_lines(text: str) -> list[str]:
    """The unit's lines with continuations joined and comment lines dropped."""
    out: list[str] = []
    pending: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith(("#", ";")):
            continue  # a comment, even in the middle of a continued line
        if pending is not None:
            line = pending + " " + line
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        pending = None
        if line:
            out.append(line)
    if pending:
        out.append(pending)
    return out


def parse_unit(text: str, file: str, unit: Unit | None = None) -> Unit:
    """The [Service] settings of one unit file (or drop-in) laid over `unit`."""
    unit = unit or Unit()
    section = ""
    for line in logical_lines(text):
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if section != "Service" or not sep:
            continue
        key, value = key.strip(), value.strip()
        lists = {"ExecStart": unit.exec_start, "Environment": unit.environment,
                 "EnvironmentFile": unit.environment_files}
        if key in lists:
            if value:
                lists[key].append((value, file))
            else:
                lists[key].clear()  # an empty assignment resets the list
        elif key == "WorkingDirectory":
            unit.working_directory = value
        elif key == "User":
            unit.user = value
    return unit


def _escape(text: str, i: int) -> tuple[str, int]:
    """The character(s) a backslash at text[i] stands for, and the index after it."""
    c = text[i + 1] if i + 1 < len(text) else ""
    if c == "x" and re.match(r"[0-9a-fA-F]{2}", text[i + 2:i + 4]):
        return chr(int(text[i + 2:i + 4], 16)), i + 4
    if c and c in "01234567" and re.match(r"[0-7]{3}", text[i + 1:i + 4]):
        return chr(int(text[i + 1:i + 4], 8)), i + 4
    return _ESCAPES.get(c, c), i + 2


def split_words(text: str) -> list[str]:
    """systemd's word splitting: whitespace separates, quotes group, backslashes escape."""
    words: list[str] = []
    word: list[str] | None = None
    quote = ""
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            ch, i = _escape(text, i)
            word = (word or []) + [ch]
            continue
        if quote:
            if c == quote:
                quote = ""
            else:
                word = (word or []) + [c]
        elif c in "\"'":
            quote, word = c, word or []
        elif c.isspace():
            if word is not None:
                words.append("".join(word))
            word = None
        else:
            word = (word or []) + [c]
        i += 1
    if quote:
        raise InitError(f"unbalanced {quote} in {text!r}")
    if word is not None:
        words.append("".join(word))
    return words


def expand_specifiers(text: str, spec: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        letter = m.group(1)
        if letter not in spec:
            raise InitError(f"the specifier %{letter} in {text!r} is not one spillway init "
                            f"knows ({', '.join('%' + k for k in spec)}); write the value "
                            "in its place")
        return spec[letter]

    return re.sub(r"%(.)", one, text)


def expand_variables(words: list[str], env: Mapping[str, str]) -> list[str]:
    """$VAR as a word: its value split at whitespace; ${VAR} anywhere: its value as is."""
    out: list[str] = []
    for word in words:
        m = _VAR_WORD.match(word)
        if m:
            out.extend(env.get(m.group(1), "").split())
            continue
        out.append(_VAR_BRACED.sub(
            lambda v: "$" if v.group(0) == "$$" else env.get(v.group(1), ""), word))
    return out


def referenced(value: str) -> list[str]:
    """The variables ExecStart= expands ($VAR and ${VAR}; none with the `:` prefix)."""
    prefixes = re.match(r"^[-@:+!]*", value)
    if prefixes is not None and ":" in prefixes.group(0):
        return []
    return re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", value.replace("$$", ""))


def exec_argv(value: str, env: Mapping[str, str]) -> list[str]:
    """ExecStart='s command: prefixes stripped, words split, variables expanded."""
    m = re.match(r"^[-@:+!]+", value)
    prefixes = m.group(0) if m else ""
    words = split_words(value[len(prefixes):])
    if ";" in words:
        raise InitError("ExecStart= runs several commands (`;`); give the one that runs "
                        "llama-server on the command line instead")
    if ":" not in prefixes:
        words = expand_variables(words, env)
    if "@" in prefixes and len(words) > 1:
        del words[1]  # `@`: the second word is argv[0], not an argument
    return words


def parse_assignments(value: str) -> list[tuple[str, str]]:
    """Environment='s NAME=value words; systemd ignores (and logs) the malformed ones."""
    out = []
    for word in split_words(value):
        name, sep, val = word.partition("=")
        if sep and _NAME.match(name):
            out.append((name, val))
    return out


def _env_file_value(raw: str) -> str:
    """One value of an environment file, unquoted as systemd.exec(5) says."""
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] == "'":
        return raw[1:-1]
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        return re.sub(r'\\([\\"`$])', r"\1", raw[1:-1].replace("\\\n", ""))
    return re.sub(r"\\(.)", r"\1", raw)


def parse_env_file(text: str) -> list[tuple[str, str]]:
    """An EnvironmentFile=: NAME=value lines; blank, `#` and `;` lines and lines without `=`
    ignored; quoted values may span lines; a trailing backslash continues a line."""
    out: list[tuple[str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", ";")) or "=" not in stripped:
            continue
        name, _, value = stripped.partition("=")
        value = value.strip()
        while i < len(lines) and _continues(value):
            value += "\n" + lines[i]
            i += 1
        if _NAME.match(name.strip()):
            out.append((name.strip(), _env_file_value(value)))
    return out


def _continues(value: str) -> bool:
    """Whether a value goes on to the next line: an open quote, or a trailing backslash."""
    if value[:1] in ("'", '"'):
        return len(value) < 2 or value[-1] != value[0] or value.endswith("\\" + value[0])
    return value.endswith("\\")


def environment(unit: Unit, spec: Mapping[str, str],
                read: Callable[[str], str | None]) -> list[EnvVar]:
    """Environment= then EnvironmentFile= (which overrides it), in order; `read` gives a file's
    text, or None when it does not exist."""
    env: dict[str, EnvVar] = {}
    for value, file in unit.environment:
        for name, val in parse_assignments(expand_specifiers(value, spec)):
            env[name] = EnvVar(name, val, f"in Environment= in {file}")
    for value, file in unit.environment_files:
        path = expand_specifiers(value, spec)
        optional = path.startswith("-")
        path = path.removeprefix("-")
        text = read(path)
        if text is None:
            if optional:
                continue
            raise InitError(f"EnvironmentFile={path} in {file}: no such file (systemd would not "
                            "start the unit either)")
        for name, val in parse_env_file(text):
            env[name] = EnvVar(name, val, f"in EnvironmentFile={path} in {file}")
    return list(env.values())


def _home(user: str) -> str:
    if not user:
        return str(Path.home())
    try:
        return pwd.getpwnam(user).pw_dir
    except KeyError:
        return f"/home/{user}"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InitError(f"{path}: cannot read: {e}") from e


def to_source(unit: Unit, path: Path, read: Callable[[str], str | None],
              home: str) -> Source:
    """The unit's command, environment and folders as a Source."""
    if not unit.exec_start:
        raise InitError(f"{path}: no ExecStart= in [Service]")
    if len(unit.exec_start) > 1:
        raise InitError(f"{path}: {len(unit.exec_start)} ExecStart= lines; a llama-server unit "
                        "runs one: give its command on the command line instead")
    spec = {"%": "%", "h": home, "u": unit.user or "root", "n": path.name,
            "N": path.name.removesuffix(".service"), "p": path.name.split("@")[0].split(".")[0],
            "i": path.name.partition("@")[2].rsplit(".", 1)[0]}
    env = environment(unit, spec, read)
    value, file = unit.exec_start[0]
    value = expand_specifiers(value, spec)
    argv = exec_argv(value, {v.name: v.value for v in env})
    if not argv:
        raise InitError(f"ExecStart= in {file} is empty once its variables are expanded")
    workdir = expand_specifiers(unit.working_directory, spec).removeprefix("-")
    if workdir.startswith("~"):
        workdir = home + workdir[1:]
    used = referenced(value)
    return Source(argv=tuple(argv), where=f"in ExecStart= in {file}", env=tuple(env),
                  workdir=workdir or "/", home=home,
                  expanded=tuple(v.name for v in env if v.name in used))


def read_unit(path: Path) -> Source:
    """The unit file and its drop-ins, read and parsed."""
    text = _read(str(path))
    if text is None:
        raise InitError(f"{path}: no such file")
    unit = parse_unit(text, str(path))
    dropins = path.with_name(path.name + ".d")
    if dropins.is_dir():
        for conf in sorted(dropins.glob("*.conf")):
            unit = parse_unit(_read(str(conf)) or "", str(conf), unit)
    return to_source(unit, path, _read, _home(unit.user))
