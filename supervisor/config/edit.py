"""`spillway config get|set|unset`: one key of the TOML file, edited in place.

The file is people's own: its comments, order and layout stay as they are (tomlkit edits the
document, not a re-rendering of it). A change is validated by the same rules the daemon reads
the file with before anything is written, and written atomically (a new file renamed over the
old), so the daemon's watcher reloads either the old file or the new one, never half of it.

Validation compares the problems of the file before and after the edit: an edit is refused
for what it breaks, not for what was already wrong or for what only the daemon's environment
provides (an `api_key_env` variable set by systemd's EnvironmentFile and not in this shell).

A secret (`server.api_key`) is never written into the file, which anyone on the machine may
read: `set_secret` puts it where `spillway init` does, in an environment file (mode 0600), and
the file names its variable (`server.api_key_env`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.items import AoT, Comment, Item, Table, Whitespace

from . import schema as config
from .files import write_atomically

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the package requires 3.11
    import tomli as tomllib


class EditError(Exception):
    """An edit that was refused; nothing was written. `problems` name their key paths."""

    def __init__(self, message: str, problems: list[config.Problem] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


@dataclass(frozen=True)
class KeyPath:
    """`section.name`, or `section.name.entry` inside a table key such as `gpu.env`."""

    section: str
    name: str
    entry: str | None
    spec: config.Key

    def __str__(self) -> str:
        return ".".join(p for p in (self.section, self.name, self.entry) if p is not None)

    @property
    def kind(self) -> str:
        return "str" if self.entry is not None else self.spec.kind


def parse_key(text: str) -> KeyPath:
    """The key path, checked against the schema (unknown names suggest the nearest)."""
    parts = text.split(".")
    if len(parts) < 2:
        raise EditError(f"{text!r}: a key is section.name, e.g. queue.max_waiting")
    section, name, rest = parts[0], parts[1], parts[2:]
    if section not in config.SCHEMA:
        raise EditError(f"{text}: unknown section {section!r}"
                        + config.suggest(section, list(config.SCHEMA)))
    keys = config.SCHEMA[section]
    if name not in keys:
        raise EditError(f"{text}: unknown key {section}.{name}"
                        + config.suggest(name, list(keys)))
    spec = keys[name]
    if rest and (spec.kind != "str_table" or len(rest) != 1 or not rest[0]):
        raise EditError(f"{text}: {section}.{name} has no entries to name"
                        if spec.kind != "str_table" else
                        f"{text}: name one entry of {section}.{name}, e.g. {section}.{name}.NAME")
    return KeyPath(section, name, rest[0] if rest else None, spec)


def parse_value(key: KeyPath, text: str) -> Any:
    """VALUE as TOML (`7`, `true`, `"hot"`, `["-ngl", "99"]`); for a string key a bare word is
    taken as the string itself, so `config set cpu.mode on-demand` needs no shell quoting, and
    `config set gpu.env.CUDA_VISIBLE_DEVICES 1` sets the string "1"."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
        if key.kind == "str" and not isinstance(value, str):
            return text
        return value
    except tomllib.TOMLDecodeError:
        if key.kind in ("str", "int_or_str", "str_or_list", "number_or_auto"):
            return text
        example = {"int": "7", "number": "2.5", "bool": "true", "str_list": '["-c", "8192"]',
                   "str_table": '{ NAME = "value" }'}.get(key.kind, '"text"')
        raise EditError(f"{key}: {text!r} is not a TOML value (e.g. {example})") from None


def read(path: Path) -> tomlkit.TOMLDocument:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EditError(f"{path}: cannot read: {e}") from e
    try:
        return tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as e:
        raise EditError(f"{path}: not valid TOML: {e}") from e


def render(value: Any) -> str:
    """A value as TOML writes it: `7`, `"hot"`, `["a", "b"]`, `{A = "b"}`."""
    if isinstance(value, dict):
        table = tomlkit.inline_table()
        table.update(value)
        return str(table.as_string()).strip()
    return str(tomlkit.item(value).as_string()).strip()


def _unwrap(item: Any) -> Any:
    return item.unwrap() if isinstance(item, Item) else item


def _lookup(doc: tomlkit.TOMLDocument, key: KeyPath) -> tuple[Any, bool]:
    """(the key's value, whether the file sets it); an unset key gives its default."""
    section = doc.get(key.section)
    if isinstance(section, dict) and key.name in section:
        value = _unwrap(section[key.name])
        if key.entry is None:
            return value, True
        found = isinstance(value, dict) and key.entry in value
        return (value[key.entry] if found else None), found
    return (key.spec.default if key.entry is None else None), False


def get(path: Path, key_text: str) -> tuple[str | None, bool]:
    """(the value as TOML, whether the file sets it); an unset key gives its default (None when
    it has none, as for server.api_key)."""
    value, found = _lookup(read(path), parse_key(key_text))
    return (render(value) if value is not None else None), found


def _section_table(doc: tomlkit.TOMLDocument, section: str) -> Table:
    table = doc.get(section)
    if table is None:
        table = tomlkit.table()
        doc.add(section, table)
    if not isinstance(table, Table):
        raise EditError(f"{section}: is not a table in the file; edit it by hand")
    return table


def _apply(doc: tomlkit.TOMLDocument, key: KeyPath, value: Any) -> None:
    """Set (or, with value None, remove) the key in the document, in place."""
    if value is None and key.section not in doc:
        return  # nothing to remove, and no empty section to add
    table = _section_table(doc, key.section)
    if key.entry is None:
        if value is None:
            table.pop(key.name, None)
        else:
            _set(doc, key.section, key.name, value)
        return
    current = table.get(key.name)
    if current is None:
        if value is None:
            return
        current = tomlkit.inline_table()
        _set(doc, key.section, key.name, current)
    if not isinstance(current, dict):
        raise EditError(f"{key.section}.{key.name}: is not a table in the file")
    if value is None:
        current.pop(key.entry, None)
    elif isinstance(current, Table):  # a [section.name] table of its own
        _set(table, key.name, key.entry, value)
    else:
        current[key.entry] = value


def _set(doc: dict[str, Any], section: str, name: str, value: Any) -> None:
    """Set `name` in the table `doc[section]` (`doc`: the document, or a table holding a
    [section.name] table); a key the table lacks goes after its last key, not under the
    comments that close it, where tomlkit would put it: for tomlkit the comments above a table's
    header belong to the table before it ("# the CPU child" over [cpu] is in [gpu]'s body).
    tomlkit has no public insert: the table is then made anew, in the order wanted, from its
    items (public API only), and put in its place."""
    table = doc[section]
    assert isinstance(table, Table)
    if name in table:
        table[name] = value
        return
    body = table.value.body
    keys = [i for i, (k, item) in enumerate(body)
            if k is not None and not isinstance(item, (Table, AoT))]
    if not keys or body[keys[-1]][0].is_dotted():  # type: ignore[union-attr]
        table[name] = value
        return
    last = keys[-1]
    end = next((i for i, (_, item) in enumerate(body) if i > last
                and isinstance(item, (Table, AoT))), len(body))
    if not any(isinstance(item, Comment) for _, item in body[last + 1:end]):
        table[name] = value
        return
    made = tomlkit.table()
    made.trivia.indent = table.trivia.indent
    made.trivia.comment_ws = table.trivia.comment_ws
    made.trivia.comment = table.trivia.comment
    made.trivia.trail = table.trivia.trail
    for i, (k, item) in enumerate(body):
        made.append(k, item)
        if i == last:
            made.append(name, value)
    kept = len(made.value.body)
    doc[section] = made
    # Put in place, a table that does not end with a blank line gets one from tomlkit (a
    # "cosmetic" newline): ours ends with the next section's comments, which must stay on it.
    if len(made.value.body) > kept and isinstance(made.value.body[-1][1], Whitespace):
        del made.value.body[-1]


# A table's header line: `[name]`, `[name.sub]`, `["name"]` (not an array of tables' `[[...]]`)
_HEADER = re.compile(r'^[ \t]*\[(?!\[)[ \t]*"?([A-Za-z0-9_-]+)"?[ \t]*[.\]]')


def _placed(text: str, key: KeyPath, value: Any, appended: str) -> str:
    """`text` with the section it lacks, holding the key, in config.SECTIONS' order: before the
    header of the first section that comes after it (and above the comment lines right over that
    header, which are its own), not at the end, where tomlkit adds it (`appended`). `appended`
    when the file has no section after it, or when the placed text would not read as the same
    TOML (a header-like line inside a multi-line string)."""
    names = list(config.SECTIONS)
    later = set(names[names.index(key.section) + 1:])
    lines = text.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines)
               if (m := _HEADER.match(line)) and m.group(1) in later), None)
    if at is None:
        return appended
    above = at
    while above > 0 and lines[above - 1].lstrip().startswith("#"):
        above -= 1
    if above > 0:  # else they are the file's opening comments: they stay on top
        at = above
    section = tomlkit.document()
    _apply(section, key, value)
    gap = "\n" if at > 0 and lines[at - 1].strip() else ""
    placed = "".join(lines[:at]) + gap + section.as_string().rstrip("\n") + "\n\n" + \
        "".join(lines[at:])
    try:
        same = tomllib.loads(placed) == tomllib.loads(appended)
    except tomllib.TOMLDecodeError:
        same = False
    return placed if same else appended


def problems_of(text: str, path: Path,
                environ: Mapping[str, str] | None = None) -> list[config.Problem]:
    """What the daemon would refuse in this text, read as the file at `path` (with `environ`,
    else this process's environment)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return [config.Problem("", f"not valid TOML: {e}")]
    try:
        config.build(raw, source=str(path), base_dir=path.resolve().parent, environ=environ)
    except config.ConfigError as e:
        return e.problems
    return []


@dataclass(frozen=True)
class Change:
    key: str
    before: str | None  # as TOML; None: not set in the file
    after: str | None  # as TOML; None: removed
    unchanged: bool
    already_wrong: list[config.Problem]  # problems the file had before, left as they were


def edit(path: Path, key_text: str, value_text: str | None) -> Change:
    """Set KEY to VALUE (None: remove it, back to its default), validate, write atomically."""
    key = parse_key(key_text)
    path = path.resolve()  # a symlinked config: the file it points to is replaced
    doc = read(path)
    before_text = doc.as_string()
    before, before_set = _lookup(doc, key)
    value = None if value_text is None else parse_value(key, value_text)
    added = value is not None and key.section not in doc
    _apply(doc, key, value)
    after_text = doc.as_string()
    if added:
        after_text = _placed(before_text, key, value, after_text)
    old_problems = problems_of(before_text, path)
    new_problems = [p for p in problems_of(after_text, path) if p not in old_problems]
    if new_problems:
        raise EditError(f"{path}: {key} = {value_text} would make the config invalid; "
                        "nothing was written", new_problems)
    change = Change(str(key), render(before) if before_set else None,
                    None if value is None else render(value), after_text == before_text,
                    old_problems)
    if not change.unchanged:
        write_atomically(path, after_text)  # with the old file's mode and owner
    return change


# A key whose value is a secret -> the key that names the environment variable holding it.
SECRET_KEYS = {"server.api_key": "server.api_key_env"}
# The variable a key goes to when the file names none yet: init's (and the shipped unit's).
KEY_VARIABLE = "SPILLWAY_API_KEY"


@dataclass(frozen=True)
class SecretChange:
    key: str  # the secret's key, e.g. server.api_key
    variable: str  # the environment variable that holds it now
    names: Change  # the key that names the variable (server.api_key_env), as changed
    removed: bool  # the file held the secret itself, and no longer does


def set_secret(path: Path, key_text: str, value: str,
               keep: Callable[[str, str], object]) -> SecretChange:
    """Set a secret key (SECRET_KEYS) as `spillway init` does: `keep(variable, value)` puts the
    value in the environment file, and the config names the variable (the one it names
    already, else KEY_VARIABLE) and holds no value of its own. Validated (with the variable
    set) before anything is written; the environment file first, then the config."""
    key = parse_key(key_text)
    if str(key) not in SECRET_KEYS:
        raise EditError(f"{key}: is not a secret; set it with `config set`")
    if not value:
        raise EditError(f"{key}: is empty; `config unset {key}` runs without it")
    names = parse_key(SECRET_KEYS[str(key)])
    path = path.resolve()
    doc = read(path)
    before_text = doc.as_string()
    named, named_set = _lookup(doc, names)
    variable = named if named_set and isinstance(named, str) and named else KEY_VARIABLE
    removed = _lookup(doc, key)[1]
    added = key.section not in doc
    _apply(doc, key, None)
    _apply(doc, names, variable)
    after_text = doc.as_string()
    if added:
        after_text = _placed(before_text, names, variable, after_text)
    old_problems = problems_of(before_text, path)
    new_problems = [p for p in problems_of(after_text, path, {**os.environ, variable: value})
                    if p not in old_problems]
    if new_problems:
        raise EditError(f"{path}: {key} would make the config invalid; nothing was written",
                        new_problems)
    keep(variable, value)
    if after_text != before_text:
        write_atomically(path, after_text)  # with the old file's mode and owner
    return SecretChange(str(key), variable, Change(
        str(names), render(named) if named_set else None, render(variable),
        after_text == before_text, old_problems), removed)
