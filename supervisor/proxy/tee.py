"""The event stream of a resumable request: every byte goes to its session's replay buffer, and
to the client while the client is there.

A client that leaves does not stop the answer (as with llama-server's `X-Conversation-Id`):
writes to it fail quietly from then on, and the answer goes on into the buffer, for a later
`GET /v1/stream`. Only a Stop (`DELETE /v1/stream`) or a new stream of the same conversation
ends it early.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from ..records.stream_sessions import StreamSession

# What writing to a client that went away raises (aiohttp's ClientConnectionResetError is a
# ConnectionResetError); RuntimeError: a write after the framework finished the response.
_GONE = (ConnectionError, RuntimeError)


class TeeResponse(web.StreamResponse):
    def __init__(self, session: StreamSession, **kw: Any) -> None:
        super().__init__(**kw)
        self.session = session

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        self.session.committed = True
        if self.session.client_left:
            return None
        try:
            return await super().prepare(request)
        except _GONE:
            self.session.client_left = True
            return None

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self.session.append(bytes(data))
        if self.session.client_left:
            return
        try:
            await super().write(data)
        except _GONE:
            self.session.client_left = True

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            self.session.append(data)
        if self.session.client_left:
            return
        try:
            await super().write_eof(data)
        except _GONE:
            self.session.client_left = True
