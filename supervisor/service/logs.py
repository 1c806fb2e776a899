"""Log lines for people and for journald.

One line per event. When stderr is the journal (systemd sets JOURNAL_STREAM to the device and
inode of the stream it gave us), each line starts with its syslog priority (`<3>` for errors,
`<6>` for info) and carries no timestamp, since the journal keeps its own.

The proxy writes a line per request, so a line must be cheap: the record skips what no format
here shows (the caller's file and line, the thread, the process), the timestamp's second is
formatted once per second, and inside the event loop the lines of one loop iteration reach
stderr in one write at the start of the next (whole lines, in order; a warning or an error, a
line from outside the loop, `flush()` and the exit write at once).

A request aiohttp's parser refuses (a header with a control byte or a space before its colon, a
line over the limit, a body that is not what its Content-Encoding says) never reaches Spillway's
handler; aiohttp answers it and logs it on `aiohttp.server` as an error with a traceback whose
message quotes the raw line, an `Authorization` header key and all. `MalformedRequests` makes
that one short line with no byte of the request in it: what was wrong, in the parser's first
words, and from where.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import Any, TextIO

from aiohttp.http_exceptions import (BadStatusLine, HttpProcessingError, InvalidURLError,
                                     LineTooLong, PayloadEncodingError)

from ..proxy.identity import loggable

_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}

JOURNAL_FORMAT = "%(name)s: %(message)s"
PLAIN_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


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
        lines = super().format(record).splitlines()
        if len(lines) == 1:
            return f"<{priority}>{lines[0]}"
        # A multi-line message (a traceback) keeps its priority on every line.
        return "\n".join(f"<{priority}>{line}" for line in lines)


class PlainFormatter(logging.Formatter):
    """logging.Formatter's output, its timestamp's second formatted once per second."""

    def __init__(self, fmt: str = PLAIN_FORMAT) -> None:
        super().__init__(fmt)
        self._second: tuple[int, str] = (-1, "")  # replaced whole: safe across threads

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None or self.default_msec_format is None:
            return super().formatTime(record, datefmt)
        second, text = self._second
        if int(record.created) != second:
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = (int(record.created), text)
        return self.default_msec_format % (text, record.msecs)


class LoopBatchingHandler(logging.StreamHandler[TextIO]):
    """A StreamHandler that, inside a running event loop, keeps a loop iteration's lines and
    writes them together (one write, one flush) from a callback run at the next iteration.
    Lines stay whole and in order; they are written at once (after any kept before them) when
    there is no running loop (another thread, before or after the loop), for a record of
    WARNING or above, when more than MAX_PENDING characters wait, and on `flush()` (which
    `logging.shutdown` calls at exit)."""

    MAX_PENDING = 64 * 1024

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._size = 0
        self._last: logging.LogRecord | None = None
        self._scheduled_on: asyncio.AbstractEventLoop | None = None

    def emit(self, record: logging.LogRecord) -> None:
        # Handler.handle holds self.lock around this call.
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self._pending.append(line)
        self._size += len(line)
        self._last = record
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or record.levelno >= logging.WARNING or self._size > self.MAX_PENDING:
            self._write_pending()
        elif self._scheduled_on is not loop:
            # Once per iteration; a loop that closed before running the callback leaves its
            # lines to the next record or flush(), which write them first.
            self._scheduled_on = loop
            loop.call_soon(self._flush_pending)

    def _flush_pending(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # Handler.createLock set it
            self._scheduled_on = None
            self._write_pending()

    def _write_pending(self) -> None:
        """Write what waits, in one write; the caller holds the lock."""
        if not self._pending:
            return
        text = "".join(self._pending)
        record = self._last
        self._pending.clear()
        self._size = 0
        self._last = None
        try:
            self.stream.write(text)
            self.stream.flush()
        except RecursionError:
            raise
        except Exception:
            if record is not None:
                self.handleError(record)

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._write_pending()
        super().flush()


class MalformedRequests(logging.Filter):
    """On `aiohttp.server`: a record of a request the HTTP parser refused becomes one short
    INFO line, `refused a malformed request from PEER (400): WHAT`, without its traceback and
    without the raw request bytes aiohttp's message quotes. Other records pass as they are (a
    failure of Spillway's own keeps its traceback). `logger` is the one it filters: a record
    made less severe is kept only if that logger shows the new level."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self._logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        refused = _parser_error(record.exc_info[1] if record.exc_info else None)
        if refused is None:
            return True
        peer = record.args[0] if record.msg == "Error handling request from %s" and \
            isinstance(record.args, tuple) and record.args else None
        record.msg = "refused a malformed request%s (%d): %s"
        record.args = (f" from {loggable(str(peer), 64)}" if peer is not None else "",
                       refused.code, what_was_wrong(refused))
        record.exc_info = None
        record.exc_text = None
        level = logging.INFO
        if peer is None and isinstance(refused, PayloadEncodingError):
            # aiohttp reading what a handler left of a body, after its answer: the handler
            # said it (the proxy's 400 has its own line), or did not need the body.
            level = logging.DEBUG
        record.levelno, record.levelname = level, logging.getLevelName(level)
        return self._logger.isEnabledFor(level)


def _parser_error(error: BaseException | None) -> HttpProcessingError | None:
    """The parser's error behind `error` (a body's is the cause of a RequestPayloadError)."""
    for _ in range(4):
        if error is None or isinstance(error, HttpProcessingError):
            return error
        error = error.__cause__ or error.__context__
    return None


def what_was_wrong(error: HttpProcessingError) -> str:
    """The parser's first words, before the colon that introduces the bytes it quotes
    ("Invalid header token:", "Got more than 16384 bytes when reading: b'Bearer ...'"). A
    request line and a URL are quoted without one, so those get words of their own."""
    text = error.message.split("\n", 1)[0]
    if isinstance(error, BadStatusLine) and text != "Received HTTPS traffic on an HTTP port":
        return "a bad request line"
    if isinstance(error, InvalidURLError):
        return "an invalid character in the URL"
    if isinstance(error, LineTooLong):
        return f"a line over {error.args[1]} bytes"
    return loggable(text.partition(":")[0].strip(), 100) or type(error).__name__


def quiet_records() -> None:
    """Records skip what no format here shows: the caller's frame (file, line, function: the
    costliest part of a record), the thread, the process, the asyncio task. Without the
    caller's frame, `stack_info=True` shows no stack: nothing here asks for one."""
    logging._srcfile = None  # the logging HOWTO's switch (Optimization): no findCaller
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if sys.version_info >= (3, 12):
        logging.logAsyncioTasks = False


def pending_figures() -> dict[str, Any]:
    """For the status's caches: the lines a batching handler keeps until the loop's next
    iteration (written at once past MAX_PENDING characters)."""
    kept = [h for h in logging.getLogger().handlers if isinstance(h, LoopBatchingHandler)]
    return {"entries": sum(len(h._pending) for h in kept),
            "bytes": sum(h._size for h in kept),
            "max_entries": None, "max_bytes": LoopBatchingHandler.MAX_PENDING, "max_age_s": None}


def setup(level: str = "info") -> None:
    handler = LoopBatchingHandler(sys.stderr)
    formatter: logging.Formatter
    if stderr_is_journal():
        formatter = JournalFormatter(JOURNAL_FORMAT)
    else:
        formatter = PlainFormatter(PLAIN_FORMAT)
    handler.setFormatter(formatter)
    # The formats show none of the fields quiet_records leaves out.
    quiet_records()
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, LoopBatchingHandler):  # a second setup: what it kept goes out first
            with contextlib.suppress(OSError, ValueError):
                old.flush()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log is replaced by one line per request from the proxy.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in server.filters):
        server.addFilter(MalformedRequests(server))
