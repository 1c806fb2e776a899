"""Streams through GPU deaths: what a continuation costs, and how many streams finish.

Real llama-server children serving the embedded SmolLM2-135M-Instruct behind one Spillway; the
GPU child's death is injected by tests/gpu_fault_injector.py (the captured CUDA lines, then
SIGABRT). Two parts, in the same run:

- penalty: one greedy stream at a time, the GPU child dying after K events (K = 20, 80, 160):
  the time from the death to the continuation's next token (the incident's continued_after_s)
  against the CPU child's own prefill of the same prompt and prefix (the continuation's final
  event carries the CPU child's timings, prompt_ms), and how much of the text equals the
  uninterrupted greedy answer at llama-server's default micro-batch;
- chaos: the GPU child dies every S seconds while C concurrent long streams (300 tokens) run,
  for R rounds, taking turns on chat completions, /v1/messages and /v1/responses: streams in
  flight at each death, and how many of all streams finished (chat: [DONE]; messages:
  message_stop; responses: response.completed) with no error event. Each round one more
  stream carries X-Conversation-Id and its client leaves after 5 events; it is read back from
  GET /v1/stream once it is done, and counts as finished when that ends with its [DONE].

    .venv/bin/python -m bench.continuation [--rounds 3] [--concurrency 4] [--every 2.5]

Prints the tables and writes bench/results/continuation.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness import Spillway, injector_script, real_config  # noqa: E402

from supervisor.commands import bootstrap  # noqa: E402

STORY = "Tell me a long story about a robot who learns to paint, with many details."


def config(binary: Path, model: Path, injector: Path, env: dict[str, str],
           slots: int = 4) -> dict[str, Any]:
    cfg = real_config(binary, model, model={"args": ["-c", str(1024 * slots), "-np", str(slots),
                                                     "-t", "1", "-tb", "1"]},
                      restart={"backoff_initial_s": 0.2, "backoff_max_s": 1.0})
    cfg["gpu"] = {**cfg["gpu"], "llama_server": str(injector),
                  "env": {"REAL_LLAMA_SERVER": str(binary), "FAULT_LINES": "terse", **env}}
    return cfg


APIS = ("chat", "messages", "responses")


def _body(api: str, tokens: int, content: str) -> tuple[str, dict[str, Any]]:
    if api == "messages":
        return "/v1/messages", {"model": "smollm2", "max_tokens": tokens, "temperature": 0,
                                "stream": True,
                                "messages": [{"role": "user", "content": content}]}
    if api == "responses":
        return "/v1/responses", {"model": "smollm2", "max_output_tokens": tokens,
                                 "temperature": 0, "stream": True, "ignore_eos": True,
                                 "input": content}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                    "max_tokens": tokens, "temperature": 0, "stream": True,
                                    "ignore_eos": True}


def _ended(api: str, event: dict[str, Any]) -> bool:
    return event.get("type") == {"messages": "message_stop",
                                 "responses": "response.completed"}.get(api)


def _text_of(api: str, event: dict[str, Any]) -> str:
    if api == "messages":
        delta = event.get("delta") or {}
        return str(delta.get("text") or "") if event.get("type") == "content_block_delta" else ""
    if api == "responses":
        return str(event.get("delta") or "") if event.get("type") == \
            "response.output_text.delta" else ""
    return "".join(ch.get("delta", {}).get("content") or "" for ch in event.get("choices", []))


async def any_stream(http: aiohttp.ClientSession, url: str, api: str, tokens: int,
                     content: str = STORY, leave_after: int | None = None,
                     conversation: str | None = None) -> dict[str, Any]:
    """One stream on `api`: its text, whether it ended whole (its API's last event, no error
    event), and (chat) the event with the finish, which carries the timings; `leave_after`
    events, the client leaves (with `conversation` as its X-Conversation-Id)."""
    path, body = _body(api, tokens, content)
    headers = {"X-Conversation-Id": conversation} if conversation else {}
    text, done, error, events, final = "", False, False, 0, None
    async with http.post(f"{url}{path}", json=body, headers=headers) as r:
        async for raw in r.content:
            line = raw.strip()
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: {"):
                event = json.loads(line[6:])
                events += 1
                if "error" in event or event.get("type") == "error":
                    error = True
                    continue
                text += _text_of(api, event)
                if any(ch.get("finish_reason") for ch in event.get("choices", [])):
                    final = event
                done = done or _ended(api, event)
                if leave_after is not None and events >= leave_after:
                    r.close()
                    return {"api": api, "left": True, "done": False}
    return {"api": api, "text": text, "done": done and not error, "final": final}


async def read_back(http: aiohttp.ClientSession, url: str, conversation: str) -> bool:
    """The left stream, once done, from Spillway's replay buffer: ends whole?"""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        async with http.post(f"{url}/v1/streams/lookup",
                             json={"conversation_ids": [conversation]}) as r:
            found = await r.json()
        if found and found[0]["is_done"]:
            break
        await asyncio.sleep(0.2)
    async with http.get(f"{url}/v1/stream", params={"conv_id": conversation,
                                                    "from": "0"}) as r:
        raw = await r.read()
    return raw.endswith(b"data: [DONE]\n\n") and b'data: {"error"' not in raw


async def penalty(binary: Path, model: Path, injector: Path, folder: Path) -> dict[str, Any]:
    rows = []
    for k in (20, 80, 160):
        once = folder / f"fired-{k}"
        s = Spillway(folder / f"penalty-{k}", config(binary, model, injector, {
            "FAULT_NTH": "2", "FAULT_WHEN": f"events:{k}", "FAULT_ONCE_FILE": str(once)}))
        s.start()
        try:
            async with aiohttp.ClientSession() as http:
                whole = await any_stream(http, s.url, "chat", 240)
                cut = await any_stream(http, s.url, "chat", 240)
            [record] = s.wait_incidents(1, timeout=30)
            timings = (cut["final"] or {}).get("timings", {})
            same = next((i for i, (a, b) in enumerate(zip(whole["text"], cut["text"]))
                         if a != b), min(len(whole["text"]), len(cut["text"])))
            rows.append({"events_before": k, "tokens_before": record["tokens_before"],
                         "death_to_next_token_s": record["continued_after_s"],
                         "cpu_prefill_s": timings.get("prompt_ms", 0) / 1000,
                         "cpu_prefill_tokens": timings.get("prompt_n"),
                         "finished": cut["done"],
                         "same_chars": same, "answer_chars": len(whole["text"])})
        finally:
            s.stop()
    return {"rows": rows}


async def chaos(binary: Path, model: Path, injector: Path, folder: Path, rounds: int,
                concurrency: int, every: float) -> dict[str, Any]:
    s = Spillway(folder / "chaos", config(binary, model, injector,
                                          {"FAULT_EVERY_S": str(every)}, slots=concurrency + 1))
    s.start()
    results: list[dict[str, Any]] = []
    resumed: list[bool] = []
    try:
        async with aiohttp.ClientSession() as http:
            for r in range(rounds):
                s.wait_ready(timeout=60)
                batch = [any_stream(http, s.url, APIS[(r + i) % len(APIS)], 300,
                                    f"{STORY} ({r}.{i})") for i in range(concurrency)]
                batch.append(any_stream(http, s.url, "chat", 300, f"{STORY} (left {r})",
                                        leave_after=5, conversation=f"chaos-{r}"))
                results += [x for x in await asyncio.gather(*batch) if not x.get("left")]
                resumed.append(await read_back(http, s.url, f"chaos-{r}"))
        records = s.incidents()
    finally:
        s.stop()
    deaths: dict[str, int] = {}
    for rec in records:
        deaths[rec["episode"]] = deaths.get(rec["episode"], 0) + 1
    by_api = {api: f"{sum(x['done'] for x in results if x['api'] == api)} of "
                   f"{sum(1 for x in results if x['api'] == api)}" for api in APIS}
    return {"streams": len(results), "finished": sum(r["done"] for r in results),
            "finished_by_api": by_api, "left_and_read_back": len(resumed),
            "read_back_whole": sum(resumed),
            "deaths": len(deaths), "in_flight_at_each_death": sorted(deaths.values()),
            "decisions": {d: sum(1 for x in records if x["decision"] == d)
                          for d in {x["decision"] for x in records}}}


def report(pen: dict[str, Any], ch: dict[str, Any]) -> str:
    lines = ["# Streams through GPU deaths", "", "## Penalty (one stream at a time)", "",
             "| tokens before | death to next token | CPU prefill of prompt+prefix | ratio | "
             "finished | same text (chars) |", "|---|---|---|---|---|---|"]
    for r in pen["rows"]:
        ratio = r["death_to_next_token_s"] / r["cpu_prefill_s"] if r["cpu_prefill_s"] else 0
        lines.append(f"| {r['tokens_before']} | {r['death_to_next_token_s']:.3f} s | "
                     f"{r['cpu_prefill_s']:.3f} s ({r['cpu_prefill_tokens']} tokens) | "
                     f"{ratio:.2f} | {r['finished']} | {r['same_chars']} of "
                     f"{r['answer_chars']} |")
    lines += ["", "## Chaos", "",
              f"{ch['streams']} streams of 300 tokens, {ch['deaths']} GPU deaths; streams in "
              f"flight at each death: {ch['in_flight_at_each_death']}; incidents by decision: "
              f"{ch['decisions']}; finished with [DONE] and no error event: "
              f"{ch['finished']} of {ch['streams']} "
              f"({100 * ch['finished'] / max(ch['streams'], 1):.0f}%), by API: "
              f"{ch['finished_by_api']}; streams whose client left after 5 events, read back "
              f"whole from GET /v1/stream: {ch['read_back_whole']} of "
              f"{ch['left_and_read_back']}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--every", type=float, default=2.5)
    parser.add_argument("--chaos-only", action="store_true")
    args = parser.parse_args()
    binary = bootstrap.ensure_llama_server()
    model = bootstrap.ensure_model()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        injector = injector_script(folder)
        started = time.monotonic()
        pen = {"rows": []} if args.chaos_only else \
            asyncio.run(penalty(binary, model, injector, folder))
        ch = asyncio.run(chaos(binary, model, injector, folder, args.rounds, args.concurrency,
                               args.every))
    text = report(pen, ch)
    print(text)
    print(f"({time.monotonic() - started:.0f} s)")
    out = REPO / "bench" / "results"
    if args.chaos_only:  # the penalty's figures on file stay as they were
        (out / "continuation-chaos.json").write_text(json.dumps(ch, indent=2) + "\n")
        (out / "continuation-chaos.md").write_text(text + "\n")
        return
    (out / "continuation.json").write_text(json.dumps({"penalty": pen, "chaos": ch,
                                                       "median_penalty_s": statistics.median(
                                                           r["death_to_next_token_s"]
                                                           for r in pen["rows"])},
                                                      indent=2) + "\n")
    (out / "continuation.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
