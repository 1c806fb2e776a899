"""Prometheus metrics at /spillway/metrics, in a registry of Spillway's own.

Names follow Prometheus's conventions: the `spillway_` prefix, base units (seconds, bytes) in the
name, `_total` on counters. Label values are bounded: routes by name (others are `other`),
children `gpu`/`cpu`, failure kinds from the fixed set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..policy.lifecycle import ChildState
from ..policy.mirror import MIRROR, REWARM
from ..policy.routes import ROUTE_LABEL_COUNT
from .caches import figures
from .stream_sessions import StreamSessions
from ..config.schema import ROUTERS

DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
MIRROR_OUTCOMES = ("mirrored", "cancelled", "failed", "skipped")
COUNT_ERROR_BUCKETS = (-64, -16, -4, -1, 0, 1, 4, 16, 64)
FORECAST_ERROR_BUCKETS = (-30, -10, -3, -1, -0.3, 0, 0.3, 1, 3, 10, 30)
WAIT_BUCKETS = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, children: Sequence[str] = ROUTERS) -> None:
        """`children`: their names, in the config's order (each child's series exist from the
        start, at 0, not absent)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "spillway_requests", "Requests answered, by route, the child that served the last "
            "attempt (none when Spillway answered itself) and outcome.",
            ["route", "child", "outcome"], registry=r)
        self.duration = Histogram(
            "spillway_request_duration_seconds", "Time from a request's arrival to its answer.",
            ["route"], buckets=DURATION_BUCKETS, registry=r)
        self.ttft = Histogram(
            "spillway_stream_time_to_first_token_seconds", "Time from a streamed request's "
            "arrival to its first event reaching the client.", ["route"],
            buckets=TTFT_BUCKETS, registry=r)
        # Spillway's count of a prompt against the child's own (usage.prompt_tokens, from its
        # timings): how far the figure admission acted on was off, so it can be judged.
        self.prompt_count_error = Histogram(
            "spillway_prompt_count_error_tokens", "Spillway's count of a request's prompt "
            "tokens less the child's own, for requests it counted (media: with images or "
            "audio, or not).", ["media"], buckets=COUNT_ERROR_BUCKETS, registry=r)
        self.forecast_error = Histogram(
            "spillway_forecast_error_seconds", "An answer's time on the child that took it, "
            "less the time admission forecast for it there (its measured speeds, its counted "
            "prompt, its media): how far the estimator that chooses between the children is "
            "off.", ["child"], buckets=FORECAST_ERROR_BUCKETS, registry=r)
        self.media_requests = Counter(
            "spillway_media_requests_total", "Generation requests with images, audio or "
            "video, by modality (a request with both counts once in each).", ["modality"],
            registry=r)
        self.failovers = Counter(
            "spillway_failovers", "Failures of a child caught while serving a request, by kind.",
            ["child", "kind"], registry=r)
        self.stale_connection_resends = Counter(
            "spillway_upstream_stale_connection_resends", "Requests sent once more to the same "
            "child on a new connection because a reused keep-alive connection closed before "
            "any answer while the child kept running (not a replay, not a child failure).",
            ["child"], registry=r)
        self.replays = Counter(
            "spillway_replays", "Replays on the other child, by result (completed, failed).",
            ["result"], registry=r)
        self.rejections = Counter(
            "spillway_rejections", "Requests Spillway answered with an error of its own instead "
            "of forwarding, by reason.", ["reason"], registry=r)
        self.waiting = Gauge(
            "spillway_waiting_requests", "Requests in the waiting line.", registry=r)
        self.wait = Histogram(
            "spillway_wait_seconds", "Time admitted requests spent in the waiting line.",
            buckets=WAIT_BUCKETS, registry=r)
        self.child_state = Gauge(
            "spillway_child_state", "1 for each child's current state, 0 for the others.",
            ["child", "state"], registry=r)
        self.restarts = Counter(
            "spillway_child_restarts", "Child restarts, by the kind of exit (or the reason) "
            "that caused them.", ["child", "reason"], registry=r)
        self.continuations = Counter(
            "spillway_stream_continuations", "Streams whose child failed after bytes, by what "
            "came of them: continued on the other child (completed, failed) or not (refused)",
            ["result"], registry=r)
        self.failbacks = Counter(
            "spillway_failbacks", "Streams the CPU child was answering that moved back to the "
            "GPU child once it was READY, by what came of them (completed, failed).",
            ["result"], registry=r)
        self.failback_saved = Counter(
            "spillway_failback_saved_seconds", "The time fail-backs saved: for each completed "
            "one, the rest's forecast on the CPU child less what the GPU child took.",
            registry=r)
        # The GPU lent to other programs (service/lending.py).
        self.gpu_lent = Gauge(
            "spillway_gpu_lent", "1 while the GPU child is stopped and its card lent to other "
            "programs, by why (idle: gpu.idle_release_s; operator: spillway gpu pause; yield: "
            "gpu.yield_to_other_processes).", ["why"], registry=r)
        self.gpu_lendings = Counter(
            "spillway_gpu_lendings", "Times the GPU child was stopped to lend its card, by why "
            "(idle or yield; the operator's pauses are not counted here).",
            ["why"], registry=r)
        self.gpu_wakes = Counter(
            "spillway_gpu_wakes", "Times the lent GPU child was started again, by why it was "
            "lent (idle: a request woke it; yield: the other program was done).",
            ["why"], registry=r)
        for why in ("idle", "operator", "yield"):
            self.gpu_lent.labels(why).set(0)
            if why != "operator":
                self.gpu_lendings.labels(why)
                self.gpu_wakes.labels(why)
        self.holds_expired = Counter(
            "spillway_stream_holds_expired", "Streams whose first event came after "
            "failover.stream_hold_s, by child: their status and headers went out before it, "
            "and the request gave up its replay.", ["child"], registry=r)
        self.stream_resumes = Counter(
            "spillway_stream_resumes", "GET /v1/stream: resumable streams read again from "
            "Spillway's replay buffers, by result (served, not_found, offset_lost).",
            ["result"], registry=r)
        self.stream_sessions = Gauge(
            "spillway_stream_sessions", "Resumable streams (X-Conversation-Id) held, live "
            "(still being answered) or finished (kept for their time to live).", ["state"],
            registry=r)
        # The mirror's lanes (serving/mirror.py): the warm CPU child's mirrors, and the rewarms
        # of the GPU child after its restart, by outcome (gauges read from each lane's own
        # counts, which only grow), the prompt tokens its child is known to hold, the budget
        # used.
        self.mirror_lanes = {
            lane: (Gauge(f"spillway_{lane}s", f"Conversations sent to {whom} since the start, "
                         "by outcome (mirrored, cancelled by real work, failed, skipped).",
                         ["outcome"], registry=r),
                   Gauge(f"spillway_{lane}_warm_tokens", f"Prompt tokens of the conversations "
                         f"sent to {whom} it is known to hold (the newest 64).", registry=r),
                   Gauge(f"spillway_{lane}_budget_used_seconds", f"The time of {whom} spent "
                         "on them in the last minute.", registry=r))
            for lane, whom in ((MIRROR, "the warm CPU child"),
                               (REWARM, "the GPU child after its restart"))}
        self.stream_session_bytes = Gauge(
            "spillway_stream_session_bytes", "Bytes held in the resumable streams' replay "
            "buffers.", registry=r)
        self.known_crashes = Counter(
            "spillway_known_crashes", "Child exits that matched a known crash signature "
            "(policy/signatures.py: amx_matmul, illegal_instruction, ...)",
            ["child", "signature"], registry=r)
        # Router mode: each model on each router child.
        self.model_state = Gauge(
            "spillway_model_state", "Router mode: 1 for each model's current state on each "
            "child, 0 for the others.", ["child", "model", "state"], registry=r)
        self.model_reloads = Counter(
            "spillway_model_reloads", "Router mode: loads of a model after its instance died, "
            "by the kind of the death.", ["child", "model", "reason"], registry=r)
        self.gpu_free = Gauge(
            "spillway_gpu_memory_free_bytes", "Free memory of the GPU child's tightest card "
            "(the one with the least free).", registry=r)
        self.gpu_used = Gauge(
            "spillway_gpu_memory_used_bytes", "Used memory of the GPU child's tightest card.",
            registry=r)
        self.gpu_total = Gauge(
            "spillway_gpu_memory_total_bytes", "Total memory of the GPU child's tightest card.",
            registry=r)
        self.gpu_memory = Gauge(
            "spillway_gpu_memory_bytes", "Every card's memory by PCI address, kind total, used "
            "or free (NVML; amdgpu's sysfs; Intel's estimated from llama-server's listing).",
            ["device", "kind"], registry=r)
        self._gpu_devices: set[str] = set()
        self.reloads = Counter(
            "spillway_config_reloads", "Configuration reloads, by result (applied, invalid, "
            "unchanged).", ["result"], registry=r)
        self.config_valid = Gauge(
            "spillway_config_last_reload_valid", "1 if the last configuration read was valid "
            "(the running one is in effect either way).", registry=r)
        self.config_valid.set(1)
        self._request_series: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        # Its bound: every route label, each child or none, each outcome (proxy/handler.py's
        # _outcome: success, client_error, rejected, failed, client_closed).
        self.max_request_series = ROUTE_LABEL_COUNT * (len(children) + 1) * 5
        for child in children:
            self.set_state(child, ChildState.STOPPED)
            self.stale_connection_resends.labels(child)  # 0 from the start, not absent
            self.holds_expired.labels(child)
        for result in ("served", "not_found", "offset_lost"):
            self.stream_resumes.labels(result)

    def count_request(self, route: str, child: str, outcome: str, seconds: float) -> None:
        """On every request: the labelled series are looked up once and kept."""
        key = (route, child, outcome)
        series = self._request_series.get(key)
        if series is None:
            series = (self.requests.labels(route, child, outcome),
                      self.duration.labels(route))
            self._request_series[key] = series
        series[0].inc()
        series[1].observe(seconds)

    def cache_figures(self) -> dict[str, Any]:
        """For the status's caches: the request series kept, one per (route, child, outcome)
        label set seen (label values are bounded: routes by name, else `other`)."""
        return figures(len(self._request_series), max_entries=self.max_request_series)

    def set_state(self, child: str, state: ChildState) -> None:
        for s in ChildState:
            self.child_state.labels(child, str(s)).set(1 if s is state else 0)

    def set_gpu_devices(self, cards: Iterable[tuple[str, int, int, int]]) -> None:
        """Each card's (address, total, used, free); a card no longer seen loses its series."""
        seen = set()
        for device, total, used, free in cards:
            seen.add(device)
            for kind, value in (("total", total), ("used", used), ("free", free)):
                self.gpu_memory.labels(device, kind).set(value)
        for gone in self._gpu_devices - seen:
            for kind in ("total", "used", "free"):
                self.gpu_memory.remove(gone, kind)
        self._gpu_devices = seen

    def set_model_state(self, child: str, model: str, state: ChildState) -> None:
        for s in ChildState:
            self.model_state.labels(child, model, str(s)).set(1 if s is state else 0)

    def track_mirror(self, lane: str, counts: Mapping[str, int], warm_tokens: Callable[[], int],
                     budget_used_s: Callable[[], float]) -> None:
        """A mirror lane's figures (serving/mirror.py), read at each scrape."""
        sent, warm, budget = self.mirror_lanes[lane]
        for outcome in MIRROR_OUTCOMES:
            sent.labels(outcome).set_function(
                lambda outcome=outcome: counts.get(outcome, 0))  # type: ignore[misc]
        warm.set_function(warm_tokens)
        budget.set_function(budget_used_s)

    def track_streams(self, streams: StreamSessions) -> None:
        """The resumable streams' gauges, read from the store at each scrape."""
        self.stream_sessions.labels("live").set_function(lambda: streams.live)
        self.stream_sessions.labels("finished").set_function(lambda: streams.finished_count)
        self.stream_session_bytes.set_function(lambda: streams.held_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
