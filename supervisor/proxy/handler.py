"""The request pipeline: read and check the request, take a lease, attempt, answer.

Branch numbers follow the admission order of the design (policy/admission.py decides). Where a
request may go is the pool's to say (pool.py): the handler asks it for a lease (or a refusal
with the 503's figures), forwards on it, and closes it with the attempt's outcome. What a
failure makes of the request (its replay, its stream's continuation or close, a fail-back) is
carried out by proxy/outage.py, on the recovery coordinator's decisions. The handler keeps the
request's own records: its incidents, its metrics, its access log line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..records.idempotency import IdempotencyStore, Outcome, StoredResponse, fingerprint, scope_of
from ..records.incidents import Incident, IncidentLog, new_incident_id
from ..records.metrics import Metrics
from ..serving.pool import Lease, Pool
from ..serving.recovery import Recovery
from ..serving.mirror import Mirror
from ..serving.held import DEFAULT_MAX_HELD_BYTES, LARGE_BODY_BYTES, HeldBodies
from ..serving.pools import Pools
from ..gpu import MIB
from ..records.stream_sessions import MAX_CONVERSATION_ID, StreamSession, StreamSessions
from ..records.timefmt import rfc3339
from ..policy import admission, continuation, media, prompts
from ..policy.routes import RouteClass, classify_route, route_label
from . import errors, tokens
from .auth import AUTHENTICATED, presented_key
from .bodies import BodyTimeout, BodyTooLarge, BodyUnreadable, parse_json_object, read_body, \
    refusal
from ..vocabulary import Attempt, Received
from .outcomes import Answered, AttemptResult, Broken, ending
from .forward import Forwarder, RequestCtx
from .outage import Episode, Outage
from .headers import HeaderProblem, own_headers
from .identity import loggable, request_id_of

log = logging.getLogger("spillway.proxy")

CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"
_HELD = "spillway_held_bytes"  # the request's place among the large bodies held
# Headers of a stored answer that a replay from the store repeats.
_STORED_HEADERS = ("Content-Type", "X-Spillway-Child", "X-Spillway-Attempts",
                   "X-Spillway-Failover")


@dataclass
class ProxySettings:
    max_body_bytes: int
    max_replay_body_bytes: int
    replay: bool = True
    continue_streams: bool = True  # failover.continue_streams
    fail_back: bool = True  # failover.fail_back (serving/failback.py)
    # Children started with --no-prefill-assistant: /v1/messages streams are not continued
    # there (the Messages API cannot ask for the final message to be continued).
    no_prefill: frozenset[str] = frozenset()
    body_timeout_s: float = 30.0
    access_log: bool = True
    # small.requests = "all": every generation request accepts the small child's smaller
    # model unless it says X-Spillway-Fallback: none.
    smaller_for_all: bool = False
    # The children's media marker (LLAMA_MEDIA_MARKER): what splits a prompt object's text
    # around its multimodal_data when it is counted.
    media_marker: str | None = None
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES  # failover.max_held_mib (serving/held.py)


class ProxyHandler:
    """Handles every request outside /spillway/."""

    def __init__(self, pools: Pool | Pools, forwarder: Forwarder, settings: ProxySettings,
                 incidents: IncidentLog, idempotency: IdempotencyStore,
                 metrics: Metrics, streams: StreamSessions | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 held: HeldBodies | None = None) -> None:
        # One pool (single-model mode), or one per model (router mode): see pools.py.
        self.pools = pools if isinstance(pools, Pools) else Pools(pools)
        self.forwarder = forwarder
        self.settings = settings
        self.incidents = incidents
        self.idempotency = idempotency
        self.metrics = metrics
        # Resumable streams' replay buffers (X-Conversation-Id): see stream_sessions.py.
        self.streams = streams if streams is not None else StreamSessions()
        self.wall_clock = wall_clock
        # The large bodies (images, audio, long prompts) held at once, for their replays.
        self.held = held if held is not None else HeldBodies()
        self.mirror: Mirror | None = None  # the warm CPU child (serving/mirror.py), if any
        self._recoveries: dict[int, Recovery] = {}  # each pool's coordinator (by its id)
        # What a failure does to a request (its replay, continuation, fail-back), carried out.
        self.outage = Outage(forwarder, metrics, self._recovery, self._attempt)
        # Requests in the server (reading a body, waiting in line, at an upstream): what a
        # shutdown waits for. What each upstream is working on is the pool's count.
        self.open_requests = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        self.open_requests += 1
        self.idle.clear()
        try:
            return await self._handle(request)
        except ConnectionError:
            # The client left while its answer was being written (recorded as 499 on the
            # way out). A response handed back is finished by aiohttp, which takes the closed
            # connection quietly; the exception would be logged as an error of the server's.
            return web.Response(status=CLIENT_CLOSED)
        finally:
            if request.get(_HELD):
                self.held.give_back(request[_HELD])
            self.open_requests -= 1
            if self.open_requests == 0:
                self.idle.set()

    def _hold(self, request: web.Request, size: int) -> bool:
        """A place among the large bodies held (serving/held.py) for this request's, of `size`
        bytes (0: not large, nothing held); False when the bound is passed."""
        taken = request.get(_HELD, 0)
        self.held.limit = self.settings.max_held_bytes  # (a reload may have changed it)
        if size == taken:
            return True
        if size == 0:
            self.held.give_back(taken)
            request[_HELD] = 0
            return True
        if not self.held.grow(taken, size):
            return False
        request[_HELD] = size
        return True

    def _hold_announced(self, request: web.Request, rid: str) -> web.StreamResponse | None:
        """A body its Content-Length says is large takes its place before it is read: a
        flood of them is refused without their bytes in memory."""
        announced = request.content_length or 0
        if LARGE_BODY_BYTES <= announced <= self.settings.max_body_bytes and \
                not self._hold(request, announced):
            return self._held_refusal(request, rid, announced)
        return None

    def _held_refusal(self, request: web.Request, rid: str, size: int) -> web.StreamResponse:
        held = self.held
        retry = self.pools.main.service_estimate()[0]
        return self._early(None, request, rid, "held_bytes", errors.unavailable(
            f"too many large request bodies (images, audio, long prompts) are held for their "
            f"replay: {held.held / MIB:.0f} MiB by {held.holders} requests, and this one's "
            f"{size / MIB:.1f} MiB would pass failover.max_held_mib "
            f"({held.limit / MIB:.0f} MiB)", rid, retry_after_s=retry,
            queue_position=held.holders + 1))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        rid = request_id_of(request)
        route = classify_route(request.path)
        started = time.monotonic()
        # 2. Bad input is answered before any child sees it: Spillway's own headers (before
        # the body is read), then the body.
        own = own_headers(request.headers, self._pinnable)
        if isinstance(own, HeaderProblem):
            return self._early(None, request, rid, "bad_request", errors.invalid_request(
                400, own.message, rid, param=own.header))
        timeout_s = self.settings.body_timeout_s
        if route is RouteClass.GENERATION and (refused := self._hold_announced(request, rid)):
            return refused  # before its body is read
        try:
            body = await read_body(request, self.settings.max_body_bytes, timeout_s)
        except (BodyTimeout, BodyTooLarge, BodyUnreadable) as e:
            cause = "body_timeout" if isinstance(e, BodyTimeout) else \
                "body_too_large" if isinstance(e, BodyTooLarge) else "bad_request"
            return self._early(None, request, rid, cause, refusal(e, rid, timeout_s))
        payload: dict[str, Any] | None = None
        if route is RouteClass.GENERATION and request.method == "POST":
            problem, payload = parse_json_object(body)
            if problem is not None:
                return self._early(None, request, rid, "bad_request",
                                   errors.invalid_request(400, problem, rid))
        found = media.find(request.path, payload, body)
        held = _held_bytes(body, found)
        if route is RouteClass.GENERATION and not self._hold(request, held):
            return self._held_refusal(request, rid, held)
        stream = bool(payload.get("stream")) if payload else False
        conversation = request.headers.get("X-Conversation-Id") if stream else None
        ctx = RequestCtx(Received(
            request_id=rid, method=request.method, path=request.path,
            path_qs=request.raw_path, route=route, body=body, payload=payload, stream=stream,
            client_headers=request.headers, received=started,
            trusted=request.get(AUTHENTICATED, True), own=own, media=found,
            model=await self._model_of(request, payload),
            smaller_ok=route is RouteClass.GENERATION and payload is not None and (
                own.fallback == "smaller" or (own.fallback == "" and
                                              self.settings.smaller_for_all)),
            conversation=conversation if conversation is not None and
            0 < len(conversation) <= MAX_CONVERSATION_ID else None,
        ))
        if conversation is not None and ctx.req.conversation is None:
            return self._early(ctx, request, rid, "bad_request", errors.invalid_request(
                400, f"X-Conversation-Id must be 1 to {MAX_CONVERSATION_ID} characters", rid,
                param="X-Conversation-Id"))
        if found and (fatal := media.aborts_child(request.path, payload,
                                                  self.settings.media_marker)):
            return self._early(ctx, request, rid, "bad_request",
                               errors.invalid_request(400, fatal, rid, param="prompt"))
        ctx.follow = self._followed(ctx.req)
        # From here the JSON is ctx.req's alone, so that a held body's can be let go
        # (`_let_go`) while this frame awaits the answer.
        del payload
        idem_key = request.headers.get("Idempotency-Key")
        if idem_key is not None and request.method == "POST":
            return await self._with_idempotency(request, ctx, idem_key)
        return (await self._serve_and_record(request, ctx)).response

    async def _model_of(self, request: web.Request, payload: dict[str, Any] | None) -> str | None:
        """Router mode: the model the request names, as the routers list it."""
        if not self.pools.router:
            return None
        named = payload.get("model") if payload else request.query.get("model")
        if isinstance(named, str):
            await self.pools.listed()  # a router just ready: its models known first
        return self.pools.for_model(named if isinstance(named, str) else None, request.path)[0]

    def _followed(self, req: Received) -> continuation.Transcript | None:
        """A stream that may go on from the other child if its own dies after bytes: what the
        client receives of it is followed."""
        if req.stream and self.settings.continue_streams and self.settings.replay and \
                len(req.body) <= self.settings.max_replay_body_bytes and \
                continuation.body_refusal(req.path, req.payload, _opted_out(req)) is None:
            return continuation.Transcript(continuation.route_kind(req.path) or "chat")
        return None

    # --- Idempotency-Key ----------------------------------------------------------------------

    async def _with_idempotency(self, request: web.Request, ctx: RequestCtx,
                                key: str) -> web.StreamResponse:
        rid = ctx.req.request_id
        if not key or len(key) > 255:
            return self._early(ctx, request, rid, "bad_request", errors.invalid_request(
                400, "Idempotency-Key must be 1 to 255 characters", rid,
                param="Idempotency-Key"))
        scope = scope_of(presented_key(request), ctx.req.path)
        fp = fingerprint(ctx.req.method, ctx.req.path_qs, ctx.req.body)
        found = self.idempotency.begin(scope, key, fp, time.monotonic())
        if found.outcome is Outcome.IN_PROGRESS:
            return self._early(ctx, request, rid, "idempotency_in_progress", errors.json_error(
                409, "invalid_request_error", "a request with this Idempotency-Key is still "
                "running; retry when it is done", rid, param="Idempotency-Key",
                headers={"Retry-After": "1"}))
        if found.outcome is Outcome.MISMATCH:
            return self._early(ctx, request, rid, "idempotency_mismatch", errors.json_error(
                422, "invalid_request_error", "this Idempotency-Key was used with a different "
                "request body", rid, param="Idempotency-Key"))
        if found.outcome is Outcome.DONE:
            assert found.response is not None
            stored = found.response
            replayed = dict(stored.headers)
            replayed.update({"X-Request-Id": rid, "Idempotent-Replayed": "true"})
            return self._early(ctx, request, rid, None, web.Response(
                status=stored.status, body=stored.body, headers=replayed))
        ctx.capture = bytearray()
        # What could never be stored is not collected either.
        ctx.capture_limit = min(self.idempotency.max_response_bytes,
                                self.idempotency.max_total_bytes)
        stored_ok = False
        try:
            served = await self._serve_and_record(request, ctx)
            response = served.response
            final = (ctx.capture is not None and isinstance(served, Answered) and ctx.attempts
                     and (200 <= response.status < 300 or
                          (400 <= response.status < 500 and response.status not in
                           (408, 409, 429))))
            if final and ctx.capture is not None:
                kept = tuple((h, response.headers[h]) for h in _STORED_HEADERS
                             if h in response.headers)
                stored_ok = self.idempotency.complete(
                    scope, key, StoredResponse(response.status, kept, bytes(ctx.capture)))
            return response
        finally:
            if not stored_ok:
                self.idempotency.release(scope, key)

    # --- serving ------------------------------------------------------------------------------

    async def _serve_and_record(self, request: web.Request,
                                ctx: RequestCtx) -> Answered | Broken:
        if ctx.req.conversation is not None:
            return await self._resumable(request, ctx, ctx.req.conversation)
        return await self._serve_recorded(request, ctx)

    async def _resumable(self, request: web.Request, ctx: RequestCtx,
                         conversation: str) -> Answered | Broken:
        """A stream with X-Conversation-Id: served by a task of its own, which a client that
        leaves does not cancel. What it sends also goes to the conversation's replay buffer
        (proxy/tee.py), for GET /v1/stream; a Stop (DELETE /v1/stream) or a new stream of the
        same conversation cancels it."""
        session = self.streams.start(conversation, ctx.req.request_id, self.wall_clock())
        ctx.resumable = session
        self.open_requests += 1  # until the answer ends, wherever the client is
        self.idle.clear()
        task = asyncio.get_running_loop().create_task(self._produce(request, ctx, session))
        task.add_done_callback(_log_failed_producer)
        session.stop = task.cancel
        served = await asyncio.shield(task)
        if served is not None:
            return served
        # Stopped: a started stream just ends; one still waiting gets llama-server's answer.
        ctx.capture = None
        if ctx.event_stream is not None:
            return Answered(ctx.event_stream)
        return Answered(errors.invalid_request(
            400, "request cancelled by a stop (DELETE /v1/stream, or a new stream of this "
                 "conversation) before it started", ctx.req.request_id))

    async def _produce(self, request: web.Request, ctx: RequestCtx,
                       session: StreamSession) -> Answered | Broken | None:
        """The resumable stream's own task: its answer, or None when it was stopped."""
        try:
            return await self._serve_recorded(request, ctx)
        except asyncio.CancelledError:
            if not session.cancelled:
                raise
            return None
        finally:
            self.streams.finished(session, self.wall_clock())
            self.open_requests -= 1
            if self.open_requests == 0:
                self.idle.set()

    async def _serve_recorded(self, request: web.Request,
                              ctx: RequestCtx) -> Answered | Broken:
        episodes: list[Episode] = []
        connected = True
        served: Answered | Broken | None = None
        try:
            served = await self._serve(request, ctx, episodes)
            response = served.response
            if episodes and not response.prepared:
                # Send it here, so the incident knows whether the client was still there.
                try:
                    await response.prepare(request)
                    await response.write_eof()
                except (ConnectionError, RuntimeError):
                    connected = False
            return served
        except (asyncio.CancelledError, ConnectionError):
            # The client went away; after its stream's last event, with the whole answer.
            connected = ctx.answer_ended
            raise
        finally:
            if ctx.resumable is not None and ctx.resumable.client_left:
                connected = False  # the answer went on, into its replay buffer
            answered = served.response if served is not None else ctx.event_stream
            status = answered.status if answered is not None and connected else CLIENT_CLOSED
            broken = isinstance(served, Broken)
            if isinstance(served, Broken) and not any(e.failure is served.failure
                                                      for e in episodes):
                episodes.append(Episode(served.failure, "passed_on",
                                         "the stream had started: bytes already reached the "
                                         "client; it ended with an SSE error event"))
            for episode in episodes:
                self._record(ctx, episode, status, connected)
            self._finish(ctx, request, ctx.req.request_id, status, broken)

    def _pinnable(self) -> list[str]:
        """What X-Spillway-Child may name: every pool's upstreams (in router mode a model's
        pool may hold a small one), in the config's order."""
        return list(dict.fromkeys(name for pool in self.pools for name in pool.roles))

    def _pool(self, ctx: RequestCtx) -> Pool:
        """The request's pool: its model's in router mode, else the one."""
        return self.pools.for_model(ctx.req.model, ctx.req.path)[1]

    async def _serve(self, request: web.Request, ctx: RequestCtx,
                     episodes: list[Episode]) -> Answered | Broken:
        pin = None
        count = None
        pool = self._pool(ctx)
        if ctx.req.route is not RouteClass.GENERATION:
            # Outside the caps: the GPU child when ready, else the CPU child, or the pinned one.
            pin = ctx.req.own.pin
            got = pool.passthrough(pin)
            if isinstance(got, admission.Decision) and ctx.req.model is not None:
                # Its model is loaded nowhere: the router answers for it.
                pool = self.pools.main
                got = pool.passthrough(pin)
        else:
            # Generation: 3 to 7 of the admission order, asked of the recovery coordinator.
            recovery = self._recovery(ctx)
            asked = recovery.work(ctx.req)  # (read from its JSON before it may be let go)
            count = await self._prompt_count(ctx)
            ctx.prompt_tokens = count.largest
            ctx.work = dataclasses.replace(asked, prompt_tokens=count.largest) \
                if ctx.counted else asked
            got = await recovery.admit(ctx.req, ctx.work, count.largest, count.exact)
        if isinstance(got, admission.Decision):
            loading = admission.loading(pool.states(), pin)
            return Answered(self._refusal(ctx, got, count, loading))
        if got.counted:
            ctx.waited_s = got.waited_s
            ctx.wait_estimate_s = got.estimated_wait_s
            ctx.wait_estimate_basis = got.estimate_basis
        self.outage.watch(ctx, got)  # (a stream on the CPU child in an outage may move back)
        result: AttemptResult | None = None
        try:
            result = await self._attempt(request, ctx, got)
        finally:
            back = self.outage.unlist(ctx, result)
        return await self.outage.after(request, ctx, result, back, episodes)

    def _recovery(self, ctx: RequestCtx) -> Recovery:
        """The recovery coordinator for the request's pool (serving/recovery.py): where it
        goes, its replay or continuation, what is mirrored. One a pool, made once: it reads
        the proxy's settings, which a reload updates in place."""
        pool = self._pool(ctx)
        recovery = self._recoveries.get(id(pool))
        if recovery is None or recovery.pool is not pool:
            recovery = Recovery(pool, self.settings,
                                self.mirror if pool is self.pools.main else None)
            self._recoveries[id(pool)] = recovery
        return recovery

    async def _prompt_count(self, ctx: RequestCtx) -> tokens.Count:
        """The prompt's tokens, as the child counts them, when they may matter (over the
        smallest context of a slot), else the cheap bound (or 0: unknown, which fits
        anywhere). A held body's JSON is let go before the count is awaited."""
        bound = prompts.upper_bound(len(ctx.req.body), ctx.req.payload)
        pool = self._pool(ctx)
        # The children that may take it: a smaller model's only for a request that accepts one
        # (its context, often the smallest, would otherwise make every prompt counted).
        limit = min(filter(None, (pool.ctx_per_slot(n) for n in pool.roles
                                  if ctx.req.smaller_ok or n not in pool.smaller)), default=None)
        # Images and audio are always counted: their base64 says nothing of their tokens (a
        # 1 MB image is no 350,000 tokens), and the expected times and VRAM need the figure.
        # So is every prompt during an outage (the GPU child not ready), where the earliest
        # expected finish weighs it; the GPU's fast path never pays for a count.
        outage = not pool.upstreams[pool.roles[0]].is_ready
        payload = ctx.req.payload
        if payload is None or (not ctx.req.media and not outage and
                               (limit is None or bound < limit)):
            self._let_go(ctx)
            return tokens.Count((bound if limit is not None else 0,), exact=True)
        counter = pool.first_ready(ctx.req.media.modalities)
        plan = prompts.plan(ctx.req.path, payload, self.settings.media_marker)
        model = payload.get("model")
        del payload
        self._let_go(ctx)
        counted = None if counter is None or plan is None else await tokens.count(
            self.forwarder.session, self.forwarder.client, counter, plan, model, ctx.req.body,
            limit or 0)
        if counted is not None:
            ctx.counted = True
        return counted if counted is not None else tokens.Count((0,), exact=True)

    def _let_go(self, ctx: RequestCtx) -> None:
        """A body held for its replay (serving/held.py: images, audio, over 1 MiB) keeps its
        bytes alone from here, while it is counted, waits in line and runs: its parsed JSON
        (as large again) is let go, and parsed again only by a step that reads it later (a
        continuation). A flood of image requests costs each body's bytes once, not twice."""
        if ctx.req.payload is not None and _held_bytes(ctx.req.body, ctx.req.media):
            ctx.req = ctx.req.light()

    def _refusal(self, ctx: RequestCtx, decision: admission.Decision,
                 count: tokens.Count | None, loading: bool) -> web.Response:
        self._rejected(decision.cause or "other", ctx.req.path)
        if decision.action is admission.Action.TOO_LONG:
            # As llama-server says it, before any child works on it.
            n_prompt = count.first_over(decision.n_ctx) if count else 0
            return errors.exceed_context(n_prompt, decision.n_ctx, ctx.req.request_id)
        if loading:
            # What llama-server answers while it loads, with Spillway's own reason beside it.
            return errors.unavailable(errors.LOADING, ctx.req.request_id,
                                      retry_after_s=decision.retry_after_s,
                                      queue_position=decision.queue_position,
                                      reason=decision.reason)
        return errors.unavailable(decision.reason, ctx.req.request_id,
                                  retry_after_s=decision.retry_after_s,
                                  queue_position=decision.queue_position)

    async def _attempt(self, request: web.Request, ctx: RequestCtx,
                       lease: Lease) -> AttemptResult:
        """One attempt on the lease's upstream; the lease is closed with its outcome."""
        child = lease.upstream
        attempt = Attempt(child.name, len(ctx.attempts) + 1, media_items=len(ctx.req.media.items))
        ctx.attempts.append(attempt)
        own = [("X-Request-Id", ctx.req.request_id), ("X-Spillway-Child", child.name),
               ("X-Spillway-Attempts", str(attempt.number))]
        if ctx.failover_kind:
            own.append(("X-Spillway-Failover", ctx.failover_kind))
        if ctx.req.model is not None:  # (a smaller model's own name, when it answers)
            own.append(("X-Spillway-Model", child.serves_model or ctx.req.model))
        if ctx.wait_estimate_s is not None and ctx.waited_s is not None:
            # W3C Server-Timing (browsers' dev tools show it): the time this request spent in
            # the waiting line, and the estimate it was given on joining, which is what a 503's
            # Retry-After says; so a client can see how well that promise is kept.
            own.append(("Server-Timing", f"queue;dur={ctx.waited_s * 1000:.1f}, "
                                         f"queue-estimate;dur={ctx.wait_estimate_s * 1000:.1f};"
                                         f'desc="{ctx.wait_estimate_basis}"'))
        result: AttemptResult | None = None
        lease.pool.carry_media(lease, len(ctx.req.media.items))
        try:
            result = await self.forwarder.attempt(request, ctx, attempt, child, own)
            return result
        finally:
            lease.close(attempt, ending(result, ctx.req.body))
            self._judge_forecast(ctx, lease, attempt, result)

    def _judge_forecast(self, ctx: RequestCtx, lease: Lease, attempt: Attempt,
                        result: AttemptResult | None) -> None:
        """The forecast admission acted on, beside the answer's time on that child (a whole
        answer only): its error is a metric, and the access log shows both."""
        expected = lease.decision.expected_s if lease.decision is not None else None
        if expected is None or not isinstance(result, Answered) or \
                result.response.status != 200:
            return
        took = time.monotonic() - attempt.started
        ctx.forecast = (expected, took)
        self.metrics.forecast_error.labels(attempt.child).observe(took - expected)

    # --- records ------------------------------------------------------------------------------

    def _record(self, ctx: RequestCtx, episode: Episode, status: int,
                connected: bool) -> None:
        f = episode.failure
        self.incidents.write(Incident(
            id=new_incident_id(),
            episode=self._pool(ctx).episode_id(f.child, f.generation),
            time=rfc3339(time.time()),
            request_id=ctx.req.request_id,
            child=f.child,
            kind=str(f.verdict.kind),
            evidence=f.verdict.evidence,
            decision=episode.decision,
            reason=episode.reason,
            cpu_start_s=round(episode.cpu_start_s, 3),
            status=status,
            tokens=_tokens(ctx.last),
            latency_s=round(time.monotonic() - ctx.req.received, 3),
            client_connected=connected,
            route=ctx.req.path,
            replay_child=episode.replay_child,
            attempts=len(ctx.attempts),
            stream=ctx.req.stream,
            model=ctx.req.model,
            known_crash=f.verdict.known_crash,
            tokens_before=episode.tokens_before,
            continued_after_s=(round(episode.continued_after_s, 3)
                               if episode.continued_after_s is not None else None),
            prompt_tokens=ctx.prompt_tokens if ctx.counted else None,
            media=ctx.req.media.describe(),
            prompt_reused=_reused(ctx.last),
            **_forecast(ctx, episode),
        ))

    def _early(self, ctx: RequestCtx | None, request: web.Request, rid: str,
               cause: str | None, response: web.StreamResponse) -> web.StreamResponse:
        """An answer Spillway gives itself, before or instead of any attempt."""
        if cause is not None:
            self._rejected(cause, request.path)
        if ctx is not None:
            self._finish(ctx, request, rid, response.status, broken=False)
        else:
            self._log_line(request, rid, "-", response.status, 0.0, 0)
        return response

    def _finish(self, ctx: RequestCtx, request: web.Request, rid: str, status: int,
                broken: bool) -> None:
        """One log line per request, with its id; and its metrics."""
        last = ctx.last
        reported = _child_prompt_tokens(ctx)
        self._log_line(request, rid, last.child if last else "-", status,
                       time.monotonic() - ctx.req.received, len(ctx.attempts),
                       _count_words(ctx, reported))
        ctx.status = status
        self._count(ctx, status, broken)
        follow = ctx.follow
        self._recovery(ctx).served(ctx.req, ctx.attempts, status, ctx.continued,
                                   follow.text or None if follow is not None and
                                   not follow.tool_calls else None, ctx.prompt_tokens)
        if reported is not None:
            self.metrics.prompt_count_error.labels("yes" if ctx.req.media else "no").observe(
                ctx.prompt_tokens - reported)

    def _count(self, ctx: RequestCtx, status: int, broken: bool) -> None:
        """The request's metrics."""
        last = ctx.last
        route = route_label(ctx.req.path)
        elapsed = time.monotonic() - ctx.req.received
        m = self.metrics
        m.count_request(route, last.child if last is not None else "none",
                        _outcome(ctx, status, broken), elapsed)
        if ctx.req.stream and last is not None and last.first_byte_s is not None and status == 200:
            m.ttft.labels(route).observe(last.first_byte_s)
        if len(ctx.attempts) == 2 and not ctx.continued:
            m.replays.labels("completed" if status == 200 and not broken else "failed").inc()
        if ctx.hold_expired_on is not None:
            m.holds_expired.labels(ctx.hold_expired_on).inc()
        if ctx.waited_s is not None:
            m.wait.observe(ctx.waited_s)
        for modality in ctx.req.media.modalities:
            m.media_requests.labels(str(modality)).inc()

    def _rejected(self, cause: str, path: str) -> None:
        self.metrics.rejections.labels(cause).inc()
        if cause in ("body_too_large", "bad_request"):
            self.metrics.requests.labels(route_label(path), "none", "rejected").inc()

    def _log_line(self, request: web.Request, rid: str, child: str, status: int,
                  elapsed: float, attempts: int, counted: str = "") -> None:
        if not self.settings.access_log and 200 <= status < 400 and attempts <= 1:
            return  # only the lines that say something went differently
        log.info("rid=%s %s %s -> %s %d %.3fs attempts=%d%s", rid, request.method,
                 loggable(request.path), child, status, elapsed, attempts, counted)


def _log_failed_producer(task: asyncio.Task[Answered | Broken | None]) -> None:
    """A resumable stream's task that failed with nobody left to await it (its client went
    away): said in the log, not lost as an unretrieved exception."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("a resumable stream's answer failed: %s", error, exc_info=error)


def _reused(attempt: Attempt | None) -> int | None:
    """The prompt tokens the attempt's child found in its cache (its timings' cache_n)."""
    n = attempt.timings.get("cache_n") if attempt is not None and attempt.timings else None
    return n if isinstance(n, int) else None


def _child_prompt_tokens(ctx: RequestCtx) -> int | None:
    """The prompt's tokens as the child that answered reported them (its timings or its usage:
    those it processed and those it found cached), for a request Spillway counted; None
    otherwise (a continued stream's last attempt was another prompt)."""
    last = ctx.last
    if not ctx.counted or ctx.continued or last is None:
        return None
    return last.prompt_tokens


def _count_words(ctx: RequestCtx, reported: int | None) -> str:
    """The access log's fields for a counted prompt: Spillway's figure beside the child's, and
    the request's media; and what Spillway did to its stream."""
    words = _stream_words(ctx)
    if ctx.forecast is not None:
        words += f" forecast_s={ctx.forecast[0]:.2f} took_s={ctx.forecast[1]:.2f}"
    if not ctx.counted:
        return words
    words += f" prompt_tokens={ctx.prompt_tokens}"
    if reported is not None:
        words += f" child_prompt_tokens={reported}"
    if ctx.req.media:
        words += f' media="{ctx.req.media.describe()}"'
    return words


def _stream_words(ctx: RequestCtx) -> str:
    """What Spillway did to a stream, which the client's bytes do not say (llama-server would
    not have written it): its status and headers let out before its first event, past
    failover.stream_hold_s; its continuation on another child."""
    words = ""
    if ctx.hold_expired_on is not None:
        words += f" hold_expired={ctx.hold_expired_on}"
    if ctx.continued and len(ctx.attempts) >= 2:
        tokens = f" tokens_before={ctx.follow.tokens}" if ctx.follow is not None else ""
        words += f" continued_from={ctx.attempts[-2].child}{tokens}"
    return words


def _outcome(ctx: RequestCtx, status: int, broken: bool) -> str:
    if status == CLIENT_CLOSED:
        return "client_closed"
    if broken:
        return "failed"
    if status < 400:
        return "success"
    if not ctx.attempts:
        return "rejected"
    return "client_error" if status < 500 else "failed"


def _held_bytes(body: bytes, found: media.Media) -> int:
    """The bytes a request's body holds among the large bodies held for their replays (0: it
    is not one of them): any body with media, or over LARGE_BODY_BYTES."""
    return len(body) if found or len(body) >= LARGE_BODY_BYTES else 0


def _opted_out(req: Received) -> bool:
    """X-Spillway-Replay: never: the client would rather have an error than a replay."""
    return not req.own.replay


def _forecast(ctx: RequestCtx, episode: Episode) -> dict[str, float | None]:
    """The incident's forecast beside what happened: the failover's (from its decision to the
    end), else admission's for the last attempt."""
    if episode.forecast_s is not None:
        return {"forecast_s": round(episode.forecast_s, 3),
                "took_s": round(time.monotonic() - episode.decided_at, 3)}
    if ctx.forecast:
        return {"forecast_s": round(ctx.forecast[0], 3), "took_s": round(ctx.forecast[1], 3)}
    return {"forecast_s": None, "took_s": None}


def _tokens(attempt: Attempt | None) -> int:
    """Completion tokens of the last attempt: as the answer said, else the events delivered."""
    if attempt is None:
        return 0
    return attempt.tokens if attempt.tokens is not None else attempt.events
