"""files.write_atomically: the one way Spillway replaces a file people and daemons read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from supervisor.config.files import write_atomically


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_gets_the_umasks_mode_or_the_one_asked_for(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_atomically(tmp_path / "sub" / "a.toml", "a = 1\n")
    finally:
        os.umask(old)
    assert (tmp_path / "sub" / "a.toml").read_text() == "a = 1\n"
    assert mode(tmp_path / "sub" / "a.toml") == 0o640
    write_atomically(tmp_path / "env", "K='v'\n", mode=0o600)
    assert mode(tmp_path / "env") == 0o600


def test_a_replaced_file_keeps_its_mode_and_nothing_is_left_behind(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("old\n")
    path.chmod(0o604)
    write_atomically(path, "new\n")
    assert (path.read_text(), mode(path)) == ("new\n", 0o604)
    assert [p.name for p in tmp_path.iterdir()] == ["c.toml"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        write_atomically(path, "\udcff")  # a lone surrogate cannot be written as UTF-8
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["c.toml"]
