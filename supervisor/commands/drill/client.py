"""The drill's view of a running Spillway: requests as a client sends them, and the daemon's
own records (status, incidents, timeline) read back."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import struct
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from ..remote import Target
from ...config.schema import GPU_CHILD, SMALL_CHILD

CHAT = "/v1/chat/completions"


@dataclass
class Sent:
    """One request the drill made, and what came back."""

    scenario: int
    request_id: str
    stream: bool
    started: float  # wall clock
    ended: float = 0.0
    status: int | None = None  # None: no answer (the client left, or the connection broke)
    attempts: int = 0
    child: str | None = None
    model: str | None = None  # X-Spillway-Model (router mode)
    failover: str | None = None
    complete: bool = False  # a whole answer: JSON with choices, or a stream ending in [DONE]
    error_event: bool = False  # a stream ended by Spillway's error event
    controlled: bool = False  # a JSON error from Spillway (src: spillway)
    client_left: bool = False  # the drill left on purpose
    request_id_kept: bool = False
    tokens: int = 0
    cut_at: int | None = None  # scenarios 7, 11: the events read when the GPU child was stopped
    # The stream said it was continued on the other child: its final event's
    # `spillway_continuation` (proxy/continued.py), the only word of it on the wire; and that
    # word itself (`from_child`, `child`, `kind`, `tokens_before`).
    continued: bool = False
    continuation: dict[str, Any] | None = None
    # X-Spillway-Fallback as sent: "smaller" (it accepts a smaller model's answer), "none"
    # (it does not, even where small.requests = "all"), None (not sent)
    fallback: str | None = None
    answer_model: str | None = None  # the answer's own `model` (the model that answered)
    gpu_when_sent: str | None = None  # scenario 8: the GPU child's state as it was sent
    images: int = 0  # scenario 9: the images the request carried
    prompt_tokens: int = 0  # the answer's usage.prompt_tokens (media tokens included)
    # A stream: seconds from sending it to its first event with text (its time to first token)
    ttft_s: float | None = None
    # The answering child's timings (a stream's last event, a whole answer's body): the prompt
    # tokens it found in its cache (cache_n), those it computed (prompt_n), and how long that
    # took it (prompt_ms); None when the answer had no timings.
    cache_n: int | None = None
    prompt_n: int | None = None
    prompt_ms: float | None = None
    answer: str | None = None  # the answer's text, where the drill asked to keep it (`keep`)
    note: str = ""
    incident: dict[str, Any] | None = None  # the daemon's newest record of it
    # All the daemon's records of it, oldest first: a stream continued on the CPU child and
    # then moved back to the GPU child has two (`continued`, `failed_back`).
    incidents: list[dict[str, Any]] = field(default_factory=list)

    @property
    def latency_s(self) -> float:
        return round(self.ended - self.started, 3) if self.ended else 0.0

    @property
    def outcome(self) -> str:
        if self.client_left:
            return "cancelled"
        if self.complete and self.continued:
            note = self.continuation or {}
            if note.get("kind") == "failed_back":
                return "failed_back"  # moved back from the CPU child to the GPU child
            if note.get("child") is not None and note.get("child") == note.get("from_child"):
                return "waited"  # went on from the child that died, once it was back
            return "continued"
        if self.complete and self.attempts >= 2 and self.child == SMALL_CHILD:
            return "rerouted"  # the GPU child lost it; the small child answered
        if self.complete and self.attempts >= 2 and self.child == GPU_CHILD:
            # (No child hands a request over to the GPU child: it was the GPU child's own,
            # answered after its return.)
            return "waited"
        if self.complete and self.attempts >= 2:
            return "replayed"
        if self.complete:
            return "completed"
        if self.controlled or self.error_event:
            return "controlled_error"
        return "failed"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["latency_s"] = self.latency_s
        out["outcome"] = self.outcome
        return out


def state_of(status: dict[str, Any], child: str, model: str | None = None) -> str | None:
    """A child's state; in router mode (`model`), that model's state on that router (the
    router's own when the router itself is not READY)."""
    info = status["children"][child]
    if model is None or info["state"] != "READY":
        return str(info["state"])
    found = (info.get("models") or {}).get(model)
    return None if found is None else str(found["state"])


def model_info(status: dict[str, Any], child: str, model: str) -> dict[str, Any]:
    """One model's entry on one router in the status ({} when it has none)."""
    found: dict[str, Any] = (status["children"][child].get("models") or {}).get(model) or {}
    return found


@dataclass
class DrillClient:
    target: Target
    session: aiohttp.ClientSession
    sent: list[Sent] = field(default_factory=list)
    model: str | None = None  # router mode: every request names it
    drill_token: str | None = None  # the daemon's window for this drill (begin, end)
    # X-Spillway-Fallback for every request that does not say its own: "none" where a small
    # child serves, so that only the requests meant for it (scenario 8) may get its answer,
    # even where small.requests = "all"
    fallback: str | None = None

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.target.api_key:
            h["Authorization"] = f"Bearer {self.target.api_key}"
        h.update(extra or {})
        return h

    async def get(self, path: str, **headers: str) -> Any:
        async with self.session.get(self.target.url + path,
                                    headers=self._headers(headers)) as r:
            return await r.json()

    async def post_json(self, path: str, body: Any, **headers: str) -> Any:
        async with self.session.post(self.target.url + path, data=json.dumps(body),
                                     headers=self._headers(headers)) as r:
            return await r.json()

    async def begin(self) -> None:
        """Open the daemon's drill window: arming answers only inside it."""
        async with self.session.post(self.target.url + "/spillway/drill/start", data="{}",
                                     headers=self._headers()) as r:
            answer = await r.json()
            if r.status != 200:
                raise RuntimeError("Spillway refused to start a drill: "
                                   f"{answer.get('error', {}).get('message', answer)}")
        self.drill_token = str(answer["drill"])

    async def arm(self, body: dict[str, Any]) -> Any:
        """`/spillway/drill/arm` with the drill's token (the window must be open)."""
        async with self.session.post(self.target.url + "/spillway/drill/arm",
                                     data=json.dumps(body),
                                     headers=self._headers(self._drill_header())) as r:
            return await r.json()

    async def end(self) -> None:
        """Close the window (the daemon disarms what is armed); once."""
        if self.drill_token is None:
            return
        async with self.session.post(self.target.url + "/spillway/drill/end", data="{}",
                                     headers=self._headers(self._drill_header())):
            self.drill_token = None

    def _drill_header(self) -> dict[str, str]:
        return {"X-Spillway-Drill": self.drill_token} if self.drill_token else {}

    async def post(self, path: str, body: Any) -> tuple[int, str]:
        """(status, body text), whatever the answer is."""
        async with self.session.post(self.target.url + path, data=json.dumps(body),
                                     headers=self._headers()) as r:
            return r.status, await r.text(errors="replace")

    async def status(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.get("/spillway/status")
        return result

    async def incidents(self, limit: int = 500) -> list[dict[str, Any]]:
        body = await self.get(f"/spillway/incidents?limit={limit}")
        records: list[dict[str, Any]] = body["incidents"]
        return records

    async def wait_state(self, child: str, states: tuple[str, ...], timeout: float,
                         model: str | None = None) -> bool:
        """Until the child (in router mode: `model` on that router) is in one of `states`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if state_of(await self.status(), child, model) in states:
                return True
            await asyncio.sleep(0.1)
        return False

    async def tasks_started(self) -> dict[str, int]:
        return {n: c["tasks_started"] for n, c in (await self.status())["children"].items()}

    async def chat(self, scenario: int, messages: list[dict[str, Any]], max_tokens: int,
                   stream: bool = False, headers: dict[str, str] | None = None,
                   leave_after_first_event: bool = False,
                   extra: dict[str, Any] | None = None,
                   cut: tuple[int, Callable[[], Awaitable[None]]] | None = None,
                   keep: bool = False) -> Sent:
        """One chat request; `cut` = (K, stop): `stop()` is awaited once K events of the
        stream have been read (scenarios 7 and 11 stop the GPU child there), and reading goes on;
        `keep`: the text of a whole answer is kept (scenario 10's next turn carries it)."""
        rid = f"drill-{scenario}-{uuid.uuid4().hex[:10]}"
        sent = Sent(scenario, rid, stream, time.time(), images=_images(messages))
        self.sent.append(sent)
        body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens,
                                "stream": stream, "temperature": 0, **(extra or {})}
        if self.model is not None:
            body["model"] = self.model
        sending = {"X-Request-Id": rid, **({"X-Spillway-Fallback": self.fallback}
                                          if self.fallback else {}), **(headers or {})}
        sent.fallback = sending.get("X-Spillway-Fallback")
        try:
            async with self.session.post(self.target.url + CHAT, data=json.dumps(body),
                                         headers=self._headers(sending)) as r:
                sent.status = r.status
                sent.attempts = int(r.headers.get("X-Spillway-Attempts", "0"))
                sent.child = r.headers.get("X-Spillway-Child")
                sent.model = r.headers.get("X-Spillway-Model")
                sent.failover = r.headers.get("X-Spillway-Failover")
                sent.request_id_kept = r.headers.get("X-Request-Id") == rid
                if stream and r.status == 200:
                    await self._read_stream(r, sent, leave_after_first_event, cut)
                else:
                    raw = await r.read()
                    self._read_json(raw, sent, keep)
        except (TimeoutError, aiohttp.ClientError) as e:
            sent.note = f"connection: {type(e).__name__}: {e}"
        sent.ended = time.time()
        return sent

    @staticmethod
    def _read_json(raw: bytes, sent: Sent, keep: bool = False) -> None:
        try:
            data = json.loads(raw)
        except ValueError:
            sent.note = f"not JSON: {raw[:100]!r}"
            return
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            sent.controlled = data["error"].get("src") == "spillway"
            sent.note = str(data["error"].get("message", ""))[:300]
        elif isinstance(data, dict) and data.get("choices"):
            sent.complete = True
            sent.answer_model = _model_of(data)
            usage = data.get("usage") or {}
            sent.tokens = int(usage.get("completion_tokens", 0))
            sent.prompt_tokens = int(usage.get("prompt_tokens", 0))
            _read_timings(data.get("timings"), sent)
            if keep:
                message = (data["choices"][0] or {}).get("message") or {}
                sent.answer = str(message.get("content") or "")

    @staticmethod
    async def _read_stream(r: aiohttp.ClientResponse, sent: Sent, leave: bool,
                           cut: tuple[int, Callable[[], Awaitable[None]]] | None) -> None:
        events = 0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                sent.complete = True
                break
            if b'"error"' in data:
                sent.error_event = True
                sent.note = data.decode(errors="replace")[:300]
                break
            events += 1
            if sent.answer_model is None:
                sent.answer_model = _model_of(data)
            if sent.ttft_s is None and _has_text(data):
                sent.ttft_s = round(time.time() - sent.started, 3)
            if b'"timings"' in data or b'"spillway_continuation"' in data:
                with contextlib.suppress(ValueError, AttributeError):
                    event = json.loads(data)
                    _read_timings(event.get("timings"), sent)
                    note = event.get("spillway_continuation")
                    if isinstance(note, dict):
                        sent.continued, sent.continuation = True, note
            if cut is not None and events == cut[0]:
                sent.cut_at = events
                await cut[1]()
            if leave:
                sent.client_left = True
                r.close()  # the client goes away during the failover
                break
        sent.tokens = events


def _model_of(data: Any) -> str | None:
    """The `model` an answer (or one event of a stream) names: the model that answered."""
    if isinstance(data, bytes):
        try:
            data = json.loads(data)
        except ValueError:
            return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def _has_text(data: bytes) -> bool:
    """Whether a chat stream's event carries the answer's first text (content, reasoning or a
    tool call): the role-only event before it does not."""
    if b'"delta"' not in data:
        return False
    try:
        choices = json.loads(data).get("choices") or [{}]
        delta = choices[0].get("delta") or {}
    except (ValueError, AttributeError):
        return False
    return any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls"))


def _read_timings(timings: Any, sent: Sent) -> None:
    """The answering child's timings, where the answer has them."""
    if not isinstance(timings, dict):
        return
    for name in ("cache_n", "prompt_n"):
        if isinstance(timings.get(name), int):
            setattr(sent, name, int(timings[name]))
    if isinstance(timings.get("prompt_ms"), (int, float)):
        sent.prompt_ms = round(float(timings["prompt_ms"]), 1)


def _images(messages: list[dict[str, Any]]) -> int:
    """The `image_url` parts of a chat request's messages."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict)
               and part.get("type") == "image_url")


def png(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    """An RGB PNG of seeded noise, made with the standard library (zlib, struct): the drill's
    image needs no imaging package."""
    rnd = random.Random(seed)
    raw = b"".join(b"\x00" + rnd.randbytes(3 * width) for _ in range(height))  # filter 0

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def image_part(data: bytes) -> dict[str, Any]:
    """A chat content part carrying a PNG as a data URI, as an OpenAI client sends one."""
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return {"type": "image_url", "image_url": {"url": uri}}
