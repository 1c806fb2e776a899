"""Resumable streams: the bounded replay buffer of each conversation's stream, held by Spillway.

llama-server (PR 23226) keeps a streamed answer in a ring buffer when the request carries
`X-Conversation-Id`, so that a client that left (a page reload, a phone going to sleep) can
read it again with `GET /v1/stream?conv_id=ID&from=N`. A child's buffer dies with the child and
knows nothing of the other child, so Spillway holds the buffer itself, in front of both: what
it holds is what the client was sent, continued or replayed answers included, and the
children never see the header.

The same rules as llama-server's `stream_session_manager`:
- one conversation, one session: a new stream with the same id stops the old one;
- each session keeps at most `max_bytes`, dropping its oldest bytes first; a reader asking for
  a dropped offset is told the offset is lost;
- a finished session is kept `ttl_s` (counted from its end), then forgotten.
And bounds of Spillway's own: finished sessions hold at most `max_total_bytes` together, and
are at most `max_finished` (the oldest go first, whichever bound is reached). Live ones are
bounded by admission (each is a request in flight).

No clock reads here: the caller passes `now` (wall-clock seconds, as llama-server reports
`started_at` and `completed_at`). Stopping a producer is the caller's: a session only holds the
callable that does it.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .caches import figures
MAX_CONVERSATION_ID = 512  # characters; llama-server sets none, but an id is kept in memory


class Read(enum.Enum):
    OK = "ok"
    OFFSET_LOST = "offset_lost"  # `from` is below the bytes the cap dropped


@dataclass
class StreamSession:
    """One conversation's stream: its bytes (a window of at most `max_bytes`), as sent."""

    conversation_id: str
    request_id: str
    started_at: float
    max_bytes: int
    completed_at: float = 0.0  # 0 while it is live, as llama-server reports it
    dropped: int = 0  # bytes evicted from the front by the cap
    cancelled: bool = False  # stopped (DELETE, or a new stream for the same conversation)
    committed: bool = False  # an event stream was started for the client
    client_left: bool = False  # the original client went away; the answer went on
    stop: Callable[[], Any] | None = None  # stops the producer (the request's task)
    _buffer: bytearray = field(default_factory=bytearray)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.completed_at != 0.0

    @property
    def total_bytes(self) -> int:
        """Bytes that ever entered the session: the offset a reader reaches at its end."""
        return self.dropped + len(self._buffer)

    @property
    def held_bytes(self) -> int:
        return len(self._buffer)

    def append(self, data: bytes) -> bool:
        """The next bytes sent; False (and nothing kept) once the session has ended."""
        if self.done:
            return False
        if not data:
            return True
        if len(data) >= self.max_bytes:
            skip = len(data) - self.max_bytes
            self.dropped += len(self._buffer) + skip
            self._buffer = bytearray(data[skip:])
        else:
            over = len(self._buffer) + len(data) - self.max_bytes
            if over > 0:
                del self._buffer[:over]
                self.dropped += over
            self._buffer += data
        self._wake()
        return True

    def finish(self, now: float) -> None:
        """No more bytes: readers drain what is held and end."""
        if not self.done:
            self.completed_at = max(now, 1e-9)
            self.stop = None  # nothing left to stop; and it held the producer's task
            self._wake()

    def read_from(self, offset: int) -> tuple[Read, bytes]:
        """What is held from `offset` on (b"" when nothing yet), or OFFSET_LOST."""
        if offset < self.dropped:
            return Read.OFFSET_LOST, b""
        start = offset - self.dropped
        return Read.OK, bytes(self._buffer[start:])

    async def wait_beyond(self, offset: int) -> None:
        """Until bytes past `offset` arrive or the session ends."""
        while offset >= self.total_bytes and not self.done:
            await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def describe(self) -> dict[str, Any]:
        """One entry of POST /v1/streams/lookup, in llama-server's shape."""
        return {"conversation_id": self.conversation_id, "is_done": self.done,
                "total_bytes": self.total_bytes, "started_at": int(self.started_at),
                "completed_at": int(self.completed_at)}


@dataclass
class StreamSessions:
    """Every conversation's session, live or finished, by conversation id."""

    max_bytes: int = 4 * 1024 * 1024
    ttl_s: float = 300.0
    max_total_bytes: int = 64 * 1024 * 1024
    max_finished: int = 4096
    _sessions: dict[str, StreamSession] = field(default_factory=dict)
    # The finished ones in finishing order (expiry and eviction: oldest first).
    _finished: OrderedDict[str, StreamSession] = field(default_factory=OrderedDict)
    _finished_bytes: int = 0  # their held bytes together (a finished session's never change)

    def configure(self, *, max_bytes: int, ttl_s: float, max_total_bytes: int,
                  max_finished: int | None = None) -> None:
        """New limits (a reload): they apply to sessions started from now on, and the totals
        at once."""
        self.max_bytes, self.ttl_s, self.max_total_bytes = max_bytes, ttl_s, max_total_bytes
        if max_finished is not None:
            self.max_finished = max_finished
        self._evict()

    def start(self, conversation_id: str, request_id: str, now: float) -> StreamSession:
        """A new stream for the conversation; the one it had before is stopped."""
        self.prune(now)
        previous = self._sessions.get(conversation_id)
        if previous is not None:
            # Finished or live, it goes whole: a finished one left in the finishing order
            # would later be evicted in the new one's name (and counted twice).
            self._forget(previous)
            self._end(previous, now, cancel=True)
        session = StreamSession(conversation_id, request_id, now, self.max_bytes)
        self._sessions[conversation_id] = session
        return session

    def finished(self, session: StreamSession, now: float) -> None:
        """Its producer is done: kept for `ttl_s`, or forgotten at once if it never started
        an event stream (it was refused, or answered with an error), as llama-server does."""
        if self._sessions.get(session.conversation_id) is not session:
            session.finish(now)  # replaced or stopped meanwhile: already forgotten
            return
        if not session.committed:
            self._forget(session)
            session.finish(now)
            return
        session.finish(now)
        self._finished[session.conversation_id] = session
        self._finished_bytes += session.held_bytes
        self._evict()

    def get(self, conversation_id: str, now: float) -> StreamSession | None:
        self.prune(now)
        return self._sessions.get(conversation_id)

    def lookup(self, ids: Iterable[str], now: float) -> list[StreamSession]:
        """The sessions of ids the caller names: each id matches itself and `ID::model` (the
        router's per-model ids). Nothing is listed that was not asked for."""
        self.prune(now)
        found: list[StreamSession] = []
        for wanted in ids:
            prefix = wanted + "::"
            found += [s for cid, s in self._sessions.items()
                      if cid == wanted or cid.startswith(prefix)]
        return found

    def stop(self, conversation_id: str, now: float) -> bool:
        """The explicit Stop: the producer is stopped and the session forgotten. Idempotent;
        True if there was one."""
        session = self._sessions.get(conversation_id)
        if session is None:
            return False
        self._forget(session)
        self._end(session, now, cancel=True)
        return True

    def stop_all(self, now: float) -> None:
        """Shutdown: every producer is stopped, every reader ends."""
        for session in list(self._sessions.values()):
            self._end(session, now, cancel=True)
        self._sessions.clear()
        self._finished.clear()
        self._finished_bytes = 0

    def prune(self, now: float) -> None:
        """Forget finished sessions past their time to live (oldest first)."""
        while self._finished:
            cid, session = next(iter(self._finished.items()))
            if now - session.completed_at < self.ttl_s:
                break
            self._forget(session)

    @property
    def live(self) -> int:
        return len(self._sessions) - len(self._finished)

    @property
    def finished_count(self) -> int:
        return len(self._finished)

    @property
    def held_bytes(self) -> int:
        return sum(s.held_bytes for s in self._sessions.values())

    def summary(self) -> dict[str, Any]:
        """For the status: how many streams are held, and how much of the budget they use."""
        return {"live": self.live, "finished": self.finished_count,
                "held_bytes": self.held_bytes, "finished_budget_bytes": self.max_total_bytes,
                "ttl_s": self.ttl_s}

    def cache_figures(self) -> dict[str, Any]:
        """For the status's caches: the finished sessions kept for readers (live ones are
        requests in flight, bounded by admission)."""
        return figures(len(self._finished), max_entries=self.max_finished,
                       size=self._finished_bytes, max_bytes=self.max_total_bytes,
                       max_age_s=self.ttl_s)

    def _evict(self) -> None:
        """The oldest finished sessions go while over either bound. O(1) per session."""
        while self._finished and (self._finished_bytes > self.max_total_bytes
                                  or len(self._finished) > self.max_finished):
            _, oldest = self._finished.popitem(last=False)
            self._sessions.pop(oldest.conversation_id, None)
            self._finished_bytes -= oldest.held_bytes

    def _forget(self, session: StreamSession) -> None:
        if self._sessions.get(session.conversation_id) is session:
            del self._sessions[session.conversation_id]
        if self._finished.get(session.conversation_id) is session:
            del self._finished[session.conversation_id]
            self._finished_bytes -= session.held_bytes

    @staticmethod
    def _end(session: StreamSession, now: float, cancel: bool) -> None:
        if cancel and not session.done:
            session.cancelled = True
            if session.stop is not None:
                session.stop()
        session.finish(now)

    def __len__(self) -> int:
        return len(self._sessions)
