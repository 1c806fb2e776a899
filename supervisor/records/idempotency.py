"""Idempotency-Key (IETF httpapi draft "The Idempotency-Key HTTP Header Field").

A bounded store with a time to live. Keys are scoped to the API key the client presented (or
global without one) and to the route. For each key:
- the first request runs; while it runs, a retry gets 409 Conflict;
- once it completed, a retry with the same body gets the stored response, marked
  `Idempotent-Replayed: true`, without running again;
- the same key with a different body gets 422 Unprocessable Content;
- only final answers are stored: after a controlled 503/502/504 (or a stream cut short) the key
  is released, so a retry runs anew.

Streams are stored whole when they complete and fit the size limit; a retry gets the whole
event stream at once. A stream too large to store releases its key like a controlled error does.

Bounds, each kept in constant time per request (no scan of the store, however full):
- a time to live, counted from a key's first request;
- at most `max_entries` keys: when full, the oldest completed answer goes;
- at most `max_total_bytes` of stored answers (`stored_size`): the oldest completed answers go
  until the new one fits; an answer larger than the whole budget (or than
  `max_response_bytes`) is not stored and its key is released.
A key still running is never evicted (its retry must get 409); there are at most as many as
requests in flight, so the store may then hold more than `max_entries` keys for a while.

No clock reads here: the caller passes `now` (monotonic seconds).
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .caches import figures

# Rough cost of a stored answer beyond the lengths of its body, headers, key and scope: the
# entry and the response objects, both ordered maps' nodes, the fingerprint, and each string's
# and the body's own object header (about 1 KiB measured with tracemalloc on CPython 3.11).
ENTRY_OVERHEAD_BYTES = 1024


class Outcome(enum.Enum):
    NEW = "new"  # run it; then complete() or release()
    IN_PROGRESS = "in_progress"  # 409
    MISMATCH = "mismatch"  # 422
    DONE = "done"  # answer with the stored response


@dataclass(frozen=True)
class StoredResponse:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass
class _Entry:
    fingerprint: str
    created: float
    response: StoredResponse | None = None


@dataclass(frozen=True)
class Lookup:
    outcome: Outcome
    response: StoredResponse | None = None


def fingerprint(method: str, path_qs: str, body: bytes) -> str:
    h = hashlib.sha256()
    for part in (method.encode(), b"\0", path_qs.encode(), b"\0", body):
        h.update(part)
    return h.hexdigest()


def scope_of(api_key: str | None, route: str) -> str:
    """Keys of different API keys never meet (a hash, so the key itself is not kept)."""
    owner = hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else "global"
    return f"{owner}:{route}"


def stored_size(scope: str, key: str, response: StoredResponse) -> int:
    """What an answer counts against `max_total_bytes`: its body, its headers and the entry."""
    return (len(response.body) + sum(len(h) + len(v) for h, v in response.headers)
            + len(scope) + len(key) + ENTRY_OVERHEAD_BYTES)


_Id = tuple[str, str]  # (scope, key)


@dataclass
class IdempotencyStore:
    max_entries: int = 10_000
    ttl_s: float = 24 * 3600.0
    max_response_bytes: int = 8 * 1024 * 1024
    max_total_bytes: int = 256 * 1024 * 1024
    # Every key, running or completed, in creation order (time to live: oldest first).
    _entries: OrderedDict[_Id, _Entry] = field(default_factory=OrderedDict)
    # The completed ones in completion order, each with its size (eviction: oldest first).
    # OrderedDict: deleting from the middle and popping the oldest are both O(1).
    _done: OrderedDict[_Id, int] = field(default_factory=OrderedDict)
    _stored_bytes: int = 0

    @property
    def stored_bytes(self) -> int:
        """The stored answers' total size, as counted against `max_total_bytes`."""
        return self._stored_bytes

    @property
    def completed(self) -> int:
        return len(self._done)

    def configure(self, *, max_entries: int, ttl_s: float, max_response_bytes: int,
                  max_total_bytes: int) -> None:
        """New limits (a reload): lower ones take effect at once."""
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_response_bytes = max_response_bytes
        self.max_total_bytes = max_total_bytes
        self._evict(len(self._entries) - max_entries)

    def _forget(self, ident: _Id) -> None:
        self._entries.pop(ident, None)
        size = self._done.pop(ident, None)
        if size is not None:
            self._stored_bytes -= size

    def _evict(self, count: int) -> None:
        """Drop the oldest completed answers: `count` of them, then as many more as the byte
        budget needs. Running keys stay. O(1) per answer dropped."""
        while self._done and (count > 0 or self._stored_bytes > self.max_total_bytes):
            ident, size = self._done.popitem(last=False)
            del self._entries[ident]
            self._stored_bytes -= size
            count -= 1

    def _expire(self, now: float) -> None:
        while self._entries:  # oldest first: entries are kept in creation order
            ident, entry = next(iter(self._entries.items()))
            if now - entry.created < self.ttl_s:
                break
            self._forget(ident)

    def begin(self, scope: str, key: str, fp: str, now: float) -> Lookup:
        self._expire(now)
        ident = (scope, key)
        entry = self._entries.get(ident)
        if entry is None:
            # Room for one more key: the oldest completed answers go. If every key is still
            # running, it is added anyway, as a request in flight is bounded elsewhere.
            self._evict(len(self._entries) - self.max_entries + 1)
            self._entries[ident] = _Entry(fp, now)
            return Lookup(Outcome.NEW)
        if entry.fingerprint != fp:
            return Lookup(Outcome.MISMATCH)
        if entry.response is None:
            return Lookup(Outcome.IN_PROGRESS)
        return Lookup(Outcome.DONE, entry.response)

    def complete(self, scope: str, key: str, response: StoredResponse) -> bool:
        """Store a final answer; False (and the key released) if it is too large to keep: over
        `max_response_bytes`, or alone over `max_total_bytes`. Older completed answers make
        room for it."""
        ident = (scope, key)
        entry = self._entries.get(ident)
        if entry is None:
            return False
        size = stored_size(scope, key, response)
        if len(response.body) > self.max_response_bytes or size > self.max_total_bytes:
            self._forget(ident)
            return False
        if entry.response is not None:  # completed twice: the new answer replaces the old
            self._stored_bytes -= self._done.pop(ident)
        entry.response = response
        self._done[ident] = size
        self._stored_bytes += size
        self._evict(0)  # the new answer is the newest and fits alone: it stays
        return True

    def export(self) -> list[tuple[str, str, str, float, StoredResponse]]:
        """The completed answers, oldest first: (scope, key, fingerprint, created, response),
        as an upgrade hands them to the next daemon (`created` is monotonic seconds: the same
        clock for every process of one boot)."""
        return [(scope, key, self._entries[(scope, key)].fingerprint,
                 self._entries[(scope, key)].created, response)
                for (scope, key) in self._done
                if (response := self._entries[(scope, key)].response) is not None]

    def absorb(self, answers: list[tuple[str, str, str, float, StoredResponse]],
               now: float) -> int:
        """Answers another daemon completed (export's), each kept as if completed here, within
        this store's bounds; a key this store holds already keeps its own, and an expired one
        is dropped. How many were kept."""
        kept = 0
        for scope, key, fp, created, response in answers:
            ident = (scope, key)
            if ident in self._entries or now - created >= self.ttl_s:
                continue
            self._evict(len(self._entries) - self.max_entries + 1)
            self._entries[ident] = _Entry(fp, created)
            kept += self.complete(scope, key, response)
        return kept

    def release(self, scope: str, key: str) -> None:
        """Not a final answer (a controlled error): a retry runs anew."""
        self._forget((scope, key))

    def __len__(self) -> int:
        return len(self._entries)

    def cache_figures(self) -> dict[str, Any]:
        """For the status's caches: keys held (running ones included) and stored bytes."""
        return figures(len(self._entries), max_entries=self.max_entries,
                       size=self._stored_bytes, max_bytes=self.max_total_bytes,
                       max_age_s=self.ttl_s)
