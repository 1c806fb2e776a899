"""Which pool a request is served from.

Single-model mode has one pool (pool.py), and every request is its. Router mode has one pool per
model (router/models.py: the model's upstream on each router) and the routers' own pool, for
requests that name no model the routers listed: Spillway's questions about the routers
themselves (`/health`, `/models`, `/props`), and requests for a model nobody knows, which the GPU
router answers in its own words (`model 'x' not found`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

from .pool import Pool

# a model named by a request -> (its canonical name, its pool), or None when no router lists it
ModelLookup = Callable[[str], "tuple[str, Pool] | None"]

# Routes that act on a router itself even though their body names a model: a load or unload is
# for the GPU router (the CPU router loads on demand), whatever is loaded where.
ROUTER_ROUTES = frozenset({"/models/load", "/models/unload"})


class Pools:
    def __init__(self, main: Pool, lookup: ModelLookup | None = None,
                 every: Callable[[], list[Pool]] | None = None,
                 listed: Callable[[], Awaitable[None]] | None = None) -> None:
        self.main = main
        self.lookup = lookup
        self._every = every
        self._listed = listed

    @property
    def router(self) -> bool:
        return self.lookup is not None

    async def listed(self) -> None:
        """Until the models are known that a router which has just become ready serves (its
        listing read): asked before `for_model` for a request that names a model."""
        if self._listed is not None:
            await self._listed()

    def for_model(self, model: str | None, path: str = "") -> tuple[str | None, Pool]:
        """(the model's canonical name, its pool); (None, the main pool) when the request names
        no known model, and always in single-model mode."""
        if self.lookup is None or model is None or path in ROUTER_ROUTES:
            return None, self.main
        found = self.lookup(model)
        return found if found is not None else (None, self.main)

    def __iter__(self) -> Iterator[Pool]:
        yield self.main
        if self._every is not None:
            yield from self._every()
