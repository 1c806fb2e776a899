"""One attempt: forward a request to one child and bring its answer back.

An attempt ends in one of three values: `Answered` (a response is on its way to the client, or
already sent), `AttemptFailure` (failed before any byte reached the client, with the evidence,
so that the caller can still replay the request on the other child or answer with a controlled
error) or `Broken` (failed after bytes reached the client: the stream was ended with one error
event). What the attempt delivered (first byte, events, llama-server's timings) is on its
`Attempt`; the `RequestCtx` describes the request alone.

- Non-streaming generation answers are read whole before the client sees anything: llama-server
  sends them in one piece at the end anyway, and a child that dies mid-answer is still
  replayable.
- Streams are held until their first SSE event, because llama-server sends its 200 and SSE
  headers when prompt processing starts (seen on an H200: headers at 18 ms, abort at 88 ms with no
  event). Holding has a limit; past it, the status and headers alone go out (what llama-server
  itself had sent by then) and the request gives up replay. After the first event, whole events
  flow as they come, and a child that dies then ends the stream with one
  `data: {"error": ...}` event and no `[DONE]`.
- Nothing goes out that llama-server would not send on that request: no comment line of
  Spillway's own, and a child's pings (`:` comments) only to a client that asked for them
  (policy/pings.py); to such a client Spillway also pings, at its interval, while it (not a
  child) keeps the stream silent, between a child's death and its continuation's first byte.
- Everything else (`/props`, `/slots`, ...) is piped through as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from ..policy import continuation, pings, sickness
from ..policy.estimate import Work
from ..policy import evidence as ev
from ..vocabulary import Attempt, AttemptFailure, Received, Upstream
from .outcomes import Answered, AttemptResult, Broken, Interrupted, Recalled
from ..policy import router as router_evidence
from ..policy.routes import ANTHROPIC_ROUTES, RouteClass
from . import sse
from .connections import (
    ConnectionUse, UpstreamClient, UpstreamClosed, UpstreamConnectError, UpstreamResponse,
)
from ..records.stream_sessions import StreamSession
from ..serving.failback import Recall
from .continued import ContinuedStream
from .errors import sse_error_event
from .headers import downstream_headers, upstream_headers
from .tee import TeeResponse

log = logging.getLogger("spillway.proxy")

# Methods that change nothing on the server (RFC 9110, 9.2.1): safe to send again. (aiohttp
# itself already sends an idempotent request once more when a connection fails under it; this
# covers the case where that second try met a stale connection too.)
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# How long to wait, after a connection closed with no answer, for the child's exit record: the
# exit status is the best evidence and usually arrives within milliseconds.
EXIT_EVIDENCE_WAIT_S = 2.0

T = TypeVar("T")


@dataclass
class RequestCtx:
    """One client request being served: as received (`req`, frozen), and its progress, which
    the handler writes (the forwarder only what went out: the capture, the client's stream)."""

    req: Received
    attempts: list[Attempt] = field(default_factory=list)
    failover_kind: str | None = None  # the failure its replay answers, once replayed
    waited_s: float | None = None  # time spent in the waiting line, when admitted
    wait_estimate_s: float | None = None  # the wait it was told to expect, when it waited
    wait_estimate_basis: str = "measured"  # see policy/waitline.service_estimate
    status: int | None = None  # the status the client got
    capture: bytearray | None = None  # the bytes sent, when an Idempotency-Key wants them
    capture_limit: int = 0
    prompt_tokens: int = 0  # admission's count of its prompt (or a bound of it)
    counted: bool = False  # prompt_tokens is the child's own count, not a bound
    # The time admission forecast for its answer on the child that gave it, and what it took.
    forecast: tuple[float, float] | None = None
    work: Work = Work(0, 0)  # what it asks of a child, for expected times (once counted)
    # A stream that may be continued on the other child: what the client has of it so far.
    follow: continuation.Transcript | None = None
    continued: bool = False  # it was continued once (never twice)
    # Once continued: what its continuation relayed, read from that child's own events (its
    # count from its own start), and the stream's rewriting (the text the client got of it).
    leg: continuation.Transcript | None = None
    continued_stream: ContinuedStream | None = None
    # A stream the CPU child answers that may move back to the GPU child (serving/failback):
    # the relay stops at a whole event once it is due.
    recall: Recall | None = None
    failed_back: bool = False  # it moved back once (never twice)
    # A resumable stream's replay buffer, which every byte sent joins.
    resumable: StreamSession | None = None
    event_stream: web.StreamResponse | None = None  # the client's, once its headers went out
    # Its stream's last event went out: a client that closes after it (the OpenAI client does,
    # at [DONE]) has the whole answer, not a 499.
    answer_ended: bool = False
    # The child whose stream's status and headers went out before its first event, past
    # failover.stream_hold_s (the request gave up its replay then).
    hold_expired_on: str | None = None

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def captured(self, data: bytes) -> None:
        if self.capture is not None:
            if len(self.capture) + len(data) > self.capture_limit:
                self.capture = None  # too large to store: the key will be released
            else:
                self.capture += data


@dataclass(frozen=True)
class _Held:
    """A stream held until its first event: what was read, that event, and the response if
    the hold limit already let the headers out."""

    buffer: bytes
    first_event: bytes
    resp: web.StreamResponse | None


@dataclass
class ForwardSettings:
    read_timeout_s: float
    connect_timeout_s: float
    stream_hold_s: float
    # Each child's --sse-ping-interval, where the operator set one (policy/pings.py).
    ping_flags: dict[str, int] = field(default_factory=dict)


# What an attempt's read of the child can raise: the connection closed, or it broke.
_READ_ERRORS = (ConnectionError, OSError)


def _naming(ctx: RequestCtx, model: str | None) -> bytes | None:
    """The request's body naming `model` (a larger model's request sent to its smaller model,
    which the router finds by that name); None: as the client sent it."""
    if model is None or not ctx.req.is_json:
        return None
    payload = ctx.req.whole().payload  # (parsed again when a held body's was let go)
    if payload is None or payload.get("model") == model:
        return None
    return json.dumps({**payload, "model": model}).encode()


def _is_sse(resp: UpstreamResponse) -> bool:
    return resp.headers.get("Content-Type", "").startswith("text/event-stream")


def _chat_text(answer: Any) -> str | None:
    """A chat answer's text, when it is text alone (not a tool call)."""
    with contextlib.suppress(AttributeError, IndexError, KeyError, TypeError):
        message = answer["choices"][0]["message"]
        if not message.get("tool_calls") and isinstance(message.get("content"), str):
            return str(message["content"])
    return None


@dataclass(frozen=True)
class _Figures:
    timings: dict[str, Any] | None = None
    tokens: int | None = None  # completion tokens
    prompt_tokens: int | None = None  # the prompt's, those found cached included


def _answer_figures(payload: Any) -> _Figures:
    """llama-server's `timings`, the completion token count and the prompt's token count of one
    answer (or event)."""
    if not isinstance(payload, dict):
        return _Figures()
    timings = payload.get("timings")
    usage = payload.get("usage")
    tokens = None
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        tokens = usage["completion_tokens"]
    elif isinstance(payload.get("tokens_predicted"), int):
        tokens = payload["tokens_predicted"]
    elif isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        tokens = timings["predicted_n"]
    timings = timings if isinstance(timings, dict) else None
    return _Figures(timings, tokens, _prompt_tokens(timings, usage))


def _prompt_tokens(timings: dict[str, Any] | None, usage: Any) -> int | None:
    """The prompt's tokens as the child reported them: its timings (those it processed and
    those it found cached), else its usage (the Responses and Anthropic answers carry no
    timings): `prompt_tokens`, or `input_tokens` with Anthropic's `cache_read_input_tokens`
    (which its input_tokens leaves out; the Responses API's input_tokens holds them)."""
    if timings is not None:
        n, cached = timings.get("prompt_n"), timings.get("cache_n", 0)
        if isinstance(n, int) and isinstance(cached, int):
            return n + cached
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("prompt_tokens"), int):
        return int(usage["prompt_tokens"])
    n, cached = usage.get("input_tokens"), usage.get("cache_read_input_tokens", 0)
    return n + cached if isinstance(n, int) and isinstance(cached, int) else None


class Forwarder:
    """Attempts. `client` holds the keep-alive connections to the children (and opens a new
    one for the one resend after a reused connection failed); `session` is aiohttp's, for the
    proxy's own questions to a child (token counts); `on_resend(child)` counts the resends."""

    def __init__(self, client: UpstreamClient, session: aiohttp.ClientSession,
                 settings: ForwardSettings,
                 on_resend: Callable[[str], None] | None = None) -> None:
        self.client = client
        self.session = session
        self.on_resend = on_resend
        self.settings = settings

    def _silent(self, child: Upstream, generation: int, **kw: Any) -> AttemptFailure:
        return AttemptFailure(child.name, generation, ev.Verdict(
            ev.FailureKind.CRASH, f"no byte in {self.settings.read_timeout_s:.0f} s "
                                  "(server.read_timeout_s)"), timed_out=True, **kw)

    async def attempt(self, request: web.Request, ctx: RequestCtx, attempt: Attempt,
                      child: Upstream, own_headers: list[tuple[str, str]]) -> AttemptResult:
        generation = child.generation
        headers = upstream_headers(ctx.req.client_headers, ctx.req.request_id,
                                   child.api_key if ctx.req.trusted else None)
        if ctx.req.stream:
            # llama-server closes the connection right after every streamed answer, though it
            # says `Keep-Alive: timeout=5, max=100`; pooled, such a connection fails the next
            # request that takes it before its close is read (most of the stale connections in
            # the chaos run). Said up front, the connection is never pooled.
            headers["Connection"] = "close"
        use = ConnectionUse()
        try:
            sent = await self._send(ctx, child, generation, headers, use,
                                    body=_naming(ctx, child.serves_model))
            if isinstance(sent, AttemptFailure):
                return sent
            upstream = sent
            try:
                if ctx.req.route is not RouteClass.GENERATION:
                    return await self._pipe(request, ctx, attempt, upstream, own_headers)
                if upstream.status == 200 and _is_sse(upstream):
                    return await self._stream(request, ctx, attempt, child, generation, upstream,
                                              own_headers)
                return await self._whole(ctx, attempt, child, generation, upstream, own_headers)
            finally:
                upstream.close()  # frees the child's slot if the client went away
        finally:
            use.done(time.monotonic())

    async def _send(self, ctx: RequestCtx, child: Upstream, generation: int,
                    headers: CIMultiDict[str], use: ConnectionUse,
                    body: bytes | None = None) -> UpstreamResponse | AttemptFailure:
        """The request, up to the child's status line. A request that got no byte back on a
        *reused* keep-alive connection, while its child is still running, most likely met a
        connection the child had just closed (cpp-httplib closes idle ones after 5 s): it is
        sent once more to the same child on a new connection when sending it twice is safe.
        That is neither a replay nor evidence about the child; only a failure on the new
        connection is."""
        try:
            return await self._request(ctx, child, headers, use, fresh=False, body=body)
        except (OSError, TimeoutError) as e:
            if not self._may_resend(ctx, child, generation, use, e):
                return await self._send_failed(child, generation, e)
        if self.on_resend is not None:
            self.on_resend(child.name)
        try:
            return await self._request(ctx, child, headers, ConnectionUse(), fresh=True,
                                       body=body)
        except (OSError, TimeoutError) as e:
            return await self._send_failed(child, generation, e)

    async def _request(self, ctx: RequestCtx, child: Upstream, headers: CIMultiDict[str],
                       use: ConnectionUse, fresh: bool,
                       body: bytes | None = None) -> UpstreamResponse:
        # No total timeout: a long generation is not an error. Only silence is.
        return await self.client.request(
            child.host, child.port or 0, ctx.req.method, ctx.req.path_qs, headers.items(),
            ctx.req.body if body is None else body,
            use, connect_timeout=self.settings.connect_timeout_s,
            read_timeout=self.settings.read_timeout_s, fresh=fresh)

    def _may_resend(self, ctx: RequestCtx, child: Upstream, generation: int,
                    use: ConnectionUse, error: BaseException) -> bool:
        if isinstance(error, (UpstreamConnectError, TimeoutError)):
            return False  # nothing listening, or silence: both say something about the child
        # Safe to send twice: a generation route (the replay rule's route condition), a
        # method that changes nothing, or a request that never left (aiohttp could not write
        # it to a transport that was already closing).
        unwritten = isinstance(error, UpstreamClosed) and error.unwritten
        safe = ctx.req.route is RouteClass.GENERATION or ctx.req.method in _SAFE_METHODS or \
            unwritten
        resend = use.reused and safe and child.running(generation)
        log.warning("rid=%s %s child: %s (%s) before a response on %s; %s", ctx.req.request_id,
                    child.name, type(error).__name__, error, use.describe(),
                    "the child is running: sending it again on a new connection" if resend
                    else "taken as evidence about the child")
        return resend

    async def _send_failed(self, child: Upstream, generation: int,
                           error: BaseException) -> AttemptFailure:
        if isinstance(error, UpstreamConnectError):
            return await self._failure(child, generation, connect_failed=True)
        if isinstance(error, TimeoutError):
            return self._silent(child, generation)
        return await self._failure(child, generation, closed=True)

    async def _failure(self, child: Upstream, generation: int, *, connect_failed: bool = False,
                       closed: bool = False, stream_started: bool = False,
                       after_bytes: bool = False) -> AttemptFailure:
        record = await child.exit_of(generation, EXIT_EVIDENCE_WAIT_S)
        if record is not None:
            verdict = ev.Verdict(record.kind, record.evidence, known_crash=record.known_crash)
        else:
            verdict = ev.classify(ev.Evidence(
                stderr_tail=list(child.stderr_tail)[-50:], connect_failed=connect_failed,
                closed_before_response=closed))
        return AttemptFailure(child.name, generation, verdict, stream_started=stream_started,
                              after_bytes=after_bytes)

    async def _whole(self, ctx: RequestCtx, attempt: Attempt, child: Upstream, generation: int,
                     upstream: UpstreamResponse,
                     own_headers: list[tuple[str, str]]) -> Answered | AttemptFailure:
        try:
            body = await upstream.read()
        except TimeoutError:
            return self._silent(child, generation)
        except _READ_ERRORS:
            return await self._failure(child, generation, closed=True)
        if upstream.status >= 500 and (router_evidence.is_proxy_error(upstream.status, body) or
                                       router_evidence.is_load_failure_body(upstream.status,
                                                                            body)):
            # Router mode: the model's instance died under the request (or while loading for
            # it); the router lives on and says so in a 500. The instance's exit is the
            # evidence.
            return await self._failure(child, generation, closed=True)
        if upstream.status >= 400:
            verdict = ev.classify_response(upstream.status, body.decode("utf-8", "replace"),
                                           _tail(child, upstream.status))
            if verdict.child_failed:
                return AttemptFailure(child.name, generation, verdict, status=upstream.status,
                                      body=body)
        elif upstream.status == 200 and body[:1] == b"{":
            with contextlib.suppress(ValueError):
                answer = json.loads(body)
                figures = _answer_figures(answer)
                attempt.timings, attempt.tokens = figures.timings, figures.tokens
                attempt.prompt_tokens = figures.prompt_tokens
                attempt.answer_text = _chat_text(answer)
        attempt.first_byte_s = time.monotonic() - ctx.req.received
        ctx.captured(body)
        failed = upstream.status >= 500
        return Answered(web.Response(status=upstream.status, body=body,
                                     headers=downstream_headers(upstream.headers, own_headers)),
                        server_error=_first_line(upstream.status, body) if failed else "",
                        server_message=sickness.error_message(body) if failed else "")

    async def _pipe(self, request: web.Request, ctx: RequestCtx, attempt: Attempt,
                    upstream: UpstreamResponse,
                    own_headers: list[tuple[str, str]]) -> Answered:
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                  headers=downstream_headers(upstream.headers, own_headers))
        length = upstream.headers.get("Content-Length")
        if length is not None and length.isdigit():
            resp.content_length = int(length)
        await resp.prepare(request)
        attempt.first_byte_s = time.monotonic() - ctx.req.received
        while True:
            try:
                chunk = await upstream.readany()
            except (TimeoutError, *_READ_ERRORS):
                # The child went away mid-answer: end the connection uncleanly so that the
                # client cannot take a truncated body for a whole one.
                ctx.capture = None
                if request.transport is not None:
                    request.transport.close()
                return Answered(resp)
            if not chunk:
                break
            ctx.captured(chunk)
            await resp.write(chunk)
        await resp.write_eof()
        return Answered(resp)

    async def _stream(self, request: web.Request, ctx: RequestCtx, attempt: Attempt,
                      child: Upstream, generation: int, upstream: UpstreamResponse,
                      own_headers: list[tuple[str, str]]) -> AttemptResult:
        headers = downstream_headers(upstream.headers, own_headers)
        anthropic = ctx.req.path in ANTHROPIC_ROUTES
        # 1. Hold the client's status and headers until the first event arrives.
        held = await self._hold(request, ctx, attempt, child, generation, upstream, headers,
                                anthropic)
        if not isinstance(held, _Held):
            return held
        error = sse.error_of(held.first_event)
        if error is not None and held.resp is None:
            code = error.get("code")
            status = code if isinstance(code, int) else 500
            verdict = ev.classify_response(status, json.dumps(error), _tail(child, status))
            if verdict.child_failed:
                return AttemptFailure(child.name, generation, verdict, status=200,
                                      body=held.first_event, stream_started=True)
        resp = held.resp or await self._commit(request, ctx, attempt, headers)
        # 2. Whole events flow as they come.
        return await self._relay(ctx, attempt, child, generation, upstream, resp, held.buffer,
                                 anthropic, pings=self.ping_interval(ctx, child.name) is not None)

    async def _hold(self, request: web.Request, ctx: RequestCtx, attempt: Attempt,
                    child: Upstream, generation: int, upstream: UpstreamResponse,
                    headers: CIMultiDict[str],
                    anthropic: bool) -> _Held | Broken | Interrupted | AttemptFailure:
        """Read until the first SSE event, holding the client's status and headers. Past the
        hold limit the status and headers alone go out: llama-server sends them when prompt
        processing starts, so they are nothing the client could not have had from it, and
        they end its wait for a response (undici's headersTimeout; the first read of aiohttp's
        sock_read or httpx's read timeout); the request gives up its replay, and the rest is
        relayed as it comes. The pings the child sent while held are dropped: late, they would
        keep no timer alive."""
        buffer = b""
        deadline = time.monotonic() + self.settings.stream_hold_s
        while (found := sse.first_data_event(buffer)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                ctx.hold_expired_on = child.name
                resp = await self._commit(request, ctx, attempt, headers)
                return _Held(sse.without_comments(buffer), b"", resp)
            try:
                async with asyncio.timeout(left):
                    chunk = await upstream.readany()
            except TimeoutError:
                if time.monotonic() < deadline:  # sock_read fired first: the child is silent
                    return await self._stream_broke(ctx, child, generation, None, anthropic,
                                                    timed_out=True)
                continue  # the hold limit: handled at the top of the loop
            except _READ_ERRORS:
                chunk = b""
            if not chunk:
                return await self._stream_broke(ctx, child, generation, None, anthropic)
            child.load.moved(time.monotonic())  # progress, for the stall rule
            buffer += chunk
        return _Held(sse.without_comments(buffer), found[0], None)

    def ping_interval(self, ctx: RequestCtx, child: str) -> int | None:
        """The seconds after which the client asked to hear a ping on a silent stream from
        `child`; None: it did not ask (policy/pings.py)."""
        return pings.asked_interval(ctx.req.payload, ctx.req.path in ANTHROPIC_ROUTES,
                                    self.settings.ping_flags.get(child))

    async def _relay(self, ctx: RequestCtx, attempt: Attempt, child: Upstream, generation: int,
                     upstream: UpstreamResponse, resp: web.StreamResponse, buffer: bytes,
                     anthropic: bool, continued: ContinuedStream | None = None,
                     pings: bool = False
                     ) -> Answered | Broken | Interrupted | Recalled | AttemptFailure:
        """Whole events, as they come (rewritten by `continued`, for a continuation), and the
        child's pings only for a client that asked for them (`pings`). Reads and writes fail
        apart: a read error is the child's failure, a write error is the client leaving (it
        propagates)."""
        whole, pending = _complete(buffer, pings)
        last = b""
        while True:
            if whole:
                if continued is not None:
                    if ctx.leg is not None:
                        _follow(ctx.leg, whole)
                    whole = continued.rewrite(whole)
                    if continued.generated and attempt.first_byte_s is None:
                        # The continuation's first token (its progress events and pings, sent
                        # before, are not one).
                        attempt.first_byte_s = time.monotonic() - ctx.req.received
                await resp.write(whole)
                ctx.captured(whole)
                attempt.events += sse.count_data_events(whole)
                if ctx.follow is not None and not ctx.continued:
                    _follow(ctx.follow, whole)
                if sse.ends_answer(whole):
                    # The stream's last event: the answer ends here, not when the child closes
                    # its response. A client that closes at once (the OpenAI client does at
                    # [DONE]) would otherwise find this task still reading, and cancel it
                    # before its answer is counted.
                    ctx.answer_ended = True
                    self._final_figures(attempt, last + whole)
                    with contextlib.suppress(ConnectionError):
                        await resp.write_eof()
                    return Answered(resp)
                last = whole
                if ctx.recall is not None and ctx.recall.due:
                    return Recalled(resp, anthropic)  # (the rest goes on from the GPU child)
            try:
                chunk = await upstream.readany()
            except TimeoutError:
                return await self._stream_broke(ctx, child, generation, resp, anthropic,
                                                timed_out=True)
            except _READ_ERRORS:
                return await self._stream_broke(ctx, child, generation, resp, anthropic)
            if not chunk:
                break
            child.load.moved(time.monotonic())  # progress, for the stall rule
            whole, pending = _complete(pending + chunk, pings)
        if pending and router_evidence.stream_tail_is_proxy_error(pending):
            # Router mode: the instance died mid-stream, and the router ended the stream with
            # its plain-text proxy error (no error event, no [DONE]).
            return await self._stream_broke(ctx, child, generation, resp, anthropic)
        if pending:
            if continued is not None:
                pending = continued.rewrite(pending + sse.SEPARATOR) if pending.strip() else b""
            await resp.write(pending)
            ctx.captured(pending)
        self._final_figures(attempt, last + pending)
        await resp.write_eof()
        return Answered(resp)

    @staticmethod
    def _final_figures(attempt: Attempt, tail: bytes) -> None:
        """The last events carry llama-server's timings (and usage, when asked for)."""
        if b'"timings"' not in tail and b'"usage"' not in tail:
            return
        for block in reversed(tail.split(sse.SEPARATOR)):
            data = sse.event_data(block)
            if data.startswith(b"{"):
                with contextlib.suppress(ValueError):
                    figures = _answer_figures(json.loads(data))
                    if figures.timings is not None or figures.tokens is not None:
                        attempt.timings, attempt.tokens = figures.timings, figures.tokens
                        attempt.prompt_tokens = figures.prompt_tokens
                        return

    async def _commit(self, request: web.Request, ctx: RequestCtx, attempt: Attempt,
                      headers: CIMultiDict[str]) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=headers) if ctx.resumable is None else \
            TeeResponse(ctx.resumable, status=200, headers=headers)
        ctx.event_stream = resp
        await resp.prepare(request)
        attempt.first_byte_s = time.monotonic() - ctx.req.received
        return resp

    async def _stream_broke(self, ctx: RequestCtx, child: Upstream, generation: int,
                            resp: web.StreamResponse | None, anthropic: bool,
                            timed_out: bool = False) -> Broken | Interrupted | AttemptFailure:
        """The child failed mid-stream. Before any byte reached the client this is an ordinary
        failure (replayable); after, a followed stream is left open for its continuation, and
        any other ends with one error event and no [DONE]."""
        after = resp is not None
        if timed_out:
            failure = self._silent(child, generation, stream_started=True, after_bytes=after)
        else:
            failure = await self._failure(child, generation, closed=True, stream_started=True,
                                          after_bytes=after)
        if resp is None:
            return failure
        ctx.capture = None  # not a final answer: never stored for a retry
        if ctx.follow is not None and not ctx.continued and not timed_out:
            # (Silence is not a death: the child may still be writing to a slot of its own.)
            return Interrupted(resp, failure, anthropic)
        return await self.end_broken(ctx, resp, failure, anthropic)

    async def end_broken(self, ctx: RequestCtx, resp: web.StreamResponse,
                         failure: AttemptFailure, anthropic: bool = False,
                         why: str = "") -> Broken:
        """One error event and no [DONE]: the honest end of a stream that cannot go on."""
        child = failure.child
        message = (f"the {child} child failed during the stream "
                   f"({failure.verdict.kind}: {failure.verdict.evidence}); the answer is "
                   f"incomplete{why}")
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
            await resp.write(sse_error_event(message, "upstream_error", 502, ctx.req.request_id,
                                             anthropic=anthropic,
                                             kind=str(failure.verdict.kind)))
            await resp.write_eof()
        return Broken(resp, failure)

    async def end_closed(self, resp: web.StreamResponse, events: bytes) -> Answered:
        """The stream's own finish, sent by Spillway (proxy/closing.py): a clean end."""
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
            await resp.write(events)
            await resp.write_eof()
        return Answered(resp)

    async def continue_stream(self, ctx: RequestCtx, attempt: Attempt, child: Upstream,
                              interrupted: Interrupted, body: bytes,
                              stream: ContinuedStream) -> Answered | Broken | Recalled:
        """The interrupted stream goes on from `child`: `body` (the relayed text as the
        answer's start) is sent there, and its events reach the client rewritten by `stream`
        (whose final event says it was continued: nothing else on the wire does). A client
        that asked for pings hears them while `child` has not answered. A second failure ends
        it with the error event."""
        resp = interrupted.response
        ctx.continued = True
        ctx.leg = continuation.Transcript(stream.before.kind)
        ctx.continued_stream = stream
        generation = child.generation
        headers = upstream_headers(ctx.req.client_headers, ctx.req.request_id,
                                   child.api_key if ctx.req.trusted else None)
        headers["Connection"] = "close"
        headers["Content-Type"] = "application/json"
        interval = self.ping_interval(ctx, child.name)
        use = ConnectionUse()
        try:
            sent = await pinging(resp, interval,
                                 self._send(ctx, child, generation, headers, use, body=body))
            if isinstance(sent, AttemptFailure):
                return await self.end_broken(ctx, resp, sent, interrupted.anthropic,
                                             "; its continuation failed too")
            try:
                if sent.status != 200 or not _is_sse(sent):
                    text = (await sent.read()).decode("utf-8", "replace")
                    failure = AttemptFailure(child.name, generation,
                                             ev.classify_response(sent.status, text,
                                                                  _tail(child, sent.status)),
                                             status=sent.status, after_bytes=True)
                    return await self.end_broken(ctx, resp, failure, interrupted.anthropic,
                                                 "; its continuation was refused")
                result = await self._relay(ctx, attempt, child, generation, sent, resp, b"",
                                           interrupted.anthropic, continued=stream,
                                           pings=interval is not None)
            finally:
                sent.close()
        finally:
            use.done(time.monotonic())
        if isinstance(result, Interrupted):  # (not followed twice, but to be sure)
            return await self.end_broken(ctx, resp, result.failure, result.anthropic)
        if isinstance(result, AttemptFailure):
            return await self.end_broken(ctx, resp, result, interrupted.anthropic)
        return result


async def pinging(resp: web.StreamResponse, interval: int | None, work: Awaitable[T]) -> T:
    """`work`, awaited; meanwhile, with an `interval`, llama-server's ping goes to the client
    after every `interval` seconds that `work` keeps it waiting, as llama-server pings a
    silent stream. Only while nothing else writes to `resp`: the caller is waiting."""
    if interval is None:
        return await work
    pinger = asyncio.create_task(_ping_every(resp, interval))
    try:
        return await work
    finally:
        pinger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pinger


async def _ping_every(resp: web.StreamResponse, interval: int) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await resp.write(pings.PING)
        except (ConnectionError, RuntimeError):
            return  # the client left: what the caller writes next finds it out


def _complete(data: bytes, pings: bool) -> tuple[bytes, bytes]:
    """(the whole events, the unfinished rest); without the comment lines (the child's pings)
    unless the client asked for `pings`."""
    whole, pending = sse.split_complete(data)
    return (whole if pings or not whole else sse.without_comments(whole)), pending


def _tail(child: Upstream, status: int) -> list[str]:
    """The child's last lines, for a 5xx it answered alive: they tell a `Compute error.` after
    a lost device from one after an OOM (none needed for other answers)."""
    return list(child.stderr_tail)[-50:] if status >= 500 else []


def _first_line(status: int, body: bytes) -> str:
    first = body[:300].decode("utf-8", "replace").strip().splitlines()
    return f"HTTP {status}: {first[0]}" if first else f"HTTP {status}"


def _follow(transcript: continuation.Transcript, whole: bytes) -> None:
    """What the client has now of a followed stream: each event's JSON, in order."""
    for block in whole.split(sse.SEPARATOR):
        data = sse.event_data(block)
        if data.startswith(b"{"):
            with contextlib.suppress(ValueError):
                event = json.loads(data)
                if isinstance(event, dict):
                    transcript.take(event)
