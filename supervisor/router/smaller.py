"""A larger model's smaller model, both on the GPU router (router mode's `small.models`).

Router mode has no third process: the smaller model S is one more model of the GPU router, with
its own entry, pool and lifecycle (models.py). A larger model M's pool holds S's instance on the
GPU router as its third upstream, named `small` there, between M's two: a request for M that
accepts a smaller model (X-Spillway-Fallback: smaller) goes to it when M's instance on the GPU
router cannot take it, as to the small child in single-model mode. This is that upstream: the
same instance (its state, its one count of requests, its lifecycle are S's own upstream's, so
S's pool and M's count the same requests), under M's pool's name for it, and naming S in what
it is sent (`serves_model`: the forwarder rewrites the request's "model").
"""

from __future__ import annotations

from collections.abc import Sequence

from ..policy.lifecycle import ChildState
from ..vocabulary import ExitInfo, Load, StateListener
from .upstream import ModelUpstream


class SmallerModel:
    def __init__(self, instance: ModelUpstream, name: str) -> None:
        self.instance = instance
        self.name = name  # the role in the larger model's pool: "small"
        self.serves_model: str | None = instance.model

    @property
    def model(self) -> str:
        return self.instance.model

    @property
    def generation(self) -> int:
        return self.instance.generation

    @property
    def api_key(self) -> str:
        return self.instance.api_key

    @property
    def host(self) -> str:
        return self.instance.host

    @property
    def port(self) -> int | None:
        return self.instance.port

    @property
    def stderr_tail(self) -> Sequence[str]:
        return self.instance.stderr_tail

    @property
    def base_url(self) -> str:
        return self.instance.base_url

    @property
    def is_ready(self) -> bool:
        return self.instance.is_ready

    def running(self, generation: int) -> bool:
        return self.instance.running(generation)

    async def exit_of(self, generation: int, timeout: float) -> ExitInfo | None:
        return await self.instance.exit_of(generation, timeout)

    @property
    def load(self) -> Load:
        return self.instance.load

    @property
    def last_start_s(self) -> float | None:
        return self.instance.last_start_s

    @property
    def listeners(self) -> list[StateListener]:
        return self.instance.listeners

    @property
    def state(self) -> ChildState:
        return self.instance.state

    @property
    def state_since(self) -> float:
        return self.instance.state_since

    def next_try_in_s(self) -> float | None:
        return self.instance.next_try_in_s()

    def drain(self, reason: str) -> None:
        self.instance.drain(reason)

    @property
    def pid(self) -> int | None:
        return self.instance.pid

    @property
    def start_timeout_s(self) -> float:
        return self.instance.start_timeout_s

    def start(self) -> None:
        self.instance.start()

    async def wait_state(self, *states: ChildState, timeout: float | None = None) -> bool:
        return await self.instance.wait_state(*states, timeout=timeout)
