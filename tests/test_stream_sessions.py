"""The resumable streams' store (stream_sessions.py): llama-server's rules for its replay
buffer, and Spillway's byte budget, on a fake clock (`now` is passed in)."""

from __future__ import annotations

import asyncio

import pytest

from supervisor.records.stream_sessions import Read, StreamSessions


def test_a_session_holds_what_was_sent_and_reads_from_any_offset() -> None:
    store = StreamSessions()
    s = store.start("conv", "rid-1", now=100.0)
    s.append(b"data: a\n\n")
    s.append(b"data: b\n\n")
    assert s.read_from(0) == (Read.OK, b"data: a\n\ndata: b\n\n")
    assert s.read_from(9) == (Read.OK, b"data: b\n\n")
    assert s.read_from(18) == (Read.OK, b"")
    assert s.total_bytes == 18 and not s.done
    assert s.describe() == {"conversation_id": "conv", "is_done": False, "total_bytes": 18,
                            "started_at": 100, "completed_at": 0}


def test_the_cap_drops_the_oldest_bytes_and_an_offset_below_them_is_lost() -> None:
    store = StreamSessions(max_bytes=10)
    s = store.start("conv", "rid", now=0.0)
    s.append(b"0123456")
    s.append(b"789abc")  # 13 bytes sent: the first 3 go
    assert s.dropped == 3 and s.total_bytes == 13
    assert s.read_from(2) == (Read.OFFSET_LOST, b"")
    assert s.read_from(3) == (Read.OK, b"3456789abc")
    s.append(b"x" * 25)  # one write larger than the cap keeps its own last 10 bytes
    assert s.total_bytes == 38 and s.dropped == 28
    assert s.read_from(28) == (Read.OK, b"x" * 10)


def test_a_new_stream_of_the_conversation_stops_the_old_one() -> None:
    store = StreamSessions()
    stopped: list[str] = []
    old = store.start("conv", "rid-1", now=0.0)
    old.stop = lambda: stopped.append("old")
    new = store.start("conv", "rid-2", now=1.0)
    assert stopped == ["old"] and old.cancelled and old.done
    assert store.get("conv", now=1.0) is new
    assert not old.append(b"late")  # a stopped session takes nothing more
    # Its producer ending later does not touch the new one.
    store.finished(old, now=2.0)
    assert store.get("conv", now=2.0) is new and not new.done


def test_a_finished_session_is_kept_for_its_ttl_from_its_end() -> None:
    store = StreamSessions(ttl_s=300.0)
    s = store.start("conv", "rid", now=0.0)
    s.committed = True
    s.append(b"data: x\n\n")
    store.finished(s, now=50.0)
    assert s.done and s.completed_at == 50.0
    assert store.get("conv", now=349.0) is s
    assert store.get("conv", now=350.0) is None
    assert len(store) == 0


def test_a_stream_that_never_started_is_forgotten_when_its_request_ends() -> None:
    """A refused or failed request (no event stream was started) leaves nothing to find, as
    llama-server evicts a session whose request failed before streaming."""
    store = StreamSessions()
    s = store.start("conv", "rid", now=0.0)
    store.finished(s, now=1.0)
    assert store.get("conv", now=1.0) is None and s.done


def test_stop_stops_the_producer_and_forgets_the_session_idempotently() -> None:
    store = StreamSessions()
    stopped: list[bool] = []
    s = store.start("conv", "rid", now=0.0)
    s.stop = lambda: stopped.append(True)
    assert store.stop("conv", now=1.0)
    assert stopped == [True] and s.cancelled and s.done
    assert not store.stop("conv", now=1.0)
    assert store.get("conv", now=1.0) is None
    # A finished session is forgotten without stopping anything more.
    done = store.start("other", "rid", now=0.0)
    done.committed = True
    store.finished(done, now=1.0)
    done.stop = lambda: stopped.append(True)
    assert store.stop("other", now=2.0) and stopped == [True]


def test_lookup_answers_only_for_the_ids_named_and_their_model_variants() -> None:
    store = StreamSessions()
    for cid in ("a", "a::org/model", "ab", "b"):
        store.start(cid, "rid", now=0.0)
    assert [s.conversation_id for s in store.lookup(["a"], now=0.0)] == ["a", "a::org/model"]
    assert store.lookup([], now=0.0) == []
    assert store.lookup(["zzz"], now=0.0) == []


def test_finished_sessions_together_stay_under_the_byte_budget_oldest_first() -> None:
    store = StreamSessions(max_bytes=100, max_total_bytes=150)
    sessions = []
    for i in range(3):
        s = store.start(f"c{i}", "rid", now=float(i))
        s.committed = True
        s.append(b"x" * 60)
        store.finished(s, now=float(i))
        sessions.append(s)
    # 3 x 60 > 150: the oldest went.
    assert store.get("c0", now=3.0) is None
    assert store.get("c1", now=3.0) is sessions[1] and store.get("c2", now=3.0) is sessions[2]
    # A live one is never evicted for the budget.
    live = store.start("live", "rid", now=3.0)
    live.append(b"y" * 100)
    store.configure(max_bytes=100, ttl_s=300.0, max_total_bytes=0)
    assert store.finished_count == 0 and store.get("live", now=3.0) is live
    assert store.live == 1 and store.held_bytes == 100


def test_stop_all_ends_every_producer() -> None:
    store = StreamSessions()
    stopped: list[str] = []
    for cid in ("a", "b"):
        store.start(cid, "rid", now=0.0).stop = lambda cid=cid: stopped.append(cid)
    store.stop_all(now=1.0)
    assert sorted(stopped) == ["a", "b"] and len(store) == 0


@pytest.mark.asyncio
async def test_a_reader_waits_for_bytes_past_its_offset_and_for_the_end() -> None:
    store = StreamSessions()
    s = store.start("conv", "rid", now=0.0)
    s.committed = True
    first = asyncio.create_task(s.wait_beyond(0))
    done, _ = await asyncio.wait({first}, timeout=0.05)
    assert not done  # nothing past offset 0 yet: it waits
    s.append(b"data: a\n\n")
    await asyncio.wait_for(first, 1.0)  # woken by the bytes
    end = asyncio.create_task(s.wait_beyond(s.total_bytes))
    done, _ = await asyncio.wait({end}, timeout=0.05)
    assert not done
    store.finished(s, now=1.0)
    await asyncio.wait_for(end, 1.0)  # woken by the end
