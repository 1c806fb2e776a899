"""The five scenarios of the drill, in order, each with the bar it must meet.

Every figure in the report comes from the daemon's own incident records, matched by request
id; the drill adds only what a client alone can know (did the connection survive, what did the
simulated tool do).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from .client import DrillClient, Sent
from .provoke import Provoker

WORDS = ("the quick brown fox jumps over the lazy dog while the model reads a long document "
         "about memory and servers ").split()


@dataclass
class ScenarioResult:
    number: int
    name: str
    bar: str
    simulated: bool
    passed: bool = False
    verdict: str = ""
    requests: list[Sent] = field(default_factory=list)
    tool_effects: dict[int, int] | None = None
    executions: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number, "name": self.name, "bar": self.bar,
            "simulated": self.simulated, "passed": self.passed, "verdict": self.verdict,
            "requests": [r.to_json() for r in self.requests],
            "tool_effects": self.tool_effects, "executions": self.executions,
            "notes": self.notes,
        }


Progress = Callable[[str], None]


class Drill:
    def __init__(self, client: DrillClient, provoker: Provoker, progress: Progress,
                 prompt_tokens: int, settle_s: float = 180.0) -> None:
        self.client = client
        self.provoker = provoker
        self.say = progress
        self.prompt_tokens = prompt_tokens
        self.settle_s = settle_s
        self._words_per_token: float | None = None

    # --- helpers ------------------------------------------------------------------------------

    async def prompt(self, tokens: int) -> str:
        """About `tokens` tokens of text, as the model's own tokenizer counts them."""
        if self._words_per_token is None:
            sample = " ".join(WORDS * 10)
            try:
                counted = await self.client.post_json("/tokenize", {"content": sample})
                n = len(counted.get("tokens", [])) or len(WORDS) * 10
            except Exception:  # noqa: BLE001 - a rough prompt is still a prompt
                n = len(WORDS) * 10
            self._words_per_token = len(WORDS) * 10 / n
        count = max(1, int(tokens * self._words_per_token))
        return " ".join((WORDS * (count // len(WORDS) + 1))[:count])

    async def messages(self, tokens: int, note: str = "") -> list[dict[str, str]]:
        text = await self.prompt(tokens)
        return [{"role": "user", "content": f"{note} Summarise: {text}"}]

    async def settle(self) -> None:
        """Wait until the GPU child is back before the next scenario."""
        if not await self.client.wait_state("gpu", ("READY",), self.settle_s):
            self.say("  the GPU child is not back; going on")

    @contextlib.asynccontextmanager
    async def failing(self) -> AsyncIterator[None]:
        """The failure armed for what follows; released as soon as the GPU child is down."""
        await self.provoker.arm()
        watcher = asyncio.create_task(self._release_when_down())
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await self.provoker.after_failure()

    async def _release_when_down(self) -> None:
        while (await self.client.status())["children"]["gpu"]["state"] == "READY":
            await asyncio.sleep(0.05)
        await self.provoker.after_failure()

    async def attach_incidents(self, results: list[ScenarioResult]) -> None:
        by_id = {r["request_id"]: r for r in await self.client.incidents()}
        for result in results:
            for sent in result.requests:
                sent.incident = by_id.get(sent.request_id)

    # --- the scenarios ------------------------------------------------------------------------

    def _new(self, number: int, name: str, bar: str) -> ScenarioResult:
        self.say(f"[{number}/5] {name}")
        return ScenarioResult(number, name, bar, self.provoker.simulated)

    async def _executions(self, before: dict[str, int]) -> dict[str, int]:
        after = await self.client.tasks_started()
        return {k: after[k] - before.get(k, 0) for k in after}

    async def non_streaming(self) -> ScenarioResult:
        r = self._new(1, "a non-streaming request over the GPU profile",
                      "completed once on the CPU child (2 attempts), request id kept")
        before = await self.client.tasks_started()
        async with self.failing():
            sent = await self.client.chat(1, await self.messages(self.prompt_tokens), 16)
        r.requests.append(sent)
        r.executions = await self._executions(before)
        await self.settle()
        return r

    async def streaming(self) -> ScenarioResult:
        r = self._new(2, "the same request, streamed",
                      "a whole stream ([DONE], no error event) from the CPU child, 2 attempts")
        async with self.failing():
            sent = await self.client.chat(2, await self.messages(self.prompt_tokens), 16,
                                          stream=True)
        r.requests.append(sent)
        await self.settle()
        return r

    async def cancellation(self) -> ScenarioResult:
        r = self._new(3, "cancellation: the client leaves during the failover",
                      "the replay is cancelled with its client: no work left on the CPU child")
        async with self.failing():
            sent = await self.client.chat(3, await self.messages(self.prompt_tokens), 400,
                                          stream=True, leave_after_first_event=True)
        r.requests.append(sent)
        # The CPU child must let go of the abandoned replay (llama-server notices a closed
        # stream at its next write). Polled slowly: /slots answers wake llama-server's waits.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            slots = await self.client.get("/slots", **{"X-Spillway-Child": "cpu"})
            if not any(s.get("is_processing") for s in slots):
                break
            await asyncio.sleep(1.0)
        else:
            r.notes.append("the CPU child was still working 15 s after the client left")
        await self.settle()
        return r

    async def concurrent(self, clients: int = 6) -> ScenarioResult:
        r = self._new(4, f"concurrent traffic: {clients} clients during the failure",
                      "each completed exactly once or got a controlled error (503/502 JSON, or "
                      "one SSE error event)")
        before = await self.client.tasks_started()
        async with self.failing():
            tasks = [asyncio.create_task(self.client.chat(
                4, await self.messages(self.prompt_tokens // 2, f"client {i}."), 48,
                stream=i % 2 == 1)) for i in range(clients)]
            r.requests.extend(await asyncio.gather(*tasks))
        r.executions = await self._executions(before)
        await self.settle()
        return r

    async def agent(self, steps: int = 4, fail_before_step: int = 2) -> ScenarioResult:
        r = self._new(5, "an agent: model calls and a simulated tool, the failure between a "
                         "tool call and the next model call",
                      "every tool call ran exactly once; every model call was answered")
        effects: dict[int, int] = {}
        messages: list[dict[str, str]] = await self.messages(self.prompt_tokens // 4,
                                                             "Plan a trip.")
        for step in range(steps):
            if step == fail_before_step:
                ctx: contextlib.AbstractAsyncContextManager[None] = self.failing()
            else:
                ctx = contextlib.nullcontext()
            async with ctx:
                answer = await self._model_call(r, messages, step)
            if answer is None:
                r.notes.append(f"step {step}: the model call was never answered")
                break
            messages.append({"role": "assistant", "content": answer[:200]})
            # The simulated tool: a side effect we count (a payment, an email, a file write).
            effects[step] = effects.get(step, 0) + 1
            messages.append({"role": "user", "content": f"tool result {step}: done"})
        r.tool_effects = effects
        await self.settle()
        return r

    async def _model_call(self, r: ScenarioResult, messages: list[dict[str, str]],
                          step: int) -> str | None:
        """One model call, retried (never the tool) on a controlled error, with the same
        Idempotency-Key, as a careful agent does."""
        key = f"drill-agent-{id(r)}-step-{step}"
        for _ in range(4):
            sent = await self.client.chat(5, messages, 12,
                                          headers={"Idempotency-Key": key})
            r.requests.append(sent)
            if sent.complete:
                return f"answer {step}"
            await asyncio.sleep(2.0)
        return None


def _identity(s: Sent) -> list[str]:
    """The request's identity survived: its id kept, its incident its own."""
    problems = []
    if s.status is not None and not s.request_id_kept:
        problems.append(f"{s.request_id}: X-Request-Id not kept")
    if s.incident is not None and s.incident.get("request_id") != s.request_id:
        problems.append(f"{s.request_id}: the incident names another request")
    return problems


def _judge_failover(r: ScenarioResult) -> list[str]:
    """Scenarios 1 and 2: completed on the CPU child after a failover, recorded as replayed."""
    s = r.requests[0]
    problems = _identity(s)
    if not (s.complete and s.attempts == 2 and s.child == "cpu"):
        problems.append(f"not completed on the CPU child after a failover: status "
                        f"{s.status}, attempts {s.attempts}, {s.note}")
    if s.error_event:
        problems.append("the stream ended with an error event")
    if s.incident is None or s.incident.get("decision") != "replayed":
        problems.append("no incident recording the replay")
    if r.number == 1 and r.executions and sum(r.executions.values()) != 2:
        problems.append(f"executed {sum(r.executions.values())} times (GPU then CPU: 2)")
    return problems


def _judge_cancellation(r: ScenarioResult) -> list[str]:
    """Scenario 3: the client left during the failover, and the incident says so."""
    s = r.requests[0]
    problems = _identity(s)
    if not s.client_left:
        problems.append("the client did not get to leave during the failover")
    inc = s.incident
    if inc is None:
        problems.append("no incident for the cancelled request")
    elif inc.get("client_connected") is not False:
        problems.append("the incident says the client was still there")
    return problems + r.notes


def _judge_concurrent(r: ScenarioResult) -> list[str]:
    """Scenario 4: every request completed or got a controlled error; some were caught."""
    problems = []
    for s in r.requests:
        problems += _identity(s)
        if not (s.complete or s.controlled or s.error_event):
            problems.append(f"{s.request_id}: neither completed nor a controlled error "
                            f"({s.status}, {s.note})")
    if not any(s.incident for s in r.requests):
        problems.append("no request was caught in the failure")
    return problems


def _judge_agent(r: ScenarioResult) -> list[str]:
    """Scenario 5: each tool ran exactly once, and the failure hit the call after a tool."""
    problems = [p for s in r.requests for p in _identity(s)]
    effects = r.tool_effects or {}
    if any(count != 1 for count in effects.values()) or len(effects) < 4:
        problems.append(f"tool side effects {effects}: each must run exactly once")
    if not any(s.incident for s in r.requests):
        problems.append("the failure did not hit the model call after the tool")
    return problems + r.notes


_JUDGES = {1: _judge_failover, 2: _judge_failover, 3: _judge_cancellation,
           4: _judge_concurrent, 5: _judge_agent}


def judge(r: ScenarioResult) -> None:
    """Did the scenario meet its bar? Sets passed and verdict."""
    problems = _JUDGES[r.number](r)
    r.passed = not problems
    r.verdict = "meets the bar" if r.passed else "; ".join(problems)
