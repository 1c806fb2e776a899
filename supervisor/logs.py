"""Log lines for people and for journald.

One line per event. When stderr is the journal (systemd sets JOURNAL_STREAM to the device and
inode of the stream it gave us), each line starts with its syslog priority (`<3>` for errors,
`<6>` for info) and carries no timestamp, since the journal keeps its own.
"""

from __future__ import annotations

import logging
import os
import sys

_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def stderr_is_journal() -> bool:
    value = os.environ.get("JOURNAL_STREAM", "")
    if ":" not in value:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    dev, _, ino = value.partition(":")
    return f"{st.st_dev}:{st.st_ino}" == f"{dev}:{ino}"


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        # A multi-line message (a traceback) keeps its priority on every line.
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines())


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if stderr_is_journal():
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: "
                                               "%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log is replaced by one line per request from the proxy.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
