"""The agent-check port: HAProxy's agent connects, reads one line, and the connection closes
(policy/balancer.py says what the line is). Off unless `balancer.agent_listen` is set.

The protocol has no authentication, so the port is on loopback unless the operator says
otherwise; what it tells (ready, drain, down, a weight) is what any balancer probing
/spillway/ready could learn too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ..config.schema import parse_listen

log = logging.getLogger("spillway.balancer")

READ_GRACE_S = 0.5  # for the agent to read the line and close its side


class AgentServer:
    def __init__(self, listen: str, reply: Callable[[], str]) -> None:
        self.address = parse_listen(listen)
        self.reply = reply
        self._server: asyncio.Server | None = None
        self.served = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._answer, self.address.host,
                                                  self.address.port, reuse_address=True)
        log.info("HAProxy agent-check on %s", self.address)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = self.reply()
            writer.write(line.encode("ascii", "replace") + b"\n")
            await writer.drain()
            self.served += 1
            # Read what the agent sent (HAProxy's agent-send string, if configured) before
            # closing: closing with unread input resets the connection, and the reply with it.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(READ_GRACE_S):
                    while await reader.read(4096):
                        pass
        except (ConnectionError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a probe must never take the daemon down
            log.exception("agent-check reply failed")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
