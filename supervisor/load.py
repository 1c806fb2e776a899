"""What one upstream is working on: the one count of its requests in flight.

The pool writes it (a lease taken, a lease closed); nothing else does. The child reads it: a
draining child waits for `idle`, and its status shows the count.
"""

from __future__ import annotations

import asyncio


class Load:
    __slots__ = ("generation", "other", "idle")

    def __init__(self) -> None:
        self.generation = 0  # generation requests: what the admission caps count
        self.other = 0  # routes outside the caps (/props, /slots, ...)
        self.idle = asyncio.Event()  # set while nothing is in flight
        self.idle.set()

    @property
    def in_flight(self) -> int:
        return self.generation + self.other

    def take(self, generation: bool) -> None:
        if generation:
            self.generation += 1
        else:
            self.other += 1
        self.idle.clear()

    def give_back(self, generation: bool) -> None:
        if generation:
            self.generation = max(0, self.generation - 1)
        else:
            self.other = max(0, self.other - 1)
        if self.generation == 0 and self.other == 0:
            self.idle.set()
