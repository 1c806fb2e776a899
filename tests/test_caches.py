"""Every cache Spillway keeps has a bound, in entries or bytes and in time, and reports its size
against it (the status's `caches`, records/caches.py). Each bound here on a fake clock: the
stores take `now`, and time.monotonic is replaced where a part reads it itself."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from conftest import SpillwayFactory
from harness import fake_config

from supervisor.gpu.history import GpuHistory, MemoryPoint
from supervisor.policy.routes import ROUTE_LABEL_COUNT, route_label
from supervisor.proxy import connections
from supervisor.records.idempotency import IdempotencyStore, StoredResponse
from supervisor.records.incidents import Incident, IncidentLog
from supervisor.records.metrics import Metrics
from supervisor.records.stream_sessions import StreamSessions
from supervisor.service import memory_debug
from supervisor.upstreams.launcher import recent_ports_figures


def finished_stream(store: StreamSessions, cid: str, size: int, now: float) -> None:
    s = store.start(cid, f"rid-{cid}", now)
    s.committed = True
    s.append(b"x" * size)
    store.finished(s, now)


def test_finished_streams_are_bounded_in_number_bytes_and_time() -> None:
    store = StreamSessions(max_bytes=1000, ttl_s=300.0, max_total_bytes=10_000, max_finished=5)
    for i in range(8):
        finished_stream(store, f"c{i}", 100, now=float(i))
    figures = store.cache_figures()
    assert figures == {"entries": 5, "bytes": 500, "max_entries": 5, "max_bytes": 10_000,
                       "max_age_s": 300.0}
    assert store.get("c2", now=8.0) is None and store.get("c3", now=8.0) is not None
    for i in range(8, 12):  # 1000 bytes each: the byte budget holds fewer than five
        finished_stream(store, f"c{i}", 1000, now=float(i))
    assert store.cache_figures()["bytes"] <= 10_000
    assert store.cache_figures()["entries"] == 5
    store.prune(now=11.0 + 300.0)
    assert store.cache_figures() == {**figures, "entries": 0, "bytes": 0}


def test_a_conversation_restarted_after_its_stream_finished_keeps_its_new_stream() -> None:
    """The finished session goes whole when the conversation starts again: left in the
    finishing order, its eviction took the new live session with it."""
    store = StreamSessions(max_total_bytes=250)
    finished_stream(store, "conv", 100, now=0.0)
    live = store.start("conv", "rid-2", now=1.0)
    assert store.cache_figures()["entries"] == 0 and store.cache_figures()["bytes"] == 0
    assert store.live == 1
    for i in range(3):  # evictions of older finished sessions
        finished_stream(store, f"other{i}", 100, now=2.0 + i)
    assert store.get("conv", now=5.0) is live
    assert store.cache_figures()["bytes"] == 200
    store.stop("other2", now=6.0)
    assert store.cache_figures() == {"entries": 1, "bytes": 100, "max_entries": 4096,
                                     "max_bytes": 250, "max_age_s": 300.0}


def test_a_reload_lowers_the_finished_streams_bound_at_once() -> None:
    store = StreamSessions(max_finished=10)
    for i in range(6):
        finished_stream(store, f"c{i}", 10, now=float(i))
    store.configure(max_bytes=1000, ttl_s=300.0, max_total_bytes=10_000, max_finished=2)
    assert store.cache_figures()["entries"] == 2


def test_the_idempotency_store_reports_its_keys_and_bytes_against_its_bounds() -> None:
    store = IdempotencyStore(max_entries=3, ttl_s=60.0, max_total_bytes=1_000_000)
    for i in range(5):
        store.begin("s", f"k{i}", "fp", now=float(i))
        store.complete("s", f"k{i}", StoredResponse(200, (), b"x" * 100))
    figures = store.cache_figures()
    assert figures["entries"] == 3 and figures["max_entries"] == 3
    assert figures["bytes"] == store.stored_bytes > 300
    assert figures["max_bytes"] == 1_000_000 and figures["max_age_s"] == 60.0
    store.begin("s", "late", "fp", now=4.0 + 60.0)  # the others expired
    assert store.cache_figures()["entries"] == 1 and store.cache_figures()["bytes"] == 0


def test_recent_incidents_are_a_fixed_count(tmp_path: Path) -> None:
    log = IncidentLog(tmp_path / "incidents.jsonl", 1 << 20, keep=3)
    for i in range(5):
        log.write(Incident(id=str(i), episode="e", time="t", request_id="r", child="gpu",
                           kind="cuda_error", evidence="", decision="replayed", reason="",
                           cpu_start_s=0.0, status=200, tokens=0, latency_s=0.0,
                           client_connected=True))
    assert log.cache_figures() == {"entries": 3, "bytes": None, "max_entries": 3,
                                   "max_bytes": None, "max_age_s": None}


def test_the_gpu_chart_is_bounded_in_points_and_age() -> None:
    chart = GpuHistory(span_s=10.0, max_points=5)
    for t in range(100):
        chart.add(MemoryPoint(float(t), float(t), 100, 50, 50))
        assert len(chart) <= chart.max_points == 6
    assert all(p.monotonic >= 99 - 10 for p in chart.since(0.0))


def test_request_series_are_bounded_by_routes_children_and_outcomes() -> None:
    metrics = Metrics(("gpu", "cpu"))
    paths = [f"/random/{i}" for i in range(500)] + ["/v1/chat/completions", "/health",
                                                     "/v1/models/x", "/slots?fail"]
    for path in paths:
        for child in ("gpu", "cpu", "none"):
            for outcome in ("success", "client_error", "rejected", "failed", "client_closed"):
                metrics.count_request(route_label(path), child, outcome, 0.01)
    figures = metrics.cache_figures()
    assert figures["max_entries"] == ROUTE_LABEL_COUNT * 3 * 5
    assert figures["entries"] == 4 * 3 * 5  # other, chat, health, /v1/models


def test_idle_upstream_connections_go_once_idle_past_keepalive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(connections.time, "monotonic", lambda: clock[0])

    class Conn:
        def __init__(self) -> None:
            self.history = connections._History()
            self.closed = False

        def close(self) -> None:
            self.closed = True

    idle = connections._Idle(keepalive_s=4.0)
    old = [Conn(), Conn()]
    for c in old:
        idle.put(c)  # type: ignore[arg-type]
    clock[0] += 5.0
    new = Conn()
    idle.put(new)  # type: ignore[arg-type]
    assert idle.conns == [new] and all(c.closed for c in old)
    client = connections.UpstreamClient(keepalive_s=4.0)
    client._idle[("127.0.0.1", 1)] = idle
    assert client.cache_figures() == {"entries": 1, "bytes": None, "max_entries": None,
                                      "max_bytes": None, "max_age_s": 4.0}


def test_recent_ports_are_a_fixed_count() -> None:
    figures = recent_ports_figures()
    assert figures["max_entries"] == 32 and figures["entries"] <= 32


def test_the_memory_debug_switch_reports_the_types_that_grew() -> None:
    assert memory_debug.grown(Counter({"dict": 10, "Task": 7, "list": 1}),
                              Counter({"dict": 4, "Task": 7, "list": 3})) == {"dict": 6}


def test_the_memory_debug_route_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory_debug.ENV, raising=False)
    assert memory_debug.routes_from_env() == {}
    monkeypatch.setenv(memory_debug.ENV, "1")
    assert list(memory_debug.routes_from_env()) == [("GET", memory_debug.PATH)]
    report = memory_debug.MemoryDebug(trace=False).report()
    assert report["gc_objects"] > 0 and report["grown_types"] == {}


CACHES = {"stream_sessions", "idempotency", "incidents_recent", "timeline", "gpu_samples",
          "gpu_chart", "metrics_request_series", "systemd_pending", "log_pending",
          "recent_ports", "child_output_gpu", "child_output_cpu",
          "upstream_idle_connections", "held_bodies", "mirror_queue", "mirror_warm",
          "rewarm_queue", "rewarm_warm"}


def test_the_status_lists_every_cache_with_a_bound_and_the_debug_route_counts_objects(
        spillway: SpillwayFactory, fake_server: Path, tiny_model: Path) -> None:
    s = spillway(fake_config(fake_server, tiny_model, streams={"max_finished": 7}),
                 env={memory_debug.ENV: "1"})
    code, _ = s.post("/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                     headers={"Idempotency-Key": "k1"})
    assert code == 200
    status = s.status()
    caches = status["caches"]
    assert set(caches) == CACHES
    for name, c in caches.items():
        assert set(c) == {"entries", "bytes", "max_entries", "max_bytes", "max_age_s"}, name
        assert c["max_entries"] or c["max_bytes"] or c["max_age_s"], name
        assert c["max_entries"] is None or c["entries"] <= c["max_entries"], name
    assert caches["idempotency"]["entries"] == 1 and caches["idempotency"]["bytes"] > 0
    assert caches["stream_sessions"]["max_entries"] == 7
    assert isinstance(status["process"]["asyncio_tasks"], int)
    assert status["process"]["asyncio_tasks"] > 0
    code, memory = s.get("/spillway/debug/memory")
    assert code == 200 and memory["gc_objects"] > 0


def test_a_finished_stream_is_freed_as_the_store_drops_it_without_waiting_for_the_gc() -> None:
    """A session's `stop` held the producer's task, whose result (the response) holds the
    session: a cycle, so each expired stream (its buffer, its request) waited for the oldest
    generation's collection, and RSS grew for minutes after the store was full (issue 43)."""
    import gc
    import weakref

    class Producer:  # a task: its result refers back to the session
        def __init__(self) -> None:
            self.result: object = None

        def cancel(self) -> None:
            pass

    store = StreamSessions(ttl_s=1.0)
    s = store.start("conv", "rid", now=0.0)
    producer = Producer()
    producer.result = s
    s.stop = producer.cancel
    s.committed = True
    s.append(b"x" * 1000)
    store.finished(s, now=0.0)
    assert s.stop is None
    gone = weakref.ref(s)
    del s, producer
    gc.disable()
    try:
        store.prune(now=2.0)
        assert gone() is None
    finally:
        gc.enable()
