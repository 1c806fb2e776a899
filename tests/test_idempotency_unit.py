"""The Idempotency-Key store alone, with a fake clock: constant-time eviction, the byte budget,
the key bound, the time to live, and the config key that sets the budget."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.records import idempotency
from supervisor.config.schema import build
from supervisor.records.idempotency import IdempotencyStore, Outcome, StoredResponse

MIB = 1024 * 1024
SCOPE = "global:/v1/chat/completions"


def stored_size(key: str, response: StoredResponse) -> int:
    return idempotency.stored_size(SCOPE, key, response)


def answer(size: int) -> StoredResponse:
    return StoredResponse(200, (("Content-Type", "application/json"),), b"x" * size)


def run_one(store: IdempotencyStore, key: str, now: float, size: int = 10) -> bool:
    """A fresh key: begin, then complete with an answer of `size` bytes."""
    assert store.begin(SCOPE, key, "fp", now).outcome is Outcome.NEW
    return store.complete(SCOPE, key, answer(size))


def is_stored(store: IdempotencyStore, key: str, now: float) -> bool:
    """Whether a retry of `key` would get the stored answer (a miss is released again)."""
    found = store.begin(SCOPE, key, "fp", now)
    if found.outcome is Outcome.NEW:
        store.release(SCOPE, key)
    return found.outcome is Outcome.DONE


class _Touches:
    count = 0


def counting_entries(monkeypatch: pytest.MonkeyPatch) -> type[_Touches]:
    """Make the store's entries count every attribute read: a scan of the store shows up as
    reads proportional to its size."""
    base: Any = idempotency._Entry

    class CountingEntry(base):  # type: ignore[misc]
        def __getattribute__(self, name: str) -> Any:
            _Touches.count += 1
            return super().__getattribute__(name)

    monkeypatch.setattr(idempotency, "_Entry", CountingEntry)
    _Touches.count = 0
    return _Touches


@pytest.mark.parametrize("full", [1_000, 20_000])
def test_a_full_store_does_not_scan_its_entries_on_each_new_key(
        monkeypatch: pytest.MonkeyPatch, full: int) -> None:
    touches = counting_entries(monkeypatch)
    store = IdempotencyStore(max_entries=full, ttl_s=1e9)
    for i in range(full):
        run_one(store, f"fill-{i}", now=float(i))
    assert len(store) == full
    touches.count = 0
    inserts = 200
    for i in range(inserts):
        run_one(store, f"new-{i}", now=float(full + i))
    assert len(store) == full
    # Each new key may touch a handful of entries (the oldest, the one it evicts, its own),
    # never the whole store: the same bound for 1,000 entries as for 20,000.
    assert touches.count <= 10 * inserts, f"{touches.count / inserts:.0f} reads per new key"


def test_when_full_the_oldest_completed_answer_goes_and_running_keys_stay() -> None:
    store = IdempotencyStore(max_entries=4, ttl_s=1e9)
    store.begin(SCOPE, "running-a", "fp", 0.0)
    run_one(store, "done-b", 1.0)
    store.begin(SCOPE, "running-c", "fp", 2.0)
    run_one(store, "done-d", 3.0)
    run_one(store, "done-e", 4.0)  # full: done-b (the oldest completed) goes
    assert len(store) == 4
    assert store.begin(SCOPE, "running-a", "fp", 5.0).outcome is Outcome.IN_PROGRESS
    assert store.begin(SCOPE, "running-c", "fp", 5.0).outcome is Outcome.IN_PROGRESS
    assert is_stored(store, "done-e", 5.0)
    assert not is_stored(store, "done-b", 5.0)


def test_eviction_follows_completion_order_not_creation_order() -> None:
    store = IdempotencyStore(max_entries=3, ttl_s=1e9)
    store.begin(SCOPE, "slow", "fp", 0.0)  # created first, completed last
    run_one(store, "fast", 1.0)
    store.complete(SCOPE, "slow", answer(10))
    run_one(store, "third", 2.0)
    run_one(store, "fourth", 3.0)  # full: "fast" completed first, so it goes
    assert store.begin(SCOPE, "slow", "fp", 4.0).outcome is Outcome.DONE
    assert store.begin(SCOPE, "fast", "fp", 4.0).outcome is Outcome.NEW


def test_a_store_of_running_keys_only_takes_one_more_as_today() -> None:
    store = IdempotencyStore(max_entries=2, ttl_s=1e9)
    for key in ("a", "b", "c"):
        assert store.begin(SCOPE, key, "fp", 0.0).outcome is Outcome.NEW
    assert len(store) == 3  # nothing completed to evict: a running key is never dropped
    for key in ("a", "b", "c"):
        assert store.begin(SCOPE, key, "fp", 1.0).outcome is Outcome.IN_PROGRESS


def test_the_byte_budget_holds_and_the_oldest_completed_answers_go_first() -> None:
    budget = 1 * MIB
    store = IdempotencyStore(max_entries=100_000, ttl_s=1e9, max_response_bytes=8 * MIB,
                             max_total_bytes=budget)
    store.begin(SCOPE, "running", "fp", 0.0)
    size = 100 * 1024
    for i in range(200):
        assert run_one(store, f"k-{i}", now=float(i), size=size)
        assert store.stored_bytes <= budget
    kept = budget // stored_size("k-000", answer(size))
    assert store.completed == kept >= 9
    # The stored answers are the newest ones, and the byte count is theirs.
    stored = [i for i in range(200) if is_stored(store, f"k-{i}", 1000.0)]
    assert stored == list(range(200 - kept, 200))
    assert store.stored_bytes == sum(stored_size(f"k-{i}", answer(size)) for i in stored)
    assert store.begin(SCOPE, "running", "fp", 1000.0).outcome is Outcome.IN_PROGRESS


def test_an_answer_larger_than_the_whole_budget_is_not_stored_and_its_key_is_released() -> None:
    store = IdempotencyStore(max_entries=100, ttl_s=1e9, max_response_bytes=8 * MIB,
                             max_total_bytes=1 * MIB)
    assert run_one(store, "small", 0.0, size=1000)
    assert not run_one(store, "huge", 1.0, size=2 * MIB)  # under max_response_bytes, over all
    assert store.begin(SCOPE, "huge", "fp", 2.0).outcome is Outcome.NEW  # released: runs anew
    assert is_stored(store, "small", 2.0)  # nothing was evicted for an answer never stored
    assert store.stored_bytes == stored_size("small", answer(1000))


def test_a_zero_budget_stores_no_answer_but_still_guards_a_running_key() -> None:
    store = IdempotencyStore(max_total_bytes=0)
    assert store.begin(SCOPE, "k", "fp", 0.0).outcome is Outcome.NEW
    assert store.begin(SCOPE, "k", "fp", 0.0).outcome is Outcome.IN_PROGRESS
    assert not store.complete(SCOPE, "k", StoredResponse(200, (), b""))
    assert len(store) == 0 and store.stored_bytes == 0


def test_release_and_expiry_give_their_bytes_back() -> None:
    store = IdempotencyStore(max_entries=100, ttl_s=10.0, max_total_bytes=1 * MIB)
    run_one(store, "a", 0.0, size=1000)
    run_one(store, "b", 5.0, size=1000)
    store.release(SCOPE, "a")
    assert store.stored_bytes == stored_size("b", answer(1000))
    assert store.begin(SCOPE, "b", "fp", 14.9).outcome is Outcome.DONE
    assert store.begin(SCOPE, "c", "fp", 15.0).outcome is Outcome.NEW  # b (created at 5) expired
    assert store.begin(SCOPE, "b", "fp", 15.0).outcome is Outcome.NEW
    assert store.stored_bytes == 0


def test_the_time_to_live_counts_from_the_first_request_even_when_completed_late() -> None:
    store = IdempotencyStore(max_entries=100, ttl_s=10.0)
    store.begin(SCOPE, "late", "fp", 0.0)
    run_one(store, "early", 1.0)
    store.complete(SCOPE, "late", answer(10))  # completed after "early", created before it
    assert store.begin(SCOPE, "late", "fp", 9.9).outcome is Outcome.DONE
    assert store.begin(SCOPE, "late", "fp", 10.0).outcome is Outcome.NEW
    assert store.begin(SCOPE, "early", "fp", 10.5).outcome is Outcome.DONE
    assert store.begin(SCOPE, "early", "fp", 11.0).outcome is Outcome.NEW


def test_lower_limits_on_reload_take_effect_at_once() -> None:
    store = IdempotencyStore(max_entries=100, ttl_s=1e9, max_total_bytes=1 * MIB)
    for i in range(10):
        run_one(store, f"k-{i}", float(i), size=10_000)
    one = stored_size("k-0", answer(10_000))
    store.configure(max_entries=100, ttl_s=1e9, max_response_bytes=8 * MIB,
                    max_total_bytes=3 * one)
    assert store.completed == 3 and store.stored_bytes == 3 * one
    store.configure(max_entries=2, ttl_s=1e9, max_response_bytes=8 * MIB,
                    max_total_bytes=3 * one)
    assert len(store) == 2
    assert [is_stored(store, f"k-{i}", 20.0) for i in (8, 9)] == [True, True]


def test_max_total_mib_is_a_config_key_with_a_default_of_256() -> None:
    assert build({"model": {"path": "/m.gguf"}}, check_paths=False) \
        .idempotency.max_total_bytes == 256 * MIB
    cfg = build({"model": {"path": "/m.gguf"}, "idempotency": {"max_total_mib": 0.5}},
                check_paths=False)
    assert cfg.idempotency.max_total_bytes == MIB // 2


def test_an_upgrade_hands_the_completed_answers_to_the_next_store() -> None:
    """Issue 40: export's answers, absorbed by another store, are answered from there; a
    running key is not handed over, nor an expired one, and a key the new store holds keeps
    its own."""
    old = IdempotencyStore(max_entries=100, ttl_s=100.0)
    run_one(old, "done", 1.0)
    run_one(old, "old", 0.0)
    old.begin(SCOPE, "running", "fp", 2.0)
    new = IdempotencyStore(max_entries=100, ttl_s=100.0)
    new.begin(SCOPE, "done", "other", 3.0)  # a retry the new daemon saw first: its own
    kept = new.absorb(old.export(), now=100.5)  # "old" (created at 0) has expired
    assert kept == 0 and new.begin(SCOPE, "done", "other", 100.5).outcome is Outcome.IN_PROGRESS
    fresh = IdempotencyStore(max_entries=100, ttl_s=100.0)
    assert fresh.absorb(old.export(), now=50.0) == 2
    found = fresh.begin(SCOPE, "done", "fp", 50.0)
    assert found.outcome is Outcome.DONE and found.response == old.export()[0][4]
    assert fresh.begin(SCOPE, "running", "fp", 50.0).outcome is Outcome.NEW
