"""The projector in the config: model.args' --mmproj goes to the GPU and CPU children (the CPU
child runs it on the CPU: it is given no card), never to the small child, which takes its own
from small.mmproj."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import llama_args
from supervisor.config import schema as config


def build(tmp_path: Path, **small: str) -> config.Config:
    for name in ("large.gguf", "small.gguf", "mmproj-large.gguf", "mmproj-small.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    (tmp_path / "llama-server").write_text("#!/bin/sh\n")
    (tmp_path / "llama-server").chmod(0o755)
    return config.build({"model": {"path": str(tmp_path / "large.gguf"),
                                   "llama_server": str(tmp_path / "llama-server"),
                                   "args": ["--mmproj", str(tmp_path / "mmproj-large.gguf")]},
                         "small": {"path": str(tmp_path / "small.gguf"), **small}},
                        base_dir=tmp_path)


def test_the_large_projector_on_the_gpu_and_cpu_children_not_the_small_one(
        tmp_path: Path) -> None:
    cfg = build(tmp_path)
    large = str(tmp_path / "mmproj-large.gguf")
    assert llama_args.flag_value(cfg.child("gpu").args, "--mmproj") == large
    assert llama_args.flag_value(cfg.child("cpu").args, "--mmproj") == large
    # The CPU child sees no card: its projector runs on the CPU (llama-server's --mmproj-offload
    # follows --device none).
    assert llama_args.flag_value(cfg.child("cpu").args, "--device") == "none"
    assert llama_args.flag_value(cfg.child("small").args, "--mmproj") is None


def test_small_mmproj_gives_the_small_child_its_own(tmp_path: Path) -> None:
    cfg = build(tmp_path, mmproj="mmproj-small.gguf")  # relative to the config's folder
    assert llama_args.flag_value(cfg.child("small").args, "--mmproj") == \
        str(tmp_path / "mmproj-small.gguf")
    assert llama_args.flag_value(cfg.child("gpu").args, "--mmproj") == \
        str(tmp_path / "mmproj-large.gguf")


def test_a_missing_small_projector_is_a_problem_of_its_key(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError) as e:
        build(tmp_path, mmproj="nowhere.gguf")
    assert "small.mmproj: no such file" in str(e.value)


def test_small_mmproj_without_a_small_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError) as e:
        config.build({"model": {"path": str(tmp_path / "m.gguf")},
                      "small": {"mmproj": "p.gguf"}}, check_paths=False)
    assert "small.path" in str(e.value) and "small.mmproj" in str(e.value)
