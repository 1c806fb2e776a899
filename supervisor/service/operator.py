"""The operator's actions on the GPU child (`spillway gpu restart|drain|pause|resume`), in one
place: the key-guarded routes call it (the CLI goes through them), and the daemon asks it
whether the GPU child is paused (the tick must not bring a paused child back, the balancer's
agent says "drain" for it).

Pausing is the only state here: the set of paused roles, shared with the resources and the
pools (which send nothing to a paused upstream); the operator is its only writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..policy.lifecycle import ChildState

if TYPE_CHECKING:
    from ..upstreams.children import Child
    from ..router.models import RouterModels

ACTIONS = ("restart", "drain", "pause", "resume")


class Operator:
    def __init__(self, gpu: Child, paused: set[str],
                 models: RouterModels | None = None) -> None:
        self.gpu = gpu
        self.paused = paused  # resources.paused: read by the pools, written only here
        self.models = models  # router mode: every model's upstream on the GPU router

    @property
    def gpu_paused(self) -> bool:
        return self.gpu.name in self.paused

    async def act(self, action: str) -> str:
        """One of ACTIONS; what was done, in a sentence."""
        if action == "restart":
            return self.restart()
        if action == "drain":
            return self.drain()
        if action == "pause":
            return await self.pause()
        if action == "resume":
            return self.resume()
        raise ValueError(f"no operator action {action!r}; one of {', '.join(ACTIONS)}")

    def restart(self) -> str:
        self.paused.discard(self.gpu.name)
        if self.models is not None:
            for model in self.models.neighbours(self.gpu.name):
                model.reset("operator: spillway gpu restart")
        self.gpu.restart("operator: spillway gpu restart")
        return "restarting the GPU child"

    def drain(self) -> str:
        if self.gpu.state is not ChildState.READY:
            return f"the GPU child is {self.gpu.state}; nothing to drain"
        self.gpu.drain("operator: spillway gpu drain")
        return "draining the GPU child; it restarts when its requests are done"

    async def pause(self) -> str:
        self.paused.add(self.gpu.name)
        await self.gpu.stop("operator: spillway gpu pause (VRAM freed)")
        return "the GPU child is stopped and its VRAM free; the CPU child serves"

    def resume(self) -> str:
        self.paused.discard(self.gpu.name)
        self.gpu.start()
        return "starting the GPU child"
