"""The bytes of large request bodies held at once, across requests: a body with images or
audio (or any over `LARGE_BODY_BYTES`) stays in memory from its arrival until its answer ends,
so that a failed attempt can be replayed with it. Without a bound, a flood of such requests is
a flood of memory; past the bound, a request gets the waiting line's controlled 503 (its queue
position: the bodies held ahead of it; `Retry-After`), before its body is read when its
Content-Length says it is large, and never a memory blow-up.

The handler is the one writer: it takes a place when the body's size is known (announced, or
read) and gives it back when the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..gpu import MIB

LARGE_BODY_BYTES = 1 * MIB  # a body this large counts even without media (long prompts)
DEFAULT_MAX_HELD_BYTES = 128 * MIB


@dataclass
class HeldBodies:
    limit: int = DEFAULT_MAX_HELD_BYTES  # 0: no bound
    held: int = 0  # bytes held now
    holders: int = 0  # requests holding them
    refused: int = 0  # requests refused, since the start

    def take(self, size: int) -> bool:
        """A place for a body of `size` bytes; False when it would pass the bound (a body
        larger than the whole bound is still taken when nothing else is held: it is under
        server.max_body_mib, and refusing it for ever would be no answer)."""
        if self.limit and self.held and self.held + size > self.limit:
            self.refused += 1
            return False
        self.held += size
        self.holders += 1
        return True

    def grow(self, taken: int, size: int) -> bool:
        """A place already taken for `taken` bytes (0: none) made right for `size`."""
        if taken == 0:
            return self.take(size)
        if size > taken and self.limit and self.held - taken + size > self.limit and \
                self.held > taken:
            self.refused += 1
            return False
        self.held += size - taken
        return True

    def give_back(self, size: int) -> None:
        self.held = max(0, self.held - size)
        self.holders = max(0, self.holders - 1)

    def to_json(self) -> dict[str, int]:
        return {"held_bytes": self.held, "holders": self.holders, "max_bytes": self.limit,
                "refused": self.refused}
