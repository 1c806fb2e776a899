"""The eleven scenarios of the drill, in order, each with the bar it must meet.

Every figure in the report comes from the daemon's own incident records, matched by request
id; the drill adds only what a client alone can know (did the connection survive, what did the
simulated tool do).

In router mode every request names the drilled model (A), the failure is A's instance's on the
GPU router, and "back" means A READY on the GPU router again. Scenario 6, a second model (B)
loading on the GPU router while A's requests run there, is router mode's alone: elsewhere it is
skipped, with the reason, and counts as neither passed nor failed. Scenario 7, a stream whose
GPU child dies in the middle of its answer, is continued on the CPU child; the death is
Spillway's SIGABRT at the drill's word, on a GPU too (labelled simulated). Scenario 8, the
small model answering while the large one reloads, needs a small child ([small]): without one it
is skipped, as 6 is outside router mode. Scenario 9, an image request whose vision encoder takes
the last VRAM, needs a projector (`--mmproj`): where the GPU child's /props `modalities` say it
takes no images, it is skipped too. Scenario 10, a long conversation failing over to the warm
CPU child, needs the CPU child's mirroring (the status's `mirror` enabled: a hot CPU child,
`cpu.mirror` on): without it, and in router mode (which does not mirror yet), it is skipped.
Scenario 11, the GPU child back while its stream, continued on the CPU child, is still being
answered: the stream waits for it or moves back to it where the GPU child is the sooner; where
it is not faster here (a test machine's "GPU child" on the CPU), the rule keeps the stream on the
CPU child and the scenario is skipped, with the figures, after it ran.

Spillway decides where what a GPU death catches goes by each child's speed, learned from its
answers; the drill first has the CPU child answer once where it has answered nothing yet
(`Drill.speeds_known`), so that the decisions judged are made by figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ...config.schema import CPU_CHILD, GPU_CHILD, SMALL_CHILD
from ...policy.continuation import FAIL_BACK_MARGIN
from ...policy.evidence import FailureKind
from ...policy.replay import own_size_suspect
from .client import DrillClient, Sent, image_part, model_info, png, state_of
from .provoke import Provoker, SimulatedFailure

SCENARIOS = 11
SMALLER = {"X-Spillway-Fallback": "smaller"}  # the request accepts a smaller model's answer
PLAIN = {"X-Spillway-Fallback": "none"}  # it does not, even where small.requests = "all"
# Scenario 10: the warm turn finds at least this share of the first turn's prompt in the CPU
# child's cache; the cold one, at most this share of its own (its template's first tokens).
WARM_SHARE = 0.8
COLD_SHARE = 0.2
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
    # Scenario 6: the drilled and the second model, the second one's load answer, and each
    # one's state on the GPU router at the end. Scenario 8: the small child's mode, the GPU
    # child's state as the requests were sent while it was down, how many went.
    models: dict[str, Any] | None = None
    # Scenario 9: what each child's projector takes, the image's tokens in the answer, the GPU
    # child's state at the end.
    media: dict[str, Any] | None = None
    # Scenario 10: the first turn, the mirror, the warm and the cold second turns' figures (time
    # to first token, prompt tokens cached), their ratio, the GPU child's state at the end.
    conversation: dict[str, Any] | None = None
    # Scenario 11: when the GPU child was back, the answer's end, each child's speeds as
    # Spillway measured them, and (once judged) what the stream did: `moved` (waited,
    # failed_back or None), the token it moved at, the rest's forecast and time.
    returned: dict[str, Any] | None = None
    skipped: str | None = None  # why it did not run (6 outside router mode, 8 without [small],
    # 9 without a projector, 10 without mirroring), or, having run, showed nothing (11 where
    # the GPU child is not faster)

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number, "name": self.name, "bar": self.bar,
            "simulated": self.simulated, "passed": self.passed, "verdict": self.verdict,
            "requests": [r.to_json() for r in self.requests],
            "tool_effects": self.tool_effects, "executions": self.executions,
            "notes": self.notes, "models": self.models, "media": self.media,
            "conversation": self.conversation, "returned": self.returned,
        }

    def skip_json(self) -> dict[str, Any]:
        return {"number": self.number, "name": self.name, "bar": self.bar,
                "why": self.skipped, "returned": self.returned}


Progress = Callable[[str], None]


class Drill:
    def __init__(self, client: DrillClient, provoker: Provoker, progress: Progress,
                 prompt_tokens: int, settle_s: float = 180.0,
                 second_model: str | None = None) -> None:
        self.client = client
        self.provoker = provoker
        self.say = progress
        self.prompt_tokens = prompt_tokens
        self.settle_s = settle_s
        self.model = client.model  # router mode: the drilled model (A); None: single-model
        self.second = second_model  # router mode: the model that loads next to it (B)
        self._words_per_token: dict[str | None, float] = {}  # by child (None: the model's)
        self._per_s: float | None = None  # the GPU child's tokens a second, once measured
        # The CPU child's first answer, where the drill had it answer one so that Spillway knew
        # its speed (speeds_known); None when it knew it already, or before it was asked.
        self.learned: dict[str, Any] | None = None
        self._speeds_checked = False

    @property
    def gpu(self) -> str:
        """What must be back: the GPU child, or A on the GPU router."""
        return "the GPU child" if self.model is None else \
            f"model {self.model} on the GPU router"

    # --- helpers ------------------------------------------------------------------------------

    async def prompt(self, tokens: int, child: str | None = None) -> str:
        """About `tokens` tokens of text, as the model's own tokenizer counts them (`child`:
        as that child's model counts them, /tokenize pinned to it: the small child's model has
        a tokenizer of its own; the model's count when that child cannot say)."""
        count = max(1, int(tokens * await self._words_per(child)))
        return " ".join((WORDS * (count // len(WORDS) + 1))[:count])

    async def _words_per(self, child: str | None) -> float:
        """Words per token of WORDS, as `child`'s model (None: the model's) counts them."""
        if child in self._words_per_token:
            return self._words_per_token[child]
        sample = " ".join(WORDS * 10)
        body: dict[str, Any] = {"content": sample}
        path = "/tokenize"
        if self.model is not None:  # the model's own tokenizer, on a router
            body["model"] = self.model
            path += f"?model={urllib.parse.quote(self.model)}"
        pin = {} if child is None else {"X-Spillway-Child": child}
        try:
            n = len((await self.client.post_json(path, body, **pin)).get("tokens", []))
        except Exception:  # noqa: BLE001 - a rough prompt is still a prompt
            n = 0
        if not n:  # not cached: the child (or the model's, when it is down) may answer later
            return 1.0 if child is None else await self._words_per(None)
        self._words_per_token[child] = len(WORDS) * 10 / n
        return self._words_per_token[child]

    async def messages(self, tokens: int, note: str = "") -> list[dict[str, Any]]:
        text = await self.prompt(tokens)
        return [{"role": "user", "content": f"{note} Summarise: {text}"}]

    async def armed(self, asked: int) -> tuple[int, dict[str, Any]]:
        """max_tokens and the extra fields of a request the simulated failure is armed for
        (asked before the failure is armed: it may measure the GPU child's speed). The arm acts
        as Spillway reads the child's task-launch line, while the child goes on: a small fast
        model (the tests' own) answered a few tokens whole before the line was read on a busy
        machine, and nothing was caught. So, simulated: about a second of answer at the GPU
        child's own speed, its end of text ignored, at most half a slot (the prompt may leave
        less: the answer then stops at the slot's end), never less than asked. With ballast (a
        real GPU) the memory fails the request, not a read: as asked."""
        if not self.provoker.simulated:
            return asked, {}
        wanted = max(asked, int(await self._speed()))
        slots = [int(ctx) for child in (GPU_CHILD, CPU_CHILD)
                 if (ctx := self._info(await self.client.status(), child).get("ctx_per_slot"))]
        if slots:
            wanted = min(wanted, max(asked, min(slots) // 2))
        return wanted, {"ignore_eos": True}

    async def settle(self) -> None:
        """Wait until the GPU child (router mode: A on the GPU router) is back before the next
        scenario."""
        if not await self.client.wait_state("gpu", ("READY",), self.settle_s, self.model):
            self.say(f"  {self.gpu} is not back; going on")

    @contextlib.asynccontextmanager
    async def failing(self, provoker: Provoker | None = None) -> AsyncIterator[None]:
        """The failure armed for what follows; released as soon as the GPU child (router mode:
        A's instance on the GPU router) is down."""
        provoker = provoker or self.provoker
        await provoker.arm()
        watcher = asyncio.create_task(self._release_when_down(provoker))
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await provoker.after_failure()

    async def _release_when_down(self, provoker: Provoker) -> None:
        while state_of(await self.client.status(), "gpu", self.model) == "READY":
            await asyncio.sleep(0.05)
        await provoker.after_failure()

    async def attach_incidents(self, results: list[ScenarioResult]) -> None:
        by_id: dict[str, list[dict[str, Any]]] = {}
        for record in await self.client.incidents():  # (oldest first)
            by_id.setdefault(record["request_id"], []).append(record)
        for result in results:
            for sent in result.requests:
                sent.incidents = by_id.get(sent.request_id, [])
                sent.incident = sent.incidents[-1] if sent.incidents else None

    async def speeds_known(self) -> None:
        """Spillway forecasts a request's time on each child from that child's own answers
        (their timings): whether what a GPU death catches waits for the GPU child or goes to
        the CPU child, and whether a stream moves back (serving/failover.py, failback.py). A
        CPU child that has answered nothing has no speed, and a replay or a continuation then
        waits for the GPU child as if the CPU child could not take it. So, once a drill, before
        the first scenario that fails the GPU child: where Spillway knows no generation speed
        of the CPU child, the CPU child answers one short request, sent while the GPU child is
        down (Spillway's SIGABRT at the drill's word, as in scenario 7)."""
        if self._speeds_checked:
            return
        self._speeds_checked = True
        if self._generation(await self.client.status(), CPU_CHILD) is not None:
            return
        self.say("  Spillway knows no speed of the CPU child (it has answered nothing): one "
                 f"short answer from it first, while {self.gpu} is stopped")
        await self.settle()
        messages = await self.messages(16, "Warm up.")  # (counted while the GPU child is up)
        stopped = await self.client.arm(self._now())
        if not stopped.get("sent") or not await self._gpu_down(30.0):
            self.say(f"  {self.gpu} could not be stopped ({stopped}); going on")
            return
        # (As the GPU child's own measure: the same prompt, 64 tokens.)
        sent = await self.client.chat(0, messages, 64, extra={"ignore_eos": True})
        await self.settle()
        self.learned = {"request_id": sent.request_id, "child": sent.child,
                        "status": sent.status,
                        "tokens_per_s": self._info(await self.client.status(),
                                                   CPU_CHILD).get("tokens_per_s")}

    def _generation(self, status: dict[str, Any], child: str) -> float | None:
        """A child's generation speed as Spillway measured it (tokens a second); None before
        it has answered."""
        speed = (self._info(status, child).get("tokens_per_s") or {}).get("generation")
        return None if speed is None else float(speed)

    def _now(self) -> dict[str, Any]:
        """The arm's body that stops the GPU child (router mode: A's instance) at once."""
        body: dict[str, Any] = {"now": True}
        if self.model is not None:
            body["model"] = self.model
        return body

    async def _gpu_down(self, timeout: float) -> bool:
        """Until the GPU child (router mode: A on the GPU router) is no longer READY."""
        deadline = time.monotonic() + timeout
        while state_of(await self.client.status(), GPU_CHILD, self.model) == "READY":
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    # --- the scenarios ------------------------------------------------------------------------

    def _new(self, number: int, name: str, bar: str) -> ScenarioResult:
        self.say(f"[{number}/{SCENARIOS}] {name}")
        return ScenarioResult(number, name, bar, self.provoker.simulated)

    def _skip(self, r: ScenarioResult, why: str) -> ScenarioResult:
        self.say(f"  skipped: {why}")
        r.skipped = why
        return r

    async def _executions(self, before: dict[str, int]) -> dict[str, int]:
        after = await self.client.tasks_started()
        return {k: after[k] - before.get(k, 0) for k in after}

    async def non_streaming(self) -> ScenarioResult:
        r = self._new(1, "a non-streaming request over the GPU profile",
                      "completed once on the CPU child (2 attempts), request id kept (or "
                      "on the GPU child once back, `waited`, where Spillway found that sooner "
                      "and the death was no out-of-memory in its prefill)")
        await self.speeds_known()
        tokens, extra = await self.armed(16)
        before = await self.client.tasks_started()
        async with self.failing():
            sent = await self.client.chat(1, await self.messages(self.prompt_tokens), tokens,
                                          extra=extra)
        r.requests.append(sent)
        r.executions = await self._executions(before)
        await self.settle()
        return r

    async def streaming(self) -> ScenarioResult:
        r = self._new(2, "the same request, streamed",
                      "a whole stream ([DONE], no error event) from the CPU child, 2 attempts "
                      "(or from the GPU child once back, as 1)")
        await self.speeds_known()
        tokens, extra = await self.armed(16)
        async with self.failing():
            sent = await self.client.chat(2, await self.messages(self.prompt_tokens), tokens,
                                          stream=True, extra=extra)
        r.requests.append(sent)
        await self.settle()
        return r

    async def cancellation(self) -> ScenarioResult:
        r = self._new(3, "cancellation: the client leaves during the failover",
                      "the replay is cancelled with its client: no work left on the CPU child")
        await self.speeds_known()
        tokens, extra = await self.armed(400)
        async with self.failing():
            sent = await self.client.chat(3, await self.messages(self.prompt_tokens), tokens,
                                          stream=True, leave_after_first_event=True,
                                          extra=extra)
        r.requests.append(sent)
        # The CPU child must let go of the abandoned replay (llama-server notices a closed
        # stream at its next write). Polled slowly: /slots answers wake llama-server's waits.
        deadline = time.monotonic() + 15
        path = "/slots" if self.model is None else \
            f"/slots?model={urllib.parse.quote(self.model)}"
        while time.monotonic() < deadline:
            slots = await self.client.get(path, **{"X-Spillway-Child": "cpu"})
            # (A router whose model is not loaded answers with an error object: no slots.)
            if not isinstance(slots, list) or not any(s.get("is_processing") for s in slots):
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
        await self.speeds_known()
        tokens, extra = await self.armed(48)
        before = await self.client.tasks_started()
        async with self.failing():
            tasks = [asyncio.create_task(self.client.chat(
                4, await self.messages(self.prompt_tokens // 2, f"client {i}."), tokens,
                stream=i % 2 == 1, extra=extra)) for i in range(clients)]
            r.requests.extend(await asyncio.gather(*tasks))
        r.executions = await self._executions(before)
        await self.settle()
        return r

    async def agent(self, steps: int = 4, fail_before_step: int = 2) -> ScenarioResult:
        r = self._new(5, "an agent: model calls and a simulated tool, the failure between a "
                         "tool call and the next model call",
                      "every tool call ran exactly once; every model call was answered")
        await self.speeds_known()
        effects: dict[int, int] = {}
        messages: list[dict[str, Any]] = await self.messages(self.prompt_tokens // 4,
                                                             "Plan a trip.")
        for step in range(steps):
            tokens, extra = 12, dict[str, Any]()
            if step == fail_before_step:
                tokens, extra = await self.armed(tokens)
                ctx: contextlib.AbstractAsyncContextManager[None] = self.failing()
            else:
                ctx = contextlib.nullcontext()
            async with ctx:
                answer = await self._model_call(r, messages, step, tokens, extra)
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

    async def _model_call(self, r: ScenarioResult, messages: list[dict[str, Any]],
                          step: int, tokens: int, extra: dict[str, Any]) -> str | None:
        """One model call, retried (never the tool) on a controlled error, with the same
        Idempotency-Key, as a careful agent does."""
        key = f"drill-agent-{id(r)}-step-{step}"
        for _ in range(4):
            sent = await self.client.chat(5, messages, tokens, extra=extra,
                                          headers={"Idempotency-Key": key})
            r.requests.append(sent)
            if sent.complete:
                return f"answer {step}"
            await asyncio.sleep(2.0)
        return None

    # --- scenario 7: a stream cut in the middle of its answer -----------------------------------

    async def continued_stream(self, cut_after: int = 8) -> ScenarioResult:
        r = self._new(7, "a stream cut in the middle of its answer",
                      "one whole stream ([DONE], no error event) that says it was continued, "
                      "its incident `continued` on the CPU child (or `waited`: continued by "
                      "the GPU child itself once back, where Spillway found that sooner)")
        self._mid_answer(r, cut_after)
        await self.speeds_known()
        await self.settle()
        max_tokens = await self._cut_answer(cut_after)
        r.requests.append(await self.client.chat(
            7, await self.messages(16, "Write a long story."), max_tokens, stream=True,
            extra={"ignore_eos": True}, cut=(cut_after, self._stopper(r))))
        await self.settle()
        return r

    def _mid_answer(self, r: ScenarioResult, cut_after: int) -> None:
        """Scenarios 7 and 11: the GPU child is stopped by Spillway's SIGABRT `cut_after`
        events into the answer, even on a GPU: ballast cannot be timed to the middle of an
        answer."""
        r.simulated = True
        if not self.provoker.simulated:
            self.say(f"  simulated, even on this GPU: Spillway's SIGABRT to {self.gpu} "
                     f"{cut_after} events into the answer")

    def _stopper(self, r: ScenarioResult,
                 info: dict[str, Any] | None = None) -> Callable[[], Awaitable[None]]:
        """What stops the GPU child at the cut; the wall-clock time of the word in
        `info["stopped_at"]`."""
        async def stop_the_gpu() -> None:
            if info is not None:
                info["stopped_at"] = time.time()
            answer = await self.client.arm(self._now())
            if not answer.get("sent"):
                r.notes.append(f"the GPU child could not be stopped: {answer}")
        return stop_the_gpu

    async def _cut_answer(self, cut_after: int, seconds: float = 3.0,
                          at_least: int = 0) -> int:
        """max_tokens for scenario 7's stream: about `seconds` of answer at the GPU child's own
        speed, so that the child is still generating when the drill's word to stop it arrives
        (the word goes from the drill through Spillway while the child goes on writing: a small
        fast model wrote a fixed 64 tokens, and then 370 tokens sized by a 2 s guess, before it
        on a busy machine, and the stream was never cut); within the smaller slot less its
        short prompt, so that the CPU child can go on from the cut; and at least 8 tokens an
        event read before the cut (and `at_least`: scenario 11's)."""
        floor = cut_after * 8
        wanted = max(floor, at_least, int(await self._speed() * seconds))
        status = await self.client.status()
        slots = [int(ctx) for child in (GPU_CHILD, CPU_CHILD)
                 if (ctx := self._info(status, child).get("ctx_per_slot"))]
        return min(wanted, max(floor, min(slots) - 64)) if slots else wanted

    def _info(self, status: dict[str, Any], child: str) -> dict[str, Any]:
        """A child's figures in the status; in router mode, the drilled model's on it."""
        if self.model is not None:
            return model_info(status, child, self.model)
        found: dict[str, Any] = status["children"].get(child) or {}
        return found

    # --- scenario 6: a second model takes the last VRAM (router mode) -------------------------

    async def second_model(self, clients: int = 4) -> ScenarioResult:
        a, b = self.model or "A", self.second or "B"
        r = self._new(6, "a second model takes the last VRAM",
                      f"every request for {a} completed or got a controlled error (503/502 "
                      f"JSON, or one SSE error event); {a}'s non-streaming work replayed on the "
                      f"CPU router and completed; {b} READY on the GPU router")
        r.simulated = True  # the neighbour's load is simulated, even on a GPU
        if self.model is None:
            return self._skip(r, "router mode only: this Spillway serves one model")
        if self.second is None:
            return self._skip(r, f"the routers list fewer than two models (only "
                                 f"{self.model}): there is no second model to load")
        if not self.provoker.simulated:
            self.say(f"  simulated, even on this GPU: {b}'s load kills {a}'s instance by "
                     "Spillway's SIGABRT")
        models: dict[str, Any] = {"model": a, "second_model": b}
        r.models = models
        await self.speeds_known()
        await self._unloaded(b)  # so that loading it spawns its instance
        await self.settle()
        max_tokens = await self._long_answer()
        async with self.failing(SimulatedFailure(self.client, a, when="neighbour_load")):
            r.requests.extend(await self._while_loading(models, max_tokens, clients))
        ready = await self.client.wait_state("gpu", ("READY",), self.settle_s, b)
        states = {b: state_of(await self.client.status(), "gpu", b)}
        if not ready:
            self.say(f"  model {b} is not READY on the GPU router")
        await self.settle()
        states[a] = state_of(await self.client.status(), "gpu", a)
        models["gpu_states_after"] = states
        return r

    async def _unloaded(self, model: str) -> None:
        """The model not loaded on the GPU router (unloaded when it is)."""
        if state_of(await self.client.status(), "gpu", model) == "STOPPED":
            return
        self.say(f"  unloading {model} from the GPU router first, so that loading it is a load")
        await self.client.post("/models/unload", {"model": model})
        await self.client.wait_state("gpu", ("STOPPED",), self.settle_s, model)

    async def _long_answer(self, seconds: float = 4.0) -> int:
        """max_tokens for an answer of about `seconds` on the GPU router (A's own speed, from a
        short request's timings), so that A's requests are still running when B loads."""
        per_s = await self._speed()
        return 256 if per_s <= 0 else max(64, min(4096, int(per_s * seconds)))

    async def _speed(self) -> float:
        """The GPU child's (router mode: A's on the GPU router) tokens a second, from a short
        answer's timings, measured once a drill; 0 when it cannot say."""
        if self._per_s is None:
            self._per_s = await self._measure_speed()
        return self._per_s

    async def _measure_speed(self) -> float:
        # 64 tokens: a child that has just started is slow for its first few (a 16-token
        # measure on a busy machine said 185 tokens a second of a child that then ran 1,440).
        body: dict[str, Any] = {"max_tokens": 64, "temperature": 0, "ignore_eos": True,
                                "messages": await self.messages(16, "Warm up.")}
        if self.model is not None:
            body["model"] = self.model
        try:
            # (PLAIN where a small child serves: the speed is the GPU child's, not its.)
            pin = {"X-Spillway-Fallback": self.client.fallback} if self.client.fallback else {}
            answer = await self.client.post_json("/v1/chat/completions", body, **pin)
            return float((answer.get("timings") or {}).get("predicted_per_second") or 0)
        except Exception:  # noqa: BLE001 - a guess is still a length
            return 0.0

    async def _while_loading(self, models: dict[str, Any], max_tokens: int,
                             clients: int) -> list[Sent]:
        """A's requests on the GPU router, first a non-streaming one, then a stream and
        `clients` more (streamed and not), and B loaded there while they run; what was in
        flight and the load's answer go into `models`."""
        second = models["second_model"]
        extra = {"ignore_eos": True}
        first = asyncio.create_task(self.client.chat(
            6, await self.messages(16, "Write a long story."), max_tokens, extra=extra))
        await self._in_flight_on_gpu(1)
        rest = [asyncio.create_task(self.client.chat(
            6, await self.messages(16, f"Client {i}: write a long story."), max_tokens,
            stream=i % 2 == 0, extra=extra)) for i in range(clients + 1)]
        cap = int(model_info(await self.client.status(), "gpu", self.model or "")
                  .get("cap") or 1)
        models["in_flight_on_gpu"] = await self._in_flight_on_gpu(min(2, cap))
        self.say(f"  {models['in_flight_on_gpu']} request(s) for {self.model} in flight on "
                 f"the GPU router; loading {second} there")
        code, text = await self.client.post("/models/load", {"model": second})
        models.update(load_status=code, load_answer=text[:300])
        return list(await asyncio.gather(first, *rest))

    async def _in_flight_on_gpu(self, count: int, timeout: float = 5.0) -> int:
        """Until `count` requests for A run on the GPU router; how many do."""
        deadline = time.monotonic() + timeout
        while True:
            found = int(model_info(await self.client.status(), "gpu", self.model or "")
                        .get("in_flight") or 0)
            if found >= count or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.02)

    # --- scenario 8: the small model answers while the large one reloads ----------------------

    async def smaller_model(self, opted_in: int = 3, plain: int = 3) -> ScenarioResult:
        r = self._new(8, "the small model answers while the large one reloads",
                      "the opted-in request the GPU child lost was rerouted to the small child "
                      "(incident `rerouted`, replay_child small); the opted-in requests sent "
                      "while the GPU child was down were answered by the small child (not with "
                      "the large model's name), the others by the GPU or CPU child; none lost, "
                      "request ids kept")
        small = (await self.client.status())["children"].get(SMALL_CHILD)
        if small is None:
            return self._skip(r, "no [small] child configured")
        await self.speeds_known()
        mode = str(small.get("mode") or "resident")
        info: dict[str, Any] = {"small_mode": mode}
        r.models = info
        # Settled: the GPU child READY, the small child READY (on demand: it may be STOPPED,
        # to be started into the VRAM the GPU child's death frees).
        await self.settle()
        settled = ("READY",) if mode == "resident" else ("READY", "STOPPED")
        if not await self.client.wait_state(SMALL_CHILD, settled, self.settle_s):
            self.say(f"  the small child is not {' or '.join(settled)}; going on")
        status = await self.client.status()
        text = await self._for_both(status)
        gpu_was = state_of(status, GPU_CHILD)
        # The request the GPU child loses accepts the smaller model: rerouted, not replayed.
        tokens, extra = await self.armed(16)
        async with self.failing():
            first = await self.client.chat(8, [{"role": "user", "content": f"Summarise: {text}"}],
                                           tokens, headers=SMALLER, extra=extra)
        first.gpu_when_sent = gpu_was
        r.requests.append(first)
        # While the GPU child is down: more that accept the smaller model (as many as the small
        # child has room for) and as many that do not, together.
        status = await self._small_serving_while_gpu_down()
        gpu_now = state_of(status, GPU_CHILD)
        room = int(status["children"][SMALL_CHILD].get("cap") or 1) - int(
            status["children"][SMALL_CHILD].get("busy") or 0)
        count = max(1, min(opted_in, room))
        info.update(gpu_when_sent=gpu_now, opted_in=count, plain=plain)
        self.say(f"  the GPU child is {gpu_now}: {count} opted-in and {plain} plain request(s)")
        batch = [self.client.chat(8, await self.messages(16, f"Client {i}: name a colour."), 8,
                                  stream=i % 2 == 1, headers=SMALLER) for i in range(count)]
        batch += [self.client.chat(8, await self.messages(16, f"Client {i}: name a city."), 8,
                                   stream=i % 2 == 1, headers=PLAIN) for i in range(plain)]
        for sent in await asyncio.gather(*batch):
            sent.gpu_when_sent = gpu_now
            r.requests.append(sent)
        await self.settle()
        return r

    async def _for_both(self, status: dict[str, Any]) -> str:
        """The text of a request over the GPU's profile, as long as the small model can take it
        too, in its own tokens (many more for the same text, with another tokenizer). Its own
        count when it is READY; else (on demand, stopped) at most a token per character, in the
        slot context it had when it last ran, or the 16 tokens of the other requests if it never
        ran."""
        text = await self.prompt(self.prompt_tokens)
        ctx = status["children"][SMALL_CHILD].get("ctx_per_slot")
        if ctx and state_of(status, SMALL_CHILD) == "READY":
            return min(text, await self.prompt(int(ctx * 0.6), SMALL_CHILD), key=len)
        if not ctx:
            return min(text, await self.prompt(16), key=len)
        words, used = [], 0
        for word in text.split():  # no tokenizer makes more tokens than this text has bytes
            used += len(word) + 1
            if used > ctx * 0.6:
                break
            words.append(word)
        return " ".join(words) or WORDS[0]

    async def _small_serving_while_gpu_down(self) -> dict[str, Any]:
        """The status once the small child is READY (on demand: started as the GPU child died,
        or for the rerouted request), or once the GPU child is back and the moment has gone."""
        deadline = time.monotonic() + self.settle_s
        while True:
            status = await self.client.status()
            if state_of(status, SMALL_CHILD) == "READY" or \
                    state_of(status, GPU_CHILD) == "READY" or time.monotonic() > deadline:
                return status
            await asyncio.sleep(0.05)


    # --- scenario 9: an image request takes the last VRAM -------------------------------------

    async def image_request(self, plain: int = 2) -> ScenarioResult:
        r = self._new(9, "an image request takes the last VRAM",
                      "the image request answered (200) by the CPU child with its image (2 "
                      "attempts, its incident `replayed` on the CPU child, or, as 1, `waited` "
                      "on the GPU child once back; the image's tokens in the answer's prompt); "
                      "the plain requests sent during the failure "
                      f"answered; {self.gpu} READY again")
        takes = await self._modalities()
        info: dict[str, Any] = {"modalities": takes, "gpu": self.gpu}
        r.media = info
        if "vision" not in (takes.get(GPU_CHILD) or []):
            said = takes.get(GPU_CHILD)
            return self._skip(r, "no projector: the GPU child's /props `modalities` say it "
                                 "takes no images (start the model with --mmproj)"
                              if said is not None else
                              "the GPU child's /props say nothing of its projector: no image "
                              "can be sent to it")
        if "vision" not in (takes.get(CPU_CHILD) or []):
            self.say("  the CPU child's /props say it takes no images: the image request has "
                     "nowhere to go when the GPU child loses it")
        await self.speeds_known()
        await self.settle()
        text = f"Describe this image, then summarise: {await self.prompt(self.prompt_tokens)}"
        info["text_tokens"] = await self._count([{"role": "user", "content": text}])
        # The image first: its encoder runs before the long text is decoded, so that on a GPU
        # its allocation is the one that meets the card short.
        messages = [{"role": "user", "content": [image_part(png()),
                                                 {"type": "text", "text": text}]}]
        tokens, extra = await self.armed(16)
        before = await self.client.tasks_started()
        async with self.failing():
            image = asyncio.create_task(self.client.chat(9, messages, tokens, extra=extra))
            await self._image_launched(image, before.get(GPU_CHILD, 0))
            # Plain requests while the image request is failed over, streamed and not.
            others = [asyncio.create_task(self.client.chat(
                9, await self.messages(16, f"Client {i}: name a colour."), 8,
                stream=i % 2 == 1)) for i in range(plain)]
            r.requests.extend(await asyncio.gather(image, *others))
        first = r.requests[0]
        counted = info["text_tokens"]
        info["prompt_tokens"] = first.prompt_tokens or None
        info["image_tokens"] = first.prompt_tokens - counted if counted and \
            first.prompt_tokens else None
        await self.settle()
        info["gpu_after"] = state_of(await self.client.status(), GPU_CHILD, self.model)
        return r

    async def _modalities(self) -> dict[str, list[str] | None]:
        """What the GPU and the CPU child's projectors take, as each one's /props `modalities`
        say (router mode: the drilled model's instance on each router); the status's figure
        (read from the same /props as the child became READY) where /props does not answer;
        None where neither says."""
        status = await self.client.status()
        path = "/props" if self.model is None else \
            f"/props?model={urllib.parse.quote(self.model)}"
        out: dict[str, list[str] | None] = {}
        for child in (GPU_CHILD, CPU_CHILD):
            if child not in status["children"]:
                continue
            try:
                props = await self.client.get(path, **{"X-Spillway-Child": child})
            except Exception:  # noqa: BLE001 - the status may still say
                props = None
            said = props.get("modalities") if isinstance(props, dict) else None
            if isinstance(said, dict):
                out[child] = sorted(k for k, v in said.items() if v is True)
            else:
                known = self._info(status, child).get("modalities")
                out[child] = None if known is None else [str(m) for m in known]
        return out

    async def _count(self, messages: list[dict[str, Any]]) -> int | None:
        """The prompt tokens of a chat request's messages, as the model counts them
        (`/v1/chat/completions/input_tokens`); None when it cannot say."""
        body: dict[str, Any] = {"messages": messages}
        if self.model is not None:
            body["model"] = self.model
        try:
            answer = await self.client.post_json("/v1/chat/completions/input_tokens", body)
            return int(answer["input_tokens"])
        except Exception:  # noqa: BLE001 - the image's tokens are then not known
            return None

    async def _image_launched(self, image: asyncio.Task[Sent], before: int,
                              timeout: float = 30.0) -> None:
        """Until the image request's task has launched on the GPU child (its count of started
        tasks grew), the GPU child is down, or the request is over."""
        deadline = time.monotonic() + timeout
        while not image.done() and time.monotonic() < deadline:
            status = await self.client.status()
            gpu = status["children"].get(GPU_CHILD) or {}
            if int(gpu.get("tasks_started") or 0) > before or \
                    state_of(status, GPU_CHILD, self.model) != "READY":
                return
            await asyncio.sleep(0.02)


    # --- scenario 10: a long conversation fails over ------------------------------------------

    async def long_conversation(self, mirror_wait_s: float = 60.0) -> ScenarioResult:
        r = self._new(10, "a long conversation fails over",
                      "its second turn, lost by the GPU child, answered (200, a whole stream) "
                      "by the CPU child, which the conversation was mirrored to: at least "
                      f"{WARM_SHARE:.0%} of the first turn's prompt tokens found in its cache "
                      "(timings.cache_n), and its first token sooner than that of the same turn "
                      "of a cold conversation (as long, never mirrored, lost and replayed the "
                      f"same way, mostly uncached); {self.gpu} READY again")
        why = no_mirror(await self.client.status())
        if why is not None:
            return self._skip(r, why)
        await self.speeds_known()
        await self.settle()
        # Two conversations of the same length that share no prefix (their own tag first, the
        # same words in the reverse order): the warm one's first turn is answered by the GPU
        # child and mirrored; the cold one's never reaches any child, so that neither child holds
        # a token of it (its answer is the warm one's, its questions the same).
        text = await self.prompt(self.prompt_tokens)
        question, follow = "Summarise the document in one line.", "And what of the servers?"
        warm_system = f"Conversation {uuid.uuid4().hex[:8]}. {text}"
        cold_system = f"Conversation {uuid.uuid4().hex[:8]}. {' '.join(text.split()[::-1])}"
        first = [{"role": "system", "content": warm_system}, {"role": "user", "content": question}]
        info: dict[str, Any] = {"gpu": self.gpu, "mirror_wait_s": mirror_wait_s}
        r.conversation = info
        one = await self.client.chat(10, first, 16, extra={"ignore_eos": True}, keep=True)
        r.requests.append(one)
        info["first"] = _turn(one)
        if not (one.complete and one.child == GPU_CHILD):
            r.notes.append(f"{one.request_id}: the first turn was not answered by the GPU child "
                           f"(status {one.status}, child {one.child}): nothing to mirror")
            return await self._conversation_end(r)
        info["mirror"] = await self._mirrored(mirror_wait_s)
        if not info["mirror"]["mirrored"]:
            r.notes.append(f"the first turn ({one.prompt_tokens} prompt tokens) was not "
                           f"mirrored to the CPU child within {mirror_wait_s:.0f} s (status "
                           f"`mirror`: {info['mirror']['status']}; a conversation over "
                           "cpu.mirror_max_prompt_tokens is never mirrored)")
            return await self._conversation_end(r)
        answer = [{"role": "assistant", "content": one.answer or ""},
                  {"role": "user", "content": follow}]
        # The cold turn first: the GPU child's death in it empties its cache, so that the warm
        # turn's prefill on the GPU child is as long as the cold one's, and its simulated death
        # (at the task's launch) lands before its first token, as a real OOM's does.
        prefill_s = (one.prompt_ms or 0.0) / 1000
        cold = await self._lost_turn([{"role": "system", "content": cold_system},
                                      {"role": "user", "content": question}, *answer], prefill_s)
        warm = await self._lost_turn([*first, *answer], prefill_s)
        r.requests.extend([cold, warm])
        info["cold"], info["warm"] = _turn(cold), _turn(warm)
        if warm.ttft_s and cold.ttft_s:
            info["warm_over_cold"] = round(warm.ttft_s / cold.ttft_s, 3)
        return await self._conversation_end(r)

    async def _mirrored(self, timeout: float) -> dict[str, Any]:
        """Until the CPU child has mirrored one more conversation, this one (the newest goes
        first, and none older was running: the first turn's own work would have cancelled it),
        or `timeout` seconds; what the status said, and how long it took."""
        began = time.monotonic()
        before = int(((await self.client.status()).get("mirror") or {}).get("mirrored") or 0)
        while True:
            mirror = (await self.client.status()).get("mirror") or {}
            done = int(mirror.get("mirrored") or 0) > before
            if done or time.monotonic() - began > timeout:
                return {"mirrored": done, "waited_s": round(time.monotonic() - began, 2),
                        "status": {k: mirror.get(k) for k in (
                            "queued", "warm_prefixes", "warm_tokens", "mirrored", "cancelled",
                            "budget_used_s")}}
            await asyncio.sleep(0.1)

    async def _lost_turn(self, messages: list[dict[str, Any]], prefill_s: float) -> Sent:
        """A second turn, streamed, lost by the GPU child as its task launches (the failure
        armed as for 1 to 5) and replayed on the CPU child; then the GPU child back. Simulated,
        the answer armed() asks for keeps the GPU child at work for about a second after the
        launch; the GPU child's prefill of this turn (as long as the first turn's, `prefill_s`:
        it holds nothing of it) counts toward that second, and the CPU child is spared the
        rest of the answer (its time to first token is the figure, not its answer)."""
        tokens, extra = await self.armed(16)
        if self.provoker.simulated and prefill_s > 0:
            tokens = max(16, min(tokens, int(await self._speed() * max(0.0, 1.0 - prefill_s))))
        async with self.failing():
            sent = await self.client.chat(10, messages, tokens, stream=True, extra=extra)
        await self.settle()
        return sent

    async def _conversation_end(self, r: ScenarioResult) -> ScenarioResult:
        await self.settle()
        assert r.conversation is not None
        r.conversation["gpu_after"] = state_of(await self.client.status(), GPU_CHILD,
                                               self.model)
        return r

    # --- scenario 11: the GPU child comes back mid-answer -------------------------------------

    async def gpu_returns(self, cut_after: int = 8) -> ScenarioResult:
        r = self._new(11, "the GPU child comes back mid-answer",
                      "one whole stream ([DONE], no error event), cut by the GPU child's death "
                      "and continued, that went on from the GPU child once it was back: its "
                      "incidents `continued` on the CPU child then `failed_back` on the GPU "
                      "child, or `waited` on the GPU child, each with its forecast beside what "
                      "the rest took; the GPU child READY at the end. Skipped, with the "
                      "figures, where the GPU child is not faster than the CPU child: the rule "
                      "then keeps the stream on the CPU child")
        self._mid_answer(r, cut_after)
        await self.speeds_known()
        await self.settle()
        info: dict[str, Any] = {"gpu": self.gpu}
        r.returned = info
        info["max_tokens"] = await self._cut_answer(cut_after,
                                                    at_least=await self._past_return(cut_after))
        watcher = asyncio.create_task(self._speeds_on_return(info))
        try:
            sent = await self.client.chat(
                11, await self.messages(16, "Write a long story."), info["max_tokens"],
                stream=True, extra={"ignore_eos": True}, cut=(cut_after, self._stopper(r, info)))
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        r.requests.append(sent)
        await self.settle()
        info["gpu_after"] = state_of(await self.client.status(), GPU_CHILD, self.model)
        stopped = info.get("stopped_at")
        if stopped is not None:
            info["gpu_back_after_s"] = await self._back_after(stopped)
            info["answer_after_stop_s"] = round(sent.ended - stopped, 3)
        return r

    async def _speeds_on_return(self, info: dict[str, Any]) -> None:
        """Scenario 11: each child's speeds as Spillway knew them when the GPU child was READY
        again after the drill's word (what the fail-back rule then weighed: the CPU child's own
        answer, still running, is not in them yet), into `info["speeds"]`."""
        while "stopped_at" not in info:
            await asyncio.sleep(0.05)
        await self._gpu_down(30.0)
        while True:
            status = await self.client.status()
            if state_of(status, GPU_CHILD, self.model) == "READY":
                info["speeds"] = {child: self._info(status, child).get("tokens_per_s")
                                  for child in (GPU_CHILD, CPU_CHILD)}
                return
            await asyncio.sleep(0.05)

    async def _past_return(self, cut_after: int) -> int:
        """Scenario 11's answer: long enough that the CPU child, at its measured speed, is
        still writing it well after the GPU child is back (its last start and a second of
        back-off, three times over, and at least 10 s), so that a rest is left to move (the
        smaller slot may cut it short); 0 while the CPU child's speed is not known."""
        status = await self.client.status()
        gpu = self._info(status, GPU_CHILD)
        start = float(gpu.get("last_start_s") or gpu.get("last_load_s") or 5.0)
        return cut_after + int((self._generation(status, CPU_CHILD) or 0.0) *
                               max(10.0, 3 * (start + 1.0)))

    async def _back_after(self, since: float) -> float | None:
        """Seconds from `since` (wall clock) to the GPU child's (router mode: A's) first READY
        after it, in Spillway's own timeline; None when it was not back."""
        events = (await self.client.get(f"/spillway/timeline?since={since:.3f}"))["events"]
        back = [e["time"] for e in events if e["child"] == GPU_CHILD and
                e.get("model") == self.model and e["state"] == "READY" and e["time"] > since]
        return round(min(back) - since, 3) if back else None


def no_mirror(status: dict[str, Any]) -> str | None:
    """Scenario 10: why there is no warm CPU child to fail over to (None: there is one)."""
    if status.get("router"):
        return "router mode does not mirror conversations to the CPU router (yet)"
    mirror = status.get("mirror")
    if mirror is None:
        return "this Spillway does not mirror conversations (its status has no `mirror`)"
    if not mirror.get("enabled"):
        mode = (status.get("children", {}).get(CPU_CHILD) or {}).get("mode")
        return ("mirroring is off: the CPU child is on demand (it is stopped when idle)"
                if mode == "on-demand" else "mirroring is off (cpu.mirror = false)")
    return None


def _identity(s: Sent) -> list[str]:
    """The request's identity survived: its id kept, its incident its own."""
    problems = []
    if s.status is not None and not s.request_id_kept:
        problems.append(f"{s.request_id}: X-Request-Id not kept")
    if s.incident is not None and s.incident.get("request_id") != s.request_id:
        problems.append(f"{s.request_id}: the incident names another request")
    return problems


def _taken_over_by(s: Sent) -> str | None:
    """The child the failover rule lets answer a request the GPU child lost before its answer
    began, by its incident: the CPU child (`replayed`), or the GPU child itself once back
    (`waited`, where Spillway expected that sooner), but never after an out-of-memory death in
    its prefill, which would take the same memory again (policy/replay.own_size_suspect; the
    simulated failure is a SIGABRT, which names no request's size). None: neither."""
    inc = s.incident or {}
    step = (inc.get("decision"), inc.get("replay_child"))
    if step == ("replayed", CPU_CHILD):
        return CPU_CHILD
    try:
        kind = FailureKind(str(inc.get("kind")))
    except ValueError:
        kind = FailureKind.NONE
    if step == ("waited", GPU_CHILD) and not own_size_suspect(kind, answer_started=False):
        return GPU_CHILD
    return None


def _judge_failover(r: ScenarioResult) -> list[str]:
    """Scenarios 1 and 2: completed on the CPU child after a failover, recorded as replayed
    (or on the GPU child once back, recorded as waited, where the rule allows that)."""
    s = r.requests[0]
    problems = _identity(s)
    by = _taken_over_by(s)
    if not (s.complete and s.attempts == 2 and s.child == (by or CPU_CHILD)):
        problems.append(f"not completed on the {by or CPU_CHILD} child after a failover: "
                        f"status {s.status}, attempts {s.attempts}, {s.note}")
    if s.error_event:
        problems.append("the stream ended with an error event")
    if by is None:
        problems.append("no incident recording the replay (or a wait for the GPU child's "
                        "return that the rule allows)")
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
    problems = _each_ended_well(r)
    if not any(s.incident for s in r.requests):
        problems.append("no request was caught in the failure")
    return problems


def _each_ended_well(r: ScenarioResult) -> list[str]:
    """Each request kept its identity and ended complete or with a controlled error."""
    problems = []
    for s in r.requests:
        problems += _identity(s)
        if not (s.complete or s.controlled or s.error_event):
            problems.append(f"{s.request_id}: neither completed nor a controlled error "
                            f"({s.status}, {s.note})")
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


def _judge_second_model(r: ScenarioResult) -> list[str]:
    """Scenario 6: every request for A ended complete or with a controlled error, none of A's
    non-streaming work was lost (replayed on the CPU router for A), and B is READY on the GPU
    router."""
    models = r.models or {}
    a, b = models.get("model"), models.get("second_model")
    problems = _each_ended_well(r)
    problems += [f"{s.request_id}: answered for model {s.model}, not {a}"
                 for s in r.requests if s.model is not None and s.model != a]
    whole = [s for s in r.requests if not s.stream]
    lost = [s.request_id for s in whole if not s.complete]
    if lost:
        problems.append(f"{a}'s work lost: {', '.join(lost)} never completed")
    caught = [s for s in whole if s.incident is not None]
    for s in caught:
        inc = s.incident or {}
        if (inc.get("decision"), inc.get("replay_child"), inc.get("model")) != \
                ("replayed", "cpu", a):
            problems.append(f"{s.request_id}: its incident says {inc.get('decision')} on "
                            f"{inc.get('replay_child')} for {inc.get('model')}, not replayed "
                            f"on the CPU router for {a}")
    if not caught:
        problems.append(f"no non-streaming request for {a} was caught on the GPU router when "
                        f"{b} loaded")
    if models.get("load_status") != 200:
        problems.append(f"loading {b} answered {models.get('load_status')}: "
                        f"{models.get('load_answer')}")
    state = (models.get("gpu_states_after") or {}).get(b)
    if state != "READY":
        problems.append(f"{b} is {state} on the GPU router, not READY")
    return problems


def _judge_continued(r: ScenarioResult) -> list[str]:
    """Scenario 7: the stream cut mid-answer went on from the CPU child (or from the GPU child
    once back, where Spillway found that sooner), as one stream."""
    s = r.requests[0]
    problems = _cut_whole(s) + r.notes
    inc = _first_incident(s)  # (a stream continued on the CPU child may fail back after)
    if inc is None or (inc.get("decision"), inc.get("replay_child")) not in (
            ("continued", CPU_CHILD), ("waited", GPU_CHILD)):
        problems.append(f"its incident says {None if inc is None else inc.get('decision')}, "
                        "not continued on the CPU child (nor waited for the GPU child)")
    return problems


def _cut_whole(s: Sent) -> list[str]:
    """Scenarios 7 and 11: the stream was cut in its middle, and the client got it whole."""
    problems = _identity(s)
    if s.cut_at is None:
        problems.append("the answer ended before the GPU child was stopped in its middle")
    if not s.complete or s.error_event:
        problems.append(f"not one whole stream: {s.note or 'no [DONE]'}")
    if not s.continued:
        problems.append("the stream does not say it was continued")
    return problems


def _first_incident(s: Sent) -> dict[str, Any] | None:
    return s.incidents[0] if s.incidents else s.incident


# Scenario 11: what the daemon's records of the stream may say, oldest first, and what the
# stream then did once the GPU child was back.
_WENT_BACK = {(("waited", GPU_CHILD),): "waited",
              (("continued", CPU_CHILD), ("failed_back", GPU_CHILD)): "failed_back",
              (("continued", CPU_CHILD),): None}


def _judge_returned(r: ScenarioResult) -> list[str]:
    """Scenario 11: the stream cut mid-answer, whole, went on from the GPU child once it was
    back (`waited`, or `continued` then `failed_back`), its forecast beside what the rest took;
    the GPU child READY at the end. A stream that stayed on the CPU child is no failure where
    the rule keeps it there (the GPU child not faster, or back too late): the scenario is then
    skipped (`r.skipped`), with the figures; it fails where the GPU child was faster."""
    if not r.requests:
        return ["no stream was sent"]
    s, info = r.requests[0], r.returned if r.returned is not None else {}
    problems = _cut_whole(s) + r.notes
    if info.get("gpu_after") != "READY":
        problems.append(f"{info.get('gpu') or 'the GPU child'} is {info.get('gpu_after')} at "
                        "the end, not READY")
    records = s.incidents or ([s.incident] if s.incident else [])
    steps = tuple((str(i.get("decision")), str(i.get("replay_child"))) for i in records)
    info["decisions"] = [d for d, _ in steps]
    if steps not in _WENT_BACK:
        said = ", ".join(f"{d} on {c}" for d, c in steps) or "nothing"
        return problems + [f"its incidents say {said}: not continued then failed back, nor "
                           "waited"]
    info["moved"] = moved = _WENT_BACK[steps]
    if moved is None:
        return problems or _stayed(r, info, records[0])
    record = records[-1]
    info.update(tokens_before=record.get("tokens_before"), forecast_s=record.get("forecast_s"),
                took_s=record.get("took_s"), reason=record.get("reason"))
    if moved == "failed_back":
        info["continued_at"] = records[0].get("tokens_before")
        if (record.get("tokens_before") or 0) <= (info["continued_at"] or 0):
            problems.append(f"it failed back at token {record.get('tokens_before')}, not after "
                            f"the {info['continued_at']} it was continued at")
    if record.get("forecast_s") is None or record.get("took_s") is None:
        problems.append(f"its `{moved}` incident has no forecast beside what the rest took")
    return problems


def _stayed(r: ScenarioResult, info: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """Scenario 11's stream stayed on the CPU child: skipped where the rule keeps it there, a
    failure otherwise. The rule (policy/continuation.fail_back) moves a stream when the GPU
    child's rest (its prefill of the prompt and of the answer so far, then the rest at its
    speed) is expected in under FAIL_BACK_MARGIN of the CPU child's. Judged here by Spillway's
    own speeds as the GPU child came back, against the time the CPU child then really took,
    the prefill counted at its most (the whole answer's tokens): so a stay is a failure only
    where a fail-back was clearly due."""
    gpu = info.get("gpu") or "the GPU child"
    back, left = info.get("gpu_back_after_s"), info.get("answer_after_stop_s")
    continued = f"continued on the CPU child after {record.get('tokens_before')} tokens"
    if back is None or left is None or back >= left:
        r.skipped = (f"{gpu} was not back before the answer's end (back "
                     f"{_seconds(back)} after its death, the answer done {_seconds(left)} after "
                     f"it, {info.get('max_tokens')} tokens asked; {continued})")
        return []
    speeds = info.get("speeds") or {}
    fast = (speeds.get(GPU_CHILD) or {}).get("generation")
    slow = (speeds.get(CPU_CHILD) or {}).get("generation")
    reads = (speeds.get(GPU_CHILD) or {}).get("prompt")
    rest_s = left - back
    so_far = int(record.get("prompt_tokens") or 0) + r.requests[0].tokens
    ratio = "" if fast is None or not slow else f", {fast / slow:.2f}x"
    figures = (f"{gpu} generates {_or(fast)} tokens/s, the CPU child {_or(slow)}{ratio} "
               f"(Spillway's measures as it came back, {back:.1f} s after its death); the "
               f"CPU child took {rest_s:.1f} s for the rest")
    if not (fast and slow and reads):
        r.skipped = (f"Spillway had no forecast to move the stream by: {figures}, {gpu}'s "
                     f"prefill {_or(reads)} tokens/s; it stayed on the CPU child ({continued})")
        return []
    gpu_s = so_far / reads + rest_s * slow / fast
    if gpu_s >= FAIL_BACK_MARGIN * rest_s:
        why = ("the GPU child is not faster here by the margin a fail-back needs"
               if fast * FAIL_BACK_MARGIN <= slow else
               f"{gpu} came back too late in the answer for a fail-back to pay")
        r.skipped = (f"{why}: {figures}, which {gpu} would have taken about {gpu_s:.1f} s "
                     f"with its prefill of the {so_far} tokens so far (at most). A stream "
                     f"moves back only when the rest is expected in under "
                     f"{FAIL_BACK_MARGIN:.0%} of its time on the CPU child, so it stayed there "
                     f"({continued}), as the rule says")
        return []
    return [f"the stream stayed on the CPU child ({continued}) although {figures}, which "
            f"{gpu} would have taken about {gpu_s:.1f} s with its prefill of the {so_far} "
            f"tokens so far: a fail-back was due"]


def _or(value: Any) -> str:
    return "unknown" if value is None else str(value)


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _judge_smaller(r: ScenarioResult) -> list[str]:
    """Scenario 8: the opted-in request the GPU child lost went to the small child (rerouted);
    while the GPU child was down, the opted-in requests were the small child's and the others
    the GPU or CPU child's; every one answered whole, under its own id."""
    if not r.requests:
        return ["no request was sent"]
    first, rest = r.requests[0], r.requests[1:]
    problems = []
    for s in r.requests:
        problems += _identity(s)
        if s.status != 200 or not s.complete or s.error_event:
            problems.append(f"{s.request_id}: lost ({s.status}, {s.note or 'no whole answer'})")
    inc = first.incident
    if inc is None or (inc.get("decision"), inc.get("replay_child")) != ("rerouted",
                                                                          SMALL_CHILD):
        problems.append(f"{first.request_id}: the request the GPU child lost was not rerouted "
                        f"to the small child (its incident: "
                        f"{'none' if inc is None else inc.get('decision')} on "
                        f"{None if inc is None else inc.get('replay_child')})")
    if first.status == 200 and first.child != SMALL_CHILD:
        problems.append(f"{first.request_id}: opted in and lost by the GPU child, answered by "
                        f"the {first.child} child, not the small one")
    during = [s for s in rest if s.fallback == "smaller" and s.gpu_when_sent not in
              (None, "READY")]
    if not during:
        problems.append("no opted-in request was sent while the GPU child was down")
    problems += [f"{s.request_id}: opted in while the GPU child was {s.gpu_when_sent}, "
                 f"answered by the {s.child} child, not the small one"
                 for s in during if s.status == 200 and s.child != SMALL_CHILD]
    others = [s for s in rest if s.fallback != "smaller"]
    if not others:
        problems.append("no request that does not accept a smaller model was sent")
    problems += [f"{s.request_id}: not opted in, answered by the {s.child} child (only the "
                 "GPU or CPU child may)"
                 for s in others if s.status == 200 and s.child not in (GPU_CHILD, CPU_CHILD)]
    # The small model answers in its own name: never the one the GPU and CPU children serve.
    large = {s.answer_model for s in r.requests
             if s.child in (GPU_CHILD, CPU_CHILD) and s.answer_model}
    problems += [f"{s.request_id}: the small child answered as the large model "
                 f"({s.answer_model})"
                 for s in r.requests if s.child == SMALL_CHILD and s.answer_model in large]
    return problems


def _judge_image(r: ScenarioResult) -> list[str]:
    """Scenario 9: the image request the GPU child lost was replayed on the CPU child (or,
    where the rule allows, waited for the GPU child) and answered with its image; every plain
    request answered; the GPU child back."""
    if not r.requests:
        return ["no request was sent"]
    info = r.media or {}
    image, plain = r.requests[0], r.requests[1:]
    problems = [p for s in r.requests for p in _identity(s)]
    by = _taken_over_by(image)
    if not (image.status == 200 and image.complete and image.attempts == 2 and
            image.child == (by or CPU_CHILD)):
        problems.append(f"{image.request_id}: the image request was not answered by the "
                        f"{'GPU child once back' if by == GPU_CHILD else 'CPU child'} after a "
                        f"failover (status {image.status}, attempts {image.attempts}, child "
                        f"{image.child}{', ' if image.note else ''}{image.note})")
    inc = image.incident
    if by is None:
        problems.append(f"{image.request_id}: its incident says "
                        f"{'none' if inc is None else inc.get('decision')} on "
                        f"{None if inc is None else inc.get('replay_child')}, not replayed on "
                        "the CPU child (nor waited for the GPU child, as the rule allows)")
    counted = info.get("image_tokens")
    if image.complete and counted is not None and counted <= 0:
        problems.append(f"{image.request_id}: the answer's prompt ({image.prompt_tokens} "
                        f"tokens) holds no more than its text ({info.get('text_tokens')}): "
                        "the image was not read")
    if not plain:
        problems.append("no plain request was sent during the failure")
    problems += [f"{s.request_id}: lost ({s.status}, {s.note or 'no whole answer'})"
                 for s in plain if s.status != 200 or not s.complete or s.error_event]
    if info.get("gpu_after") != "READY":
        problems.append(f"{info.get('gpu') or 'the GPU child'} is {info.get('gpu_after')} at "
                        "the end, not READY")
    return problems


def _turn(s: Sent) -> dict[str, Any]:
    """A turn's figures, as the client saw them and the answering child's timings said."""
    prompt = s.prompt_tokens or ((s.prompt_n or 0) + (s.cache_n or 0)) or None
    return {"request_id": s.request_id, "child": s.child, "status": s.status,
            "ttft_s": s.ttft_s, "prompt_tokens": prompt, "cache_n": s.cache_n,
            "prompt_n": s.prompt_n, "prompt_ms": s.prompt_ms}


def _judge_turn(name: str, s: Sent | None) -> list[str]:
    """Scenario 10's warm or cold second turn: lost by the GPU child, replayed on the CPU child
    (its first token the CPU child's), answered whole there."""
    if s is None:
        return [f"the {name} turn is not among the requests"]
    problems = []
    if not (s.status == 200 and s.complete and not s.error_event and s.child == CPU_CHILD):
        problems.append(f"{s.request_id}: the {name} turn was not answered whole by the CPU "
                        f"child (status {s.status}, child {s.child}"
                        f"{', ' if s.note else ''}{s.note})")
    if s.continued:
        problems.append(f"{s.request_id}: the {name} turn's first tokens were the GPU child's "
                        "(its stream was continued, not replayed)")
    inc = s.incident
    if inc is None or (inc.get("decision"), inc.get("replay_child")) != ("replayed", CPU_CHILD):
        problems.append(f"{s.request_id}: the {name} turn's incident says "
                        f"{'none' if inc is None else inc.get('decision')} on "
                        f"{None if inc is None else inc.get('replay_child')}, not replayed on "
                        "the CPU child")
    if s.ttft_s is None:
        problems.append(f"{s.request_id}: no first token of the {name} turn")
    return problems


def _judge_conversation(r: ScenarioResult) -> list[str]:
    """Scenario 10: the warm second turn, lost by the GPU child, answered by the CPU child
    from its cache, sooner than the cold one; the GPU child back."""
    info = r.conversation or {}
    by_id = {s.request_id: s for s in r.requests}
    problems = [p for s in r.requests for p in _identity(s)] + r.notes
    first = info.get("first") or {}
    if r.notes or "warm" not in info or "cold" not in info:
        return problems or ["the second turns were not sent"]
    warm, cold = info["warm"], info["cold"]
    problems += _judge_turn("warm", by_id.get(warm["request_id"]))
    problems += _judge_turn("cold", by_id.get(cold["request_id"]))
    prefix = first.get("prompt_tokens")
    reused = warm.get("cache_n")
    if not prefix or reused is None:
        problems.append(f"the warm turn's cache is not known (cache_n {reused}, the first "
                        f"turn's prompt {prefix} tokens)")
    elif reused < WARM_SHARE * prefix:
        problems.append(f"the warm turn found {reused} tokens in the CPU child's cache, under "
                        f"{WARM_SHARE:.0%} of the first turn's {prefix} prompt tokens: it was "
                        "not warm")
    cold_prompt, cold_reused = cold.get("prompt_tokens"), cold.get("cache_n")
    if cold_prompt and cold_reused is not None and cold_reused > COLD_SHARE * cold_prompt:
        problems.append(f"the cold turn found {cold_reused} of its {cold_prompt} prompt tokens "
                        f"in the CPU child's cache (over {COLD_SHARE:.0%}): it was not cold")
    if warm.get("ttft_s") is not None and cold.get("ttft_s") is not None and \
            warm["ttft_s"] >= cold["ttft_s"]:
        problems.append(f"the warm turn's first token ({warm['ttft_s']:.3f} s) came no sooner "
                        f"than the cold one's ({cold['ttft_s']:.3f} s)")
    if info.get("gpu_after") != "READY":
        problems.append(f"{info.get('gpu') or 'the GPU child'} is {info.get('gpu_after')} at "
                        "the end, not READY")
    return problems


_JUDGES = {1: _judge_failover, 2: _judge_failover, 3: _judge_cancellation,
           4: _judge_concurrent, 5: _judge_agent, 6: _judge_second_model,
           7: _judge_continued, 8: _judge_smaller, 9: _judge_image,
           10: _judge_conversation, 11: _judge_returned}


def judge(r: ScenarioResult) -> None:
    """Did the scenario meet its bar? Sets passed and verdict; or, for one that ran and could
    not show what it is for here (11), `skipped` with why (neither passed nor failed)."""
    problems = _JUDGES[r.number](r)
    if problems:
        r.skipped = None
    r.passed = not problems and r.skipped is None
    r.verdict = "meets the bar" if r.passed else "; ".join(problems) if problems else \
        f"skipped: {r.skipped}"
