"""The small child beside the GPU child: who starts and stops it, when it is on demand.

`small.mode = "resident"`: it starts at boot with the others and stays loaded; its VRAM is simply
taken from what the card has (the headroom rule and the GPU child's fit checks see it in the
card's free memory). Nothing here acts. It stays when the operator pauses the GPU child (a game
wants the card): a small model beside the game is what serves then.

`small.mode = "on-demand"`: it holds no VRAM while the GPU child serves. When the GPU child dies
(it backs off, or goes FATAL), the small child is started into the memory the death freed, and
serves the requests that accept a smaller model. Before the GPU child starts again, the small
child is drained (its requests finish) and stopped, so that the two never load into the card at
once: the GPU child's start is held (a hold of the fleet's, asked as its back-off ends) while
the small child runs, and is asked for again once the small child has stopped.

The small child's state is its own lifecycle's; this only asks the fleet (service/fleet.py, the
one owner of the children) for starts, drains and stops of the two, on what their state
changes say. The fleet takes them on a later turn of the loop: never inside the state change
or the GPU child's lifecycle step that asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..config.schema import Config
from ..policy import fleet as rules
from ..policy.lifecycle import ChildState
from .fleet import Fleet

log = logging.getLogger("spillway.small")

MAKING_WAY = "the GPU child starts again: drained and stopped to give it the card"


class SmallTier:
    def __init__(self, fleet: Fleet, gpu: str, small: str,
                 config: Callable[[], Config]) -> None:
        self.fleet = fleet
        self.gpu = fleet.children[gpu]
        self.small = fleet.children[small]
        self.config = config  # the running config (a reload may change small.mode)
        self.paused = fleet.paused
        # The GPU child's start was held for the small child: it is asked for again once the
        # small child has stopped.
        self.gpu_waiting = False
        self.gpu.listeners.append(self._gpu_changed)
        self.small.listeners.append(self._small_changed)
        fleet.hold(gpu, "small", self.hold)

    @property
    def on_demand(self) -> bool:
        return self.config().small.on_demand

    def _gpu_changed(self, child: object, old: ChildState, new: ChildState,
                     reason: str) -> None:
        if self.on_demand and new is ChildState.STARTING and not self.gpu_waiting and \
                rules.small_holds_gpu(self.small.state):
            # Started without waiting for it (an operator's restart, a reload): the small
            # child goes now, so that the two do not stay on the card together.
            log.warning("[%s] the GPU child starts while it runs: draining and stopping it",
                        self.small.name)
            self._clear(MAKING_WAY)
            return
        paused = self.small.name in self.paused or self.gpu.name in self.paused
        if self.on_demand and rules.small_starts(old, new, self.small.state, paused):
            log.info("[%s] starting into the VRAM the GPU child's end freed (%s)",
                     self.small.name, reason)
            self.fleet.start(self.small.name)

    def hold(self) -> str | None:
        """Why the GPU child may not start yet (asked as its back-off ends): the small child
        still holds the card. It is drained and stopped now; the GPU child starts after."""
        if not self.on_demand or not rules.small_holds_gpu(self.small.state):
            return None
        if not self.gpu_waiting:
            self.gpu_waiting = True
            self._clear(MAKING_WAY)  # (what it asks of the fleet is taken after this step)
        return f"the {self.small.name} child holds the card: draining it first"

    def _clear(self, reason: str) -> None:
        """Drained (its requests finish) and stopped; stopped at once if it is not serving."""
        if self.small.state is ChildState.READY:
            self.fleet.drain(self.small.name, reason, then_stop=True)
        elif self.small.state is not ChildState.STOPPED:
            # starting, backing off, or draining to restart (sick): stopped for good now
            self.fleet.stop(self.small.name, reason)

    def _small_changed(self, child: object, old: ChildState, new: ChildState,
                       reason: str) -> None:
        if new is ChildState.STOPPED and self.gpu_waiting:
            self.gpu_waiting = False
            if self.gpu.name not in self.paused:
                log.info("[%s] stopped: the GPU child starts again", self.small.name)
                self.fleet.start(self.gpu.name)
