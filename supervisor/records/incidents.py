"""Incident records: one JSON line per request caught in an episode.

An episode is one failure of a child (one death, one OOM the child survived); an incident is one
request caught in it. A crash that hits 16 requests is one episode and 16 incidents. Fields:

    id, episode, time (RFC 3339), request_id, child, kind, evidence, decision (replayed;
    rerouted: replayed on the small child's smaller model; continued; finished: a stream at its
    token limit when its child died, closed as llama-server would; rejected; passed_on),
    reason, cpu_start_s (0 when the CPU child was already running), status, tokens, latency_s,
    client_connected

The file is rotated by size (`incidents.jsonl`, `.1`, `.2`, ...); the newest records are also
kept in memory for the status.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .caches import figures
from .timefmt import rfc3339

log = logging.getLogger("spillway.incidents")

FIELDS = ("id", "episode", "time", "request_id", "child", "kind", "evidence", "decision",
          "reason", "cpu_start_s", "status", "tokens", "latency_s", "client_connected")


@dataclass(frozen=True)
class Incident:
    id: str
    episode: str
    time: str
    request_id: str
    child: str
    kind: str
    evidence: str
    decision: str  # replayed | rerouted (to a smaller model) | rejected | passed_on | continued
    # | finished (closed at its token limit)
    reason: str
    cpu_start_s: float
    status: int
    tokens: int
    latency_s: float
    client_connected: bool
    # Beyond the required fields: what the drill and operators want to see.
    route: str = ""
    replay_child: str | None = None
    attempts: int = 1
    stream: bool = False
    model: str | None = None  # router mode: the model the request named
    known_crash: str = ""  # the child died a known way: what it is and what to change
    tokens_before: int = 0  # decision "continued": the tokens the client had before the death
    continued_after_s: float | None = None  # "continued": the death to the next token
    # The prompt as Spillway counted it (None: a bound, not counted), its media, and how many
    # of its tokens the child that answered last found in its cache (timings.cache_n: a warm
    # CPU child reuses the conversation's prefix).
    prompt_tokens: int | None = None
    media: str = ""
    prompt_reused: int | None = None
    # The forecast admission acted on for the last attempt, and what it took.
    forecast_s: float | None = None
    took_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def new_incident_id() -> str:
    return uuid.uuid4().hex[:16]


def child_episode(child: str, kind: str, decision: str, reason: str, *,
                  evidence: str | None = None, episode: str | None = None,
                  model: str | None = None) -> Incident:
    """An episode of a child's with no request in it (a lending, an adoption, a start ended
    for want of offload): what was done, and why."""
    return Incident(
        id=new_incident_id(), episode=episode or new_incident_id(), time=rfc3339(time.time()),
        request_id="", child=child, kind=kind, evidence=reason if evidence is None else evidence,
        decision=decision, reason=reason, cpu_start_s=0.0, status=0, tokens=0, latency_s=0.0,
        client_connected=False, model=model)


def default_path() -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=) or ~/.local/state/spillway."""
    state = os.environ.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0]) / "incidents.jsonl"
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "spillway" / "incidents.jsonl"


class IncidentLog:
    def __init__(self, path: Path, max_bytes: int, backups: int = 3, keep: int = 100) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self.written = 0
        self.error: str | None = None

    def cache_figures(self) -> dict[str, Any]:
        """For the status's caches: the newest records kept in memory (a fixed count)."""
        return figures(len(self.recent), max_entries=self.recent.maxlen)

    def configure(self, path: Path, max_bytes: int, backups: int) -> None:
        """A reload: where the records go, and when the file rotates."""
        self.path, self.max_bytes, self.backups = path, max_bytes, backups

    def write(self, incident: Incident) -> None:
        record = incident.to_json()
        self.recent.append(record)
        self.written += 1
        log.warning("incident %s episode=%s rid=%s child=%s kind=%s decision=%s status=%s "
                    "reason=%s evidence=%s", incident.id, incident.episode,
                    incident.request_id, incident.child, incident.kind, incident.decision,
                    incident.status, incident.reason, incident.evidence)
        line = json.dumps(record, separators=(",", ":")) + "\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists() and self.path.stat().st_size + len(line) > self.max_bytes:
                self._rotate()
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
            self.error = None
        except OSError as e:  # a full disk must not take requests down with it
            if self.error is None:
                log.error("cannot write incidents to %s: %s", self.path, e)
            self.error = str(e)

    def _rotate(self) -> None:
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.backups > 0:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink()

    def read(self, limit: int) -> list[dict[str, Any]]:
        """The newest `limit` records from the file (and its rotations), oldest first."""
        records: list[dict[str, Any]] = []
        files = [self.path] + [self.path.with_name(f"{self.path.name}.{i}")
                               for i in range(1, self.backups + 1)]
        for path in files:
            if len(records) >= limit:
                break
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except OSError:
                continue
            chunk = []
            for line in lines:
                try:
                    chunk.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line after a crash
            records = chunk + records
        return records[-limit:] if limit > 0 else []
