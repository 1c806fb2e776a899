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
No clock reads here: the caller passes `now` (monotonic seconds).
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field


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


@dataclass
class IdempotencyStore:
    max_entries: int = 10_000
    ttl_s: float = 24 * 3600.0
    max_response_bytes: int = 8 * 1024 * 1024
    _entries: OrderedDict[tuple[str, str], _Entry] = field(default_factory=OrderedDict)

    def _expire(self, now: float) -> None:
        while self._entries:  # oldest first: entries are kept in creation order
            key, entry = next(iter(self._entries.items()))
            if now - entry.created < self.ttl_s:
                break
            del self._entries[key]
        excess = len(self._entries) - self.max_entries + 1
        if excess > 0:
            # Full: drop the oldest completed answers. A key still running stays, since its
            # retry must get 409, and there are at most as many as requests in flight.
            done = [k for k, e in self._entries.items() if e.response is not None]
            for key in done[:excess]:
                del self._entries[key]

    def begin(self, scope: str, key: str, fp: str, now: float) -> Lookup:
        self._expire(now)
        entry = self._entries.get((scope, key))
        if entry is None:
            self._entries[(scope, key)] = _Entry(fp, now)
            return Lookup(Outcome.NEW)
        if entry.fingerprint != fp:
            return Lookup(Outcome.MISMATCH)
        if entry.response is None:
            return Lookup(Outcome.IN_PROGRESS)
        return Lookup(Outcome.DONE, entry.response)

    def complete(self, scope: str, key: str, response: StoredResponse) -> bool:
        """Store a final answer; False (and the key released) if it is too large to keep."""
        entry = self._entries.get((scope, key))
        if entry is None:
            return False
        if len(response.body) > self.max_response_bytes:
            del self._entries[(scope, key)]
            return False
        entry.response = response
        return True

    def release(self, scope: str, key: str) -> None:
        """Not a final answer (a controlled error): a retry runs anew."""
        self._entries.pop((scope, key), None)

    def __len__(self) -> int:
        return len(self._entries)
