"""The browser checks (policy/browser.py), table-driven: the Host check against DNS rebinding, the
cross-site check of the routes that change something, and which routes take which while
Spillway listens on loopback only or beyond it."""

from __future__ import annotations

import pytest

from supervisor.policy.browser import (
    BrowserRules, check_cross_site, check_host, check_request, normal_origin, split_host,
    valid_host_entry,
)

LOOPBACK = BrowserRules.build(["127.0.0.1"])
NAMED = BrowserRules.build(["127.0.0.1"], ["spillway.lan", "192.168.1.9"])
SUFFIX = BrowserRules.build(["127.0.0.1"], [".lan"])
STAR_SUFFIX = BrowserRules.build(["127.0.0.1"], ["*.Lan."])
ANY = BrowserRules.build(["127.0.0.1"], ["*"])
EVERYWHERE = BrowserRules.build(["0.0.0.0"])
ONE_ADDRESS = BrowserRules.build(["192.168.1.5", "::1"])
MACHINE = frozenset({"192.168.1.5", "10.0.0.7", "fe80::1"})

HOSTS = [
    # (rules, Host header, passes)
    (LOOPBACK, None, True),  # no Host: not a browser (HTTP/1.0 probes)
    (LOOPBACK, "127.0.0.1:8080", True),
    (LOOPBACK, "127.0.0.1", True),
    (LOOPBACK, "127.5.6.7:8080", True),  # all of 127/8 is loopback
    (LOOPBACK, "localhost:8080", True),
    (LOOPBACK, "LocalHost.:8080", True),  # case and the root's dot do not matter
    (LOOPBACK, "[::1]:8080", True),
    (LOOPBACK, "[::ffff:127.0.0.1]:8080", True),
    (LOOPBACK, "app.localhost:8080", True),  # RFC 6761: browsers resolve it to loopback
    (LOOPBACK, "evil.example", False),  # DNS rebinding: the attacker's name
    (LOOPBACK, "evil.example:8080", False),
    (LOOPBACK, "localhost.evil.example:8080", False),
    (LOOPBACK, "127.0.0.1.evil.example", False),
    (LOOPBACK, "127.0.0.1@evil.example", False),
    (LOOPBACK, "127.0.0.1:8080/x", False),
    (LOOPBACK, "[::1", False),
    (LOOPBACK, "127.0.0.1:99999", False),
    (LOOPBACK, "", False),
    (LOOPBACK, "192.168.1.5:8080", False),  # an address Spillway does not listen on
    (NAMED, "spillway.lan:8080", True),
    (NAMED, "SPILLWAY.LAN", True),
    (NAMED, "192.168.1.9:8080", True),
    (NAMED, "x.spillway.lan", False),  # exact names match exactly
    (SUFFIX, "box.lan:8080", True),
    (SUFFIX, "a.b.lan", True),
    (SUFFIX, "lan", True),
    (SUFFIX, "evillan", False),
    (STAR_SUFFIX, "box.lan:8080", True),  # "*.lan" is said as ".lan"
    (STAR_SUFFIX, "evillan", False),
    (ANY, "anything.example", True),
    (EVERYWHERE, "192.168.1.5:8080", True),  # 0.0.0.0: the machine's addresses are listened on
    (EVERYWHERE, "[fe80::1]:8080", True),
    (EVERYWHERE, "192.168.1.6:8080", False),
    (EVERYWHERE, "box.local:8080", False),  # a name still has to be listed
    (ONE_ADDRESS, "192.168.1.5:8080", True),
    (ONE_ADDRESS, "10.0.0.7:8080", False),  # the machine's, but not listened on
]


@pytest.mark.parametrize(("rules", "host", "passes"), HOSTS)
def test_the_host_check(rules: BrowserRules, host: str | None, passes: bool) -> None:
    refusal = check_host(host, rules, lambda: MACHINE)
    assert (refusal is None) is passes
    if refusal is not None:
        assert refusal.status == 403 and refusal.reason == "foreign_host"
        assert refusal.setting == "server.allowed_hosts"
        assert "server.allowed_hosts" in refusal.message


def test_the_machines_addresses_are_read_only_when_listening_everywhere() -> None:
    asked: list[int] = []

    def machine() -> frozenset[str]:
        asked.append(1)
        return MACHINE

    assert check_host("192.168.1.5", LOOPBACK, machine) is not None
    assert check_host("localhost:8080", EVERYWHERE, machine) is None
    assert check_host("box.lan", EVERYWHERE, machine) is not None
    assert asked == []  # loopback and names never need them
    assert check_host("192.168.1.5", EVERYWHERE, machine) is None
    assert asked == [1]


OWN = "127.0.0.1:8080"
JSON = "application/json"
ALLOWING = BrowserRules.build(["127.0.0.1"], allowed_origins=["http://dash.lan:3000"])
PROXIED = BrowserRules.build(["127.0.0.1"], ["spillway.lan"])

CROSS_SITE = [
    # (method, Host, Origin, Sec-Fetch-Site, Content-Type, rules, expected status or None)
    # Not a browser's (curl, `spillway gpu`, scripts): no Origin, no Sec-Fetch-Site.
    ("POST", OWN, None, None, None, LOOPBACK, None),
    ("POST", OWN, None, None, "text/plain", LOOPBACK, None),
    # Spillway's own page: same origin, JSON.
    ("POST", OWN, "http://127.0.0.1:8080", "same-origin", JSON, LOOPBACK, None),
    ("POST", OWN, "http://127.0.0.1:8080", "same-origin", "application/json; charset=utf-8",
     LOOPBACK, None),
    ("POST", OWN, "http://127.0.0.1:8080", None, JSON, LOOPBACK, None),  # no Sec-Fetch-*
    # ... but not JSON: a simple request, no preflight was needed: 415.
    ("POST", OWN, "http://127.0.0.1:8080", "same-origin", "text/plain", LOOPBACK, 415),
    ("POST", OWN, "http://127.0.0.1:8080", "same-origin", None, LOOPBACK, 415),
    ("POST", OWN, "http://127.0.0.1:8080", "same-origin",
     "application/x-www-form-urlencoded", LOOPBACK, 415),
    # Another site: 403, whatever the body.
    ("POST", OWN, "http://evil.example", "cross-site", "text/plain", LOOPBACK, 403),
    ("POST", OWN, "http://evil.example", "cross-site", JSON, LOOPBACK, 403),
    ("POST", OWN, "http://evil.example", None, JSON, LOOPBACK, 403),  # an older browser
    ("POST", OWN, None, "cross-site", JSON, LOOPBACK, 403),
    ("POST", OWN, "null", "cross-site", JSON, LOOPBACK, 403),  # a sandboxed frame, a file
    ("POST", OWN, "null", None, JSON, LOOPBACK, 403),
    # Another port of the same host is the same site but another origin: 403.
    ("POST", OWN, "http://127.0.0.1:9999", "same-site", JSON, LOOPBACK, 403),
    ("POST", OWN, "http://localhost:8080", "same-site", JSON, LOOPBACK, 403),
    ("POST", OWN, "https://127.0.0.1:8080", "same-site", JSON, LOOPBACK, 403),
    # Headers that disagree are taken at their worst.
    ("POST", OWN, "http://127.0.0.1:8080", "cross-site", JSON, LOOPBACK, 403),
    # Every method that is not GET, HEAD or OPTIONS.
    ("PUT", OWN, "http://evil.example", "cross-site", JSON, LOOPBACK, 403),
    ("DELETE", OWN, "http://evil.example", "cross-site", JSON, LOOPBACK, 403),
    ("GET", OWN, "http://evil.example", "cross-site", None, LOOPBACK, None),
    ("HEAD", OWN, None, "cross-site", None, LOOPBACK, None),
    ("OPTIONS", OWN, "http://evil.example", "cross-site", None, LOOPBACK, None),
    # An origin the operator listed.
    ("POST", OWN, "http://dash.lan:3000", "cross-site", JSON, ALLOWING, None),
    ("POST", OWN, "HTTP://DASH.LAN:3000", "cross-site", JSON, ALLOWING, None),
    ("POST", OWN, "http://dash.lan:3000", "cross-site", "text/plain", ALLOWING, 415),
    ("POST", OWN, "http://dash.lan:3001", "cross-site", JSON, ALLOWING, 403),
    # Behind a TLS proxy: the page is https://spillway.lan, the Host spillway.lan.
    ("POST", "spillway.lan", "https://spillway.lan", "same-origin", JSON, PROXIED, None),
    ("POST", "spillway.lan:443", "https://spillway.lan", "same-origin", JSON, PROXIED, None),
    ("POST", "spillway.lan", "http://spillway.lan:80", "same-origin", JSON, PROXIED, None),
    ("POST", "spillway.lan", "http://spillway.lan:8080", "same-site", JSON, PROXIED, 403),
    ("POST", None, "http://127.0.0.1:8080", "same-origin", JSON, LOOPBACK, 403),  # no Host
]


@pytest.mark.parametrize(("method", "host", "origin", "site", "content_type", "rules",
                          "status"), CROSS_SITE)
def test_the_cross_site_check(method: str, host: str | None, origin: str | None,
                              site: str | None, content_type: str | None, rules: BrowserRules,
                              status: int | None) -> None:
    refusal = check_cross_site(method, host, origin, site, content_type, rules)
    assert (refusal.status if refusal is not None else None) == status
    if refusal is not None and refusal.status == 403:
        assert refusal.reason == "cross_site" and refusal.setting == "server.allowed_origins"
    if refusal is not None and refusal.status == 415:
        assert refusal.reason == "not_json" and "application/json" in refusal.message


@pytest.mark.parametrize(("text", "parsed"), [
    ("localhost", ("localhost", None)), ("Example.COM.:80", ("example.com", 80)),
    ("[::1]:8080", ("::1", 8080)), ("::1", ("::1", None)), ("[::1]", ("::1", None)),
    ("a:b", None), ("[::1]x", None), ("[example.com]:80", None), ("a b", None),
    ("a/b", None), ("a:0", None), (":80", None), ("é.lan", None),
    ("-", None), ("a_b.lan", ("a_b.lan", None)),
])
def test_split_host(text: str, parsed: tuple[str, int | None] | None) -> None:
    assert split_host(text) == parsed


@pytest.mark.parametrize(("text", "normal"), [
    ("http://A.example", "http://a.example"), ("http://a.example:80", "http://a.example"),
    ("https://a.example:443", "https://a.example"), ("https://a.example:8443",
                                                     "https://a.example:8443"),
    ("http://[::1]:8080", "http://[::1]:8080"), ("null", None), ("ftp://a", None),
    ("http://a/path", None), ("http://", None), ("*", None),
])
def test_normal_origin(text: str, normal: str | None) -> None:
    assert normal_origin(text) == normal


@pytest.mark.parametrize(("entry", "valid"), [
    ("spillway.lan", True), (".lan", True), ("*", True), ("192.168.1.9", True), ("::1", True),
    ("[::1]", True), ("a:80", False), ("http://a", False), ("", False), (".", False),
    ("a b", False), ("*.lan", True), ("a*b", False), ("-a", False),
])
def test_allowed_hosts_entries(entry: str, valid: bool) -> None:
    assert valid_host_entry(entry) is valid


# --- which routes take which check ------------------------------------------------------------

@pytest.mark.parametrize(("listen", "allowed", "loopback_only"), [
    (["127.0.0.1"], [], True),
    (["127.0.0.2"], [], True),  # all of 127/8
    (["::1"], [], True),
    (["localhost"], [], True),
    (["127.0.0.1", "::1", "localhost"], [], True),  # several addresses, all of them loopback
    (["127.0.0.1"], ["spillway.lan"], True),  # names allowed: still only this machine reaches it
    (["127.0.0.1"], ["*"], True),  # (but "*" turns the Host check off, below)
    (["127.0.0.1", "0.0.0.0"], [], False),  # one address beyond loopback is enough
    (["127.0.0.1", "192.168.1.5"], [], False),
    (["0.0.0.0"], [], False),
    (["::"], [], False),
    (["box.lan"], [], False),  # a name Spillway cannot tell is loopback
    ([], [], False),  # not known: as before, only the own routes are checked
])
def test_loopback_only_is_every_listen_address(listen: list[str], allowed: list[str],
                                               loopback_only: bool) -> None:
    assert BrowserRules.build(listen, allowed).loopback_only is loopback_only


V6_LOOPBACK = BrowserRules.build(["::1"])
BOTH = BrowserRules.build(["127.0.0.1", "192.168.1.5"])
EVIL_ORIGIN = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}

REQUESTS = [
    # (method, path, headers, rules, expected (status, reason) or None)
    # On loopback only, llama-server's routes take the Host check: a rebinding page is refused.
    ("GET", "/props", {"Host": "evil.example:8080"}, LOOPBACK, (403, "foreign_host")),
    ("GET", "/slots", {"Host": "evil.example:8080"}, LOOPBACK, (403, "foreign_host")),
    ("GET", "/v1/models", {"Host": "evil.example:8080"}, LOOPBACK, (403, "foreign_host")),
    ("POST", "/v1/chat/completions", {"Host": "evil.example:8080"}, LOOPBACK,
     (403, "foreign_host")),
    ("GET", "/", {"Host": "evil.example:8080"}, LOOPBACK, (403, "foreign_host")),
    ("GET", "/health", {"Host": "evil.example:8080"}, LOOPBACK, (403, "foreign_host")),
    ("GET", "/v1/stream", {"Host": "evil.example:8080"}, LOOPBACK, (403, "foreign_host")),
    ("GET", "/props", {"Host": "evil.example:8080"}, V6_LOOPBACK, (403, "foreign_host")),
    # ... while what curl and the OpenAI SDK send passes, with the port or without.
    ("GET", "/props", {"Host": "127.0.0.1:8080"}, LOOPBACK, None),
    ("GET", "/props", {"Host": "localhost:8080"}, LOOPBACK, None),
    ("GET", "/props", {"Host": "localhost"}, LOOPBACK, None),
    ("POST", "/v1/chat/completions", {"Host": "[::1]:8080"}, V6_LOOPBACK, None),
    ("POST", "/v1/chat/completions", {"Host": "127.0.0.1:8080"}, V6_LOOPBACK, None),
    ("GET", "/props", {}, LOOPBACK, None),  # HTTP/1.0: no Host, not a browser's
    ("GET", "/props", {"Host": "spillway.lan"}, NAMED, None),  # a name the operator listed
    ("GET", "/props", {"Host": "box.lan:8080"}, SUFFIX, None),
    ("GET", "/props", {"Host": "evil.example"}, ANY, None),  # "*": the check is off
    # Beyond loopback, llama-server's routes take any Host, as llama-server does...
    ("GET", "/props", {"Host": "evil.example:8080"}, EVERYWHERE, None),
    ("GET", "/props", {"Host": "evil.example:8080"}, BOTH, None),
    ("POST", "/v1/chat/completions", {"Host": "my.server.example"}, ONE_ADDRESS, None),
    # ... and Spillway's own still do not.
    ("GET", "/spillway/status", {"Host": "evil.example:8080"}, EVERYWHERE,
     (403, "foreign_host")),
    ("GET", "/spillway/status", {"Host": "evil.example:8080"}, LOOPBACK, (403, "foreign_host")),
    ("POST", "/spillway/gpu/pause", {"Host": OWN, **EVIL_ORIGIN}, LOOPBACK, (403, "cross_site")),
    ("POST", "/spillway/gpu/pause", {"Host": OWN, "Origin": "http://127.0.0.1:8080"}, LOOPBACK,
     (415, "not_json")),
    # A page's own requests to llama-server's routes are not judged by their origin: llama-server
    # answers them by its CORS settings (the children's answers are passed on).
    ("POST", "/v1/chat/completions", {"Host": OWN, **EVIL_ORIGIN}, LOOPBACK, None),
    ("POST", "/v1/streams/lookup", {"Host": OWN, **EVIL_ORIGIN}, LOOPBACK, None),
    # The Stop of a resumable stream, which Spillway answers itself, is refused to another site
    # wherever Spillway listens, as the operator's routes are...
    ("DELETE", "/v1/stream", {"Host": OWN, **EVIL_ORIGIN}, LOOPBACK, (403, "cross_site")),
    ("DELETE", "/v1/stream", {"Host": "box.example:8080", **EVIL_ORIGIN}, EVERYWHERE,
     (403, "cross_site")),
    ("DELETE", "/v1/stream", {"Host": OWN, "Origin": "http://127.0.0.1:9999",
                              "Sec-Fetch-Site": "same-site"}, LOOPBACK, (403, "cross_site")),
    ("DELETE", "/v1/stream", {"Host": OWN, "Origin": "null"}, LOOPBACK, (403, "cross_site")),
    # ... but the page it came from (llama-server's web UI, through Spillway) stops its stream
    # without a body or a Content-Type, as that UI sends it; so do curl and a listed origin.
    ("DELETE", "/v1/stream", {"Host": OWN, "Origin": "http://127.0.0.1:8080",
                              "Sec-Fetch-Site": "same-origin"}, LOOPBACK, None),
    ("DELETE", "/v1/stream", {"Host": OWN}, LOOPBACK, None),
    ("DELETE", "/v1/stream", {"Host": OWN, "Origin": "http://dash.lan:3000",
                              "Sec-Fetch-Site": "cross-site"}, ALLOWING, None),
    ("GET", "/v1/stream", {"Host": OWN, **EVIL_ORIGIN}, LOOPBACK, None),  # a read
]


@pytest.mark.parametrize(("method", "path", "headers", "rules", "expected"), REQUESTS)
def test_which_routes_take_which_check(method: str, path: str, headers: dict[str, str],
                                       rules: BrowserRules,
                                       expected: tuple[int, str] | None) -> None:
    refusal = check_request(method, path, headers, rules, lambda: MACHINE)
    assert (None if refusal is None else (refusal.status, refusal.reason)) == expected
    if refusal is not None and refusal.reason == "foreign_host":
        assert "server.allowed_hosts" in refusal.message and "own routes" not in refusal.message
