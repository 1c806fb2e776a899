"""The clients home servers run, each as it speaks to a llama-server: its request (route, headers,
body) and how it reads the answer, line by line as its own code does. What
tests/test_client_shapes_integration.py sends through Spillway across a GPU death.

What each client does, read in its source (the revision read is named; paths in its repository):

Open WebUI (open-webui/open-webui; backend/open_webui/routers/openai.py `generate_chat_completion`
  and utils/middleware.py `stream_body_handler`, revisions 004a45f and 000032e)
  - POST {base}/chat/completions with aiohttp, its own session per request, total timeout
    AIOHTTP_CLIENT_TIMEOUT. Headers: Content-Type, `Authorization: Bearer KEY` (no header without
    a key), the X-OpenWebUI-User-* headers only when ENABLE_FORWARD_USER_INFO_HEADERS is set.
  - Body: model, messages (a system message when the model has one), stream: true and
    `stream_options.include_usage: true` added to every stream, the model's params (temperature,
    top_p, max_tokens, seed, stop, ...), `tools` when native function calling is on.
  - Reads the stream as aiohttp hands it over, one line at a time: blank lines and any line not
    starting with `data:` are skipped; the rest is json.loads'ed, a failure ignored (`[DONE]`
    too); a chunk with no choices and an `error` shows the error in the chat; `usage` and
    llama.cpp's `timings` are shown; tool-call deltas are joined by index.
  - No retry. A status >= 400 is passed to the browser as it came (the JSON error's message).

Continue (continuedev/continue d0a3c0b; core/llm/llms/LlamaCpp.ts, core/llm/index.ts `fetch`,
  core/util/withExponentialBackoff.ts, packages/fetch/src/stream.ts `streamSse`,
  packages/openai-adapters/src/apis/OpenAI.ts)
  - provider `llama.cpp`: POST {apiBase}/completion, fetch with Content-Type and
    `Authorization: Bearer ${apiKey}` (literally "Bearer undefined" without a key); body model,
    prompt (the chat rendered by Continue's template), stream: true, n_predict, temperature,
    top_k, top_p, min_p, stop, frequency_penalty, presence_penalty, mirostat (unset ones left out).
  - provider `openai` (an OpenAI-compatible apiBase): the OpenAI Node SDK v5 (its own retry,
    below), `stream_options.include_usage: true` on every stream.
  - streamSse splits on "\\n": `data: [DONE]` ends the batch, `data:` lines are JSON.parse'd (a
    failure throws "Malformed JSON sent from server", an `error` key throws "Error streaming
    response: <message>"), `: ping` ends the batch, every other line is ignored.
  - Retry (withExponentialBackoff around BaseLLM.fetch, 5 tries, 0.5 s doubling): only when the
    error's response status is 429, or its message holds `"code": 429`, "overloaded" or
    "malformed json". A status >= 400 becomes Error("HTTP 503 Service Unavailable from URL\\n\\n"
    + body) with no response attached: Retry-After is never read on this path. A stream that
    fails after its headers is not retried.

Cline (cline/cline; the OpenAI-compatible provider src/core/api/providers/openai.ts and
  src/core/api/retry.ts at 7c31c1d, the last before the move to apps/ and the AI SDK)
  - The OpenAI Node SDK (`createOpenAIClient`: timeout 600 s, so `X-Stainless-Timeout: 600`, and
    its X-Stainless-* headers; SDK retries 2, on 408/409/429/5xx and x-should-retry, sleeping a
    Retry-After up to 60 s). Body: model, messages (system first), temperature (left out when the
    model's is 0, the default), max_tokens only when set, stream: true,
    `stream_options.include_usage: true`, tools with tool_choice "auto" and
    parallel_tool_calls false (native tool calling).
  - Reads the SDK's chunks: delta.content, delta.reasoning_content, tool-call deltas (a call is
    used once it has an id, a name and arguments), usage.
  - @withRetry: 3 tries on a 429 only (its retry-after honoured); any other error is shown with
    a Retry button. (HEAD, sdk/packages/llms: the AI SDK's openai-compatible provider; its
    eventsource-parser skips comment lines; 2 retries on 408/409/429/5xx.)

Roo Code (RooCodeInc/Roo-Code cb83656; src/api/providers/openai.ts, src/core/task/Task.ts)
  - The OpenAI Node SDK, timeout `apiRequestTimeout` (600 s: `X-Stainless-Timeout: 600`), SDK
    retries 2. Body: model, temperature (0 unless set), messages, stream: true,
    `stream_options.include_usage: true`, tools, tool_choice "auto", parallel_tool_calls true,
    max_completion_tokens only with includeMaxTokens.
  - Reads delta.content (a <think> tag matcher), reasoning_content, tool-call deltas, usage.
  - An error before the first chunk: with auto-approval, retried after requestDelaySeconds
    (5 s) doubling, whatever the status (else a Retry button); an error mid-stream (the SDK
    raises on an `error` event) aborts the stream and resends the whole request the same way.

aider through LiteLLM (Aider-AI/aider 5dc9490; aider/models.py `send_completion`,
  aider/coders/base_coder.py `send_message` and `show_send_output_stream`, aider/exceptions.py;
  BerriAI/litellm 1.110's OpenAI handler)
  - litellm.completion(model, messages, stream, temperature 0, timeout 600, and with functions
    `tools: [one function]` and the forced `tool_choice: {"type": "function", "function":
    {"name": ...}}`; today only the deprecated *_func coders pass functions). For `openai/...`
    LiteLLM calls the OpenAI Python SDK (its X-Stainless-* headers, `x-stainless-read-timeout`,
    2 retries that honour Retry-After).
  - Reads LiteLLM's chunks: finish_reason "length" raises FinishReasonLength; delta.content,
    reasoning_content, the legacy delta.function_call.
  - Retries a LiteLLM exception its table marks retryable, looked up by its exact class
    (APIError, APIConnectionError, InternalServerError, ServiceUnavailableError, RateLimitError,
    Timeout, ...), 0.25 s doubling up to 60 s, never reading Retry-After; BadRequestError,
    NotFoundError, auth errors end it. An error event mid-stream comes out of LiteLLM 1.82.3
    (aider's pin) as MidStreamFallbackError, a class the table does not name: shown, not
    retried.

home-llm (acon96/home-llm 5f627ca;
  custom_components/llama_conversation/backends/generic_openai.py, entity.py)
  - POST {host}/v1/chat/completions (path `openai_path`, "v1") with Home Assistant's aiohttp
    session, timeout 90 s, `Authorization` only with a key. Body: model, stream: true,
    max_tokens 512, temperature 0.1, top_p 1, messages, tools (Home Assistant's intents) unless
    legacy tool calling, response_format when an AI task asks for JSON.
  - Reads `async for line in response.content`: strip; a line starting with `error: ` raises;
    "data: " removed; a chunk holding "[DONE]" ends it; any other non-empty line is json.loads'ed
    (a comment line raises JSONDecodeError, failing the voice command); a chunk with no choices
    (usage, or Spillway's `{"error": ...}` event) is logged and skipped, so an error event ends
    the answer silently with what was said; each tool-call delta's `function` must be a whole
    call (name and arguments).
  - No retry.

Jan (janhq/jan 983de33; extensions/llamacpp-extension/src/index.ts `chat`,
  `handleStreamingResponse`)
  - Before each chat: `GET http://localhost:PORT/health` (only a network failure counts: then
    "Model appears to have crashed! Please reload!"). POST /v1/chat/completions with
    Content-Type and `Authorization: Bearer KEY`; body: the app's request (model, messages,
    stream: true, the model's sampling settings, tools with tool_choice "auto" when MCP tools
    are on) with `return_progress: true` always added. Timeout 600 s.
  - Reads with a TextDecoder, split on "\\n", each line trimmed: empty lines and
    `data: [DONE]` skipped, `data: ` JSON.parse'd (a failure ends the chat), `error: ` thrown as
    its message, ANY other line throws "Malformed chunk"; a chunk with finish_reason "length" is
    thrown as "the request exceeds the available context size." (so a made-up length finish
    is shown as a context overflow).
  - No retry; a status >= 400 throws "API request failed with status N: <body>".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import strict_sse

# The tool each tool-using client offers here (a home-llm intent, Cline's and Roo Code's file
# tools and aider's function look alike to the server: a name, a description, a JSON schema).
TOOL = {"type": "function", "function": {
    "name": "replace_lines", "description": "Replace lines of a file with new text",
    "parameters": {"type": "object", "properties": {
        "explanation": {"type": "string", "description": "Why"},
        "path": {"type": "string", "description": "The file"}},
        "required": ["explanation", "path"]}}}


@dataclass(frozen=True)
class Shape:
    """One client's request: its route under the server's root, headers and JSON body (for an
    SDK client, the body is what the SDK sends, and its keys are the SDK call's arguments)."""

    client: str
    route: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def _chat(system: str | None, prompt: str) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": prompt}]


def open_webui(prompt: str, model: str = "smollm2") -> Shape:
    return Shape("Open WebUI", "/v1/chat/completions", {
        "model": model, "messages": _chat(None, prompt), "stream": True,
        "stream_options": {"include_usage": True}},
        {"Content-Type": "application/json", "Authorization": "Bearer sk-open-webui"})


def continue_llamacpp(prompt: str, model: str = "smollm2") -> Shape:
    """Continue's `llama.cpp` provider: its own template (ChatML for this model) to /completion."""
    rendered = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    return Shape("Continue", "/completion", {
        "model": model, "prompt": rendered, "stream": True, "n_predict": 4096,
        "temperature": 0.5, "stop": ["<|im_end|>"]},
        {"Content-Type": "application/json", "Authorization": "Bearer undefined"})


def cline(prompt: str, model: str = "smollm2") -> Shape:
    return Shape("Cline", "/v1/chat/completions", {
        "model": model, "messages": _chat("You are Cline, a software engineer.", prompt),
        "stream": True, "stream_options": {"include_usage": True}, "tools": [TOOL],
        "tool_choice": "auto", "parallel_tool_calls": False})


def roo_code(prompt: str, model: str = "smollm2") -> Shape:
    return Shape("Roo Code", "/v1/chat/completions", {
        "model": model, "temperature": 0,
        "messages": _chat("You are Roo, a software engineer.", prompt), "stream": True,
        "stream_options": {"include_usage": True}, "tools": [TOOL], "tool_choice": "auto",
        "parallel_tool_calls": True})


def aider(prompt: str, model: str = "smollm2") -> Shape:
    """aider's send_completion with functions: the one tool, forced. (LiteLLM's own arguments,
    api_base and timeout, are the caller's.)"""
    return Shape("aider", "/v1/chat/completions", {
        "model": f"openai/{model}", "messages": _chat("Act as an expert developer.", prompt),
        "stream": True, "temperature": 0, "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": TOOL["function"]["name"]}}})


def home_llm(prompt: str, model: str = "smollm2") -> Shape:
    return Shape("home-llm", "/v1/chat/completions", {
        "model": model, "stream": True, "max_tokens": 512, "temperature": 0.1, "top_p": 1,
        "messages": _chat("You are 'Al', a helpful AI Assistant that controls the devices in a "
                          "house.", prompt), "tools": [TOOL]})


def jan(prompt: str, model: str = "smollm2") -> Shape:
    return Shape("Jan", "/v1/chat/completions", {
        "model": model, "messages": _chat(None, prompt), "stream": True, "temperature": 0.7,
        "top_p": 0.95, "return_progress": True},
        {"Content-Type": "application/json", "Authorization": "Bearer jan-session-key"})


# --- reading the answer, as each client reads it ----------------------------------------------


@dataclass
class Reading:
    """What a client took from a stream."""

    text: str = ""
    finishes: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    error: Any = None  # an error the client shows (it did not raise)
    usage: dict[str, Any] | None = None

    def take_chunk(self, chunk: dict[str, Any]) -> None:
        """An OpenAI chat chunk: content, tool-call deltas joined by index, finish, usage."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            self.text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                whole = self.tool_calls.setdefault(call.get("index", 0),
                                                   {"name": "", "arguments": ""})
                function = call.get("function") or {}
                whole["name"] += function.get("name") or ""
                whole["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finishes.append(choice["finish_reason"])


class ClientRefused(Exception):
    """The client's own code threw on what it read: the user sees this message, not an answer
    (a line its parser refuses raises strict_sse.Refused instead)."""


def open_webui_read(raw: bytes) -> Reading:
    """stream_body_handler: `data:` lines only, JSON failures ignored, an error shown."""
    reading = Reading()
    for line in raw.split(b"\n"):
        data = line.decode("utf-8", "replace")
        if not data.strip() or not data.startswith("data:"):
            continue
        try:
            chunk = json.loads(data[len("data:"):].strip())
        except ValueError:
            continue  # `[DONE]`, or anything else it cannot read
        if not chunk.get("choices") and chunk.get("error"):
            reading.error = chunk["error"]
            continue
        reading.take_chunk(chunk)
    return reading


def continue_stream_sse(raw: bytes) -> list[dict[str, Any]]:
    """packages/fetch streamSse with parseSseLine: the data objects, or its error."""
    out: list[dict[str, Any]] = []
    lines = raw.decode("utf-8").split("\n")
    for line in lines:
        if line.startswith("data:[DONE]") or line.startswith("data: [DONE]") or \
                line.startswith(": ping"):
            continue  # ends the batch read so far; the next read goes on
        if not line.startswith("data:"):
            continue
        text = line[len("data: "):] if line.startswith("data: ") else line[len("data:"):]
        try:
            data = json.loads(text)
        except ValueError:
            raise ClientRefused(f"Malformed JSON sent from server: {text}") from None
        if isinstance(data, dict) and data.get("error"):
            error = data["error"]
            message = error.get("message") if isinstance(error, dict) else json.dumps(error)
            raise ClientRefused(f"Error streaming response: {message}")
        out.append(data)
    return out


def continue_retries(status: int, status_text: str, url: str, body: str) -> bool:
    """Whether withExponentialBackoff retries the error BaseLLM.fetch makes of this answer (the
    error has no response attached, so only its message can match)."""
    message = f"HTTP {status} {status_text} from {url}\n\n{body}"
    lower = message.lower()
    return bool(re.search(r'"code"\s*:\s*429', message)) or "overloaded" in lower or \
        "malformed json" in lower


def home_llm_read(raw: bytes) -> Reading:
    """home-llm's loop (its lines: strict_sse.home_llm), and what it makes of each chunk: one
    with no choices is skipped (an error event too: the answer ends with what was said), and
    each tool-call delta must be a whole call."""
    reading = Reading()
    for chunk in strict_sse.home_llm(raw):
        if not chunk.get("choices"):
            continue  # "Response missing or empty 'choices'", logged and skipped
        for call in (chunk["choices"][0].get("delta") or {}).get("tool_calls") or []:
            function = call.get("function") or {}
            if "name" not in function or "arguments" not in function:
                raise ClientRefused(f"MalformedToolCallException: {function}")
        reading.take_chunk(chunk)
    return reading


JAN_OUT_OF_CONTEXT = "the request exceeds the available context size."


def jan_read(raw: bytes) -> Reading:
    """Jan's handleStreamingResponse (its lines: strict_sse.jan), which also throws a `length`
    finish as a context overflow."""
    reading = Reading()
    for chunk in strict_sse.jan(raw):
        if (chunk.get("choices") or [{}])[0].get("finish_reason") == "length":
            raise ClientRefused(JAN_OUT_OF_CONTEXT)
        reading.take_chunk(chunk)
    return reading


def sdk_read(chunks: Iterable[Any]) -> Reading:
    """The OpenAI SDK's chunk objects (Cline, Roo Code), or LiteLLM's (aider), read as dicts."""
    reading = Reading()
    for chunk in chunks:
        reading.take_chunk(chunk.model_dump(exclude_none=True))
    return reading


# aider/exceptions.py: the LiteLLM exceptions aider retries, by exact class (the rest, and the
# classes it does not name, end the request).
AIDER_RETRIES = {"APIConnectionError": True, "APIError": True, "BadGatewayError": True,
                 "InternalServerError": True, "ServiceUnavailableError": True,
                 "RateLimitError": True, "Timeout": True, "BadRequestError": False,
                 "NotFoundError": False, "AuthenticationError": False,
                 "ContextWindowExceededError": False, "PermissionDeniedError": False}


def aider_retries(error: BaseException) -> bool:
    """aider's rule for an exception LiteLLM raised: by its class name (its ExInfo table)."""
    return AIDER_RETRIES.get(type(error).__name__, False)
