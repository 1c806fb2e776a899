"""The operator's actions on the GPU child (`spillway gpu restart|drain|pause|resume`), in one
place: the key-guarded routes call it (the CLI goes through them), and the daemon asks it
whether the GPU child is paused (the tick must not bring a paused child back, the balancer's
agent says "drain" for it).

Each action is a command to the fleet (service/fleet.py), the one owner of the children, which
also keeps the paused roles (shared with the resources and the pools, which send nothing to a
paused upstream).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..policy.lifecycle import ChildState

if TYPE_CHECKING:
    from ..router.models import RouterModels
    from .fleet import Fleet

ACTIONS = ("restart", "drain", "pause", "resume")


class Operator:
    def __init__(self, fleet: Fleet, gpu: str, models: RouterModels | None = None) -> None:
        self.fleet = fleet
        self.gpu = fleet.children[gpu]
        self.models = models  # router mode: every model's upstream on the GPU router

    @property
    def gpu_paused(self) -> bool:
        return self.gpu.name in self.fleet.paused

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
        if self.models is not None:
            for model in self.models.neighbours(self.gpu.name):
                model.reset("operator: spillway gpu restart")
        self.fleet.restart(self.gpu.name, "operator: spillway gpu restart", unpause=True)
        return "restarting the GPU child"

    def drain(self) -> str:
        if self.gpu.state is not ChildState.READY:
            return f"the GPU child is {self.gpu.state}; nothing to drain"
        self.fleet.drain(self.gpu.name, "operator: spillway gpu drain")
        return "draining the GPU child; it restarts when its requests are done"

    async def pause(self) -> str:
        await self.fleet.pause(self.gpu.name, "operator: spillway gpu pause (VRAM freed)")
        return "the GPU child is stopped and its VRAM free; the CPU child serves"

    def resume(self) -> str:
        self.fleet.resume(self.gpu.name)
        return "starting the GPU child"
