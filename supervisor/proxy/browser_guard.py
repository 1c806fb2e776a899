"""The browser checks (policy/browser.py), as a check of the app's one middleware: `Host` on every
/spillway/ route, and on every route while Spillway listens on loopback only; the cross-site
check on the own routes that change something and on the Stop of a resumable stream
(docs/operations.md: "Web pages and Spillway's own routes").
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Any

import psutil
from aiohttp import web

from ..policy import browser
from . import errors
from .identity import loggable, request_id_of

log = logging.getLogger("spillway.browser")

# The machine's addresses change rarely (DHCP, a VPN coming up): read again at most this often.
ADDRESSES_TTL_S = 10.0


class MachineAddresses:
    """The machine's own interface addresses, normalised as the Host check compares them; asked
    only when Spillway listens on every address."""

    def __init__(self, read: Callable[[], list[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read or _interface_addresses
        self._clock = clock
        self._cached: frozenset[str] = frozenset()
        self._until = float("-inf")

    def __call__(self) -> frozenset[str]:
        now = self._clock()
        if now >= self._until:
            self._cached = frozenset(a for a in map(_normal_address, self._read()) if a)
            self._until = now + ADDRESSES_TTL_S
        return self._cached


def _interface_addresses() -> list[str]:
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs]


def _normal_address(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text.split("%", 1)[0]))  # fe80::1%eth0: no zone
    except ValueError:
        return None  # a MAC address (AF_PACKET)


def browser_guard(rules: Callable[[], browser.BrowserRules],
                  on_refused: Callable[[str], None] | None = None,
                  addresses: Callable[[], frozenset[str]] | None = None
                  ) -> Callable[[web.Request], web.StreamResponse | None]:
    """A check of the app's middleware: None to go on, or the refusal. `rules` is read on every
    request (a reload changes them); `on_refused` is told each refusal's reason (a metric)."""
    machine = addresses or MachineAddresses()

    def guard(request: web.Request) -> web.StreamResponse | None:
        headers = request.headers
        refusal = browser.check_request(request.method, request.path, headers, rules(),
                                        machine)
        if refusal is None:
            return None
        log.warning("refused %s %s: %s (Host %r, Origin %r, Sec-Fetch-Site %r)",
                    request.method, loggable(request.path), refusal.reason, headers.get("Host"),
                    headers.get("Origin"), headers.get("Sec-Fetch-Site"))
        if on_refused is not None:
            on_refused(refusal.reason)
        rid = request_id_of(request)
        if refusal.status == 415:
            return errors.invalid_request(415, refusal.message, rid)
        extra: dict[str, Any] = {"setting": refusal.setting} if refusal.setting else {}
        return errors.json_error(refusal.status, "permission_error", refusal.message, rid,
                                 **extra)

    return guard
