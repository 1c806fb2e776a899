"""What one router child says of its models, told to their upstreams (upstream.py).

Three sources, because each sees what the others miss:
- `GET /models` when the router is ready, and again whenever the event stream dropped (so that a
  change missed meanwhile does not stay wrong);
- `GET /models/sse`, followed while the router runs: each `loading`, `loaded` and `unloaded`
  (with its exit code) as it happens;
- the router's output lines: `spawning server instance with name=M on port P` (which instance is
  which model), the instance's own lines relayed with a `[P]` prefix (the evidence of a death, a
  CUDA line among them), `instance name=M exited with status N`, and the LRU eviction under
  `--models-max` (planned, no failure).

It also finds each loaded instance's pid (a grandchild of Spillway's: the router spawned it),
for NVML's per-process memory and RSS, and loads and unloads models for the upstreams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import psutil

from ..upstreams.children import Child
from ..policy.lifecycle import SERVING, ChildState
from ..policy.router import parse_models, parse_router_line, parse_sse_data
from .upstream import ModelUpstream

log = logging.getLogger("spillway.router")

RECONNECT_S = 0.5
_EVICTION = re.compile(r"models_max limit reached, removing LRU name=(.+?)\s*$")

# model name -> its upstream on this router (made on first sight)
UpstreamFor = Callable[[str], ModelUpstream]


class RouterWatch:
    def __init__(self, child: Child, upstream_for: UpstreamFor,
                 session: Callable[[], aiohttp.ClientSession],
                 on_loaded: Callable[[ModelUpstream], None] | None = None,
                 neighbours: Callable[[], list[ModelUpstream]] | None = None) -> None:
        self.child = child
        self.neighbours = neighbours  # every model's upstream on this router
        self.upstream_for = upstream_for
        self.session = session
        self.on_loaded = on_loaded  # a model became READY here (profile, pid)
        self.listed: list[str] = []  # the models the router listed last, in its order
        self.last_listing: Any = None  # its last /models answer, as JSON
        self._ports: dict[int, str] = {}  # instance port -> model
        self._followed: set[str] = set()  # the models whose READY it is told of
        self._task: asyncio.Task[None] | None = None
        # Set when nothing is to be waited for: the router is not serving, or it has listed
        # its models since it became ready (or failed to). Cleared in between: a request that
        # names a model must not be served as naming none while its entry is not yet made.
        self.listed_since_ready = asyncio.Event()
        self.listed_since_ready.set()
        child.line_listeners.append(self.heard_line)
        child.listeners.append(self._router_changed)

    def _upstream(self, model: str) -> ModelUpstream:
        """The model's upstream on this router; told to the watch when it becomes READY (its
        owner takes what the watch heard in its own time)."""
        upstream = self.upstream_for(model)
        if model not in self._followed:
            self._followed.add(model)
            upstream.listeners.append(self._model_changed)
        return upstream

    def _model_changed(self, upstream: ModelUpstream, old: ChildState, new: ChildState,
                       reason: str) -> None:
        if new is ChildState.READY:
            self._loaded(upstream)

    # --- the router's output ---------------------------------------------------------------------

    def heard_line(self, line: str) -> None:
        r = parse_router_line(line)
        if r.kind == "instance" and r.port is not None:
            model = self._ports.get(r.port)
            if model is not None:
                self._upstream(model).heard_instance_line(r.text)
        elif r.kind == "spawn" and r.model is not None and r.port is not None:
            self._ports[r.port] = r.model
            upstream = self._upstream(r.model)
            upstream.heard_spawn(r.port)
            if upstream.is_ready and upstream.pid is None:
                # Its `loaded` event came first (the output is read behind the event stream
                # when the cores are busy), when its port was not known: its pid is found now.
                upstream.heard_pid(self.instance_pid(r.port))
            for other in self.neighbours() if self.neighbours is not None else ():
                if other.model != r.model:
                    other.heard_neighbour_load(r.model)
        elif r.kind == "exit" and r.model is not None and r.status is not None:
            self._upstream(r.model).heard_exit(r.status)
        elif (m := _EVICTION.search(line)) is not None:
            self._upstream(m.group(1)).heard_eviction()

    # --- following /models ------------------------------------------------------------------------

    def _router_changed(self, child: Child, old: ChildState, new: ChildState,
                        reason: str) -> None:
        if new is ChildState.READY and (self._task is None or self._task.done()):
            self._ports.clear()
            self.listed_since_ready.clear()
            self._task = asyncio.get_running_loop().create_task(
                self._follow(), name=f"router-watch-{child.name}")
        elif new not in SERVING:
            self.listed_since_ready.set()
            if self._task is not None:
                self._task.cancel()
                self._task = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.child.api_key}"}

    async def _follow(self) -> None:
        """Read the listing, then follow the events until the router stops; reconnect."""
        while self.child.state in SERVING:
            try:
                await self.refresh()
                await self._events()
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                log.info("[%s] model events: %s; reconnecting", self.child.name, e)
            finally:
                # A listing that failed is not waited for: requests go on as before.
                self.listed_since_ready.set()
            await asyncio.sleep(RECONNECT_S)

    async def refresh(self) -> None:
        """GET /models: each model's state as the router has it now."""
        async with self.session().get(f"{self.child.base_url}/models", headers=self._headers(),
                                      timeout=aiohttp.ClientTimeout(total=10)) as r:
            doc = await r.json(content_type=None)
        self.last_listing = doc
        infos = parse_models(doc)
        self.listed = [i.name for i in infos]
        for info in infos:
            if info.status == "loaded" and info.port:
                self._ports[info.port] = info.name
            self._upstream(info.name).heard_listing(info)
        self.listed_since_ready.set()

    async def _events(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None)
        async with self.session().get(f"{self.child.base_url}/models/sse",
                                      headers=self._headers(), timeout=timeout) as r:
            if r.status != 200:
                raise aiohttp.ClientError(f"/models/sse answered {r.status}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                change = parse_sse_data(line[5:].strip())
                if change is None:
                    continue
                self._upstream(change.model).heard_status(change)

    def _loaded(self, upstream: ModelUpstream) -> None:
        upstream.heard_pid(self.instance_pid(upstream.instance_port))
        if self.on_loaded is not None:
            self.on_loaded(upstream)

    def instance_pid(self, port: int | None) -> int | None:
        """The pid of the router's instance listening on `port` (its --port argument)."""
        if port is None or self.child.pid is None:
            return None
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process(self.child.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    args = proc.cmdline()
                    if "--port" in args and args[args.index("--port") + 1:][:1] == [str(port)]:
                        return int(proc.pid)
        return None

    # --- loading and unloading (upstream.Loader) --------------------------------------------------

    async def load(self, model: str) -> str | None:
        return await self._post("/models/load", model)

    async def unload(self, model: str) -> str | None:
        return await self._post("/models/unload", model)

    async def _post(self, path: str, model: str) -> str | None:
        try:
            async with self.session().post(f"{self.child.base_url}{path}",
                                           headers=self._headers(), json={"model": model},
                                           timeout=aiohttp.ClientTimeout(total=30)) as r:
                body = await r.read()
                if r.status == 200:
                    return None
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"{path}: {e}"
        message = body.decode("utf-8", "replace")[:300]
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            message = json.loads(body)["error"]["message"]
        return f"{path} answered {r.status}: {message}"

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
