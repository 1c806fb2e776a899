"""What Spillway takes from a web browser: two checks, pure.

Any web page the user visits can send requests to a server on the user's machine:
- Cross-site requests (CSRF). A "simple" request (a form POST, `fetch` with `mode: "no-cors"`, an
  image) needs no CORS preflight: the browser sends it and only hides the answer from the page.
  For a route that changes something, sending is enough. So such a route refuses a browser's
  request from another site or origin (`Sec-Fetch-Site`, `Origin`), unless the operator listed
  that origin; and on Spillway's own routes a browser's request must say its body is JSON,
  which a page can only say after a preflight, which Spillway never grants there.
- DNS rebinding. A page at attacker.example whose name is made to resolve to 127.0.0.1 is
  same-origin with Spillway as far as the browser knows; the one trace is the `Host` header,
  which still says attacker.example. So Spillway answers only to the names it is reached by:
  its listen addresses, localhost, the loopback addresses, and what the operator listed.

Which routes take which check (`check_request`): Spillway's own (/spillway/*) both, always.
llama-server's routes, passed through or answered here, take the Host check while Spillway
listens on loopback only: there nothing but this machine can reach it, so a foreign name can
only be a rebinding page's (llama-server checks no Host; without a key, that page could read
/props, the prompts in /slots and run the model). Listening beyond loopback, they take any Host,
as llama-server does (clients name the machine as they know it). The one llama-server route
Spillway answers itself that changes something, the Stop of a resumable stream, takes the
cross-site check.

A request with neither `Origin` nor `Sec-Fetch-Site` is not a browser's (curl, `spillway gpu`,
scripts; browsers send `Origin` on every POST), and a request without `Host` is not one either
(HTTP/1.0 health probes): both pass. This is Ollama's fix for CVE-2024-28224 (a Host check while
it listens on loopback), and what Jupyter and Vite check.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from .routes import ANSWERED_CHANGES, RouteClass, classify_route

# Methods that never change anything on Spillway's own routes: only the others are checked for
# cross-site use (a page can read nothing cross-origin anyway: Spillway sends no CORS headers).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# What browsers send in Sec-Fetch-Site for a request from a page of another origin.
FOREIGN_SITES = frozenset({"cross-site", "same-site"})

HOSTS_SETTING = "server.allowed_hosts"
ORIGINS_SETTING = "server.allowed_origins"

_DEFAULT_PORTS = {"http": 80, "https": 443}
# A host name as browsers send it (IDNs in punycode); underscores occur on home networks.
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?")


@dataclass(frozen=True)
class Refusal:
    status: int  # 403 or 415
    reason: str  # a metric label: foreign_host, cross_site, not_json
    message: str
    setting: str | None  # the config key that would let the request through, if any


@dataclass(frozen=True)
class BrowserRules:
    """What the operator allows beyond Spillway's own addresses (built from the config)."""

    listen_hosts: frozenset[str] = frozenset()  # the listen addresses' hosts, normalised
    allowed_hosts: frozenset[str] = frozenset()  # exact names and addresses, normalised
    allowed_suffixes: tuple[str, ...] = ()  # entries given as ".example.lan"
    any_host: bool = False  # allowed_hosts = ["*"]: the Host check is off
    allowed_origins: frozenset[str] = frozenset()  # "scheme://host[:port]", normalised

    @classmethod
    def build(cls, listen_hosts: Iterable[str], allowed_hosts: Iterable[str] = (),
              allowed_origins: Iterable[str] = ()) -> BrowserRules:
        names = [_entry(n) for n in allowed_hosts]
        return cls(
            listen_hosts=frozenset(filter(None, (normal_host(h) for h in listen_hosts))),
            allowed_hosts=frozenset(h for n in names if not n.startswith(".")
                                    and n != "*" and (h := normal_host(n)) is not None),
            allowed_suffixes=tuple(n for n in names if n.startswith(".") and len(n) > 1),
            any_host="*" in names,
            allowed_origins=frozenset(o for o in map(normal_origin, allowed_origins)
                                      if o is not None),
        )

    @property
    def listens_everywhere(self) -> bool:
        """Listening on 0.0.0.0 or ::: every address of the machine is a listen address."""
        return bool(self.listen_hosts & {"0.0.0.0", "::", ""})

    @cached_property
    def loopback_only(self) -> bool:
        """Every listen address is a loopback one (127.0.0.1, [::1], localhost): nothing but
        this machine reaches Spillway, so every route takes the Host check. One address beyond
        loopback (0.0.0.0 among them) and llama-server's routes take any Host. No listen
        address known (rules built without them): not said, no check beyond the own routes."""
        return bool(self.listen_hosts) and all(map(is_loopback, self.listen_hosts))


# --- parsing ----------------------------------------------------------------------------------

def split_host(value: str) -> tuple[str, int | None] | None:
    """`Host` (or an origin's authority) -> (host, port); None when it is not one.

    `name`, `name:port`, `1.2.3.4:port`, `[v6]:port`; the host lower-cased, without brackets
    and without a trailing dot (`localhost.` is `localhost`)."""
    value = value.strip()
    if not value or any(c in value for c in "/\\@ \t?#"):
        return None
    if value.startswith("["):
        return _split_bracketed(value)
    port: int | None = None
    if value.count(":") == 1:
        host, _, text = value.partition(":")
        port = _port(text)
        if port is None:
            return None
    elif ":" in value:  # a bare IPv6 address (not valid in Host, but normalise it)
        return (value.lower(), None) if _is_ip(value) else None
    else:
        host = value
    host = host.lower().rstrip(".")
    return (host, port) if _NAME.fullmatch(host) else None


def _split_bracketed(value: str) -> tuple[str, int | None] | None:
    """`[v6]` or `[v6]:port`."""
    end = value.find("]")
    if end < 0:
        return None
    host, rest = value[1:end], value[end + 1:]
    port: int | None = None
    if rest:
        port = _port(rest[1:]) if rest.startswith(":") else None
        if port is None:
            return None
    return (host.lower(), port) if _is_ip(host) else None


def normal_host(value: str) -> str | None:
    """A name or address as the checks compare it; None when it is not one."""
    if value in ("", "0.0.0.0", "::"):
        return value
    parsed = split_host(value if not (":" in value and _is_ip(value)) else f"[{value}]")
    return parsed[0] if parsed is not None else None


def _entry(text: str) -> str:
    """An allowed_hosts entry as compared: lower-case, no root dot, "*.lan" said as ".lan"."""
    text = text.strip().lower().rstrip(".")
    return text[1:] if text.startswith("*.") else text


def valid_host_entry(entry: str) -> bool:
    """An entry of server.allowed_hosts: "*", ".suffix" (or "*.suffix"), an address, or a name
    (no port)."""
    entry = _entry(entry)
    if entry == "*" or _is_ip(entry.strip("[]")):
        return True
    if entry.startswith("."):
        entry = entry[1:]
    parsed = split_host(entry)
    return parsed is not None and parsed[1] is None and ":" not in entry


def normal_origin(value: str) -> str | None:
    """`scheme://host[:port]` with the default port left out, lower-cased; None when `value` is
    not a tuple origin (`null`, a path, another scheme)."""
    scheme, sep, authority = value.strip().partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in _DEFAULT_PORTS:
        return None
    parsed = split_host(authority)
    return None if parsed is None else _origin(scheme, *parsed)


def _origin(scheme: str, host: str, port: int | None) -> str:
    """An origin as browsers serialise it: brackets around IPv6, no default port."""
    shown = f"[{host}]" if ":" in host else host
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{shown}"
    return f"{scheme}://{shown}:{port}"


def _port(text: str) -> int | None:
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """localhost, a name under .localhost (RFC 6761: browsers resolve it to loopback
    themselves), 127.0.0.0/8, ::1, and ::ffff:127.x."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


# --- the checks -------------------------------------------------------------------------------

def check_host(host_header: str | None, rules: BrowserRules,
               machine_addresses: Callable[[], Collection[str]] = frozenset) -> Refusal | None:
    """The DNS-rebinding check: None when `Host` names Spillway, else a 403.

    `machine_addresses` (asked only when Spillway listens on every address and the Host is an
    address not otherwise known) gives the machine's own addresses, normalised."""
    if host_header is None or rules.any_host:
        return None
    parsed = split_host(host_header)
    if parsed is not None and _names_spillway(parsed[0], rules, machine_addresses):
        return None
    shown = host_header if len(host_header) <= 100 else host_header[:100] + "..."
    return Refusal(
        403, "foreign_host",
        f"Host {shown!r} is not a name this Spillway is reached by: refused (a guard against "
        f"DNS rebinding). If you reach Spillway by that name, add it to {HOSTS_SETTING} in the "
        f"config.", HOSTS_SETTING)


def _names_spillway(host: str, rules: BrowserRules,
                    machine_addresses: Callable[[], Collection[str]]) -> bool:
    if host in rules.listen_hosts or host in rules.allowed_hosts or is_loopback(host):
        return True
    if any(host.endswith(s) or host == s[1:] for s in rules.allowed_suffixes):
        return True
    return rules.listens_everywhere and _is_ip(host) and host in machine_addresses()


def check_cross_site(method: str, host_header: str | None, origin: str | None,
                     fetch_site: str | None, content_type: str | None,
                     rules: BrowserRules) -> Refusal | None:
    """The cross-site check for one of Spillway's own routes that changes something: None when
    the request is not a browser's, or is one from Spillway's own page (or an allowed origin)
    with a JSON body."""
    if method.upper() in SAFE_METHODS:
        return None
    if origin is None and fetch_site is None:
        return None  # not a browser's: curl, the CLI, a script
    refusal = check_origin(host_header, origin, fetch_site, rules)
    if refusal is not None:
        return refusal
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        return Refusal(415, "not_json",
                       f"a browser's request to a route that changes something must send "
                       f"Content-Type: application/json (got {media or 'none'!r})", None)
    return None


def check_origin(host_header: str | None, origin: str | None, fetch_site: str | None,
                 rules: BrowserRules) -> Refusal | None:
    """The cross-site check's first half: a 403 for a browser's request from a page of another
    origin that the operator did not list; None for one that is not a browser's."""
    if origin is None and fetch_site is None:
        return None
    trusted = origin is not None and normal_origin(origin) in rules.allowed_origins
    if trusted or not _foreign(origin, fetch_site, host_header):
        return None
    who = f"from {origin!r}" if origin is not None else f"({fetch_site})"
    return Refusal(
        403, "cross_site",
        f"a browser's request {who} to a route that changes something must come from a page "
        f"of Spillway's own origin: refused (a guard against cross-site requests). To allow a "
        f"page of yours, list its origin in {ORIGINS_SETTING}.", ORIGINS_SETTING)


def check_request(method: str, path: str, headers: Mapping[str, str], rules: BrowserRules,
                  machine_addresses: Callable[[], Collection[str]] = frozenset
                  ) -> Refusal | None:
    """Every browser check that applies to one request (see the module's doc): None to go on,
    or the refusal. `headers` as the request has them (a case-insensitive mapping)."""
    own = classify_route(path) is RouteClass.OWN
    host = headers.get("Host")
    if own or rules.loopback_only:
        refusal = check_host(host, rules, machine_addresses)
        if refusal is not None:
            return refusal
    origin, site = headers.get("Origin"), headers.get("Sec-Fetch-Site")
    if own:
        return check_cross_site(method, host, origin, site, headers.get("Content-Type"), rules)
    if (method.upper(), path) in ANSWERED_CHANGES:
        # No JSON rule here: a DELETE always needs a CORS preflight (there is no simple form of
        # it), and llama-server's web UI sends its Stop without a body or a Content-Type.
        return check_origin(host, origin, site, rules)
    return None


def _foreign(origin: str | None, fetch_site: str | None, host_header: str | None) -> bool:
    """Whether the request comes from a page of another origin (headers that disagree are
    taken at their worst)."""
    if (fetch_site or "").strip().lower() in FOREIGN_SITES:
        return True
    return origin is not None and not same_origin(origin, host_header)


def same_origin(origin: str, host_header: str | None) -> bool:
    """Whether `origin` names the server the request reached (its `Host`), ports compared with
    the origin's scheme's default (a TLS proxy in front says `https://name`, `Host: name`)."""
    normal = normal_origin(origin)
    if normal is None or host_header is None:
        return False
    parsed = split_host(host_header)
    return parsed is not None and normal == _origin(normal.partition("://")[0], *parsed)
