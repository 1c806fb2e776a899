"""The one owner of the set of children: the only thing that commands them.

Every start, restart, drain and stop of a child, its adoption and a reload's new command, is
posted to the fleet's inbox and taken by its one task, in the order posted (as each child's
engine takes its own commands: upstreams/engine.py). So no two parts of Spillway command the
children at once, and a command posted from inside a child's state change (a listener: the
small tier making way for the GPU child, the pool starting an on-demand child) is taken on a
later turn of the loop, after that change, never inside it. A command that takes time (a stop
waits for the process to end; a new command for the rollout to settle) runs beside the next
ones: its caller awaits the future `post` gives back.

The fleet's own state is what spans the children, written only here:
- `paused`: the roles the operator paused (`spillway gpu pause`: the GPU lent to another
  program) or an upgrade keeps stopped until its handover is done. The resources and the
  pools read the same set (nothing is sent to, or started on, a paused child).
- `lent`: why a paused GPU child's card is lent to other programs, and since when: by the
  operator (`spillway gpu pause`), when idle (gpu.idle_release_s: then the next request
  for the model `wake`s it, and the CPU child answers while it starts), or to another program
  that took the card's memory (gpu.yield_to_other_processes: it is `taken_back` once that
  program is done).
- the holds on a child's start: why a start that is due must wait, asked by the child's
  lifecycle as its back-off ends (`Child.hold`, which the fleet sets once and for all). Several
  parts may hold one child, each by its own name: the on-demand small child on the card
  (service/small_tier.py), an upgrade's handover (service/daemon.py).

In router mode the children are the routers; the models' instances on them are their models'
own (router/models.py), each with its engine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config.schema import ChildConfig
from ..policy import rollout
from ..upstreams.children import Child
from ..upstreams.owned import ChildRecord

log = logging.getLogger("spillway.fleet")

T = TypeVar("T")
Hold = Callable[[], "str | None"]  # why the start must wait now, or None

IDLE = "idle"  # lent when idle (gpu.idle_release_s): a request wakes it
OPERATOR = "operator"  # lent by hand (spillway gpu pause): `spillway gpu resume` brings it back
YIELD = "yield"  # given way to another program (gpu.yield_to_other_processes): back once it is
# done (service/lending.py)
LENT_WHYS = (IDLE, OPERATOR, YIELD)


@dataclass(frozen=True)
class Lent:
    """Why a paused child's card is lent, since when, and the CPU child's answers counted then
    (those since are the ones it answered meanwhile)."""

    why: str  # IDLE | OPERATOR | YIELD
    reason: str  # in words, for the log and the status
    since: float  # wall clock
    since_monotonic: float
    answers_then: int = 0
    to_whom: str = ""  # YIELD: the program given way to, as the driver names it ("" unknown)
    pid: int | None = None  # YIELD: its pid, where the driver lists it

    def to_json(self) -> dict[str, Any]:
        """As the state file keeps it, for an upgrade's new daemon (`carried`)."""
        return {"why": self.why, "reason": self.reason, "since": self.since,
                "to_whom": self.to_whom, "pid": self.pid}

    @classmethod
    def carried(cls, raw: Mapping[str, Any]) -> Lent:
        """A lending the last daemon left (its `to_json`), in this process's clock; its CPU
        child's answers counted from now. ValueError when it is not one."""
        why, since, pid = raw.get("why"), raw.get("since"), raw.get("pid")
        if why not in LENT_WHYS or not isinstance(since, int | float) or \
                not (pid is None or isinstance(pid, int)):
            raise ValueError(f"not a lending: {dict(raw)!r}")
        return cls(str(why), str(raw.get("reason") or ""), float(since),
                   time.monotonic() - max(0.0, time.time() - float(since)), 0,
                   str(raw.get("to_whom") or ""), pid)


class Fleet:
    def __init__(self, children: Mapping[str, Child], paused: set[str]) -> None:
        self.children = children
        self.paused = paused  # shared with the resources and the pools, written only here
        self.lent: dict[str, Lent] = {}  # the paused children whose card is lent, and why
        self.on_lent: Callable[[], None] = lambda: None  # told when `lent` changes
        self._holds: dict[str, dict[str, Hold]] = {name: {} for name in children}
        self._inbox: deque[tuple[str, Callable[[], Any], asyncio.Future[Any]]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[Any]] = set()  # the long commands, held until done
        for name, child in children.items():
            child.hold = self._hold_of(name)

    # --- the holds and the paused roles: the fleet's own state, at once -----------------------

    def _hold_of(self, name: str) -> Hold:
        return lambda: self.held(name)

    def held(self, name: str) -> str | None:
        """Why `name`'s start must wait now (the first hold that says so), or None."""
        for why in list(self._holds[name].values()):
            reason = why()
            if reason is not None:
                return reason
        return None

    def hold(self, name: str, owner: str, why: Hold) -> None:
        """`owner` holds `name`'s starts while `why` says a reason (replacing its last hold)."""
        self._holds[name][owner] = why

    def unhold(self, name: str, owner: str) -> None:
        self._holds[name].pop(owner, None)

    def keep_stopped(self, names: Iterable[str]) -> None:
        """`names` paused without a command: they are stopped, and stay so until let go."""
        self.paused.update(names)

    def let_go(self, names: Iterable[str]) -> None:
        """`names` no longer paused (nothing started here: their owner starts them)."""
        self.paused.difference_update(names)

    # --- commands: posted, taken in order by the fleet's one task ------------------------------

    def start(self, name: str) -> None:
        """Start `name` and keep it running; not while it is paused (checked as it is taken)."""
        def start() -> None:
            if name not in self.paused:
                self.children[name].start()
        self.post(f"start {name}", start)

    def restart(self, name: str, reason: str, unpause: bool = False) -> None:
        """Stop `name`'s process now and start it again (from BACKOFF or FATAL: at once);
        `unpause`: an operator's restart of a paused child brings it back."""
        if unpause:
            self.paused.discard(name)
            self._unlend(name)
        self.post(f"restart {name}", lambda: self.children[name].restart(reason))

    def drain(self, name: str, reason: str, then_stop: bool = False) -> None:
        """No new work for `name`; its requests finish; then it restarts, or stays stopped."""
        self.post(f"drain {name}",
                  lambda: self.children[name].drain(reason, then_stop=then_stop))

    def stop(self, name: str, reason: str, grace_s: float | None = None
             ) -> asyncio.Future[None]:
        """Stop `name`'s process; the future is done once it is gone."""
        return self.post_waiting(f"stop {name}",
                                 lambda: self.children[name].stop(reason, grace_s))

    def pause(self, name: str, reason: str, lent: Lent | None = None) -> asyncio.Future[None]:
        """`name` paused (nothing is sent to it or starts it) and stopped: its memory freed;
        `lent`: why its card is lent (else: by the operator)."""
        self.lend(name, lent or Lent(OPERATOR, reason, time.time(), time.monotonic()))
        return self.stop(name, reason)

    def lend(self, name: str, lent: Lent) -> None:
        """`name` paused and its card lent, at once (nothing new is sent to it); its stop is
        its caller's to ask (after its answers in flight had a moment to finish), or a lending
        that changes why (a wake into a card another program filled)."""
        self.paused.add(name)
        self.lent[name] = lent
        self.on_lent()

    def _unlend(self, name: str) -> None:
        if self.lent.pop(name, None) is not None:
            self.on_lent()

    def resume(self, name: str) -> None:
        self.paused.discard(name)
        self._unlend(name)
        self.start(name)

    def wake(self, name: str) -> asyncio.Future[None] | None:
        """A request for the model: `name`, lent when idle, starts again (done once its start
        is taken: its state is STARTING then); None when it was not lent when idle (lent by
        the operator, it stays so)."""
        lent = self.lent.get(name)
        if lent is None or lent.why != IDLE:
            return None
        log.info("[%s] woken by a request after %.0f s lent when idle", name,
                 time.monotonic() - lent.since_monotonic)
        return self.take_back(name)

    def take_back(self, name: str) -> asyncio.Future[None]:
        """`name`'s lending over: no longer paused, and started (done once its start is
        taken)."""
        self._unlend(name)
        self.paused.discard(name)
        return self.post(f"start {name}", self.children[name].start)

    def end_stalled(self, name: str, evidence: str) -> None:
        """`name` stalled with work in flight (serving/watchdog.py): its process ended now."""
        self.post(f"end {name}, stalled", lambda: self.children[name].end_stalled(evidence))

    def adopt(self, name: str, record: ChildRecord, changed: bool, why: str) -> None:
        """`name`'s next process is the running one another Spillway started."""
        self.post(f"adopt {name}", lambda: self.children[name].adopt(record, changed, why))

    def take_command(self, name: str, cfg: ChildConfig) -> asyncio.Future[rollout.Outcome]:
        """A reload's new command for `name`, taken as its state allows; done once settled."""
        return self.post_waiting(f"new command for {name}",
                                 lambda: self.children[name].take_command(cfg))

    async def release(self, names: Iterable[str]) -> None:
        """`names` let go of without a signal (an upgrade's handover: the next daemon has
        adopted their processes, which run on)."""
        letting = list(names)
        await asyncio.gather(*(self._post(f"let go of {n}", self.children[n].release, told=False)
                               for n in letting), return_exceptions=True)

    async def close(self, grace_s: float | None,
                    names: Iterable[str] | None = None) -> dict[str, BaseException | None]:
        """Every child (or `names`) stopped for good at once (daemon shutdown): what each
        closing raised, if it did."""
        closing = [n for n in self.children if names is None or n in set(names)]
        ended = await asyncio.gather(*(self._post(f"close {n}", functools.partial(
            self.children[n].close, grace_s), told=False) for n in closing),
            return_exceptions=True)
        return {n: e if isinstance(e, BaseException) else None
                for n, e in zip(closing, ended, strict=True)}

    def post(self, what: str, act: Callable[[], None]) -> asyncio.Future[None]:
        """`act` taken by the fleet's task after what was posted before it."""
        return self._post(what, act)

    def post_waiting(self, what: str, act: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        """`act` taken in order, as `post`; the future is done with what it awaited, once it
        is (the next commands are taken meanwhile)."""
        return self._post(what, act)

    def _post(self, what: str, act: Callable[[], Any], told: bool = True) -> asyncio.Future[Any]:
        """`told`: a failure is logged here (most callers do not await the future); close and
        release hand theirs to their caller, which says them once."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if told:
            future.add_done_callback(functools.partial(_said, what))
        self._inbox.append((what, act, future))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._take())
        return future

    async def _take(self) -> None:
        while self._inbox:
            what, act, future = self._inbox.popleft()
            try:
                done = act()
            except Exception as e:  # one command's failure is its caller's, not the fleet's
                if not future.done():
                    future.set_exception(e)
                continue
            if isinstance(done, Awaitable):
                task = asyncio.ensure_future(done)
                self._running.add(task)
                task.add_done_callback(self._running.discard)
                task.add_done_callback(functools.partial(_settle, future))
            elif not future.done():
                future.set_result(done)
            await asyncio.sleep(0)  # (each command on its own turn: the state changes it caused
            # are heard before the next is taken)


def _settle(future: asyncio.Future[Any], task: asyncio.Future[Any]) -> None:
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        future.set_result(task.result())


def _said(what: str, future: asyncio.Future[Any]) -> None:
    """A command's failure is logged, not lost: most callers post and go on."""
    if not future.cancelled() and future.exception() is not None:
        log.error("%s failed: %r", what, future.exception())
