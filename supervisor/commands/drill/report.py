"""The drill's report: a table for the terminal, a JSON file, and a self-contained HTML page with
an SVG timeline (the children's states over time, in router mode also the drilled models' on
each router; each request a bar coloured by outcome, with the child that answered it). Every
request is listed too: whether it accepted a smaller model, the GPU child's state as it was sent
(scenario 8), the child that answered, the model the answer names, attempts, outcome and
latency, and whether it carried an image (scenario 9, whose image request's line says how many
of its prompt tokens were the image's), and a stream's time to first token. Scenario 10 has a
line and a table of its own: the warm and the cold second turn's time to first token and the
prompt tokens the CPU child found in its cache, and their ratio. Scenario 11 has a line of its
own: how the stream went on from the GPU child once it was back (waited, or failed back at which
token), the rest's time against its forecast, and each child's speed. A scenario that did not run
(6 outside router mode, 8 without a small child, 9 without a projector, 10 without a warm CPU
child), or ran and could not show what it is for (11 where the GPU child is not faster), is
listed as skipped, with the reason."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any
from xml.sax.saxutils import quoteattr

from .. import tables
from ...config.schema import ROUTERS

OUTCOME_COLOURS = {
    "completed": "#2e7d32",
    "replayed": "#1565c0",
    "continued": "#6a1b9a",
    "waited": "#283593",  # went on from the GPU child once it was back, after waiting for it
    "failed_back": "#ad1457",  # moved back from the CPU child to the GPU child
    "rerouted": "#00838f",
    "controlled_error": "#ef6c00",
    "cancelled": "#757575",
    "failed": "#c62828",
}
STATE_COLOURS = {
    "READY": "#81c784",
    "STARTING": "#64b5f6",
    "DRAINING": "#fff176",
    "STOPPING": "#ffd54f",
    "EXITED": "#e57373",
    "BACKOFF": "#ffb74d",
    "FATAL": "#b71c1c",
    "STOPPED": "#bdbdbd",
}


def summary(scenario: dict[str, Any]) -> dict[str, Any]:
    """The fields the report shows for one scenario, from the daemon's incident records."""
    reqs = scenario["requests"]
    caught = [r for r in reqs if r.get("incident")]
    first = caught[0] if caught else (reqs[0] if reqs else {})
    inc = first.get("incident") or {}
    outcomes: dict[str, int] = {}
    for r in reqs:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {
        "first_error": f"{inc.get('kind')}: {inc.get('evidence')}" if inc else "none",
        "decision": f"{inc.get('decision')} ({inc.get('reason')})" if inc else "none",
        "cpu_start_s": inc.get("cpu_start_s", 0) if inc else None,
        "final": ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())),
        "latency_s": inc.get("latency_s", first.get("latency_s")) if first else None,
        "connection_survived": inc.get("client_connected") if inc else None,
        "tool_effects": scenario.get("tool_effects"),
        "request_ids": [r["request_id"] for r in reqs],
    }


def _result(scenario: dict[str, Any], report: dict[str, Any]) -> str:
    """PASS or FAIL; "(simulated)" when this scenario was, and the rest of the drill not."""
    word = "PASS" if scenario["passed"] else "FAIL"
    return word + (" (simulated)" if scenario["simulated"] and not report["simulated"] else "")


def gpu_states_after(scenario: dict[str, Any]) -> str | None:
    """Scenario 6: each model's state on the GPU router at the end, in words."""
    states = (scenario.get("models") or {}).get("gpu_states_after")
    if not states:
        return None
    return "on the GPU router at the end: " + ", ".join(f"{m} {st}" for m, st in states.items())


def image_line(scenario: dict[str, Any]) -> str | None:
    """Scenario 9: who answered the image request, how many of its prompt tokens were the
    image's, and the GPU child's state at the end, in words."""
    media = scenario.get("media")
    if not media or not scenario["requests"]:
        return None
    first = scenario["requests"][0]
    image = media.get("image_tokens")
    return (f"the image request: {first['outcome']}{_by(first)}, its prompt "
            f"{media.get('prompt_tokens') or '-'} tokens, "
            f"{'how many of them the image' if image is None else image} of them the image's; "
            f"{media.get('gpu') or 'the GPU child'} at the end: {media.get('gpu_after')}")


def conversation_line(scenario: dict[str, Any]) -> str | None:
    """Scenario 10: the warm and the cold second turn (time to first token, prompt tokens
    cached, the CPU child's own prefill time), their ratio, and the GPU child at the end."""
    talk = scenario.get("conversation")
    if not talk or "warm" not in talk or "cold" not in talk:
        return None
    warm, cold = talk["warm"], talk["cold"]
    ratio = talk.get("warm_over_cold")
    first = (talk.get("first") or {}).get("prompt_tokens")
    waited = (talk.get("mirror") or {}).get("waited_s")
    return (f"the second turn on the CPU child: warm {_turn_words(warm)}; cold "
            f"{_turn_words(cold)}; warm/cold {'-' if ratio is None else f'{ratio:.2f}'} "
            f"(the first turn's prompt {first or '-'} tokens, mirrored "
            f"{'-' if waited is None else f'{waited:.1f}'} s after its answer); "
            f"{talk.get('gpu') or 'the GPU child'} at the end: {talk.get('gpu_after')}")


def return_line(scenario: dict[str, Any]) -> str | None:
    """Scenario 11: how the stream went on from the GPU child once it was back, the rest's time
    against its forecast, and each child's generation speed, in words."""
    info = scenario.get("returned")
    if not info or info.get("moved") not in ("waited", "failed_back"):
        return None
    gpu = info.get("gpu") or "the GPU child"
    if info["moved"] == "waited":
        how = f"waited for {gpu} and went on from it at token {info.get('tokens_before')}"
    else:
        how = (f"continued on the CPU child at token {info.get('continued_at')}, failed back "
               f"to {gpu} at token {info.get('tokens_before')}")
    speeds = info.get("speeds") or {}
    back = info.get("gpu_back_after_s")
    return (f"{gpu} READY again {'-' if back is None else f'{back:.1f}'} s after its death; "
            f"the stream {how}; the rest took {_or_dash(info.get('took_s'))} s against "
            f"{_or_dash(info.get('forecast_s'))} s forecast; generation: {gpu} "
            f"{_or_dash(_generation(speeds, 'gpu'))} tokens/s, the CPU child "
            f"{_or_dash(_generation(speeds, 'cpu'))}")


def _generation(speeds: dict[str, Any], child: str) -> Any:
    return (speeds.get(child) or {}).get("generation")


def _turn_words(turn: dict[str, Any]) -> str:
    """"first token in 0.21 s, 2431 of 2450 prompt tokens cached (its prefill 12 ms)"."""
    ttft, prompt_ms = turn.get("ttft_s"), turn.get("prompt_ms")
    return (f"first token in {'-' if ttft is None else f'{ttft:.2f}'} s, "
            f"{_or_dash(turn.get('cache_n'))} of {_or_dash(turn.get('prompt_tokens'))} prompt "
            f"tokens cached (its prefill {'-' if prompt_ms is None else f'{prompt_ms:.0f}'} ms)")


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _kind(r: dict[str, Any]) -> str:
    """"stream" or "whole", and the images it carried: "whole + 1 image"."""
    n = int(r.get("images") or 0)
    return ("stream" if r["stream"] else "whole") + (
        f" + {n} image{'s' if n > 1 else ''}" if n else "")


def short_model(model: str | None) -> str:
    """The model an answer names, as a person reads it: a file's name without its folder."""
    return "-" if not model else model.rsplit("/", 1)[-1]


def answered_by(scenario: dict[str, Any]) -> list[str]:
    """Scenario 8: each request in a line: whether it accepted a smaller model, the child that
    answered, the model the answer names, the latency."""
    if "small_mode" not in (scenario.get("models") or {}):
        return []
    return [f"{r['request_id']} {_accepts(r)}{_while(r)}: {r['outcome']}{_by(r)} in "
            f"{r['latency_s']:.2f} s" for r in scenario["requests"]]


def _accepts(r: dict[str, Any]) -> str:
    return "opted in" if r.get("fallback") == "smaller" else "plain"


def _while(r: dict[str, Any]) -> str:
    """While the GPU child was down (scenario 8), in words; "" otherwise."""
    state = r.get("gpu_when_sent")
    return "" if state in (None, "READY") else f", sent while the GPU child was {state}"


def _by(r: dict[str, Any]) -> str:
    """Who answered, and the model the answer names: " by the small child (tiny.gguf)"."""
    child, model = r.get("child"), r.get("answer_model")
    return (f" by the {child} child" if child else "") + (
        f" ({short_model(model)})" if model else "")


def table(report: dict[str, Any]) -> str:
    rows = []
    for s in report["scenarios"]:
        m = summary(s)
        effects = m["tool_effects"]
        rows.append([
            s["number"], s["name"][:38], _result(s, report),
            (m["first_error"] or "")[:40], (m["decision"] or "")[:28],
            "-" if m["cpu_start_s"] is None else f"{m['cpu_start_s']:.2f}",
            m["final"][:28], "-" if m["latency_s"] is None else f"{m['latency_s']:.2f}",
            {True: "yes", False: "no", None: "-"}[m["connection_survived"]],
            "-" if effects is None else ",".join(str(v) for v in effects.values()),
        ])
    text = tables.render(["#", "scenario", "result", "first error", "decision",
                          "cpu start s", "final", "latency s", "connection", "tools"], rows)
    for s in report["scenarios"]:
        for line in (gpu_states_after(s), image_line(s), conversation_line(s),
                     return_line(s)):
            if line:
                text += f"\n[{s['number']}] {line}"
        for line in answered_by(s):
            text += f"\n[{s['number']}] {line}"
    for skipped in report.get("skipped", []):
        text += f"\n[{skipped['number']}] {skipped['name']}: skipped ({skipped['why']})"
    return text


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, default=str))


def _intervals(events: list[dict[str, Any]], child: str, start: float, end: float,
               model: str | None = None,
               initial: str = "READY") -> list[tuple[float, float, str]]:
    """(from, to, state) for one child (router mode: one model on that router) over
    [start, end]."""
    mine = sorted((e for e in events if e["child"] == child and e.get("model") == model),
                  key=lambda e: e["time"])
    state = initial
    for e in mine:
        if e["time"] <= start:
            state = e["state"]
    out = []
    t = start
    for e in mine:
        if e["time"] <= start:
            continue
        if e["time"] >= end:
            break
        out.append((t, e["time"], state))
        t, state = e["time"], e["state"]
    out.append((t, end, state))
    return [i for i in out if i[1] > i[0]]


def svg_timeline(report: dict[str, Any], width: int = 1000) -> str:
    timeline = report["timeline"]
    start, end = float(timeline["start"]), float(timeline["end"])
    span = max(end - start, 1e-3)
    left, lane_h, bar_h, gap = 110, 22, 12, 4

    def x(t: float) -> float:
        return left + (min(max(t, start), end) - start) / span * (width - left - 10)

    requests = [(s["number"], r) for s in report["scenarios"] for r in s["requests"]]
    # The children, then (router mode) each drilled model on each router.
    children = timeline.get("children") or ROUTERS  # the daemon's, in its order (older: two)
    lanes: list[tuple[str, str | None]] = [(child, None) for child in children]
    lanes += [(child, m) for m in timeline.get("models", []) for child in ROUTERS]
    height = 40 + len(lanes) * (lane_h + gap) + len(requests) * (bar_h + gap) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" class="timeline" role="img" '
             'aria-label="child states and requests over time">']
    y = 20
    initial = timeline.get("initial", {})
    for child, model in lanes:
        first = "READY" if model is None else initial.get(f"{child}/{model}") or "STOPPED"
        name = f"{child} child" if model is None else f"{child}: {model}"
        parts.append(f'<g class="lane" data-child="{child}"'
                     f'{"" if model is None else f" data-model={quoteattr(model)}"}>')
        parts.append(f'<text x="4" y="{y + 15}" class="lane-label">'
                     f'{html.escape(name[:16])}</text>')
        for a, b, state in _intervals(timeline["events"], child, start, end, model, first):
            colour = STATE_COLOURS.get(state, "#eeeeee")
            parts.append(f'<rect class="state state-{state}" data-state="{state}" '
                         f'x="{x(a):.1f}" y="{y}" width="{max(x(b) - x(a), 1):.1f}" '
                         f'height="{lane_h}" fill="{colour}"><title>{html.escape(name)}: '
                         f'{state} ({b - a:.2f} s)</title></rect>')
        parts.append("</g>")
        y += lane_h + gap
    y += 10
    previous = None
    for number, r in requests:
        if number != previous:
            parts.append(f'<text x="4" y="{y + bar_h - 2}" class="scenario-label">scenario '
                         f'{number}</text>')
            previous = number
        colour = OUTCOME_COLOURS.get(r["outcome"], "#000000")
        end_t = r["ended"] or end
        child = r.get("child") or ""
        label = html.escape(f"scenario {number}: {r['request_id']} {r['outcome']} "
                            f"({r['latency_s']} s){_by(r)}")
        parts.append(f'<rect class="request-bar outcome-{r["outcome"]}" '
                     f'data-request-id="{html.escape(r["request_id"])}" '
                     f'data-outcome="{r["outcome"]}" data-scenario="{number}" '
                     f'data-child={quoteattr(child)} '
                     f'x="{x(r["started"]):.1f}" y="{y}" '
                     f'width="{max(x(end_t) - x(r["started"]), 2):.1f}" height="{bar_h}" '
                     f'fill="{colour}"><title>{label}</title></rect>')
        y += bar_h + gap
    parts.append(f'<text x="{left}" y="{height - 8}" class="axis">0 s</text>')
    parts.append(f'<text x="{width - 60}" y="{height - 8}" class="axis">{span:.1f} s</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _after(scenario: dict[str, Any]) -> str:
    after = gpu_states_after(scenario) or image_line(scenario) or \
        conversation_line(scenario) or return_line(scenario)
    return f" ({after})" if after else ""


def _router_line(report: dict[str, Any]) -> str:
    if not report.get("router"):
        return ""
    second = report.get("second_model")
    return (f"<p>Router mode: every request is for model {html.escape(str(report['model']))}"
            f"{f'; the second model is {html.escape(second)}' if second else ''}.</p>")


def _request_rows(report: dict[str, Any]) -> str:
    """Every request in a row: what it carried (whole or a stream, its images), the child that
    answered it, the model its answer names, its latency (scenario 8 is judged on them)."""
    e = html.escape
    rows = []
    for s in report["scenarios"]:
        for r in s["requests"]:
            rows.append(
                f'<tr class="request" data-scenario="{s["number"]}" '
                f'data-request-id={quoteattr(r["request_id"])} '
                f'data-child={quoteattr(r.get("child") or "")} '
                f'data-images="{int(r.get("images") or 0)}"><td>{s["number"]}</td>'
                f'<td class="ids">{e(r["request_id"])}</td>'
                f'<td>{e(_kind(r))}</td><td>{_accepts(r)}</td>'
                f'<td>{e(str(r.get("gpu_when_sent") or "-"))}</td>'
                f'<td>{e(str(r.get("child") or "-"))}</td>'
                f'<td title={quoteattr(r.get("answer_model") or "")}>'
                f'{e(short_model(r.get("answer_model")))}</td><td>{r["attempts"]}</td>'
                f'<td>{e(r["outcome"])}</td><td>{_or_dash(r.get("ttft_s"))}</td>'
                f'<td>{r["latency_s"]}</td></tr>')
    return "".join(rows)


def _conversation_table(report: dict[str, Any]) -> str:
    """Scenario 10's warm and cold second turns, side by side, with their ratio."""
    e = html.escape
    parts = []
    for s in report["scenarios"]:
        talk = s.get("conversation") or {}
        if "warm" not in talk or "cold" not in talk:
            continue
        rows = "".join(
            f'<tr class="turn" data-turn="{name}" data-request-id={quoteattr(t["request_id"])} '
            f'data-child={quoteattr(t.get("child") or "")} '
            f'data-ttft="{_or_dash(t.get("ttft_s"))}" data-cache-n="{_or_dash(t.get("cache_n"))}"'
            f' data-prompt-tokens="{_or_dash(t.get("prompt_tokens"))}"><td>{name}</td>'
            f'<td class="ids">{e(t["request_id"])}</td><td>{e(str(t.get("child") or "-"))}</td>'
            f'<td>{_or_dash(t.get("ttft_s"))}</td><td>{_or_dash(t.get("cache_n"))}</td>'
            f'<td>{_or_dash(t.get("prompt_tokens"))}</td><td>{_or_dash(t.get("prompt_ms"))}</td>'
            f'</tr>' for name, t in (("warm", talk["warm"]), ("cold", talk["cold"])))
        ratio = talk.get("warm_over_cold")
        first = (talk.get("first") or {}).get("prompt_tokens")
        parts.append(
            f'<h2>A long conversation fails over</h2><p>Its second turn, lost by '
            f'{e(str(talk.get("gpu") or "the GPU child"))} and answered by the CPU child: '
            f'warm (the conversation mirrored to the CPU child, its first turn '
            f'{_or_dash(first)} prompt tokens) and cold (as long, never mirrored).</p>'
            '<table><tr><th>second turn</th><th>request id</th><th>answered by</th>'
            '<th>first token s</th><th>prompt tokens cached</th><th>prompt tokens</th>'
            f'<th>the child\'s prefill ms</th></tr>{rows}</table>'
            f'<p class="ratio" data-ratio="{_or_dash(ratio)}">warm/cold time to first token: '
            f'{"-" if ratio is None else f"{ratio:.2f}"}</p>')
    return "".join(parts)


def _returned(report: dict[str, Any]) -> str:
    """Scenario 11's figures, where the stream went on from the GPU child once it was back."""
    parts = []
    for s in report["scenarios"]:
        info = s.get("returned") or {}
        line = return_line(s)
        if line is None:
            continue
        parts.append(
            f'<h2>The GPU child comes back mid-answer</h2><p class="returned" '
            f'data-moved="{info["moved"]}" '
            f'data-tokens-before="{_or_dash(info.get("tokens_before"))}" '
            f'data-forecast="{_or_dash(info.get("forecast_s"))}" '
            f'data-took="{_or_dash(info.get("took_s"))}">{html.escape(line)}</p>')
    return "".join(parts)


def write_html(report: dict[str, Any], path: Path) -> None:
    e = html.escape
    rows = []
    for s in report["scenarios"]:
        m = summary(s)
        rows.append(
            f'<tr class="{"pass" if s["passed"] else "fail"}"><td>{s["number"]}</td>'
            f'<td>{e(s["name"])}</td><td>{"PASS" if s["passed"] else "FAIL"}'
            f'{" (simulated)" if s["simulated"] else ""}</td>'
            f'<td>{e(str(m["first_error"]))}</td><td>{e(str(m["decision"]))}</td>'
            f'<td>{m["cpu_start_s"]}</td><td>{e(m["final"])}</td><td>{m["latency_s"]}</td>'
            f'<td>{ {True: "yes", False: "no", None: "-"}[m["connection_survived"]]}</td>'
            f'<td>{e(str(m["tool_effects"] or "-"))}</td>'
            f'<td class="ids">{e(" ".join(m["request_ids"]))}</td></tr>'
            f'<tr class="bar"><td></td><td colspan="10">bar: {e(s["bar"])} &mdash; '
            f'{e(s["verdict"])}{e(_after(s))}</td></tr>')
    for skipped in report.get("skipped", []):
        rows.append(
            f'<tr class="skipped" data-scenario="{skipped["number"]}">'
            f'<td>{skipped["number"]}</td><td>{e(skipped["name"])}</td><td>SKIPPED</td>'
            f'<td colspan="8">{e(skipped["why"])}</td></tr>'
            f'<tr class="bar"><td></td><td colspan="10">bar: {e(skipped["bar"])}</td></tr>')
    legend = " ".join(f'<span class="key" style="background:{c}"></span>{k}'
                      for k, c in OUTCOME_COLOURS.items())
    states = " ".join(f'<span class="key" style="background:{c}"></span>{k}'
                      for k, c in STATE_COLOURS.items())
    machine = report.get("machine", {})
    profiles = ""
    if report.get("profiles"):
        prow = "".join(
            f'<tr><td>{e(p["profile"])}</td><td>{p.get("ttft_p50_s")}</td>'
            f'<td>{p.get("prompt_tps")}</td><td>{p.get("gen_tps")}</td>'
            f'<td>{p.get("latency_p50_s")}</td><td>{p.get("latency_p95_s")}</td>'
            f'<td>{p.get("peak_vram_mib")}</td><td>{p.get("peak_rss_mib")}</td></tr>'
            for p in report["profiles"]["results"])
        profiles = (f'<h2>Profiles</h2><p>{e(report["profiles"].get("note", ""))}</p>'
                    '<table><tr><th>profile</th><th>TTFT p50 s</th><th>prompt tok/s</th>'
                    '<th>gen tok/s</th><th>latency p50 s</th><th>p95 s</th>'
                    f'<th>peak VRAM MiB</th><th>peak RSS MiB</th></tr>{prow}</table>')
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Spillway drill {e(report["date"])}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; }}
tr.pass td:nth-child(3) {{ color: #2e7d32; font-weight: bold; }}
tr.fail td:nth-child(3) {{ color: #c62828; font-weight: bold; }}
tr.bar td {{ color: #555; font-size: 12px; border-top: none; }}
tr.skipped td:nth-child(3) {{ color: #757575; font-weight: bold; }}
td.ids {{ font-family: monospace; font-size: 11px; max-width: 18em; word-break: break-all; }}
.key {{ display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; }}
svg text {{ font-size: 12px; }}
</style></head><body>
<h1>Spillway drill: {"PASSED" if report["passed"] else "FAILED"}</h1>
<p>{e(report["date"])} &middot; Spillway {e(report["spillway"])} at {e(report["url"])}
&middot; {e(report["mode"])}</p>
<p>Machine: {e(str(machine.get("host")))}, {e(str(machine.get("cpu")))},
GPU: {e(str(machine.get("gpu")))}</p>
<p>How the failure was provoked: {e(report["provoked_by"])}</p>
{_router_line(report)}
<h2>Scenarios</h2>
<table><tr><th>#</th><th>scenario</th><th>result</th><th>first error</th><th>decision</th>
<th>CPU start s</th><th>final</th><th>latency s</th><th>connection survived</th>
<th>tool effects</th><th>request ids</th></tr>
{"".join(rows)}</table>
<h2>Requests</h2>
<table><tr><th>#</th><th>request id</th><th>kind</th><th>a smaller model</th>
<th>GPU child when sent</th><th>answered by</th><th>the answer's model</th><th>attempts</th>
<th>outcome</th><th>first token s</th><th>latency s</th></tr>
{_request_rows(report)}</table>
{_conversation_table(report)}
{_returned(report)}
<h2>Timeline</h2>
<p>Requests: {legend}</p><p>Child states: {states}</p>
{svg_timeline(report)}
{profiles}
<p>Every figure above comes from Spillway's own incident records, matched by request id.</p>
</body></html>
"""
    path.write_text(page)
