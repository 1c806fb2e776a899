"""A tiny Chrome DevTools Protocol driver for tests: headless Chromium, one page, over a WebSocket
with aiohttp's client (no new packages).

    async with Browser.launch(chromium, tmp_path) as page:
        await page.navigate(url)
        await page.wait_for("document.querySelector('#x') !== null")
        await page.click("button#go")
        png = await page.screenshot()

Chromium picks its own debugging port (`--remote-debugging-port=0`) and writes it into
`<user-data-dir>/DevToolsActivePort`; the page target comes from `/json/list`. Commands are sent
with ids and their answers matched by id; of the events, only what the page reports as going
wrong is kept (`problems`: exceptions, console errors, refused loads, CSP violations). Waits
poll a condition with a deadline, never a fixed sleep; the deadlines are harness.PATIENCE_S, long
enough for a busy machine (they only end a broken test).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from harness import PATIENCE_S

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--remote-debugging-port=0")


class CdpError(RuntimeError):
    """A command the browser refused, or a script that threw."""


class Page:
    """One page target: send commands, evaluate scripts, click, screenshot."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.problems: list[str] = []
        self._reader = asyncio.create_task(self._read(), name="cdp-reader")

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            self._note(data.get("method"), data.get("params", {}))
            future = self._waiting.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
        for future in self._waiting.values():  # the browser went away
            if not future.done():
                future.set_exception(CdpError("the browser closed the connection"))

    def _note(self, method: str | None, params: dict[str, Any]) -> None:
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.problems.append(details.get("exception", {}).get("description")
                                 or details.get("text", "exception"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.problems.append(" ".join(str(a.get("value", a.get("description", "")))
                                          for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.problems.append(params["entry"].get("text", ""))

    async def send(self, method: str, params: dict[str, Any] | None = None,
                   timeout: float = PATIENCE_S) -> dict[str, Any]:
        """One command; its `result`, or CdpError with the browser's error."""
        ident = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        await self._ws.send_json({"id": ident, "method": method, "params": params or {}})
        answer = await asyncio.wait_for(future, timeout)
        if "error" in answer:
            raise CdpError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        """The expression's value (promises awaited, returned by value, JSON-like)."""
        result = await self.send("Runtime.evaluate", {
            "expression": expression, "awaitPromise": True, "returnByValue": True,
            "userGesture": True})
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CdpError(f"{expression[:80]!r} threw: {text}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout: float = PATIENCE_S,
                       interval: float = 0.05) -> Any:
        """Poll `expression` until it is truthy; its value. TimeoutError says what it was."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(interval)
        raise TimeoutError(f"after {timeout} s, {expression!r} is still {value!r}")

    async def navigate(self, url: str, timeout: float = PATIENCE_S) -> str:
        """Load `url` and wait until its document is complete; where it ended (redirects)."""
        result = await self.send("Page.navigate", {"url": url}, timeout)
        if result.get("errorText"):
            raise CdpError(f"{url}: {result['errorText']}")
        # The answer comes once the new document is committed: its readyState is its own.
        return str(await self.wait_for(
            "document.readyState === 'complete' && location.href", timeout))

    async def click(self, selector: str) -> None:
        """A real mouse click (pressed, released) in the middle of the element: it must be
        visible and on top, as for a person (a modal dialog blocks what is under it)."""
        box = await self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " if (!e) return null; e.scrollIntoView({block: 'center'});"
            " const r = e.getBoundingClientRect();"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2, w: r.width}; })()")
        if not box or not box["w"]:
            raise CdpError(f"nothing visible to click at {selector!r}")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            await self.send("Input.dispatchMouseEvent", {
                "type": kind, "x": box["x"], "y": box["y"], "button": "left",
                "clickCount": 0 if kind == "mouseMoved" else 1})

    async def type_text(self, selector: str, text: str) -> None:
        """Focus the field and type into it, as a keyboard would (input events and all)."""
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.send("Input.insertText", {"text": text})

    async def press(self, key: str) -> None:
        """One key, down and up: "Enter" or "Escape"."""
        code = {"Enter": 13, "Escape": 27}[key]
        for kind in ("keyDown", "keyUp"):
            await self.send("Input.dispatchKeyEvent", {
                "type": kind, "key": key, "code": key, "windowsVirtualKeyCode": code,
                **({"text": "\r"} if kind == "keyDown" and key == "Enter" else {})})

    async def set_viewport(self, width: int, height: int, scale: float = 1.0,
                           mobile: bool = False) -> None:
        await self.send("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": scale, "mobile": mobile})
        # No scrollbar: a full-page screenshot lays the page out without one, so the page
        # must be as wide with it as without it.
        await self.send("Emulation.setScrollbarsHidden", {"hidden": True})

    async def screenshot(self, full_page: bool = True) -> bytes:
        """A PNG of the viewport, or of the whole page."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            metrics = await self.send("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            params.update(captureBeyondViewport=True, clip={
                "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        result = await self.send("Page.captureScreenshot", params)
        return base64.b64decode(result["data"])

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._ws.close()


async def _debugging_port(profile: Path, proc: asyncio.subprocess.Process,
                          timeout: float) -> int:
    """The port Chromium chose, from the file it writes once it listens."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise CdpError(f"chromium exited with {proc.returncode} before listening")
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            return int(marker.read_text().splitlines()[0])
        await asyncio.sleep(0.05)
    raise TimeoutError(f"chromium wrote no {marker} in {timeout} s")


async def _page_target(session: aiohttp.ClientSession, port: int, timeout: float) -> str:
    """The WebSocket URL of the first page target (about:blank at launch)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            for target in targets:
                if target.get("type") == "page":
                    return str(target["webSocketDebuggerUrl"])
        await asyncio.sleep(0.05)
    raise TimeoutError(f"no page target on port {port} in {timeout} s")


class Browser:
    """Headless Chromium with its own profile folder, stopped (and reaped) on exit."""

    @staticmethod
    @contextlib.asynccontextmanager
    async def launch(chromium: Path, folder: Path, timeout: float = PATIENCE_S,
                     flags: tuple[str, ...] = ()) -> AsyncIterator[Page]:
        """`flags`: more of Chromium's own, e.g. `--host-resolver-rules=MAP name 127.0.0.1`."""
        profile = folder / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        # A port file left by an earlier run in the same folder would point at no browser.
        (profile / "DevToolsActivePort").unlink(missing_ok=True)
        proc = await asyncio.create_subprocess_exec(
            str(chromium), *FLAGS, *flags, f"--user-data-dir={profile}", "about:blank",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            async with aiohttp.ClientSession() as session:
                port = await _debugging_port(profile, proc, timeout)
                url = await _page_target(session, port, timeout)
                page = Page(await session.ws_connect(url, max_msg_size=0))
                try:
                    for domain in ("Page", "Runtime", "Log"):
                        await page.send(f"{domain}.enable")
                    yield page
                finally:
                    await page.close()
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
