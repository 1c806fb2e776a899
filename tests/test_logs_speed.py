"""supervisor/service/logs.py: the cheaper log path writes the same bytes as the plain `logging` one
(plain and journal modes), and the lines it keeps within a loop iteration all reach the stream,
whole and in order."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.service import logs

# Today's formats, written out here: the test compares against `logging`'s own output.
PLAIN = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
JOURNAL = "%(name)s: %(message)s"
PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
            logging.DEBUG: 7}


def reference_plain(record: logging.LogRecord) -> str:
    return logging.Formatter(PLAIN).format(record)


def reference_journal(record: logging.LogRecord) -> str:
    text = logging.Formatter(JOURNAL).format(record)
    priority = PRIORITY.get(record.levelno, 6)
    return "\n".join(f"<{priority}>{line}" for line in text.splitlines())


@pytest.fixture
def logging_state() -> Iterator[None]:
    """setup() changes process-wide logging state: put it back."""
    root = logging.getLogger()
    saved: dict[str, Any] = {name: getattr(logging, name) for name in
                             ("_srcfile", "logThreads", "logProcesses", "logMultiprocessing")}
    handlers, level = root.handlers[:], root.level
    access = logging.getLogger("aiohttp.access").level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.getLogger("aiohttp.access").setLevel(access)
        for name, value in saved.items():
            setattr(logging, name, value)


def _exc_info() -> Any:
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        return sys.exc_info()


def records() -> list[logging.LogRecord]:
    """Records at chosen times: within a second, across seconds, back in time, on the second."""
    t0 = 1_700_000_000.0
    cases: list[tuple[float, int, str, tuple[Any, ...], Any]] = [
        (t0 + 0.123, logging.INFO, "rid=%s %s %s -> %s %d %.3fs attempts=%d",
         ("ab12", "POST", "/v1/chat/completions", "gpu", 200, 0.00123, 1), None),
        (t0 + 0.999, logging.DEBUG, "same second, later", (), None),
        (t0 + 1.0, logging.WARNING, "on the next second", (), None),
        (t0 + 1.5005, logging.ERROR, "with a traceback", (), _exc_info()),
        (t0 - 86_400.25, logging.CRITICAL, "a day back %d%%", (100,), None),
        (t0 + 1.75, logging.INFO, "carriage\rreturn and \x0bvertical tab", (), None),
        (t0 + 1.8, logging.INFO, "two\nlines\n", (), None),
        (t0 + 1.9, logging.INFO, "", (), None),
        (t0 + 3601.0, 25, "a level of its own", (), None),
    ]
    out = []
    for created, level, msg, args, exc in cases:
        r = logging.LogRecord("spillway.proxy", level, "(unknown file)", 0, msg, args, exc)
        r.created = created
        r.msecs = int((created - int(created)) * 1000) + 0.0
        out.append(r)
    return out


def test_plain_formatter_matches_logging_formatter() -> None:
    formatter = logs.PlainFormatter(logs.PLAIN_FORMAT)
    for ours, theirs in zip(records(), records(), strict=True):
        assert formatter.format(ours) == reference_plain(theirs)
    # And again, the cached second now that of the last record.
    for ours, theirs in zip(records(), records(), strict=True):
        assert formatter.format(ours) == reference_plain(theirs)


def test_journal_formatter_matches_todays_output() -> None:
    formatter = logs.JournalFormatter(logs.JOURNAL_FORMAT)
    for ours, theirs in zip(records(), records(), strict=True):
        assert formatter.format(ours) == reference_journal(theirs)


def _run_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal: bool
               ) -> tuple[Path, io.TextIOWrapper]:
    path = tmp_path / "stderr.log"
    stream = open(path, "w", encoding="utf-8")  # closed by the caller
    if journal:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    else:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.setattr(sys, "stderr", stream)
    logs.setup("debug")
    assert logs.stderr_is_journal() is journal
    return path, stream


@pytest.mark.parametrize("journal", [False, True], ids=["plain", "journal"])
def test_setup_writes_what_logging_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         logging_state: None, journal: bool) -> None:
    """Real records through the handler setup() installs, in and out of an event loop, against
    a plain StreamHandler with today's formatter fed the same records."""
    path, stream = _run_setup(tmp_path, monkeypatch, journal)
    expected = io.StringIO()
    reference = logging.StreamHandler(expected)
    reference.setFormatter(logging.Formatter(JOURNAL if journal else PLAIN))
    if journal:
        reference.format = reference_journal  # type: ignore[method-assign]
    logging.getLogger().addHandler(reference)
    log = logging.getLogger("spillway.proxy")

    def lines(tag: str) -> None:
        for i in range(50):
            log.info("rid=%s %s %s -> %s %d %.3fs attempts=%d", f"{tag}{i}", "POST",
                     "/v1/chat/completions", "gpu", 200, i / 7, 1)
        log.warning("[gpu] exited: %s", tag)
        log.debug("multi\nline %s", tag)
        try:
            raise RuntimeError(tag)
        except RuntimeError:
            log.exception("failed %s", tag)

    async def in_loop() -> None:
        lines("loop-a")
        await asyncio.sleep(0)
        lines("loop-b")

    lines("before")
    asyncio.run(in_loop())
    lines("after")
    logging.getLogger().removeHandler(reference)
    for h in logging.getLogger().handlers:
        h.flush()
    stream.close()
    got = path.read_text(encoding="utf-8")
    assert got == expected.getvalue()
    assert got.count("\n") > 4 * 55


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


def _handler() -> tuple[logs.LoopBatchingHandler, CountingStream, logging.Logger]:
    stream = CountingStream()
    handler = logs.LoopBatchingHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.Logger("batching-test", logging.DEBUG)  # outside the logging tree
    logger.addHandler(handler)
    return handler, stream, logger


def _expect(*ranges: range) -> str:
    return "".join(f"line {i}\n" for r in ranges for i in r)


def test_an_iterations_lines_go_out_in_one_write_in_order() -> None:
    _, stream, log = _handler()

    async def main() -> None:
        for i in range(100):
            log.info("line %d", i)
        assert stream.getvalue() == ""  # kept until the loop's next iteration
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert stream.getvalue() == _expect(range(100))
        assert stream.writes == 1
        for i in range(100, 110):
            log.info("line %d", i)
        log.warning("line %d", 110)  # a warning goes out at once, after the lines before it
        assert stream.getvalue() == _expect(range(111))
        log.info("line %d", 111)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert stream.getvalue() == _expect(range(112))

    asyncio.run(main())


def test_outside_a_loop_every_line_is_written_at_once() -> None:
    _, stream, log = _handler()
    for i in range(3):
        log.info("line %d", i)
        assert stream.getvalue() == _expect(range(i + 1))


def test_lines_left_when_the_loop_stops_are_written_by_flush_or_the_next_line() -> None:
    handler, stream, log = _handler()
    loop = asyncio.new_event_loop()

    def last_iteration() -> None:
        for i in range(5):
            log.info("line %d", i)
        loop.stop()  # the loop ends before the callback that would write them runs

    loop.call_soon(last_iteration)
    loop.run_forever()
    loop.close()
    assert stream.getvalue() == ""
    handler.flush()  # as logging.shutdown does at exit
    assert stream.getvalue() == _expect(range(5))

    loop = asyncio.new_event_loop()
    loop.call_soon(last_iteration)
    loop.run_forever()
    loop.close()
    log.info("line %d", 5)  # outside any loop: written at once, after those kept
    assert stream.getvalue() == _expect(range(5), range(6))

    async def again() -> None:  # a new loop gets its own callback
        log.info("line %d", 6)
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(again())
    assert stream.getvalue() == _expect(range(5), range(7))


def test_a_large_batch_is_written_before_the_iteration_ends() -> None:
    handler, stream, log = _handler()
    handler.MAX_PENDING = 1000

    async def main() -> None:
        for i in range(300):
            log.info("line %d", i)
        assert 0 < len(stream.getvalue()) < len(_expect(range(300)))
        assert _expect(range(300)).startswith(stream.getvalue())  # whole lines
        assert stream.getvalue().endswith("\n")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert stream.getvalue() == _expect(range(300))

    asyncio.run(main())


def test_lines_from_another_thread_keep_the_order_they_were_logged_in() -> None:
    _, stream, log = _handler()
    done = threading.Event()

    def other() -> None:
        log.info("line %d", 3)
        done.set()

    async def main() -> None:
        for i in range(3):
            log.info("line %d", i)
        threading.Thread(target=other).start()
        done.wait(10)  # the loop blocked on purpose: its lines still wait
        assert stream.getvalue() == _expect(range(4))
        log.info("line %d", 4)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert stream.getvalue() == _expect(range(5))

    asyncio.run(main())


def test_setup_flushes_the_handler_it_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               logging_state: None) -> None:
    path, stream = _run_setup(tmp_path, monkeypatch, journal=False)
    loop = asyncio.new_event_loop()

    def last_iteration() -> None:
        logging.getLogger("spillway").info("kept")
        loop.stop()

    loop.call_soon(last_iteration)
    loop.run_forever()
    loop.close()
    logs.setup("info")
    stream.flush()
    assert path.read_text(encoding="utf-8").endswith(" INFO    spillway: kept\n")
    stream.close()


def test_records_skip_the_callers_frame(logging_state: None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[bool] = []
    original: Callable[..., Any] = logging.Logger.findCaller

    def spy(self: logging.Logger, *a: Any, **k: Any) -> Any:
        called.append(True)
        return original(self, *a, **k)

    monkeypatch.setattr(logging.Logger, "findCaller", spy)
    logs.quiet_records()
    logger = logging.Logger("quiet-test", logging.INFO)
    logger.addHandler(logging.NullHandler())
    logger.info("x")
    assert not called
