"""How many tokens a prompt has, as the child counts them, for branch 3 of admission (context
per slot).

What to count for each route is policy/prompts.py's plan. Counting costs a call to a child (the
child's own counting route for templated routes, `/tokenize` for each prompt otherwise), so it
is skipped when the body's size shows that the prompt is small (prompts.upper_bound).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from ..policy import media, prompts
from ..vocabulary import Upstream
from .connections import ConnectionUse, UpstreamClient

log = logging.getLogger("spillway.tokens")


@dataclass(frozen=True)
class Count:
    """A request's prompt tokens: one figure for each prompt the child checks on its own."""

    tasks: tuple[int, ...]
    exact: bool  # counted and checked as the child counts and checks (prompts.Plan.exact)

    @property
    def largest(self) -> int:
        return max(self.tasks, default=0)

    def first_over(self, n_ctx: int) -> int:
        """The figure llama-server's error names: its first prompt that does not fit."""
        return next((n for n in self.tasks if n >= n_ctx), self.largest)


async def count(session: aiohttp.ClientSession, client: UpstreamClient, child: Upstream,
                plan: prompts.Plan, model: Any, body: bytes, limit: int = 0,
                timeout_s: float = 30.0) -> Count | None:
    """The prompt's tokens as `child` counts them (`plan`: prompts.plan's for the request;
    `model`: the one it names); None when they cannot be told. A prompt that its bytes show to
    be under `limit` is not counted: its bound stands. `body`: the request's own bytes, sent as
    they are to a counting route, which takes the request's body: an image's base64 is not
    written out again, twice (as text, then bytes), for each request that carries one. They go
    by the proxy's own connections (`client`), as an attempt sends them: in slices, never
    joined to the head (aiohttp's client joins them, and Python before 3.12 copies what the
    socket did not take at once)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        if plan.count_route is not None:
            counted = await _post_body(client, child, plan.count_route, body, timeout_s)
            n = counted.get("input_tokens") if counted is not None else None
            return Count((n,), plan.exact) if isinstance(n, int) else None
        figures = await asyncio.gather(*(_task(session, child, task, model, limit, timeout)
                                         for task in plan.tasks))
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        log.info("could not count the prompt's tokens on the %s child: %s", child.name, e)
        return None
    if any(n is None for n in figures):
        return None
    return Count(tuple(n for n in figures if n is not None), plan.exact)


async def _task(session: aiohttp.ClientSession, child: Upstream, task: prompts.Task,
                model: Any, limit: int, timeout: aiohttp.ClientTimeout) -> int | None:
    bound = task.known + sum(_bound(p) for p in task.pieces)
    if bound < limit and not task.media:
        return bound  # surely under the limit: not worth a call
    total = task.known
    for piece in task.pieces:
        n = await _tokenize(session, child, piece, model, timeout)
        if n is None:
            return None
        total += n
    for blob in task.media:
        n = await _media_tokens(session, child, blob, model, timeout)
        if n is None:
            return None
        total += n
    return total


async def _media_tokens(session: aiohttp.ClientSession, child: Upstream,
                        blob: prompts.MediaBlob, model: Any,
                        timeout: aiohttp.ClientTimeout) -> int | None:
    """What one media item costs on `child`: its chat counting route's figure for a message
    holding the item, less that for the same message empty. The route decodes only the item's
    header (a placeholder bitmap), and the template's text around the item is the same both
    times, so the difference is the item's own tokens (and any the projector adds around it)."""
    audio = media.sniff(blob.data) is media.Modality.AUDIO
    part = ({"type": "input_audio", "input_audio": {"data": blob.data}} if audio
            else {"type": "image_url", "image_url": {"url": blob.data}})
    counts = []
    for content in ([part], ""):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": content}]}
        if isinstance(model, str):
            body["model"] = model
        answer = await _post(session, child, "/v1/chat/completions/input_tokens", body, timeout)
        n = answer.get("input_tokens") if answer is not None else None
        if not isinstance(n, int):
            return None
        counts.append(n)
    return counts[0] - counts[1]


def _bound(piece: prompts.Piece) -> int:
    """No more tokens than bytes, plus the special tokens added around them."""
    parts = piece.content if isinstance(piece.content, list) else [piece.content]
    return sum(len(p.encode()) if isinstance(p, str) else 1 for p in parts) + 2


async def _post_body(client: UpstreamClient, child: Upstream, route: str, body: bytes,
                     timeout_s: float) -> dict[str, Any] | None:
    """The request's own bytes to a counting route; its JSON answer (None: not a 200). On a
    new connection: a pooled one the child just closed would lose the count."""
    headers = (("Authorization", f"Bearer {child.api_key}"),
               ("Content-Type", "application/json"))
    async with asyncio.timeout(timeout_s):
        r = await client.request(child.host, child.port or 0, "POST", route, headers, body,
                                 ConnectionUse(), connect_timeout=timeout_s,
                                 read_timeout=timeout_s, fresh=True)
        try:
            answer = await r.read()
        finally:
            r.close()
    if r.status != 200:
        return None  # the child's own words on the request come when it is forwarded
    parsed = json.loads(answer)
    return parsed if isinstance(parsed, dict) else None


async def _post(session: aiohttp.ClientSession, child: Upstream, route: str,
                payload: dict[str, Any],
                timeout: aiohttp.ClientTimeout) -> dict[str, Any] | None:
    headers = {"Authorization": f"Bearer {child.api_key}", "Content-Type": "application/json"}
    async with session.post(f"{child.base_url}{route}", headers=headers,
                            data=json.dumps(payload), timeout=timeout) as r:
        if r.status != 200:
            return None  # the child's own words on the request come when it is forwarded
        answer = await r.json()
        return answer if isinstance(answer, dict) else None


async def _tokenize(session: aiohttp.ClientSession, child: Upstream, piece: prompts.Piece,
                    model: Any, timeout: aiohttp.ClientTimeout) -> int | None:
    headers = {"Authorization": f"Bearer {child.api_key}", "Content-Type": "application/json"}
    body: dict[str, Any] = {"content": piece.content, "add_special": piece.add_special,
                            "parse_special": piece.parse_special}
    if isinstance(model, str):
        body["model"] = model  # a router sends it to the model's instance
    async with session.post(f"{child.base_url}/tokenize", headers=headers,
                            data=json.dumps(body), timeout=timeout) as r:
        if r.status != 200:
            return None
        tokens = (await r.json()).get("tokens")
        return len(tokens) if isinstance(tokens, list) else None
