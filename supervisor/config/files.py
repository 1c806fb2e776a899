"""Replacing a file people and daemons read: a new file in the same folder, synced, then renamed
over the old one, so a reader (the daemon's config watcher among them) sees the old file or the
new, never half of one. The one place this is done; `spillway config` and `spillway init` use it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def _default_mode() -> int:
    """What a plain open() would create: 0666 less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomically(path: Path, text: str, mode: int | None = None) -> None:
    """Write `text` to `path` in one step. The file gets `mode` when given (a secret's 0600 from
    the first byte: mkstemp creates it so), else the mode and owner of the file it replaces,
    else the umask's."""
    try:
        st: os.stat_result | None = path.stat()
    except FileNotFoundError:
        st = None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            elif st is not None:
                os.fchmod(f.fileno(), st.st_mode & 0o7777)
                if os.geteuid() == 0:
                    os.fchown(f.fileno(), st.st_uid, st.st_gid)
            else:
                os.fchmod(f.fileno(), _default_mode())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
