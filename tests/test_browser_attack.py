"""A web page against Spillway, in a real headless Chromium, against a real daemon with real
llama-server children listening on loopback (issues 26 and 37).

An attacker's page, served from another origin (another port of 127.0.0.1: the same site, so
`Sec-Fetch-Site: same-site`), tries what any page can do without a CORS preflight: `fetch` with
`mode: "no-cors"`, form POSTs (text/plain with a JSON-looking body, and urlencoded) into a hidden
frame, images, and a JSON `fetch` that needs a preflight; and the Stop of another client's
resumable stream (a DELETE, whose preflight the child grants). Then a page at a name that
resolves to 127.0.0.1 (DNS rebinding, with Chromium's `--host-resolver-rules`) runs its script in
that origin, same-origin with Spillway as far as the browser knows, and tries Spillway's routes
and llama-server's (`/props`, the prompts in `/slots`, the model's path in `/v1/models`, a
completion). The GPU child stays READY and unpaused, no drill opens, the stream is still there
to resume, every request arrived and was refused (the daemon's own counter, read with
Prometheus's parser), and Spillway's own page still pauses and resumes the GPU child.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web
from cdp import Browser
from harness import Spillway, free_port, real_config
from prometheus_client.parser import text_string_to_metric_families
from test_status_page import card, confirm_dialog

from conftest import SpillwayFactory

pytestmark = pytest.mark.integration

REBOUND = "evil.example"  # the attacker's name, resolved by the browser to 127.0.0.1

# What the page sends; each POST must reach Spillway and be refused there.
ATTACK = """<!doctype html><title>cute cats</title>
<body><iframe name="sink" hidden></iframe>
<script>
const T = %(target)s;
const posts = [];
function post(path, body, headers) {
  posts.push(path);
  return fetch(T + path, {method: 'POST', mode: 'no-cors', body, headers: headers || {}})
    .then(() => 'sent', () => 'failed');
}
function form(path, enctype, name, value) {
  posts.push(path);
  return new Promise((done) => {
    const sink = document.querySelector('iframe[name=sink]');
    sink.onload = () => done('loaded');
    const f = Object.assign(document.createElement('form'),
      {action: T + path, method: 'POST', enctype, target: 'sink'});
    f.append(Object.assign(document.createElement('input'), {type: 'hidden', name, value}));
    document.body.append(f);
    f.submit();
  });
}
function image(path) {
  return new Promise((done) => {
    const i = new Image();
    i.onload = () => done('image');
    i.onerror = () => done('not an image');
    i.src = T + path;
  });
}
(async () => {
  const results = {};
  results.pause = await post('/spillway/gpu/pause', '{}');
  // A JSON type in no-cors mode is not sent as such: the browser sends text/plain.
  results.restart = await post('/spillway/gpu/restart', '{}',
                               {'Content-Type': 'application/json'});
  results.drill_start = await post('/spillway/drill/start', '{}');
  results.arm_now = await post('/spillway/drill/arm', '{"now": true}');
  results.form_text = await form('/spillway/gpu/pause', 'text/plain', '{"now": true, "x": "',
                                 '"}');
  results.form_arm = await form('/spillway/drill/arm', 'application/x-www-form-urlencoded',
                                'now', 'true');
  for (const path of ['/spillway/gpu/pause', '/spillway/drill/arm', '/spillway/status']) {
    results['img ' + path] = await image(path);
  }
  // A real JSON POST needs a preflight, which Spillway never grants: it is never sent.
  results.cors = await fetch(T + '/spillway/gpu/pause', {method: 'POST', body: '{}',
      headers: {'Content-Type': 'application/json'}}).then(() => 'answered', () => 'blocked');
  // Another client's resumable stream: the child grants the DELETE's preflight (llama-server's
  // default CORS), so the DELETE itself reaches Spillway, which answers it.
  posts.push('/v1/stream');
  results.stop = await fetch(T + '/v1/stream?conv_id=victim', {method: 'DELETE'})
    .then((r) => r.status, () => 'blocked');
  results.posts = posts.length;
  document.body.dataset.results = JSON.stringify(results);
})();
</script></body>"""

# Run in the rebound origin (http://evil.example:PORT), where the browser takes Spillway for the
# page's own server: what can the script read and change?
REBOUND_SCRIPT = """(async () => {
  const status = await fetch('/spillway/status');
  const pause = await fetch('/spillway/gpu/pause', {method: 'POST', body: '{}',
                            headers: {'Content-Type': 'application/json'}});
  const llama = {};
  for (const path of ['/props', '/slots', '/v1/models']) {
    const r = await fetch(path);
    llama[path] = [r.status, await r.text()];
  }
  const run = await fetch('/v1/chat/completions', {method: 'POST', headers: {'Content-Type':
      'application/json'}, body: JSON.stringify({messages: [{role: 'user', content: 'hi'}],
      max_tokens: 2})});
  llama.run = [run.status, await run.text()];
  return {status: status.status, status_body: await status.json(), pause: pause.status,
          pause_body: await pause.json(), llama};
})()"""


@asynccontextmanager
async def attacker(target: str) -> AsyncIterator[str]:
    """The attacker's page on another port: its URL."""
    page = ATTACK % {"target": json.dumps(target)}

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", index)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


def refusals(s: Spillway) -> dict[str, float]:
    """spillway_rejections_total by reason, read as Prometheus reads it."""
    code, text = s.get("/spillway/metrics")
    assert code == 200
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "spillway_rejections_total":
                found[sample.labels["reason"]] = sample.value
    return found


def untouched(s: Spillway) -> None:
    status = s.status()
    gpu = status["children"]["gpu"]
    assert gpu["state"] == "READY" and gpu["paused"] is False and gpu["restarts"] == 0, gpu
    assert status["drill"] == {"running": False}
    assert status["incidents"]["written"] == 0


async def test_a_web_page_cannot_stop_the_gpu_and_the_status_page_still_can(
        spillway: SpillwayFactory, llama_server: Path, tiny_model: Path, tmp_path: Path,
        chromium: Path) -> None:
    s = await asyncio.to_thread(spillway, real_config(llama_server, tiny_model))
    # Another client's resumable stream, done and kept for it to read again.
    code, _ = await asyncio.to_thread(s.post, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
        {"X-Conversation-Id": "victim"})
    assert code == 200
    assert (await asyncio.to_thread(s.get, "/v1/stream?conv_id=victim"))[0] == 200
    flags = (f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1",)
    async with attacker(s.url) as evil, Browser.launch(chromium, tmp_path, flags=flags) as page:
        # 1. Cross-site: the attacker's page on another port.
        await page.navigate(evil)
        results = json.loads(await page.wait_for("document.body.dataset.results"))
        assert results["cors"] == "blocked", results  # the preflight was refused
        assert results["form_text"] == results["form_arm"] == "loaded", results
        assert await asyncio.to_thread(refusals, s) == {"cross_site": results["posts"]} \
            and results["posts"] == 7, results
        await asyncio.to_thread(untouched, s)
        # The stream was not stopped: its client can still read it.
        assert (await asyncio.to_thread(s.get, "/v1/stream?conv_id=victim"))[0] == 200

        # 2. DNS rebinding: a page at the attacker's name, now resolving to 127.0.0.1.
        rebound = f"http://{REBOUND}:{s.port}"
        await page.navigate(f"{rebound}/spillway/")
        shown = json.loads(await page.evaluate("document.body.innerText"))
        assert shown["error"]["setting"] == "server.allowed_hosts", shown
        seen = await page.evaluate(REBOUND_SCRIPT)
        assert seen["status"] == 403 and seen["pause"] == 403, seen
        assert "children" not in seen["status_body"]
        assert seen["pause_body"]["error"]["setting"] == "server.allowed_hosts"
        # llama-server's routes too, while Spillway listens on loopback only: the rebound page
        # reads no prompt, no model path, and runs nothing.
        for path, (code, text) in seen["llama"].items():
            assert code == 403 and json.loads(text)["error"]["setting"] == \
                "server.allowed_hosts", (path, code, text)
            assert "tiny.gguf" not in text
        await asyncio.to_thread(untouched, s)
        # The page itself, its two fetches of Spillway's routes and four of llama-server's; and
        # the browser's own /favicon.ico for the rebound origin, if it asked yet.
        assert (await asyncio.to_thread(refusals, s))["foreign_host"] in (7, 8)

        # 3. Spillway's own page still pauses and resumes the GPU child.
        await page.navigate(f"{s.url}/spillway/")
        await page.wait_for(f"{card('gpu')}?.state === 'READY'")
        await page.click("button[data-action=pause]")
        await confirm_dialog(page)
        await page.click("#confirm-yes")
        await page.wait_for(f"(() => {{ const c = {card('gpu')}; "
                            "return c.state === 'STOPPED' && c.paused === 'true'; })()")
        assert s.child("gpu")["paused"] is True
        await page.click("button[data-action=resume]")
        await confirm_dialog(page)
        await page.click("#confirm-yes")
        await page.wait_for(f"{card('gpu')}.state === 'READY'")
    gpu = await asyncio.to_thread(s.child, "gpu")
    assert gpu["state"] == "READY" and gpu["paused"] is False
    assert set(await asyncio.to_thread(refusals, s)) == {"cross_site", "foreign_host"}
