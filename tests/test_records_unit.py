"""Idempotency store, incident log rotation, and the speed estimates."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.records.idempotency import (
    IdempotencyStore, Outcome, StoredResponse, fingerprint, scope_of,
)
from supervisor.records.incidents import FIELDS, Incident, IncidentLog
from supervisor.policy import estimate

ANSWER = StoredResponse(200, (("Content-Type", "application/json"),), b'{"ok": true}')


def test_keys_run_once_then_answer_from_the_store() -> None:
    store = IdempotencyStore()
    fp = fingerprint("POST", "/v1/chat/completions", b"{}")
    assert store.begin("s", "k", fp, now=0).outcome is Outcome.NEW
    assert store.begin("s", "k", fp, now=1).outcome is Outcome.IN_PROGRESS
    assert store.begin("s", "k", fingerprint("POST", "/x", b"{}"), now=1).outcome is \
        Outcome.MISMATCH
    assert store.complete("s", "k", ANSWER)
    done = store.begin("s", "k", fp, now=2)
    assert done.outcome is Outcome.DONE and done.response == ANSWER
    # another scope (another API key or route) never sees it
    assert store.begin("other", "k", fp, now=2).outcome is Outcome.NEW


def test_released_keys_run_anew_and_old_ones_expire() -> None:
    store = IdempotencyStore(ttl_s=10)
    fp = fingerprint("POST", "/p", b"")
    store.begin("s", "k", fp, now=0)
    store.release("s", "k")
    assert store.begin("s", "k", fp, now=1).outcome is Outcome.NEW
    store.complete("s", "k", ANSWER)
    assert store.begin("s", "k", fp, now=5).outcome is Outcome.DONE
    assert store.begin("s", "k", fp, now=12).outcome is Outcome.NEW


def test_the_store_is_bounded_and_never_drops_a_running_key() -> None:
    store = IdempotencyStore(max_entries=3)
    store.begin("s", "running", "fp", now=0)
    for i in range(10):
        store.begin("s", f"k{i}", "fp", now=1 + i)
        store.complete("s", f"k{i}", ANSWER)
    assert len(store) <= 3
    assert store.begin("s", "running", "fp", now=20).outcome is Outcome.IN_PROGRESS


def test_a_response_too_large_to_store_releases_its_key() -> None:
    store = IdempotencyStore(max_response_bytes=4)
    store.begin("s", "k", "fp", now=0)
    assert not store.complete("s", "k", ANSWER)
    assert store.begin("s", "k", "fp", now=1).outcome is Outcome.NEW


def test_scopes_differ_by_api_key_and_route_and_never_hold_the_key() -> None:
    a, b = scope_of("key-a", "/v1/chat/completions"), scope_of("key-b", "/v1/chat/completions")
    assert a != b and "key-a" not in a
    assert scope_of(None, "/completion").startswith("global:")


def incident(i: int) -> Incident:
    return Incident(id=f"i{i}", episode="gpu-1", time="2026-11-30T00:00:00.000Z",
                    request_id=f"r{i}", child="gpu", kind="runtime_oom", evidence="x" * 100,
                    decision="replayed", reason="replay-safe", cpu_start_s=0.0, status=200,
                    tokens=3, latency_s=0.5, client_connected=True)


def test_the_incident_log_rotates_by_size_and_reads_back_newest_last(tmp_path: Path) -> None:
    log = IncidentLog(tmp_path / "incidents.jsonl", max_bytes=2000, backups=2)
    for i in range(20):
        log.write(incident(i))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["incidents.jsonl", "incidents.jsonl.1", "incidents.jsonl.2"]
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    records = log.read(5)
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(15, 20)]
    line = json.loads((tmp_path / "incidents.jsonl").read_text().splitlines()[0])
    assert set(FIELDS) <= set(line)


def test_an_unwritable_incident_path_is_reported_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = IncidentLog(blocker / "sub" / "incidents.jsonl", max_bytes=1000)
    log.write(incident(1))
    assert log.error is not None and len(log.recent) == 1


def test_speed_estimates_come_from_the_childs_own_timings() -> None:
    t = estimate.Throughput()
    assert estimate.expected_seconds(t, 100, 100) is None
    t = estimate.observe(t, {"prompt_n": 100, "prompt_ms": 1000, "predicted_n": 50,
                             "predicted_ms": 1000})
    assert estimate.expected_seconds(t, 200, 100) == 2.0 + 2.0
    t2 = estimate.observe(t, {"prompt_n": 1, "prompt_ms": 500, "predicted_n": 1,
                              "predicted_ms": 500})  # too small to say anything
    assert t2.prompt_tps == t.prompt_tps and t2.gen_tps == t.gen_tps
    assert estimate.requested_tokens({"max_tokens": 7}) == 7
    assert estimate.requested_tokens({}) == estimate.DEFAULT_MAX_TOKENS
