"""A long run of mixed traffic through GPU deaths: is anything lost, and does memory level off?

Spillway in front of real llama-server children on the tiny model (tests/tinymodel.py); the GPU
child behind tests/gpu_fault_injector.py with FAULT_EVERY_S, so it dies of a (captured) CUDA
out-of-memory every S seconds after it became ready, every time it comes back. Several clients
send a mix of requests, each drawn from `MIX`:

- chat: a plain chat completion; chat_stream: a streamed one (its finish and [DONE]), greedy,
  on one of a few prompts, so that its length can be held to the same request's uncut;
- resumable: a stream with X-Conversation-Id whose client leaves after a few events, then
  reads it back whole from GET /v1/stream once it is done;
- leave: a stream whose client leaves after a few events (nothing to read back);
- malformed: a body that is not JSON (a 400 is expected);
- idempotent: a chat completion with an Idempotency-Key, then the same again (the retry must be
  the stored answer, marked Idempotent-Replayed, not a second run);
- models, health, status: GET /v1/models, /health, /spillway/status.

Each request's outcome is classified (`classify`, pure): expected ("ok"; a controlled 503 with
Retry-After is "refused", expected too), "closed" (a stream Spillway closed at its limit, with
the finish llama-server would have sent: counted apart from the answers, since only the events
or llama-server's own count say that finish is the answer's) or LOST, by kind: a bare 5xx (a
500/502/504, or a 503 without Retry-After), a stream that ended without its finish, an error
event, a stream (or a read back) far shorter than the same request uncut ("short": fewer than
`SHORT_BELOW` of its content events, measured once for each prompt before the traffic; a cut
stream's continuation has other text, so its length is near the uncut one's, not equal), an
idempotent retry that ran twice, a read back that did not end whole, a timeout, a broken
connection, an unexpected status.

Every minute it reads the daemon's resident memory, open fds and threads from /proc, its asyncio
task count and caches from /spillway/status, and prints and writes them (the files are rewritten
each minute, so a run still going can be read). At the end: requests and losses by kind, and
the RSS curve. Bounded in time (`--minutes`) and requests (`--max-requests`); each request has
a time limit.

    .venv/bin/python -m bench.soak --minutes N [--gpu-death-every 45] [--clients 4]
                                   [--out bench/results]

Writes OUT/soak.{json,md}. Not part of CI: tests/test_soak_bench.py checks only the pure parts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness import Spillway, injector_script, real_config  # noqa: E402
from tinymodel import write_tiny_model  # noqa: E402

from supervisor.commands import bootstrap  # noqa: E402

# Kind -> weight in the mix.
MIX: dict[str, int] = {"chat": 20, "chat_stream": 25, "resumable": 8, "leave": 8,
                       "malformed": 5, "idempotent": 10, "models": 8, "health": 8,
                       "status": 8}
STREAM_TOKENS = 200
# The streams' prompts: few, so that each one's uncut length is measured once.
STREAM_PROMPTS = tuple(f"Tell me about the number {n}." for n in (7, 42, 365, 1024))
SHORT_BELOW = 0.9  # a stream with fewer content events than this of its uncut answer's is lost
CHAT_TOKENS = 32
LEAVE_AFTER = 5  # events before a leaving client goes
REQUEST_TIMEOUT_S = 120.0  # a stream held across a restart (failover.stream_hold_s) fits
THINK_S = (0.05, 0.4)  # a client's pause between requests


@dataclass
class Observation:
    """What a client saw of one request (of the whole exchange, for resumable and idempotent).
    """

    status: int | None = None  # HTTP status of the (first) answer; None: none came
    retry_after: bool = False  # the answer carried Retry-After
    finished: bool = False  # a finish_reason (or a whole JSON answer) came
    done: bool = False  # the stream's `data: [DONE]`
    error_event: bool = False  # an event with "error" in the stream
    error: str = ""  # the first error event, its first 400 bytes (its reason)
    left: bool = False  # the client left on purpose
    timed_out: bool = False
    broken: str = ""  # a connection error, by name
    retry_status: int | None = None  # idempotent: the retry's status
    replayed: bool | None = None  # idempotent: the retry was marked Idempotent-Replayed
    same_body: bool | None = None  # idempotent: the retry's body equals the first answer's
    read_back: Observation | None = None  # resumable: what GET /v1/stream gave
    texts: int = 0  # events with generated content (the answer's tokens, as a client counts)
    closed: bool = False  # the finish was Spillway's (`spillway_closed`: at its limit)
    continued: bool = False  # the stream went on from the other child (`spillway_continuation`)


LOSSES = ("bare_5xx", "no_finish", "error_event", "short", "ran_twice", "read_back_lost",
          "timeout", "connection", "unexpected_status")


def _status_outcome(obs: Observation, expected: Sequence[int] = (200,)) -> str | None:
    """The verdict from the status alone, or None when the body decides."""
    if obs.timed_out:
        return "lost:timeout"
    if obs.status is None:
        return f"lost:{'connection' if obs.broken else 'timeout'}"
    if obs.status == 503 and obs.retry_after:
        return "refused"
    if obs.status >= 500:
        return "lost:bare_5xx"
    if obs.status not in expected:
        return "lost:unexpected_status"
    return None


def _stream_outcome(obs: Observation, uncut: int | None = None) -> str:
    """`uncut`: the same request's content events, uncut (None: not known)."""
    if obs.error_event:
        return "lost:error_event"
    if obs.broken and not obs.left:
        return "lost:connection"
    if obs.timed_out:
        return "lost:timeout"
    if obs.left:
        return "ok"
    if not (obs.finished and obs.done):
        return "lost:no_finish"
    if uncut is not None and obs.texts < SHORT_BELOW * uncut:
        return "lost:short"  # whatever its finish says
    return "closed" if obs.closed else "ok"


def _resumable_outcome(obs: Observation, uncut: int | None) -> str:
    first = _stream_outcome(obs)
    if first != "ok":
        return first
    if obs.read_back is None:
        return "lost:read_back_lost"
    back = _status_outcome(obs.read_back) or _stream_outcome(obs.read_back, uncut)
    return "lost:read_back_lost" if back == "lost:no_finish" else back


def _idempotent_outcome(obs: Observation) -> str:
    if not obs.finished:
        return "lost:no_finish"
    if obs.retry_status is None:
        return "lost:connection"
    if obs.retry_status == 503:
        return "refused"  # a retry refused is not a second run
    if obs.retry_status != 200:
        return "lost:bare_5xx" if obs.retry_status >= 500 else "lost:unexpected_status"
    if not obs.replayed or not obs.same_body:
        return "lost:ran_twice"
    return "ok"


def classify(kind: str, obs: Observation, uncut: int | None = None) -> str:
    """"ok", "refused" (a controlled 503 with Retry-After), "closed" (a stream Spillway closed
    at its limit) or "lost:<what>" (one of LOSSES). `uncut`: a stream's request's content
    events when it is not cut (None: not known, not checked)."""
    if kind == "malformed":
        verdict = _status_outcome(obs, expected=(400,))
        return verdict or "ok"
    verdict = _status_outcome(obs)
    if verdict is not None:
        return verdict
    if kind in ("chat_stream", "leave"):
        return _stream_outcome(obs, uncut)
    if kind == "resumable":
        return _resumable_outcome(obs, uncut)
    if kind == "idempotent":
        return _idempotent_outcome(obs)
    if kind == "chat":
        return "ok" if obs.finished else "lost:no_finish"
    return "ok"  # models, health, status: the status said it


def draw_kinds(rng: random.Random, count: int,
               mix: Mapping[str, int] = MIX) -> list[str]:
    kinds = list(mix)
    return rng.choices(kinds, weights=[mix[k] for k in kinds], k=count)


# --- the clients --------------------------------------------------------------------------


def _chat_body(content: str, tokens: int, stream: bool) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "stream": stream, "ignore_eos": True}
    if stream:  # greedy: the same request's uncut answer is the one to compare with
        body.update(temperature=0, top_k=1, seed=1)
    return body


async def _read_events(r: aiohttp.ClientResponse, obs: Observation,
                       leave_after: int | None = None) -> None:
    events = 0
    async for raw in r.content:
        line = raw.strip()
        if line == b"data: [DONE]":
            obs.done = True
        elif line.startswith(b"data: {"):
            events += 1
            try:
                event = json.loads(line[6:])
            except ValueError:
                event = {"error": "not JSON"}
            if "error" in event:
                obs.error_event = True
                obs.error = obs.error or line[6:406].decode(errors="replace")
            choices = event.get("choices") or []
            if any(ch.get("finish_reason") for ch in choices):
                obs.finished = True
            obs.texts += any((ch.get("delta") or {}).get("content") for ch in choices)
            obs.closed = obs.closed or "spillway_closed" in event
            obs.continued = obs.continued or "spillway_continuation" in event
            if leave_after is not None and events >= leave_after and not obs.finished:
                obs.left = True
                r.close()
                return


async def _stream(http: aiohttp.ClientSession, url: str, body: Mapping[str, Any],
                  headers: Mapping[str, str] | None = None,
                  leave_after: int | None = None) -> Observation:
    obs = Observation()
    async with http.post(f"{url}/v1/chat/completions", json=body,
                         headers=dict(headers or {})) as r:
        obs.status, obs.retry_after = r.status, "Retry-After" in r.headers
        if r.status != 200:
            await r.read()
            return obs
        await _read_events(r, obs, leave_after)
    return obs


async def _read_back(http: aiohttp.ClientSession, url: str, conversation: str) -> Observation:
    deadline = time.monotonic() + REQUEST_TIMEOUT_S / 2
    while time.monotonic() < deadline:
        async with http.post(f"{url}/v1/streams/lookup",
                             json={"conversation_ids": [conversation]}) as r:
            found = await r.json() if r.status == 200 else []
        if found and found[0]["is_done"]:
            break
        await asyncio.sleep(0.2)
    else:
        return Observation(timed_out=True)
    obs = Observation()
    async with http.get(f"{url}/v1/stream", params={"conv_id": conversation,
                                                    "from": "0"}) as r:
        obs.status, obs.retry_after = r.status, "Retry-After" in r.headers
        if r.status == 200:
            await _read_events(r, obs)
    return obs


async def _json_post(http: aiohttp.ClientSession, url: str, path: str, data: bytes,
                     headers: Mapping[str, str] | None = None
                     ) -> tuple[int, bool, bytes, Mapping[str, str]]:
    async with http.post(f"{url}{path}", data=data,
                         headers={"Content-Type": "application/json",
                                  **dict(headers or {})}) as r:
        return r.status, "Retry-After" in r.headers, await r.read(), r.headers


def _whole_answer(raw: bytes) -> bool:
    try:
        answer = json.loads(raw)
    except ValueError:
        return False
    return any(ch.get("finish_reason") for ch in answer.get("choices", []))


async def one_request(http: aiohttp.ClientSession, url: str, kind: str, tag: str,
                      prompt: str = STREAM_PROMPTS[0]) -> Observation:
    """`prompt`: a stream's (one of STREAM_PROMPTS)."""
    content = f"Say something about the number {tag}."
    streamed = _chat_body(prompt, STREAM_TOKENS, True)
    if kind == "chat_stream":
        return await _stream(http, url, streamed)
    if kind == "leave":
        return await _stream(http, url, streamed, leave_after=LEAVE_AFTER)
    if kind == "resumable":
        conversation = f"soak-{tag}"
        obs = await _stream(http, url, streamed, {"X-Conversation-Id": conversation},
                            leave_after=LEAVE_AFTER)
        if obs.status == 200 and not obs.error_event:
            obs.read_back = await _read_back(http, url, conversation)
        return obs
    if kind in ("chat", "idempotent"):
        data = json.dumps(_chat_body(content, CHAT_TOKENS, False)).encode()
        headers = {"Idempotency-Key": f"soak-{tag}"} if kind == "idempotent" else {}
        status, retry, raw, _ = await _json_post(http, url, "/v1/chat/completions", data,
                                                 headers)
        obs = Observation(status=status, retry_after=retry,
                          finished=status == 200 and _whole_answer(raw))
        if kind == "idempotent" and obs.finished:
            again, _, raw2, h2 = await _json_post(http, url, "/v1/chat/completions", data,
                                                  headers)
            obs.retry_status, obs.replayed = again, h2.get("Idempotent-Replayed") == "true"
            obs.same_body = raw2 == raw
        return obs
    if kind == "malformed":
        status, retry, _, _ = await _json_post(http, url, "/v1/chat/completions",
                                               b'{"messages": [{"role": "user", "content')
        return Observation(status=status, retry_after=retry)
    path = {"models": "/v1/models", "health": "/health", "status": "/spillway/status"}[kind]
    async with http.get(f"{url}{path}") as r:
        await r.read()
        return Observation(status=r.status, retry_after="Retry-After" in r.headers)


class DeathCount:
    """The GPU child's deaths so far, from the daemon's log (read on from where it was)."""

    LINE = b"[gpu] exited: cuda_error"

    def __init__(self, log: Path) -> None:
        self.log, self.offset, self.count = log, 0, 0

    def __call__(self) -> int:
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        self.count += data[:end].count(self.LINE)
        self.offset += end
        return self.count


@dataclass
class Tally:
    started: float
    requests: Counter[str] = field(default_factory=Counter)  # by kind
    outcomes: Counter[str] = field(default_factory=Counter)  # "kind outcome"
    lost: list[dict[str, Any]] = field(default_factory=list)  # each loss, with its time
    count: int = 0

    def add(self, kind: str, outcome: str, obs: Observation, at: float) -> None:
        self.count += 1
        self.requests[kind] += 1
        self.outcomes[f"{kind} {outcome}"] += 1
        if outcome.startswith("lost:"):
            self.lost.append({"t_s": round(at - self.started, 1), "kind": kind,
                              "loss": outcome[5:], "seen": _brief(obs)})

    def lost_by(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for item in self.lost:
            out.setdefault(item["loss"], Counter())[item["kind"]] += 1
        return {loss: dict(kinds) for loss, kinds in out.items()}


def _brief(obs: Observation) -> dict[str, Any]:
    return {k: v for k, v in asdict(obs).items() if v not in (None, False, "")}


async def uncut_lengths(http: aiohttp.ClientSession, url: str, tries: int = 5
                        ) -> dict[str, int]:
    """Each stream prompt's content events when its stream is not cut (neither continued nor
    closed by Spillway), measured before the traffic (a GPU death may cut one: then again)."""
    lengths: dict[str, int] = {}
    for prompt in STREAM_PROMPTS:
        for _ in range(tries):
            obs = await _stream(http, url, _chat_body(prompt, STREAM_TOKENS, True))
            if obs.finished and obs.done and not (obs.continued or obs.closed or
                                                  obs.error_event):
                lengths[prompt] = obs.texts
                break
    return lengths


async def client(n: int, http: aiohttp.ClientSession, url: str, tally: Tally, deadline: float,
                 max_requests: int, seed: int, uncut: Mapping[str, int]) -> None:
    rng = random.Random(seed + n)
    i = 0
    while time.monotonic() < deadline and tally.count < max_requests:
        [kind] = draw_kinds(rng, 1)
        prompt = rng.choice(STREAM_PROMPTS)
        i += 1
        tag = f"{n}-{i}"
        try:
            obs = await asyncio.wait_for(one_request(http, url, kind, tag, prompt),
                                         REQUEST_TIMEOUT_S)
        except TimeoutError:
            obs = Observation(timed_out=True)
        except (aiohttp.ClientError, ConnectionError) as e:
            obs = Observation(broken=type(e).__name__)
        tally.add(kind, classify(kind, obs, uncut.get(prompt)), obs, time.monotonic())
        await asyncio.sleep(rng.uniform(*THINK_S))


# --- the daemon's figures ----------------------------------------------------------------


def proc_figures(pid: int) -> dict[str, Any]:
    """Resident memory (MB), open fds and threads of a process, from /proc."""
    fields: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    return {"rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024, 2),
            "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


async def sample(http: aiohttp.ClientSession, url: str, pid: int, minute: int,
                 tally: Tally, deaths: Callable[[], int], last: bool = False
                 ) -> dict[str, Any]:
    row: dict[str, Any] = {"minute": minute, **proc_figures(pid)}
    try:
        async with http.get(f"{url}/spillway/status") as r:
            status = await r.json()
        row["asyncio_tasks"] = (status.get("process") or {}).get("asyncio_tasks")
        row["caches"] = {name: {k: v for k, v in c.items() if k in ("entries", "bytes")}
                         for name, c in (status.get("caches") or {}).items()}
        # Each minute as the daemon runs (cyclic garbage included); at the end after a full
        # collection (what is live).
        async with http.get(f"{url}/spillway/debug/memory",
                            params={"collect": "1" if last else "0"}) as r:
            if r.status == 200:  # SPILLWAY_DEBUG_MEMORY on
                memory = await r.json()
                row["gc_objects"] = memory["gc_objects"]
                if memory.get("collected") is not None:
                    row["gc_collected"] = memory["collected"]
                row["grown_types"] = memory["grown_types"]
                if "traced_bytes" in memory:
                    row["traced_bytes"] = memory["traced_bytes"]
                    row["grown_lines"] = memory["grown_lines"][:10]
    except (aiohttp.ClientError, ValueError) as e:
        row["status_error"] = type(e).__name__
    row["requests"] = tally.count
    row["lost"] = len(tally.lost)
    row["gpu_deaths"] = deaths()
    return row


def second_half_types(rows: Sequence[Mapping[str, Any]], top: int = 15) -> dict[str, int]:
    """The object types that grew most from the middle of the run to its end (from the
    daemon's counts of growth since its first sample, where SPILLWAY_DEBUG_MEMORY is on)."""
    counted = [r for r in rows if "grown_types" in r and "gc_collected" not in r]
    if len(counted) < 3:
        return {}
    mid, last = counted[len(counted) // 2]["grown_types"], counted[-1]["grown_types"]
    diff = Counter({k: v - mid.get(k, 0) for k, v in last.items()})
    return {k: v for k, v in diff.most_common(top) if v > 0}


def rss_verdict(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The RSS curve's growth in each half of the run (MB), and per minute over the last half:
    a level curve once the caches are full grows by about nothing in its second half."""
    rss = [r["rss_mb"] for r in rows]
    if len(rss) < 3:
        return {"first_half_mb": None, "second_half_mb": None, "last_half_mb_per_min": None}
    mid = len(rss) // 2
    second = rss[-1] - rss[mid]
    return {"first_half_mb": round(rss[mid] - rss[0], 2), "second_half_mb": round(second, 2),
            "last_half_mb_per_min": round(second / max(len(rss) - 1 - mid, 1), 3),
            "min_mb": min(rss), "max_mb": max(rss)}


def report(result: Mapping[str, Any]) -> str:
    tally_req: Mapping[str, int] = result["requests_by_kind"]
    lost_by: Mapping[str, Mapping[str, int]] = result["lost_by"]
    state = "still running" if result["running"] else "finished"
    lines = [f"# Soak: {result['minutes_run']:.1f} minutes ({state}), {result['clients']} "
             f"clients, GPU death every {result['gpu_death_every_s']} s", "",
             f"{result['requests']} requests, {result['lost']} lost; "
             f"{result['gpu_deaths']} GPU deaths (incidents recorded: {result['incidents']})",
             "Streams' uncut content events, by prompt: " + (", ".join(
                 f"{n}" for n in result.get("uncut_events", {}).values()) or "not measured"),
             "", "| kind | requests | ok | refused (503 + Retry-After) | closed at its limit "
             "| lost |", "|---|---|---|---|---|---|"]
    outcomes: Mapping[str, int] = result["outcomes"]
    for kind in MIX:
        ok = outcomes.get(f"{kind} ok", 0)
        refused = outcomes.get(f"{kind} refused", 0)
        closed = outcomes.get(f"{kind} closed", 0)
        lost = sum(v for k, v in outcomes.items() if k.startswith(f"{kind} lost:"))
        lines.append(f"| {kind} | {tally_req.get(kind, 0)} | {ok} | {refused} | {closed} | "
                     f"{lost} |")
    lines += ["", "Lost, by what went wrong: " + (", ".join(
        f"{loss} {sum(k.values())} ({', '.join(f'{kind} {n}' for kind, n in k.items())})"
        for loss, k in lost_by.items()) or "none")]
    for item in result["lost_detail"][:20]:
        lines.append(f"- at {item['t_s']} s: {item['kind']}, {item['loss']}: {item['seen']}")
    lines += ["", "| minute | RSS MB | fds | threads | asyncio tasks | gc objects | requests | "
              "lost | GPU deaths | caches (entries) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["per_minute"]:
        caches = ", ".join(f"{n} {c.get('entries')}" for n, c in (r.get("caches") or {}).items()
                           if c.get("entries"))
        lines.append(f"| {r['minute']} | {r['rss_mb']:.1f} | {r['fds']} | {r['threads']} | "
                     f"{r.get('asyncio_tasks')} | {r.get('gc_objects', '')} | {r['requests']} | "
                     f"{r['lost']} | {r['gpu_deaths']} | {caches} |")
    v = result["rss"]
    if v["second_half_mb"] is not None:
        lines += ["", f"RSS: {v['min_mb']:.1f} to {v['max_mb']:.1f} MB; grew "
                  f"{v['first_half_mb']:+.2f} MB in the first half, {v['second_half_mb']:+.2f} "
                  f"MB in the second ({v['last_half_mb_per_min']:+.3f} MB a minute)"]
    end = result["per_minute"][-1] if result["per_minute"] else {}
    if "gc_collected" in end:
        lines += ["", f"At the end, a full collection freed {end['gc_collected']} objects; "
                  f"{end['gc_objects']} live"]
    if result.get("types_grown_second_half"):
        lines += ["", "Objects that grew most in the second half (type: count): " + ", ".join(
            f"{k} {n}" for k, n in result["types_grown_second_half"].items())]
    return "\n".join(lines)


def config(binary: Path, model: Path, injector: Path, every_s: float, slots: int,
           idempotency_keys: int) -> dict[str, Any]:
    cfg = real_config(binary, model, model={"args": ["-c", str(512 * slots), "-np", str(slots),
                                                     "-t", "1", "-tb", "1"]},
                      restart={"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
                      idempotency={"max_keys": idempotency_keys})
    cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector),
                  "env": {"REAL_LLAMA_SERVER": str(binary), "FAULT_LINES": "terse",
                          "FAULT_EVERY_S": str(every_s)}}
    return cfg


async def soak(s: Spillway, minutes: float, clients: int, max_requests: int, seed: int,
               every_s: float, out: Path) -> dict[str, Any]:
    assert s.proc is not None
    pid = s.proc.pid
    started = time.monotonic()
    deadline = started + minutes * 60
    tally = Tally(started)
    rows: list[dict[str, Any]] = []
    deaths = DeathCount(s.log_path)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=64)) as http:
        uncut = await uncut_lengths(http, s.url)
        print(f"uncut content events, by prompt: {uncut}", flush=True)

        def result(running: bool) -> dict[str, Any]:
            return {"running": running, "minutes": minutes, "clients": clients,
                    "uncut_events": uncut,
                    "gpu_death_every_s": every_s,
                    "minutes_run": round((time.monotonic() - started) / 60, 2),
                    "requests": tally.count, "lost": len(tally.lost),
                    "gpu_deaths": deaths(), "incidents": len(s.incidents()),
                    "requests_by_kind": dict(tally.requests), "outcomes": dict(tally.outcomes),
                    "lost_by": tally.lost_by(), "lost_detail": tally.lost,
                    "per_minute": rows, "rss": rss_verdict(rows),
                    "types_grown_second_half": second_half_types(rows)}

        def write(running: bool) -> str:
            res = result(running)
            text = report(res)
            out.mkdir(parents=True, exist_ok=True)
            (out / "soak.json").write_text(json.dumps(res, indent=2) + "\n")
            (out / "soak.md").write_text(text + "\n")
            return text

        async def sampler() -> None:
            minute = 0
            while True:
                row = await sample(http, s.url, pid, minute, tally, deaths)
                rows.append(row)
                caches = " ".join(f"{n}={c['entries']}"
                                  for n, c in (row.get("caches") or {}).items())
                print(f"minute {minute}: RSS {row['rss_mb']:.1f} MB, fds {row['fds']}, threads "
                      f"{row['threads']}, tasks {row.get('asyncio_tasks')}, gc objects "
                      f"{row.get('gc_objects')}, requests {row['requests']}, lost "
                      f"{row['lost']}, GPU deaths {row['gpu_deaths']}; caches (entries): "
                      f"{caches}", flush=True)
                write(True)
                minute += 1
                await asyncio.sleep(max(0.0, started + minute * 60 - time.monotonic()))

        watch = asyncio.create_task(sampler())
        await asyncio.gather(*(client(n, http, s.url, tally, deadline, max_requests, seed,
                                      uncut) for n in range(clients)))
        watch.cancel()
        rows.append(await sample(http, s.url, pid, len(rows), tally, deaths, last=True))
        rows[-1]["minute"] = round((time.monotonic() - started) / 60, 2)
        text = write(False)
    print(text, flush=True)
    return result(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--gpu-death-every", type=float, default=45.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-requests", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=43)
    parser.add_argument("--debug-memory", choices=("off", "counts", "tracemalloc"),
                        default="counts",
                        help="SPILLWAY_DEBUG_MEMORY: the daemon's object counts each minute "
                             "(counts), and its allocations traced (tracemalloc: slower)")
    parser.add_argument("--idempotency-keys", type=int, default=1000,
                        help="idempotency.max_keys: small enough that the store fills within "
                             "the run (the default 10,000 fills after some two hours of this mix)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    # Stopped early (SIGINT, even where a background shell ignored it; SIGTERM): the daemon and
    # its children are stopped too, and the files keep the last minute's figures.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    binary = bootstrap.ensure_llama_server()
    with tempfile.TemporaryDirectory(prefix="spillway-soak-") as tmp:
        folder = Path(tmp)
        model = write_tiny_model(folder / "tiny.gguf")
        injector = injector_script(folder)
        s = Spillway(folder / "daemon", config(binary, model, injector, args.gpu_death_every,
                                               slots=2 * args.clients,
                                               idempotency_keys=args.idempotency_keys),
                     env={"SPILLWAY_DEBUG_MEMORY": {"off": "0", "counts": "1"}.get(
                         args.debug_memory, args.debug_memory)})
        s.start()
        print(f"Spillway pid {s.proc.pid if s.proc else None} at {s.url}; its log: "
              f"{s.log_path}", flush=True)
        try:
            asyncio.run(soak(s, args.minutes, args.clients, args.max_requests, args.seed,
                             args.gpu_death_every, args.out))
        finally:
            s.stop()


if __name__ == "__main__":
    main()
