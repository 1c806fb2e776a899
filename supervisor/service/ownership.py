"""The children the daemon owns: written down as they change, and taken over at a start.

The children outlive the daemon by design (upstreams/owned.py: the state file;
upstreams/adopted.py: recognising a process). This module is the daemon's side of it:

- at a start (after a crash, a SIGKILL at systemd's TimeoutStopSec, or an upgrade's handover),
  each process the state file records is checked (`adopted.identify`: pid, start time, boot,
  owner mark; not its command line, which a wrapper script that execs llama-server changes).
  One that is not this config's child (gone, another start time, no owner mark, another
  user's) is never touched. One that is: adopted by its child when the config still has it
  (READY at its first /health, its model and cache kept; a command the config has changed
  since, by the fingerprint recorded, is taken afterwards, as a reload takes it: `changed`),
  else ended (SIGTERM, grace, SIGKILL) before any child starts;
- while it runs, each child's process is written to the state file as it starts and ends (in a
  worker thread, the newest state last);
- at a stop, the children stopped, the file is removed; at an upgrade's handover the new daemon
  writes it from then on (`writing`).

What it did at the start (adopted, ended, left alone, and why) is in the status (`daemon`), the
log, and the incident record (one line per child adopted or ended, decision `adopted` or
`ended`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..config.schema import Config
from ..records.incidents import IncidentLog, child_episode
from ..records.timefmt import rfc3339
from ..upstreams import adopted
from ..upstreams.children import Child
from ..upstreams.owned import ChildRecord, State, StateFile, fingerprint

log = logging.getLogger("spillway")


class Ownership:
    def __init__(self, config_path: str | None) -> None:
        self.file = StateFile(config_path) if config_path else None
        self.incidents: IncidentLog | None = None
        # What the last daemon left (read once, at the start).
        self.previous: State | None = self.file.read() if self.file is not None else None
        # The children the last daemon left lent (an upgrade's new daemon keeps them so).
        self.lent_before: Mapping[str, Mapping[str, Any]] = \
            self.previous.lent if self.previous is not None else {}
        self.children: Mapping[str, Child] = {}
        self.media_marker = ""
        self.writing = True  # False while another daemon owns the file (an upgrade's start)
        # The children whose card is lent, as the file keeps them (the daemon sets it: the
        # fleet's `lent`).
        self.lent: Callable[[], Mapping[str, Mapping[str, Any]]] = dict
        self._dirty = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closing = False  # the writer ends after its current write
        # What the start did, for the status.
        self.adopted: dict[str, int] = {}  # name -> pid
        self.changed: list[str] = []  # adopted, with a command the config has changed since
        self.ended: list[dict[str, Any]] = []
        self.left_alone: list[dict[str, Any]] = []
        self.from_pid: int | None = None  # the daemon whose children were taken over
        self.how: str | None = None  # "upgrade" or "restart"
        self._to_end: list[tuple[ChildRecord, float, str]] = []  # at an upgrade: once it is ours
        self.at: float | None = None

    @property
    def state_id(self) -> str:
        return self.file.id if self.file is not None else ""

    def inherited_marker(self) -> str | None:
        """The media marker the last daemon's children have, when some may be adopted."""
        prev = self.previous
        return prev.media_marker if prev is not None and prev.children else None

    # --- the start ---------------------------------------------------------------------------

    async def take_over(self, config: Config, children: Mapping[str, Child],
                        incidents: IncidentLog, *, router: bool, how: str,
                        adopt: Callable[[str, ChildRecord, bool, str], None]) -> list[str]:
        """Check every recorded process; adopt those the config has a child for (their
        children are then started by `adopt`), end the others. `how`: "upgrade" (the last
        daemon hands over) or "restart" (it ended without stopping its children). At an
        upgrade the processes to end are ended later (`end_deferred`, once the old daemon,
        which may still be answering on them, has exited). The names adopted, in the config's
        order. `adopt`: the fleet's (service/fleet.py), the one owner of the children."""
        self.children = children
        self.incidents = incidents
        prev, self.previous = self.previous, None
        if prev is None or not prev.children:
            return []
        self.from_pid, self.at, self.how = prev.daemon_pid, time.time(), how
        for record in prev.children:
            found = adopted.identify(record)
            if not found.ours:
                self._left_alone(record, found)
                continue
            cfg = config.child(record.name) if record.name in config.order else None
            why_end = ("router mode: its routers start anew" if router else
                       None if cfg is not None else "the config has no such child now")
            if why_end is not None or record.name in self.adopted:
                why = why_end or "a second process for one child"
                self.ended.append({"child": record.name, "pid": record.pid, "why": why})
                self._incident(record, "ended", why, how)
                self._to_end.append((record, cfg.stop_grace_s if cfg else 10.0, why))
                continue
            assert cfg is not None
            changed = fingerprint(cfg) != record.fingerprint
            self.adopted[record.name] = record.pid
            if changed:
                self.changed.append(record.name)
            what = ("upgrade: handed over by" if how == "upgrade" else
                    "left running by") + f" spillway pid {record.daemon_pid}"
            adopt(record.name, record, changed, f"adopting pid {record.pid} ({what})")
            self._incident(record, "adopted", ("its config asks another command now: it is "
                                               "restarted with it, as a reload would"
                                               if changed else "its model and cache kept"), how)
        if how != "upgrade":
            await self.end_deferred()
        if self.adopted or self.ended:
            log.warning("%s: adopted %s; ended %s", "upgrade" if how == "upgrade" else
                        f"spillway pid {prev.daemon_pid} ended without stopping its children",
                        ", ".join(f"{n} (pid {p})" for n, p in self.adopted.items()) or "none",
                        ", ".join(f"{e['child']} (pid {e['pid']})" for e in self.ended)
                        or "none")
        return [name for name in config.order if name in self.adopted]

    async def end_deferred(self) -> None:
        """End the processes no child takes (SIGTERM, grace, SIGKILL), all at once, each only
        if its identity still holds (`adopted.end` checks it again: at an upgrade they were
        checked before the old daemon's drain)."""
        ending, self._to_end = self._to_end, []
        await asyncio.gather(*(adopted.end(record, grace, why) for record, grace, why in ending))

    def _left_alone(self, record: ChildRecord, found: adopted.Identity) -> None:
        if found.gone:
            log.info("[%s] %s (recorded by spillway pid %d): nothing to adopt", record.name,
                     found.why, record.daemon_pid)
            return
        self.left_alone.append({"child": record.name, "pid": record.pid, "why": found.why})
        log.warning("[%s] the state file names pid %d, which is not this Spillway's child (%s):"
                    " left alone", record.name, record.pid, found.why)

    def _incident(self, record: ChildRecord, decision: str, reason: str, how: str) -> None:
        prefix = (f"upgrade from spillway pid {record.daemon_pid}" if how == "upgrade" else
                  f"spillway pid {record.daemon_pid} ended without stopping its children")
        if self.incidents is None:
            return
        self.incidents.write(child_episode(
            record.name, "none", decision, f"{prefix}: {reason}",
            evidence=f"pid {record.pid}, started {rfc3339(record.started)} on port {record.port}",
            episode=f"{how}-{record.daemon_pid}"))

    # --- the state file, kept up to date -----------------------------------------------------

    def watch(self, children: Mapping[str, Child], media_marker: str) -> None:
        """Write the state file each time a child's process starts or ends."""
        self.children = children
        self.media_marker = media_marker
        if self.file is None:
            return
        for child in children.values():
            child.owner_id = self.file.id
            child.process_listeners.append(self._changed)
        self._writer = asyncio.create_task(self._write_loop(), name="state-file")

    def _changed(self, child: Child | None = None) -> None:
        self._dirty.set()

    def take_writing(self) -> None:
        """From now on this daemon writes the file (an upgrade's new daemon, once the old one
        has let go)."""
        self.writing = True
        self._dirty.set()

    def state(self) -> State:
        records = tuple(r for c in self.children.values()
                        if (r := c.process_record()) is not None)
        return State(os.getpid(), self.media_marker, records, self.lent())

    def rewrite(self) -> None:
        """Something the file keeps besides the children changed (a lending): written again."""
        self._changed()

    async def _write_loop(self) -> None:
        assert self.file is not None
        while True:
            await self._dirty.wait()
            if self._closing:
                return  # (after its last write: `close` writes the final word)
            self._dirty.clear()
            if not self.writing:
                continue
            try:
                await asyncio.to_thread(self.file.write, self.state())
            except OSError as e:
                log.error("cannot write the state file %s: %s (after a crash, the children "
                          "it would name cannot be adopted)", self.file.path, e)

    async def close(self, keep: bool = False) -> None:
        """The writer ends; the file is written one last time (with the children left, none
        after a stop: it is then removed), unless `keep` (another daemon writes it now)."""
        if self._writer is not None:
            # Not cancelled: a write in its worker thread would finish after the final one
            # and put the stopped children back in the file. It ends after its write.
            self._closing = True
            self._dirty.set()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        if self.file is None or keep or not self.writing:
            return
        try:
            await asyncio.to_thread(self.file.write, self.state())
        except OSError as e:
            log.error("cannot write the state file %s: %s", self.file.path, e)

    def to_json(self) -> dict[str, Any]:
        return {
            "state_file": str(self.file.path) if self.file is not None else None,
            "adopted": dict(self.adopted),
            "adopted_changed_command": list(self.changed),
            "ended": list(self.ended),
            "left_alone": list(self.left_alone),
            "adopted_from_pid": self.from_pid,
            "adopted_how": self.how,
            "adopted_at": rfc3339(self.at) if self.at is not None else None,
        }
