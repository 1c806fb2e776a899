"""`lifecycle.step`, the one lifecycle of children and model instances, as a table: each row a
Life, the events that reach it, and what they come to (the transitions, the actions, the Life
after), run for a child (lifecycle.CHILD) and a model's instance (lifecycle.MODEL) alike where
the row says "both". Then a property: no sequence of events, in any state, makes `step` take a
transition the table does not allow, or leave the Life inconsistent.

The adapters that carry the actions out are tested on their own fakes (test_child_lifecycle.py,
test_router_upstream.py) and together on one table of deaths (test_crash_loop_both.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.policy import lifecycle as lc
from supervisor.policy.lifecycle import ChildState as S

POLICY = lc.BackoffPolicy(initial_s=1.0, max_s=8.0, quick_failure_s=30.0, max_quick_failures=3,
                          fatal_retry_max_s=60.0)
NOW = 1000.0


def death(generation: int = 1, run_s: float = 100.0, planned: bool = False,
          what: str = "crash: exited with code 1", **more: Any) -> lc.Ended:
    return lc.Ended(generation, planned, what, run_s=run_s, **more)


def run(life: lc.Life, events: list[Any], manner: lc.Manner, *, dt: float = 0.0,
        why_not: str | None = None) -> tuple[lc.Life, list[lc.Action]]:
    """The events in order, the clock `dt` further at each; every action they gave."""
    actions: list[lc.Action] = []
    now = NOW
    for event in events:
        now += dt
        ctx = lc.Context(now=now, policy=POLICY, manner=manner, drain_timeout_s=20.0,
                         jitter=lambda: 0.5, why_not_now=lambda: why_not)
        life, more = lc.step(life, event, ctx)
        actions += more
    return life, actions


def path(actions: list[lc.Action]) -> list[str]:
    return [f"{a.old} -> {a.new}: {a.reason}" for a in actions if isinstance(a, lc.Enter)]


def effects(actions: list[lc.Action]) -> list[lc.Action]:
    return [a for a in actions if not isinstance(a, (lc.Enter, lc.Record))]


# Lives to start from.
STOPPED = lc.Life()
READY_CHILD = lc.Life(state=S.READY, reason="ready", wanted=True, generation=1, running=True)
READY_MODEL = replace(READY_CHILD, wanted=True)
BACKOFF = lc.Life(state=S.BACKOFF, wanted=True, generation=1, next_try_at=NOW + 1.0,
                  loop=lc.CrashLoop(1, 0))
FATAL = lc.Life(state=S.FATAL, wanted=True, generation=3, next_try_at=NOW + 8.0,
                loop=lc.CrashLoop(3, 1))


@dataclass(frozen=True)
class Row:
    name: str
    life: lc.Life
    events: list[Any]
    manners: tuple[lc.Manner, ...]
    path: list[str]
    effects: list[Any] = field(default_factory=list)
    after: dict[str, Any] = field(default_factory=dict)  # Life fields afterwards
    dt: float = 0.0
    why_not: str | None = None


BOTH = (lc.CHILD, lc.MODEL)
CHILD = (lc.CHILD,)
MODEL = (lc.MODEL,)

ROWS = [
    # --- starting ---
    Row("a child's start launches its process", STOPPED, [lc.Start("starting", keep=True)],
        CHILD,
        ["STOPPED -> STARTING: starting"], [lc.Launch(1, "starting")],
        {"generation": 1, "running": True, "wanted": True}),
    Row("a model's start asks for a load; its instance begins when the router says so",
        lc.Life(wanted=True), [lc.Start("loaded on demand"), lc.Began("loading", since=7)],
        MODEL, ["STOPPED -> STARTING: loaded on demand"],
        [lc.Launch(0, "loaded on demand"), lc.Opened(1, 7)],
        {"generation": 1, "running": True}),
    Row("a model's router that is not ready loads nothing", lc.Life(wanted=True,
                                                                    host_up=False),
        [lc.Start("loaded on demand")], MODEL, [], []),
    Row("ready: the time since STARTING", STOPPED, [lc.Start("starting"), lc.Ready(1)], CHILD,
        ["STOPPED -> STARTING: starting", "STARTING -> READY: ready in 0.25 s"],
        [lc.Launch(1, "starting")], {"last_start_s": 0.25}, dt=0.25),
    Row("loaded: the model's word for it", lc.Life(wanted=True),
        [lc.Began("loading"), lc.Ready()], MODEL,
        ["STOPPED -> STARTING: loading", "STARTING -> READY: loaded in 0.25 s"],
        [lc.Opened(1, 0)], dt=0.25),
    Row("an older process's answer changes nothing", replace(READY_CHILD, state=S.STARTING,
                                                             generation=2),
        [lc.Ready(1), lc.Unresponsive(1, "late"), death(1)], CHILD, []),
    # --- deaths and the crash loop ---
    Row("a death after a long run backs off the initial wait", READY_CHILD, [death()], CHILD,
        ["READY -> EXITED: crash: exited with code 1",
         "EXITED -> BACKOFF: restart in 1.0 s after crash: exited with code 1"],
        [lc.WakeAt(NOW + 1.0, 1.0)], {"next_try_at": NOW + 1.0, "running": False}),
    Row("a model's death: loaded again after the wait", READY_MODEL, [death()], MODEL,
        ["READY -> EXITED: crash: exited with code 1",
         "EXITED -> BACKOFF: loaded again in 1.0 s after crash: exited with code 1"],
        [lc.WakeAt(NOW + 1.0, 1.0)]),
    Row("the back-off's end starts it again", BACKOFF, [lc.Due(NOW + 1.0)], CHILD,
        ["BACKOFF -> STARTING: backoff over"], [lc.Launch(2, "backoff over")],
        {"next_try_at": None, "loop": lc.CrashLoop(1, 0)}),
    Row("a model's back-off's end asks for a load", BACKOFF, [lc.Due(NOW + 1.0)], MODEL,
        ["BACKOFF -> STARTING: backoff over"], [lc.Launch(1, "backoff over")]),
    Row("a stale timer changes nothing", BACKOFF, [lc.Due(NOW + 0.5)], BOTH, []),
    Row("the third quick failure is FATAL, with the crash-loop back-off's wait",
        replace(READY_CHILD, state=S.STARTING, loop=lc.CrashLoop(2, 0)), [death(run_s=0.1)],
        BOTH, ["STARTING -> EXITED: crash: exited with code 1",
               "EXITED -> BACKOFF: crash: exited with code 1",
               "BACKOFF -> FATAL: 3 quick failures in a row; last: crash: exited with code 1; "
               "next try in 8 s"],
        [lc.WakeAt(NOW + 8.0, 8.0)], {"next_try_at": NOW + 8.0}),
    Row("FATAL's next try is counted", FATAL, [lc.Due(NOW + 8.0)], CHILD,
        ["FATAL -> STARTING: try 2 from FATAL (crash-loop back-off)"],
        [lc.Launch(4, "try 2 from FATAL (crash-loop back-off)")],
        {"loop": lc.CrashLoop(2, 2)}),
    Row("a deterministic known crash twice in a row is FATAL at once, served or not",
        replace(READY_CHILD, signatures=("amx_matmul",)),
        [death(served=True, signature="amx_matmul", known_crash="AMX")], CHILD,
        ["READY -> EXITED: crash: exited with code 1",
         "EXITED -> BACKOFF: crash: exited with code 1",
         "BACKOFF -> FATAL: the same crash 2 times in a row; AMX; next try in 8 s"],
        [lc.WakeAt(NOW + 8.0, 8.0)]),
    Row("a command llama-server refused is FATAL at its first end: the same command fails "
        "the same way", replace(READY_CHILD, state=S.STARTING),
        [death(run_s=0.1, refused="llama-server refused -np abc: stoi")], CHILD,
        ["STARTING -> EXITED: crash: exited with code 1",
         "EXITED -> BACKOFF: crash: exited with code 1",
         "BACKOFF -> FATAL: llama-server refused -np abc: stoi; the same command fails the "
         "same way: mend it and reload; next try in 8 s"],
        [lc.WakeAt(NOW + 8.0, 8.0)], {"loop": lc.CrashLoop(1, 0)}),
    Row("a new command that failed its first start: its last good command starts at once, "
        "and the crash loop does not count it",
        replace(READY_CHILD, state=S.STARTING, generation=2, loop=lc.CrashLoop(2, 0)),
        [death(2, run_s=0.1, refused="llama-server refused -np abc: stoi",
               rollback="its new command failed its first start; back to its last good "
                        "command")], CHILD,
        ["STARTING -> EXITED: crash: exited with code 1",
         "EXITED -> BACKOFF: its new command failed its first start; back to its last good "
         "command",
         "BACKOFF -> STARTING: its new command failed its first start; back to its last good "
         "command"],
        [lc.Launch(3, "its new command failed its first start; back to its last good "
                      "command")],
        {"loop": lc.CrashLoop(2, 0), "next_try_at": None, "running": True}),
    Row("a rollback while it was being stopped anyway: it stays stopped",
        replace(READY_CHILD, state=S.STOPPING, wanted=False),
        [death(run_s=0.1, rollback="back to its last good command")], CHILD,
        ["STOPPING -> EXITED: crash: exited with code 1",
         "EXITED -> STOPPED: exited while stopping"], []),
    Row("an end told twice is taken once", READY_MODEL, [death(), death()], MODEL,
        ["READY -> EXITED: crash: exited with code 1",
         "EXITED -> BACKOFF: loaded again in 1.0 s after crash: exited with code 1"],
        [lc.WakeAt(NOW + 1.0, 1.0)]),
    Row("not ready in time, or hung: ended, unplanned, with a note", READY_CHILD,
        [lc.Unresponsive(1, "/health unanswered for 30 s", 1.0)], CHILD, [],
        [lc.Terminate(planned=False, grace_s=1.0, note="/health unanswered for 30 s")]),
    # --- stopping ---
    Row("stop: SIGTERM's way, then STOPPED, and nothing starts it", READY_CHILD,
        [lc.Stop("operator: stop", 0.5), death(planned=True, what="stopped (exited with "
                                                                 "code 0)")], CHILD,
        ["READY -> STOPPING: operator: stop", "STOPPING -> STOPPED: stopped (exited with "
                                              "code 0)"],
        [lc.Terminate(planned=True, grace_s=0.5)], {"wanted": False, "running": False}),
    Row("stop from BACKOFF or FATAL: stopped at once", BACKOFF, [lc.Stop("x")], CHILD,
        ["BACKOFF -> STOPPED: stop asked for"], [], {"next_try_at": None}),
    Row("a death as the stop came: a death, and it stays stopped", READY_CHILD,
        [lc.Stop("x"), death()], CHILD,
        ["READY -> STOPPING: x", "STOPPING -> EXITED: crash: exited with code 1",
         "EXITED -> STOPPED: exited while stopping"], [lc.Terminate(planned=True)]),
    # --- restarting ---
    Row("restart: stopped, then started again", READY_CHILD,
        [lc.Restart("operator"), death(planned=True, what="stopped (exited with code 0)")],
        CHILD, ["READY -> STOPPING: operator",
                "STOPPING -> STOPPED: stopped (exited with code 0)",
                "STOPPED -> STARTING: restart after stop"],
        [lc.Terminate(planned=True), lc.Launch(2, "restart after stop")]),
    Row("a restart cuts the back-off short and keeps the count", BACKOFF,
        [lc.Restart("operator")], CHILD, ["BACKOFF -> STARTING: operator"],
        [lc.Launch(2, "operator")], {"loop": lc.CrashLoop(1, 0)}),
    Row("a restart from FATAL forgets the crash loop", replace(FATAL, signatures=("x",)),
        [lc.Restart("operator")], CHILD, ["FATAL -> STARTING: operator"],
        [lc.Launch(4, "operator")], {"loop": lc.CrashLoop(), "signatures": ()}),
    Row("a restart asked for as it died: no back-off", READY_CHILD,
        [lc.Restart("operator"), death()], CHILD,
        ["READY -> STOPPING: operator", "STOPPING -> EXITED: crash: exited with code 1",
         "EXITED -> BACKOFF: restart in 1.0 s after crash: exited with code 1",
         "BACKOFF -> STARTING: restart after stop"],
        [lc.Terminate(planned=True), lc.Launch(2, "restart after stop")]),
    Row("a child's start from FATAL is at once; a model's waits for its back-off", FATAL,
        [lc.Start("start asked for", keep=True)], CHILD,
        ["FATAL -> STARTING: start asked for"], [lc.Launch(4, "start asked for")]),
    Row("a model in FATAL is not loaded on demand", FATAL, [lc.Start("loaded on demand")],
        MODEL, []),
    Row("a child started while it stops starts once it has stopped",
        replace(READY_CHILD, state=S.STOPPING, wanted=False),
        [lc.Start("start asked for", keep=True),
         death(planned=True, what="stopped (exited with code 0)")], CHILD,
        ["STOPPING -> STOPPED: stopped (exited with code 0)",
         "STOPPED -> STARTING: restart after stop"], [lc.Launch(2, "restart after stop")]),
    Row("a model asked for while it unloads is asked for again on demand",
        replace(READY_MODEL, state=S.STOPPING),
        [lc.Start("loaded on demand"), death(planned=True, what="unloaded")], MODEL,
        ["STOPPING -> STOPPED: unloaded"], []),
    # --- draining ---
    Row("a child's drain: its requests finish, then it starts again", READY_CHILD,
        [lc.Drain("OOM survived"), lc.Idle(),
         death(planned=True, what="stopped (exited with code 0)")], CHILD,
        ["READY -> DRAINING: OOM survived", "DRAINING -> STOPPING: OOM survived",
         "STOPPING -> STOPPED: stopped (exited with code 0)",
         "STOPPED -> STARTING: restart after stop"],
        [lc.WaitIdle(20.0), lc.Terminate(planned=True), lc.Launch(2, "restart after stop")]),
    Row("a model's drain: unloaded, and loaded again on demand", READY_MODEL,
        [lc.Drain("OOM survived"), lc.Idle(), death(planned=True, what="unloaded")], MODEL,
        ["READY -> DRAINING: OOM survived", "DRAINING -> STOPPING: drained: unloading it",
         "STOPPING -> STOPPED: unloaded"], [lc.WaitIdle(20.0), lc.Terminate(planned=True)]),
    Row("a death while draining backs off like any other", READY_CHILD,
        [lc.Drain("OOM survived"), death()], CHILD,
        ["READY -> DRAINING: OOM survived", "DRAINING -> EXITED: crash: exited with code 1",
         "EXITED -> BACKOFF: restart in 1.0 s after crash: exited with code 1"],
        [lc.WaitIdle(20.0), lc.WakeAt(NOW + 1.0, 1.0)], {"then": None}),
    Row("drain is for READY only", replace(READY_CHILD, state=S.STARTING),
        [lc.Drain("too early"), lc.Idle()], BOTH, []),
    Row("a new command drains a READY one", READY_CHILD, [lc.CommandChanged("reload")], CHILD,
        ["READY -> DRAINING: reload"], [lc.WaitIdle(20.0)]),
    Row("a new command restarts a backing-off one", BACKOFF, [lc.CommandChanged("reload")],
        CHILD, ["BACKOFF -> STARTING: reload"], [lc.Launch(2, "reload")]),
    Row("a new command waits for a stopped one's next start", STOPPED,
        [lc.CommandChanged("reload")], CHILD, []),
    # --- a model's router, its loads and unloads ---
    Row("an idle model unloaded to make room", READY_MODEL, [lc.Unload("--models-max")], MODEL,
        ["READY -> STOPPING: --models-max"], [lc.Terminate(planned=True)]),
    Row("a load the router refused: stopped, no failure",
        lc.Life(state=S.STARTING, wanted=True), [lc.LoadRefused("model limit")], MODEL,
        ["STARTING -> STOPPING: the router did not load it: model limit",
         "STOPPING -> STOPPED: the router did not load it: model limit"], [],
        {"loop": lc.CrashLoop()}),
    Row("an unload of nothing loaded", lc.Life(state=S.STOPPING, wanted=True),
        [lc.UnloadRefused()], MODEL, ["STOPPING -> STOPPED: unloaded"]),
    Row("the router's end takes its instances along; no failure of theirs", READY_MODEL,
        [lc.HostChanged(ready=False, serving=False, reason="the gpu router is EXITED")], MODEL,
        ["READY -> STOPPING: the gpu router is EXITED",
         "STOPPING -> STOPPED: the gpu router is EXITED"], [lc.Orphaned(1)],
        {"running": False, "host_up": False, "loop": lc.CrashLoop()}),
    Row("a back-off outlasts its router's absence: tried when the router is back",
        replace(BACKOFF, host_up=False),
        [lc.Due(NOW + 1.0), lc.HostChanged(ready=True, serving=True, reason="back")], MODEL,
        ["BACKOFF -> STARTING: backoff over"], [lc.Launch(1, "backoff over")], dt=1.0),
    Row("a load that would not fit after the back-off waits for demand", BACKOFF,
        [lc.Due(NOW + 1.0)], MODEL,
        ["BACKOFF -> STOPPED: backoff over; not loaded again yet: 900 MiB short"], [],
        why_not="900 MiB short"),
    Row("... and from FATAL waits for the next interval", FATAL, [lc.Due(NOW + 8.0)], MODEL,
        [], [lc.WakeAt(NOW + 16.0, 16.0)], {"state": S.FATAL, "next_try_at": NOW + 16.0},
        why_not="900 MiB short"),
    Row("an operator's restart of a model forgets its crash loop", FATAL,
        [lc.Forgive("operator")], MODEL, ["FATAL -> STOPPED: operator"], [],
        {"loop": lc.CrashLoop(), "next_try_at": None}),
]


@pytest.mark.parametrize("row,manner", [(r, m) for r in ROWS for m in r.manners],
                         ids=[f"{r.name} [{'child' if m is lc.CHILD else 'model'}]"
                              for r in ROWS for m in r.manners])
def test_the_table(row: Row, manner: lc.Manner) -> None:
    life, actions = run(row.life, row.events, manner, dt=row.dt, why_not=row.why_not)
    assert path(actions) == row.path
    assert effects(actions) == row.effects
    for name, value in row.after.items():
        assert getattr(life, name) == value, name
    # Every transition told carries the Life as it entered.
    for action in actions:
        if isinstance(action, lc.Enter):
            assert action.life.state is action.new and action.life.reason == action.reason


def test_an_end_is_recorded_once_with_what_the_lifecycle_made_of_it() -> None:
    end = death(record="the upstream's own record")
    _, actions = run(READY_CHILD, [end, end], lc.CHILD)
    assert [a for a in actions if isinstance(a, lc.Record)] == [lc.Record(end)]


def test_a_listener_told_of_starting_reads_the_generation_before_the_launch() -> None:
    _, actions = run(STOPPED, [lc.Start("starting")], lc.CHILD)
    enter = next(a for a in actions if isinstance(a, lc.Enter))
    assert enter.life.generation == 0  # the daemon counts a restart only when it was one


def test_the_wait_is_said_as_the_death_is_told() -> None:
    _, actions = run(READY_MODEL, [death()], lc.MODEL)
    told = [a.life.next_try_at for a in actions if isinstance(a, lc.Enter)]
    assert told == [NOW + 1.0, NOW + 1.0]  # EXITED, BACKOFF: the status says the wait


# --- any sequence of events ---------------------------------------------------------------------

GENERATIONS = st.integers(min_value=0, max_value=3)
EVENTS = st.one_of(
    st.builds(lc.Start, st.just("start"), st.booleans()),
    st.builds(lc.Restart, st.just("restart")),
    st.builds(lc.Drain, st.just("drain")),
    st.builds(lc.Stop, st.just("stop")),
    st.builds(lc.CommandChanged, st.just("reload")),
    st.builds(lc.Unload, st.just("unload")),
    st.builds(lc.Forgive, st.just("forgive")),
    st.builds(lc.Began, st.just("began")),
    st.builds(lc.Ready, st.one_of(st.none(), GENERATIONS)),
    st.builds(lc.Unresponsive, GENERATIONS, st.just("hung")),
    st.builds(lc.Ended, GENERATIONS, st.booleans(), st.just("crash: x"),
              st.sampled_from([0.1, 100.0]), st.booleans(),
              st.sampled_from([None, "amx_matmul"])),
    st.just(lc.Idle()),
    st.builds(lc.Due, st.sampled_from([NOW + 1.0, NOW + 8.0, NOW + 16.0])),
    st.builds(lc.LoadRefused, st.just("full")),
    st.just(lc.UnloadRefused()),
    st.builds(lc.HostChanged, st.booleans(), st.booleans(), st.just("router")),
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([lc.CHILD, lc.MODEL]), st.lists(EVENTS, max_size=40),
       st.sampled_from([None, "too big"]))
def test_no_sequence_of_events_breaks_the_lifecycle(manner: lc.Manner, events: list[Any],
                                                    why_not: str | None) -> None:
    life = lc.Life(wanted=manner is lc.MODEL)
    for event in events:
        ctx = lc.Context(now=NOW, policy=POLICY, manner=manner, jitter=lambda: 0.5,
                         why_not_now=lambda: why_not)
        old = life
        life, actions = lc.step(life, event, ctx)  # an illegal transition would raise
        assert life.generation >= old.generation
        # A process or instance runs only in the states that have one.
        assert not life.running or life.state in (S.STARTING, S.READY, S.DRAINING,
                                                  S.STOPPING)
        # Only a waiting upstream has a next try, and every waiting one has one.
        assert (life.next_try_at is not None) == (life.state in (S.BACKOFF, S.FATAL))
        # A start after the stop is pending only while something is being stopped.
        assert life.then is None or life.state in (S.DRAINING, S.STOPPING)
        assert sum(isinstance(a, lc.Launch) for a in actions) <= 1



def test_an_unfit_start_is_a_quick_failure_however_long_it_ran() -> None:
    """gpu.require_offload ends a start without its layers on the GPU: a long load, or a
    request served before the verdict, still counts towards FATAL (it would otherwise reload
    the model for ever); the same long run that is not unfit clears the count."""
    two_quick = replace(READY_CHILD, loop=lc.CrashLoop(2, 0))
    unfit, _ = run(two_quick, [death(run_s=100.0, served=True, unfit=True,
                                     what="no_offload: 0 of 31 layers on the GPU")], lc.CHILD)
    assert unfit.state is S.FATAL and unfit.loop.quick_failures == 3
    fit, _ = run(two_quick, [death(run_s=100.0, served=True)], lc.CHILD)
    assert fit.state is S.BACKOFF and fit.loop.quick_failures == 0
