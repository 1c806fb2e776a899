"""The small child beside the GPU child: who starts and stops it, when it is on demand.

`small.mode = "resident"`: it starts at boot with the others and stays loaded; its VRAM is simply
taken from what the card has (the headroom rule and the GPU child's fit checks see it in the
card's free memory). Nothing here acts. It stays when the operator pauses the GPU child (a game
wants the card): a small model beside the game is what serves then.

`small.mode = "on-demand"`: it holds no VRAM while the GPU child serves. When the GPU child dies
(it backs off, or goes FATAL), the small child is started into the memory the death freed, and
serves the requests that accept a smaller model. Before the GPU child starts again, the small
child is drained (its requests finish) and stopped, so that the two never load into the card at
once: the GPU child's start is held (`Child.hold`, asked as its back-off ends) while the small
child runs, and is asked for again once the small child has stopped.

The small child's state is its own lifecycle's; this only posts starts, drains and stops to the
two children, on what their state changes say.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from ..config.schema import Config
from ..policy.lifecycle import DEAD, ChildState
from ..upstreams.children import Child

log = logging.getLogger("spillway.small")

# The GPU child waiting for its next try after a death (BACKOFF, FATAL): the small child
# serves meanwhile. Not EXITED alone, which may walk on to STOPPED (a stop asked for as it died).
_WAITING = DEAD - {ChildState.EXITED}
# The small child's states in which it holds VRAM, or will (its own back-off restarts it).
_SMALL_UP = frozenset({ChildState.STARTING, ChildState.READY, ChildState.DRAINING,
                       ChildState.STOPPING, ChildState.BACKOFF, ChildState.EXITED})
MAKING_WAY = "the GPU child starts again: drained and stopped to give it the card"


class SmallTier:
    def __init__(self, gpu: Child, small: Child, config: Callable[[], Config],
                 paused: Collection[str]) -> None:
        self.gpu = gpu
        self.small = small
        self.config = config  # the running config (a reload may change small.mode)
        self.paused = paused
        # The GPU child's start was held for the small child: it is asked for again once the
        # small child has stopped.
        self.gpu_waiting = False
        self._stops: set[asyncio.Task[None]] = set()
        gpu.listeners.append(self._gpu_changed)
        small.listeners.append(self._small_changed)
        gpu.hold = self.hold

    @property
    def on_demand(self) -> bool:
        return self.config().small.on_demand

    def _gpu_changed(self, child: object, old: ChildState, new: ChildState,
                     reason: str) -> None:
        if self.on_demand and new is ChildState.STARTING and not self.gpu_waiting and \
                self.small.state in _SMALL_UP:
            # Started without waiting for it (an operator's restart, a reload): the small
            # child goes now, so that the two do not stay on the card together.
            log.warning("[%s] the GPU child starts while it runs: draining and stopping it",
                        self.small.name)
            self._clear(MAKING_WAY)
            return
        if not self.on_demand or new not in _WAITING or old in _WAITING:
            return
        if self.small.state is ChildState.STOPPED and self.small.name not in self.paused \
                and self.gpu.name not in self.paused:
            log.info("[%s] starting into the VRAM the GPU child's end freed (%s)",
                     self.small.name, reason)
            self.small.start()

    def hold(self) -> str | None:
        """Why the GPU child may not start yet (asked as its back-off ends): the small child
        still holds the card. It is drained and stopped now; the GPU child starts after."""
        if not self.on_demand or self.small.state not in _SMALL_UP:
            return None
        if not self.gpu_waiting:
            self.gpu_waiting = True
            # Not from inside the GPU child's lifecycle step: on the next turn of the loop.
            asyncio.get_running_loop().call_soon(self._make_way)
        return f"the {self.small.name} child holds the card: draining it first"

    def _make_way(self) -> None:
        if self.small.state is ChildState.STOPPED:
            self._small_changed(self.small, ChildState.STOPPED, ChildState.STOPPED, MAKING_WAY)
        else:
            self._clear(MAKING_WAY)

    def _clear(self, reason: str) -> None:
        """Drained (its requests finish) and stopped; stopped at once if it is not serving."""
        if self.small.state is ChildState.READY:
            self.small.drain(reason, then_stop=True)
        elif self.small.state is not ChildState.STOPPED:
            # starting, backing off, or draining to restart (sick): stopped for good now
            self._stop(reason)

    def _stop(self, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self.small.stop(reason))
        self._stops.add(task)  # held until done
        task.add_done_callback(self._stops.discard)

    def _small_changed(self, child: object, old: ChildState, new: ChildState,
                       reason: str) -> None:
        if new is ChildState.STOPPED and self.gpu_waiting:
            self.gpu_waiting = False
            if self.gpu.name not in self.paused:
                log.info("[%s] stopped: the GPU child starts again", self.small.name)
                self.gpu.start()
