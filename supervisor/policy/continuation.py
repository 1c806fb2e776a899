"""Stream continuation: a stream whose child died after bytes reached the client goes on from
the other child, as one stream.

The text already relayed goes back as the final assistant message (chat and /v1/responses,
with `continue_final_message`; /v1/messages, which llama-server continues by itself) or is
appended to the prompt (completions); the token limit is lowered by what was generated; every
other setting (sampling, seed, tools, progress and ping options) is the client's own. Measured
on the pinned build with SmolLM2-135M-Instruct, greedy: the continuation's text is the
uninterrupted answer's rest, token for token, and its first delta does not echo the prefix (an
echo is stripped all the same, for builds that send one).

Tools offered are no reason to refuse (llama.cpp's web UI offers its built-in ones with every
chat): only a tool call already relayed is, since half a call cannot be continued. The
continuation offers the same tools, so the model may still call one after its text. Reasoning
text on chat routes goes back as the final message's `reasoning_content`, which the pinned
llama-server continues (its autoparser puts the template's reasoning start and the text in the
generation prompt, and closes it before any content); reasoning on /v1/messages (thinking
blocks) and /v1/responses (reasoning items) is never continued, nor reasoning that came after
content (a message has one place for each), nor a chat's text with reasoning parsing off (it may
be a think block's).

Never when the grammar state would restart (grammar, json_schema, a JSON response_format: the
constraint would apply to the rest as if it were the whole, as NVIDIA Dynamo's request
migration notes), for n > 1, for a prompt that is not one string, when the client opted out,
or when a finish was already sent (then only the rest of its end is sent, as llama-server
would: `after_finish`). A stream whose tokens already fill its limit is not
continued but closed (`at_limit`): llama-server would have stopped there, so the client has the
whole answer and only the finish is missing. "Fill" is as llama-server counts: its own count
(`tokens_predicted`, `timings.predicted_n`) or one event a token, never a recount of the text
(a text re-tokenizes to other tokens than were sampled: the tests' random model's 100 events
to about 200), so a finish is never made up; the limit is read as llama-server reads it
(`token_limit`). Pure: no I/O, no clock.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})
OAI_COMPLETION_ROUTES = frozenset({"/v1/completions", "/completions"})
NATIVE_COMPLETION_ROUTES = frozenset({"/completion"})
MESSAGES_ROUTES = frozenset({"/v1/messages"})  # Anthropic's Messages API
RESPONSES_ROUTES = frozenset({"/v1/responses", "/responses"})  # OpenAI's Responses API
ROUTES = CHAT_ROUTES | OAI_COMPLETION_ROUTES | NATIVE_COMPLETION_ROUTES | MESSAGES_ROUTES | \
    RESPONSES_ROUTES

# The keys llama-server reads a request's token limit from, in its order (server-schema.cpp:
# `n_predict`, then its aliases `max_completion_tokens` and `max_tokens`; the first that is
# present and not null wins), on every route that passes the body's keys on: chat, both
# completions, and /v1/responses, whose `max_output_tokens`, when given, replaces `max_tokens`
# (server-chat.cpp). /v1/messages passes on its `max_tokens` alone, 4096 when it is absent.
_SCHEMA_KEYS = ("n_predict", "max_completion_tokens", "max_tokens")
_RESPONSES_KEYS = ("n_predict", "max_completion_tokens", "max_output_tokens")
MESSAGES_DEFAULT_LIMIT = 4096
_CONSTRAINTS = ("grammar", "json_schema", "grammar_lazy", "grammar_triggers")


class Refusal(enum.StrEnum):
    ROUTE = "route"  # not a chat or completion stream
    OPTED_OUT = "opted_out"
    CONSTRAINED = "constrained"  # grammar / json_schema / response_format: state would restart
    TOOLS = "tools"  # a tool call was relayed
    REASONING = "reasoning"  # reasoning a continuation cannot carry (see the module's note)
    CHOICES = "choices"  # n > 1
    PROMPT = "prompt"  # not one string: nothing to append the text to
    FINISHED = "finished"  # a finish_reason (or stop) was already relayed
    SPENT = "spent"  # the token limit is used up
    DEADLINE = "deadline"
    ALREADY = "already_continued"
    NO_TARGET = "no_target"
    FAILED_BACK = "already_failed_back"


def route_kind(path: str) -> str | None:
    if path in CHAT_ROUTES:
        return "chat"
    if path in OAI_COMPLETION_ROUTES:
        return "oai_completion"
    if path in NATIVE_COMPLETION_ROUTES:
        return "native_completion"
    if path in MESSAGES_ROUTES:
        return "messages"
    if path in RESPONSES_ROUTES:
        return "responses"
    return None


def body_refusal(path: str, payload: dict[str, Any] | None, opted_out: bool) -> Refusal | None:
    """Whether a request could ever be continued, from its route and body alone (checked before
    the first attempt, so that only such streams pay for being followed)."""
    kind = route_kind(path)
    if kind is None or payload is None:
        return Refusal.ROUTE
    if opted_out:
        return Refusal.OPTED_OUT
    if _constrained(kind, payload):
        return Refusal.CONSTRAINED
    # (Tools offered are no reason: a stream is refused only once a call was relayed.)
    n = payload.get("n", 1)
    if not isinstance(n, int) or n != 1:
        return Refusal.CHOICES
    thinking = payload.get("thinking")
    if kind == "messages" and isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return Refusal.REASONING  # its thinking block comes first: never the answer's text
    return None if _has_prompt(kind, payload) else Refusal.PROMPT


def _constrained(kind: str, payload: dict[str, Any]) -> bool:
    """A grammar, a schema or a JSON format: its state would restart in the middle. So would a
    forced tool call's (tool_choice `required`, a named tool, Anthropic's `any`; the legacy
    function_call naming one): llama-server constrains those from the first token, where
    `auto` waits for the model's own tool-call marker."""
    if any(payload.get(k) for k in _CONSTRAINTS):
        return True
    choice = payload.get("tool_choice")
    if choice == "required" or (isinstance(choice, dict) and
                                choice.get("type") in ("function", "any", "tool")):
        return True
    if isinstance(payload.get("function_call"), dict):
        return True
    fmt = payload.get("response_format")
    if kind == "responses":  # the Responses API names its format under `text`
        text = payload.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
    return isinstance(fmt, dict) and fmt.get("type") not in (None, "text")


def _has_prompt(kind: str, payload: dict[str, Any]) -> bool:
    """Something the relayed text can be added to: a message list (whose final assistant
    message, if any, is one string), an input, or a prompt that is one string."""
    if kind == "native_completion" or kind == "oai_completion":
        return isinstance(payload.get("prompt"), str)
    given = payload.get("input" if kind == "responses" else "messages")
    if kind == "responses" and isinstance(given, str):
        return True
    if not isinstance(given, list) or not given:
        return False
    last = given[-1]
    return not (isinstance(last, dict) and last.get("role") == "assistant" and
                not isinstance(last.get("content"), str))


@dataclass
class Transcript:
    """What the client has received of a stream, as the events went by."""

    kind: str  # route_kind
    text: str = ""
    reasoning_text: str = ""  # chat: the `reasoning_content` relayed
    tokens: int = 0  # generated tokens relayed, never more than were sampled: llama-server's
    # own count when an event carries it (`counted`), else one per event with generated text
    # (see `_count`)
    counted: bool = False  # `tokens` is llama-server's own figure (tokens_predicted, predicted_n)
    own_count: str = ""  # the field that figure came from, for the records
    prompt_tokens: int | None = None  # the prompt's tokens, when an event said (closing usage)
    text_block: int | None = None  # /v1/messages: the index of the open text block
    id: str | None = None
    created: int | None = None
    model: str | None = None
    system_fingerprint: str | None = None
    role_sent: bool = False
    tool_calls: bool = False
    reasoning: bool = False  # reasoning that cannot be continued (not `reasoning_text`)
    finished: bool = False
    # The events llama-server sends only as the answer ends, as far as they were relayed, in
    # order: "finish" (a chunk with its finish_reason), "usage" (chat's usage chunk), "stop"
    # (/completion's last event), or the event's type (/v1/messages, /v1/responses). What is
    # left of the end after a death past the finish (`after_finish`).
    ends: list[str] = field(default_factory=list)
    item_id: str | None = None  # /v1/responses: the output message's id
    _last_piece: str = field(default="", repr=False)  # "reasoning" or "content" (see `_count`)

    def take(self, event: dict[str, Any]) -> None:
        """One event's JSON, as it was relayed."""
        self._take(event)
        self._own_count(event)

    @property
    def count_basis(self) -> str:
        """What `tokens` rests on, as the incident and the log say it."""
        if self.counted:
            return f"llama-server's own count ({self.own_count})"
        return "its events (one a token)"

    def _own_count(self, event: dict[str, Any]) -> None:
        """llama-server's own figures, where an event carries them: its running count of
        generated tokens (`tokens_predicted` on /completion, `timings.predicted_n` with
        `timings_per_token`), which is what its limit is checked against; and the prompt's
        tokens, for the usage of a stream Spillway closes itself."""
        timings = event.get("timings")
        timings = timings if isinstance(timings, dict) else {}
        for name, own in (("tokens_predicted", event.get("tokens_predicted")),
                          ("timings.predicted_n", timings.get("predicted_n"))):
            if isinstance(own, int) and _int(own):
                self.tokens, self.counted, self.own_count = own, True, name
        if _int(event.get("tokens_evaluated")):
            self.prompt_tokens = event["tokens_evaluated"]
        if _int(timings.get("prompt_n")):  # (it leaves out the cached part: cache_n adds it)
            cached = timings.get("cache_n")
            self.prompt_tokens = timings["prompt_n"] + (cached if _int(cached) else 0)
        progress = event.get("prompt_progress")
        if isinstance(progress, dict) and _int(progress.get("total")):
            self.prompt_tokens = progress["total"]

    def _count(self, piece: str) -> None:
        """One sampled token for a piece of generated text (`piece`: "reasoning" or "content"),
        but for content right after reasoning. llama-server sends each sampled token's text in
        one partial result, or none while a UTF-8 character or a possible stop word is not
        whole (the next one then carries both: fewer events than tokens); but on chat routes
        its parser's diffs of one partial result go out as events of their own, reasoning
        first, then content (server-task.cpp, `to_json_oaicompat_chat`). Content right after
        reasoning may be the same token's, so it is not counted: at most one token too few
        where an answer turns from reasoning to content, never one too many."""
        if not (piece == "content" and self._last_piece == "reasoning"):
            self.tokens += 1
        self._last_piece = piece

    def _take(self, event: dict[str, Any]) -> None:
        if self.id is None:
            self.id = _str(event.get("id"))
            self.model = _str(event.get("model"))
            self.system_fingerprint = _str(event.get("system_fingerprint"))
        created = event.get("created")  # llama-server stamps each chunk: the latest counts
        if isinstance(created, int) and not isinstance(created, bool):
            self.created = created
        if self.kind == "native_completion":
            self._native(event)
            return
        if self.kind == "messages":
            self._message_event(event)
            return
        if self.kind == "responses":
            self._response_event(event)
            return
        finishes = False
        for choice in event.get("choices") or []:
            if isinstance(choice, dict):
                finishes = self._choice(choice) or finishes
        if finishes:
            self.ends.append("finish")
        elif isinstance(event.get("usage"), dict):
            self.ends.append("usage")

    def _text(self, piece: Any) -> None:
        if isinstance(piece, str) and piece:
            self.text += piece
            self._count("content")

    def _reasoning(self, piece: Any) -> None:
        if not isinstance(piece, str) or not piece:
            return
        if self.text:
            # Reasoning after content: the final message has one place for each, and would
            # put this reasoning before the content, which is not what the model saw.
            self.reasoning = True
        self.reasoning_text += piece
        self._count("reasoning")

    @property
    def generated(self) -> str:
        """All the text the model generated and the client has (reasoning, then content)."""
        return self.reasoning_text + self.text

    def _native(self, event: dict[str, Any]) -> None:
        self._text(event.get("content"))  # (its `tokens_predicted`: see `_own_count`)
        if event.get("stop") is True:
            self.finished = True
            self.ends.append("stop")

    def _message_event(self, event: dict[str, Any]) -> None:
        """/v1/messages: message_start, then content blocks (start, deltas, stop), then
        message_delta (the stop reason) and message_stop."""
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message")
            if isinstance(message, dict):
                self.id, self.model = _str(message.get("id")), _str(message.get("model"))
            self.role_sent = True
        elif kind == "content_block_start":
            block = event.get("content_block")
            block_type = block.get("type") if isinstance(block, dict) else None
            self.tool_calls = self.tool_calls or block_type in ("tool_use", "server_tool_use")
            if block_type == "text" and _int(event.get("index")):
                self.text_block = event["index"]
            self.reasoning = self.reasoning or block_type in ("thinking", "redacted_thinking")
        elif kind == "content_block_delta":
            delta = event.get("delta")
            delta_type = delta.get("type") if isinstance(delta, dict) else None
            if delta_type == "text_delta" and isinstance(delta, dict):
                self._text(delta.get("text"))
            self.tool_calls = self.tool_calls or delta_type == "input_json_delta"
            self.reasoning = self.reasoning or delta_type == "thinking_delta"
        elif kind in ("content_block_stop", "message_delta", "message_stop"):
            # llama-server closes the text block only as the answer ends: the rest is only
            # its stop reason, which the other child cannot know.
            self.finished = True
            self.ends.append(kind)

    def _response_event(self, event: dict[str, Any]) -> None:
        """/v1/responses: response.created, an output message item and its text part, the
        text deltas, then the done events (with the whole text) and response.completed."""
        kind = event.get("type")
        if not isinstance(kind, str):
            return
        if kind == "response.created":
            response = event.get("response")
            if isinstance(response, dict):
                self.id = _str(response.get("id"))
            self.role_sent = True
        elif kind == "response.output_item.added":
            self._response_item(event.get("item"))
        elif kind == "response.output_text.delta":
            self._text(event.get("delta"))
        elif kind.endswith(".done") or kind in ("response.completed", "response.incomplete",
                                                "response.failed"):
            self.finished = True  # the text was closed: only its end was left to send
            self.ends.append(kind)
        self.reasoning = self.reasoning or kind.startswith("response.reasoning")
        self.tool_calls = self.tool_calls or kind.startswith("response.function_call")

    def _response_item(self, item: Any) -> None:
        item_type = item.get("type") if isinstance(item, dict) else None
        if isinstance(item, dict) and item_type == "message":
            self.item_id = self.item_id or _str(item.get("id"))
        self.tool_calls = self.tool_calls or item_type == "function_call"
        self.reasoning = self.reasoning or item_type == "reasoning"

    def _choice(self, choice: dict[str, Any]) -> bool:
        """Takes one choice; whether it carries the finish."""
        finishes = bool(choice.get("finish_reason"))
        self.finished = self.finished or finishes
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            self._text(choice.get("text") if self.kind == "oai_completion" else None)
            return finishes
        self.role_sent = self.role_sent or bool(delta.get("role"))
        self.tool_calls = self.tool_calls or bool(delta.get("tool_calls") or
                                                  delta.get("function_call"))
        self._reasoning(delta.get("reasoning_content"))
        self._text(delta.get("content"))
        return finishes


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str
    refusal: Refusal | None = None
    # Not continued, but not broken either: the token limit was reached before the child died,
    # so the client has the whole answer and only its finish is missing; Spillway sends it as
    # llama-server would have (proxy/closing.py).
    closing: bool = False


CLOSED_AT_LIMIT = "its token limit was reached before the child died; closed as llama-server " \
                  "would"
CLOSED_AFTER_FINISH = "its finish was sent before the child died; the rest of its end sent as " \
                      "llama-server would"

# The events that end a /v1/messages or /v1/responses stream, in order (closing.py builds them).
_ENDS = {"messages": ("content_block_stop", "message_delta", "message_stop"),
         "responses": ("response.output_text.done", "response.content_part.done",
                       "response.output_item.done", "response.completed")}


def after_finish(payload: dict[str, Any], transcript: Transcript) -> Decision:
    """A stream whose child died after its finish was relayed: the client has the whole
    answer, so what llama-server sends after its finish (the usage chunk, `[DONE]`,
    `message_stop`, `response.completed`) is sent as it would be, never an error event after a
    whole answer. Where the rest says what was not relayed (a stop reason after only the
    text block's end, an end with reasoning or tool calls in it), it is the error event."""
    last = transcript.ends[-1] if transcript.ends else None
    unknown = Decision(False, "its finish was already sent, and the rest of its end cannot be "
                              "told from what was relayed", Refusal.FINISHED)
    if transcript.kind in ("messages", "responses"):
        told = last in ("message_delta", "message_stop", "response.completed")
        if not told and (transcript.tool_calls or transcript.reasoning or
                         last not in _ENDS[transcript.kind]):
            return unknown
        if last == "content_block_stop" and at_limit(payload, transcript) is None:
            return unknown  # end_turn, stop_sequence or max_tokens: not known
        if transcript.kind == "responses" and not told and transcript.item_id is None:
            return unknown
    return Decision(False, CLOSED_AFTER_FINISH, Refusal.FINISHED, closing=True)


def at_limit(payload: dict[str, Any], transcript: Transcript) -> Decision | None:
    """When the tokens known to be sampled (llama-server's own count, else one event a token:
    never more than were sampled) fill the token limit: llama-server stopped there with a
    finish of its own ("length", `stop_type` "limit", "max_tokens"), so the stream is closed
    with it where its closing events can be told from what was relayed; else it is spent (the
    error event). None while tokens are left: then nothing says the answer is whole."""
    limit = token_limit(transcript.kind, payload)
    if limit is None or transcript.tokens < _sampled_at_most(limit):
        return None
    count = f"{transcript.tokens} of {limit} tokens, by {transcript.count_basis}"
    spent = f"its token limit is used up ({count})"
    if transcript.tool_calls:
        # The last call's end (and llama-server's final parse of it) is not known.
        return Decision(False, f"{spent}, in a tool call", Refusal.SPENT)
    if transcript.kind == "messages" and (transcript.reasoning or transcript.text_block is None):
        return Decision(False, f"{spent}, and its open block cannot be closed", Refusal.SPENT)
    if transcript.kind == "responses" and (transcript.reasoning or transcript.item_id is None):
        return Decision(False, f"{spent}, and its open item cannot be closed", Refusal.SPENT)
    return Decision(False, f"{CLOSED_AT_LIMIT} ({count})",
                    Refusal.SPENT, closing=True)


def decide(payload: dict[str, Any], transcript: Transcript, continued_before: bool,
           deadline_left_s: float | None, target_expected_s: float,
           target_available: bool, target_prefills: bool = True) -> Decision:
    """Whether this broken stream may go on from the other child (after `body_refusal` let it
    be followed)."""
    if continued_before:
        return Decision(False, "a stream is continued at most once", Refusal.ALREADY)
    if transcript.finished:
        return after_finish(payload, transcript)
    if (limited := at_limit(payload, transcript)) is not None:
        # Before the other refusals: the answer is whole whatever a continuation could carry.
        return limited
    if transcript.tool_calls:
        return Decision(False, "a tool call had begun", Refusal.TOOLS)
    if transcript.reasoning:
        return Decision(False, "reasoning that cannot be continued had begun",
                        Refusal.REASONING)
    if transcript.kind == "chat" and transcript.text and payload.get("reasoning_format") == "none":
        # Measured with a template that opens a think block in its generation prompt: the
        # stream's content is then the reasoning, and the continuation's prompt would close the
        # block before it (`<think>\n\n</think>\n\n` + the text): the model would answer instead.
        return Decision(False, "reasoning parsing is off (reasoning_format none): the text may "
                               "be a think block's, which a continuation would close",
                        Refusal.REASONING)
    if deadline_left_s is not None and deadline_left_s < target_expected_s:
        return Decision(False, f"its deadline leaves {max(deadline_left_s, 0):.1f} s, the other "
                               f"child needs about {target_expected_s:.1f} s", Refusal.DEADLINE)
    if not target_available:
        return Decision(False, "no other child can take it now", Refusal.NO_TARGET)
    if transcript.kind == "messages" and not target_prefills:
        return Decision(False, "the other child runs with --no-prefill-assistant: it would "
                               "begin a new answer", Refusal.PROMPT)
    return Decision(True, f"continued after {transcript.tokens} tokens, by "
                          f"{transcript.count_basis}")


# A stream moves back to the GPU child only when the rest is expected there in under this share
# of its time on the CPU child: the GPU child's forecast includes its prefill of everything so
# far (its cache is cold after its restart), and its speed is from before its death.
FAIL_BACK_MARGIN = 0.8


def fail_back(payload: dict[str, Any], transcript: Transcript, failed_back_before: bool,
              deadline_left_s: float | None, gpu_rest_s: float | None,
              cpu_rest_s: float | None, target_prefills: bool = True) -> Decision:
    """Whether a stream the CPU child is answering (after a GPU death: a continuation, a
    replay, or a request that came in the outage) moves back to the GPU child, READY again:
    the continuation in reverse, under its rules (never after a relayed tool call, never for
    a constrained answer: `body_refusal` kept those from being followed at all), at most once,
    and only when the rest is expected to end clearly sooner there (FAIL_BACK_MARGIN). A
    stream at its end (its finish relayed, its limit reached) stays: the CPU child sends the
    rest in moments."""
    if failed_back_before:
        return Decision(False, "a stream fails back at most once", Refusal.FAILED_BACK)
    if transcript.finished or at_limit(payload, transcript) is not None:
        return Decision(False, "it is at its end", Refusal.FINISHED)
    moved = decide(payload, transcript, False, deadline_left_s, gpu_rest_s or 0.0, True,
                   target_prefills)
    if not moved.allowed:
        return moved
    if gpu_rest_s is None or cpu_rest_s is None:
        return Decision(False, "no forecast for the rest on both children", Refusal.NO_TARGET)
    if gpu_rest_s >= FAIL_BACK_MARGIN * cpu_rest_s:
        return Decision(False, f"the rest is not clearly sooner on the GPU child (about "
                               f"{gpu_rest_s:.1f} s against {cpu_rest_s:.1f} s)",
                        Refusal.NO_TARGET)
    return Decision(True, f"failed back after {transcript.tokens} tokens: the rest in about "
                          f"{gpu_rest_s:.1f} s on the GPU child against {cpu_rest_s:.1f} s on "
                          f"the CPU child")


def joined(before: Transcript, leg: Transcript, added_text: str) -> Transcript:
    """What the client has of a stream continued once: the transcript before the move and
    the continuation's own (`leg`, read from the other child's events as they came, its count
    from its own start), whose text the client got as `added_text` (its echo stripped)."""
    whole = copy.copy(before)
    whole.ends = [*before.ends, *leg.ends]
    whole.text = before.text + added_text
    whole.reasoning_text = before.reasoning_text + leg.reasoning_text
    whole.tokens = before.tokens + leg.tokens
    whole.counted = before.counted and leg.counted
    whole.own_count = before.own_count if whole.counted else ""
    whole.tool_calls = before.tool_calls or leg.tool_calls
    whole.reasoning = before.reasoning or leg.reasoning or bool(
        leg.reasoning_text and before.text)
    whole.finished = leg.finished
    return whole


def token_limit(kind: str, payload: dict[str, Any]) -> int | None:
    """The request's token limit as llama-server reads it (`n_predict`); None when the request
    sets none (absent, null, or -1: the child's own `-n` then, unknown here)."""
    return _read_limit(kind, payload)[1]


def tokens_left(payload: dict[str, Any], transcript: Transcript) -> int | None:
    """The continuation's token limit: the request's, less the tokens known to be sampled
    (never more than were, so never less than is truly left), and never under 1 (a stream is
    continued only while its limit is not reached). None: no limit to lower."""
    limit = token_limit(transcript.kind, payload)
    return None if limit is None else max(limit - transcript.tokens, 1)


def _read_limit(kind: str, payload: dict[str, Any]) -> tuple[str | None, int | None]:
    """The body's key llama-server takes the limit from (None: its route's default), and the
    limit. A value is read as nlohmann's `get<int>` reads it (a fraction cut off, true as 1);
    one llama-server refuses (a string, under -1) never started a stream: None."""
    if kind == "messages":
        keys: tuple[str, ...] = ("max_tokens",)
    elif kind == "responses" and "max_output_tokens" in payload:
        keys = _RESPONSES_KEYS
    else:
        keys = _SCHEMA_KEYS
    for key in keys:
        value = payload.get(key)
        if value is None:
            continue  # absent or null: the next alias (server-schema.cpp, `has_value`)
        if isinstance(value, float) and not math.isfinite(value):
            return key, None
        read = int(value) if isinstance(value, int | float) else None
        return key, read if read is not None and read >= 0 else None
    if kind == "messages" and "max_tokens" not in payload:
        return None, MESSAGES_DEFAULT_LIMIT  # (a null max_tokens is no limit)
    return None, None


def _sampled_at_most(limit: int) -> int:
    """The tokens llama-server samples under a limit: it checks the limit after each token,
    so even `n_predict: 0` samples one (server-context.cpp, `has_budget`)."""
    return max(limit, 1)


def continuation_body(payload: dict[str, Any], transcript: Transcript) -> dict[str, Any]:
    """The request for the other child: the relayed text (and reasoning) as the answer's start,
    the limit lowered to what is left (`tokens_left`), everything else the client's own (its
    tools, progress and ping options, template kwargs included)."""
    body = copy.deepcopy(payload)
    body["stream"] = True
    kind = transcript.kind
    key, _ = _read_limit(kind, payload)
    left = tokens_left(payload, transcript)
    if left is not None:
        # In the key llama-server read the limit from: any other it names comes after it in
        # llama-server's order, so it cannot override it (/v1/messages' default: max_tokens).
        body[key or "max_tokens"] = left
    if not transcript.text and not transcript.reasoning_text:
        # Nothing generated relayed yet (the role, prompt progress, pings): the same request,
        # once more.
        return body
    if kind == "responses":
        given = body.get("input")
        items: list[Any] = [{"role": "user", "content": given}] if isinstance(given, str) \
            else list(given or [])
        _extend_final(items, transcript.text, {"type": "message"})
        body["input"] = items
        # llama-server passes what it does not convert on to its chat completion.
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    elif kind == "messages":
        # llama-server continues a final assistant message of its own accord (its default
        # --prefill-assistant); the Messages API has no continue_final_message to ask for it.
        _extend_final(body["messages"], transcript.text)
    elif kind == "chat":
        # With reasoning: llama-server resolves `continue_final_message: true` to continuing
        # the reasoning when the content is empty, else to the content after closed reasoning.
        _extend_final(body["messages"], transcript.text, reasoning=transcript.reasoning_text)
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = body["prompt"] + transcript.text
    return body


def _extend_final(messages: list[Any], text: str, shape: dict[str, str] | None = None,
                  reasoning: str = "") -> None:
    """The relayed text as the final assistant message: the client's own prefill, when its
    last message is one, is extended (no second assistant message); else one is added (with
    `shape`'s extra keys: a /v1/responses item is a `message`). `reasoning`, the relayed
    reasoning, goes in its `reasoning_content`."""
    last = messages[-1] if messages else None
    if isinstance(last, dict) and last.get("role") == "assistant":
        last["content"] = last["content"] + text
        if reasoning:
            own = last.get("reasoning_content")
            last["reasoning_content"] = (own if isinstance(own, str) else "") + reasoning
    else:
        added: dict[str, Any] = {**(shape or {}), "role": "assistant", "content": text}
        if reasoning:
            added["reasoning_content"] = reasoning
        messages.append(added)
