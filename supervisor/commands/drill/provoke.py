"""Provoking the GPU child's failure: for real with ballast on a GPU, simulated without one.

- Ballast (a real GPU): memory held on purpose so that less VRAM is free than the next request
  needs. A raw allocation where PyTorch is importable (measured on an H200: all but a few MiB,
  then a 24k-token prompt to a child started with `-ub 4096` killed it 0.1 s into the request);
  otherwise a second llama-server on the card with a context sized to fill it (the common real
  cause: a second model). The GPU child runs with `-fit off`, so the failure is not quietly
  turned into a partial offload. The ballast is released as soon as the child has died, so that
  it can come back.
- Simulated (no GPU): Spillway is asked to send SIGABRT to the GPU child the moment its next
  task launches, during prompt processing, which is when a CUDA build aborts. Every result is
  labelled "simulated". In router mode it is the drilled model's instance on the GPU router
  that gets it; scenario 6 (a second model loading next to it) arms it to fire as the other
  model's instance is spawned there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import time
from typing import Any, Protocol

import aiohttp

from ...config import gguf_meta
from ...upstreams.children import pick_port
from .client import DrillClient

log = logging.getLogger("spillway.drill")
MIB = 1024 * 1024


class Provoker(Protocol):
    simulated: bool
    description: str

    async def arm(self) -> None: ...

    async def after_failure(self) -> None: ...

    async def close(self) -> None: ...


class SimulatedFailure:
    """Spillway's drill arm: SIGABRT to the GPU child (single-model mode), or to one model's
    instance on the GPU router (router mode: `model`), as its next task launches or, `when` =
    "neighbour_load", as another model's instance is spawned on the GPU router."""

    simulated = True

    def __init__(self, client: DrillClient, model: str | None = None,
                 when: str = "task") -> None:
        self.client = client
        self.model = model
        self.when = when
        if model is None:
            self.description = (
                "simulated: no GPU here, so Spillway sends SIGABRT to the GPU child as the "
                "request's task launches (prompt processing), where a CUDA build aborts on an "
                "out-of-memory")
        elif when == "task":
            self.description = (
                f"simulated: no GPU here, so Spillway sends SIGABRT to model {model}'s "
                "instance on the GPU router as the request's task launches (prompt "
                "processing), where a CUDA build aborts on an out-of-memory")
        else:
            self.description = (
                f"simulated: Spillway sends SIGABRT to model {model}'s instance on the GPU "
                "router as another model's instance is spawned there, standing in for the "
                "allocation that fails when the second model takes the last VRAM")

    def _body(self, **more: object) -> dict[str, object]:
        body: dict[str, object] = {} if self.model is None else {"model": self.model}
        if self.model is not None and self.when != "task":
            body["when"] = self.when
        return {**body, **more}

    async def arm(self) -> None:
        await self.client.arm(self._body())

    async def after_failure(self) -> None:
        await self.client.arm(self._body(disarm=True))

    async def close(self) -> None:
        await self.after_failure()


class TorchBallast:
    """All but `leave_mib` of the card's free memory, held by PyTorch."""

    simulated = False

    def __init__(self, client: DrillClient, device_index: int, leave_mib: int = 64) -> None:
        self.client = client
        self.device_index = device_index
        self.leave_mib = leave_mib
        self._held: Any = None
        self.description = (f"ballast: a PyTorch allocation of all but {leave_mib} MiB of free "
                            f"VRAM on GPU {device_index}")

    async def arm(self) -> None:
        await asyncio.to_thread(self._allocate)
        await asyncio.sleep(2.5)  # let Spillway's GPU samples see the card full

    def _allocate(self) -> None:
        import torch  # only on a GPU machine that has it
        torch.cuda.set_device(self.device_index)
        free, _total = torch.cuda.mem_get_info()
        size = max(0, free - self.leave_mib * MIB)
        self._held = torch.empty(size, dtype=torch.uint8, device=f"cuda:{self.device_index}")
        log.info("ballast: holding %d MiB, %d MiB left free", size // MIB, self.leave_mib)

    async def after_failure(self) -> None:
        await asyncio.to_thread(self._free)

    def _free(self) -> None:
        if self._held is not None:
            import torch
            self._held = None
            torch.cuda.empty_cache()

    async def close(self) -> None:
        await self.after_failure()


class LlamaServerBallast:
    """A second llama-server on the card with a context sized to fill it."""

    simulated = False

    def __init__(self, client: DrillClient, binary: str, model: str, device_index: int,
                 ctx: int) -> None:
        self.client = client
        self.binary = binary
        self.model = model
        self.device_index = device_index
        self.ctx = ctx
        self.proc: subprocess.Popen[bytes] | None = None
        self.description = (f"ballast: a second llama-server on GPU {device_index} with a "
                            f"{ctx}-token context")

    async def arm(self) -> None:
        port = pick_port()
        env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
               "CUDA_VISIBLE_DEVICES": str(self.device_index)}
        self.proc = subprocess.Popen(
            [self.binary, "-m", self.model, "-ngl", "99", "-c", str(self.ctx), "-fit", "off",
             "--host", "127.0.0.1", "--port", str(port)], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        session = self.client.session
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"http://127.0.0.1:{port}/health") as r:
                    await r.read()
                    if r.status == 200:
                        break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.5)

    async def after_failure(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            await asyncio.to_thread(self.proc.wait, 30)
        self.proc = None

    async def close(self) -> None:
        await self.after_failure()


def torch_available() -> bool:
    try:
        import importlib.util
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


async def choose(client: DrillClient, status: dict[str, Any], how: str,
                 model_path: str | None, binary: str | None) -> Provoker:
    """`how`: auto, simulate, torch or llama-server. In router mode (the client names a
    model) the failure is that model's instance's on the GPU router."""
    gpu = status.get("gpu")
    real_gpu = gpu is not None and status.get("gpu_child_on_cpu") is False
    if how == "simulate" or (how == "auto" and not real_gpu):
        return SimulatedFailure(client, client.model)
    if not real_gpu:
        raise RuntimeError("no GPU behind this Spillway (status shows none): use --ballast "
                           "simulate")
    assert gpu is not None
    index = int(gpu["index"])
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if how == "torch" or (how == "auto" and torch_available()):
        return TorchBallast(client, index)
    if binary is None or model_path is None or shutil.which(binary) is None and \
            not os.path.exists(binary):
        raise RuntimeError("no PyTorch here and no llama-server to use as ballast: pass "
                           "--config so the drill can start a second llama-server")
    # A context whose KV cache takes what the model leaves of the free memory, but 256 MiB.
    shape = gguf_meta.model_shape(model_path)
    room = int(gpu["free_mib"]) * MIB - int(os.path.getsize(model_path) * 1.1) - 256 * MIB
    ctx = max(256, room // max(1, shape.kv_bytes(1)))
    return LlamaServerBallast(client, binary, model_path, index, ctx)
