"""Connections to the children: aiohttp's keep-alive pool, told which connection each attempt
got, how many requests it had carried and how long it had been idle.

Why: llama-server (cpp-httplib) closes a keep-alive connection after 5 s idle and after 100
requests. On a busy machine the event loop can hand out a pooled connection whose close it has
not processed yet; the request then dies on that socket, not on the child. Such a failure must
not be taken for evidence about the child, and it can only be told apart when it is known that
the connection was a reused one (a new connection that closes with no answer says something
about the child). The forwarder reads that here and logs the reuse count and idle time.

The attempt names its `ConnectionUse` through a context variable: `ClientSession.request` calls
the connector's `connect` in the caller's task, so the two meet without any private aiohttp API.
"""

from __future__ import annotations

import contextvars
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class _History:
    """What one pooled connection has done so far."""

    requests: int = 0
    last_done: float | None = None  # monotonic: when its latest request ended


@dataclass
class ConnectionUse:
    """The connection one attempt got: filled in by the connector, read by the forwarder."""

    reused: bool = False
    requests: int = 0  # requests the connection has carried, this one included
    idle_s: float | None = None  # since its previous request ended (None: a new connection)
    _history: _History | None = field(default=None, repr=False)

    def done(self, now: float) -> None:
        """The attempt is over: the connection, if pooled again, is idle from now."""
        if self._history is not None:
            self._history.last_done = now

    def describe(self) -> str:
        if not self.reused:
            return "a new connection"
        idle = f", idle {self.idle_s:.2f} s before it" if self.idle_s is not None else ""
        return f"a reused connection (request {self.requests} on it{idle})"


CURRENT_USE: contextvars.ContextVar[ConnectionUse | None] = contextvars.ContextVar(
    "spillway_connection_use", default=None)


class TrackingConnector(aiohttp.TCPConnector):
    """A TCPConnector that tells the current attempt about the connection it hands out."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._history: weakref.WeakKeyDictionary[Any, _History] = weakref.WeakKeyDictionary()

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        conn = await super().connect(req, traces, timeout)
        use = CURRENT_USE.get()
        proto = conn.protocol
        if use is not None and proto is not None:
            history = self._history.get(proto)
            if history is None:
                history = self._history[proto] = _History()
            else:
                use.reused = True
                if history.last_done is not None:
                    use.idle_s = time.monotonic() - history.last_done
            history.requests += 1
            use.requests = history.requests
            use._history = history
        return conn
