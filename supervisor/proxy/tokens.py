"""How many tokens a prompt has, for branch 3 of admission (context per slot).

Counting costs two requests to a child (`/apply-template`, then `/tokenize`), so it is skipped
when a cheap bound shows the prompt is small: no text has more tokens than bytes (llama.cpp's
tokenizers fall back to one token per byte at worst), and the body holds the text plus JSON, so
its size plus some room for the chat template's own tokens bounds the prompt.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

from ..vocabulary import Upstream

log = logging.getLogger("spillway.tokens")

CHAT_ROUTES = frozenset({"/chat/completions", "/v1/chat/completions"})
PROMPT_ROUTES = frozenset({"/completion", "/completions", "/v1/completions", "/infill"})
TEMPLATE_TOKENS_PER_MESSAGE = 32
TEMPLATE_TOKENS = 64


def upper_bound(body_size: int, payload: dict[str, Any] | None) -> int:
    messages = payload.get("messages") if payload else None
    count = len(messages) if isinstance(messages, list) else 1
    return body_size + TEMPLATE_TOKENS + TEMPLATE_TOKENS_PER_MESSAGE * count


async def count(session: aiohttp.ClientSession, child: Upstream, path: str,
                payload: dict[str, Any], timeout_s: float = 30.0) -> int | None:
    """The prompt's token count as `child` sees it; None when it cannot be told."""
    headers = {"Authorization": f"Bearer {child.api_key}", "Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        if path in CHAT_ROUTES:
            async with session.post(f"{child.base_url}/apply-template", headers=headers,
                                    data=json.dumps(payload), timeout=timeout) as r:
                if r.status != 200:
                    return None
                prompt: Any = (await r.json()).get("prompt")
        elif path in PROMPT_ROUTES:
            prompt = payload.get("prompt", payload.get("content"))
        else:
            return None
        if not isinstance(prompt, (str, list)):
            return None
        return await _tokenize(session, child, prompt, payload.get("model"), True, timeout)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        log.info("could not count the prompt's tokens on the %s child: %s", child.name, e)
        return None


async def count_text(session: aiohttp.ClientSession, child: Upstream, text: str,
                     model: Any = None, timeout_s: float = 10.0) -> int | None:
    """The tokens of a piece of generated text as `child` tokenizes it (a continuation's
    relayed text: its stream events merge a few tokens, this does not); None when unknown."""
    try:
        return await _tokenize(session, child, text, model, False,
                               aiohttp.ClientTimeout(total=timeout_s))
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        log.info("could not count the text's tokens on the %s child: %s", child.name, e)
        return None


async def _tokenize(session: aiohttp.ClientSession, child: Upstream, content: Any, model: Any,
                    special: bool, timeout: aiohttp.ClientTimeout) -> int | None:
    headers = {"Authorization": f"Bearer {child.api_key}", "Content-Type": "application/json"}
    body: dict[str, Any] = {"content": content, "add_special": special,
                            "parse_special": special}
    if isinstance(model, str):
        body["model"] = model  # a router sends it to the model's instance
    async with session.post(f"{child.base_url}/tokenize", headers=headers,
                            data=json.dumps(body), timeout=timeout) as r:
        if r.status != 200:
            return None
        tokens = (await r.json()).get("tokens")
        return len(tokens) if isinstance(tokens, list) else None
