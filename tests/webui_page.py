"""Driving llama.cpp's own web UI (the SvelteKit app llama-server serves with `--path`) in
headless Chromium, over tests/cdp.py, as a person would: type into the message box, press
Send or Stop, read the answer and the error dialog off the page.

What the page is read by (the UI's own markup, pinned build 11434):
  message box      `textarea` (the chat form's only one)
  Send             `button[type=submit]` (its screen-reader text is "Send")
  Stop             the chat form's button whose `.sr-only` text is "Stop" (shown while an answer
                   is being generated and the box is empty)
  the answer       `.chat-message-assistant .markdown-content` of the last assistant message
  error dialog     `[role=alertdialog]` (bits-ui's AlertDialog: "Server Error", "TCP Timeout")

Settings live in localStorage (`LlamaUi.config`, with `LlamaUi.userOverrides` naming the keys
the user set, so the server's defaults from /props do not replace them); they are seeded before
the app's first script runs. Every fetch the app makes is recorded in `window.__sent` (URL,
method, headers, body, and the answer's status once it came), so a test can say what the UI sent
(its tools, its conversation id) and what it was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from typing import Any

from cdp import CdpError, Page
from harness import PATIENCE_S

CONFIG_KEY = "LlamaUi.config"
OVERRIDES_KEY = "LlamaUi.userOverrides"

STOP_BUTTON = ("[...document.querySelectorAll('button')].find(b => "
               "b.querySelector('.sr-only')?.textContent.trim() === 'Stop')")
ANSWERS = "[...document.querySelectorAll('.chat-message-assistant')]"
LAST_ANSWER_TEXT = (f"(() => {{ const a = {ANSWERS}.at(-1); const m = a && "
                    "a.querySelector('.markdown-content'); return m ? m.innerText : ''; })()")
ERROR_DIALOG = ("(() => { const d = document.querySelector('[role=alertdialog]'); "
                "return d ? d.innerText : null; })()")


def seed_script(settings: dict[str, Any]) -> str:
    """Run before the app on every document: the settings (first load only: the app keeps its
    own after that) and the fetch recorder."""
    config = json.dumps(json.dumps(settings))
    overrides = json.dumps(json.dumps(sorted(settings)))
    return f"""(() => {{
  if (!localStorage.getItem({json.dumps(CONFIG_KEY)})) {{
    localStorage.setItem({json.dumps(CONFIG_KEY)}, {config});
    localStorage.setItem({json.dumps(OVERRIDES_KEY)}, {overrides});
  }}
  const sent = window.__sent = [];
  const fetch0 = window.fetch;
  window.fetch = function (input, init) {{
    const entry = {{}};
    try {{
      const url = new URL(typeof input === 'string' ? input : (input.url || String(input)),
                          location.href);
      Object.assign(entry, {{
        url: url.pathname + url.search, status: null,
        method: (init && init.method) || (input && input.method) || 'GET',
        headers: Object.fromEntries(new Headers((init && init.headers) || {{}})),
        body: init && typeof init.body === 'string' ? init.body : null}});
      sent.push(entry);
    }} catch (e) {{}}
    return fetch0.apply(this, arguments).then(r => {{ entry.status = r.status; return r; }});
  }};
}})()"""


def plain(text: str) -> str:
    """Text as compared between the page and the stream: letters and digits only (the page
    renders Markdown: its markup characters and whitespace are not the stream's)."""
    return re.sub(r"[\W_]+", "", text)


class WebUi:
    """One page of the web UI."""

    def __init__(self, page: Page, url: str) -> None:
        self.page = page
        self.url = url

    async def open(self, settings: dict[str, Any]) -> None:
        """Load the app with `settings` seeded; ready once its message box and Send are."""
        await self.page.set_viewport(1280, 900)
        await self.page.send("Page.addScriptToEvaluateOnNewDocument",
                             {"source": seed_script(settings)})
        await self.page.navigate(self.url + "/")
        await self.ready()

    async def ready(self) -> None:
        await self.page.wait_for("document.querySelector('textarea') !== null && "
                                 "document.querySelector('button[type=submit]') !== null")

    async def reload(self, timeout: float = PATIENCE_S) -> None:
        """What F5 does (the app's pagehide handler runs, the document starts again); back once
        the new document's app is ready. While the old document goes, a script may be refused
        ("Inspected target navigated or closed"): asked again."""
        await self.page.evaluate("window.__old_document = true")
        await self.page.send("Page.reload", {"ignoreCache": False})
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(CdpError):
                if await self.page.evaluate(
                        "!window.__old_document && document.readyState === 'complete' && "
                        "document.querySelector('textarea') !== null"):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page did not load again in {timeout} s")
            await asyncio.sleep(0.05)

    async def ask(self, question: str) -> None:
        """Type the question and press Send (a real click on the button)."""
        await self.page.type_text("textarea", question)
        await self.page.wait_for("!document.querySelector('button[type=submit]').disabled")
        await self.page.click("button[type=submit]")
        # The question is on the page, as the user's message.
        await self.page.wait_for(
            "[...document.querySelectorAll('.chat-message-user')].some(m => m.innerText"
            f".includes({json.dumps(question[:40])}))")

    async def answer_text(self) -> str:
        return str(await self.page.evaluate(LAST_ANSWER_TEXT))

    async def generating(self) -> bool:
        return bool(await self.page.evaluate(f"!!{STOP_BUTTON}"))

    async def error_dialog(self) -> str | None:
        """The error dialog's text while it is open ("Server Error" and the message), else
        None."""
        found = await self.page.evaluate(ERROR_DIALOG)
        return None if found is None else str(found)

    async def wait_answer_started(self, chars: int = 1, timeout: float = PATIENCE_S) -> str:
        """The answer's text once it has `chars` characters, still being generated."""
        return str(await self.page.wait_for(
            f"(() => {{ const t = {LAST_ANSWER_TEXT}; return t.trim().length >= {chars} && "
            f"!!{STOP_BUTTON} && t; }})()", timeout))

    async def wait_answer_ended(self, timeout: float = PATIENCE_S) -> str:
        """Once the answer has ended on the page (no Stop button; text, or the error dialog):
        its text."""
        await self.page.wait_for(
            f"(() => {{ const t = {LAST_ANSWER_TEXT}; return !{STOP_BUTTON} && "
            f"(t.trim().length > 0 || {ERROR_DIALOG} !== null); }})()", timeout)
        return await self.answer_text()

    async def stop(self) -> None:
        """Press the chat form's Stop button (a real click)."""
        await self.page.evaluate(f"{STOP_BUTTON}.setAttribute('data-test-stop', ''); 0")
        await self.page.click("[data-test-stop]")

    async def sent(self) -> list[dict[str, Any]]:
        """The app's fetches in this document so far."""
        return list(await self.page.evaluate("window.__sent || []"))

    async def chat_requests(self, count: int = 1) -> list[dict[str, Any]]:
        """The chat requests of this document, once there are `count`."""
        await self.page.wait_for(
            "(window.__sent || []).filter(r => r.method === 'POST' && "
            f"r.url.endsWith('/v1/chat/completions')).length >= {count}")
        return [r for r in await self.sent()
                if r["method"] == "POST" and r["url"].endswith("/v1/chat/completions")]
