"""The browser checks of Spillway's own routes (policy/browser.py), table-driven: the Host check
against DNS rebinding, and the cross-site check of the routes that change something."""

from __future__ import annotations

import pytest

from supervisor.policy.browser import (
    BrowserRules, check_cross_site, check_host, normal_origin, split_host, valid_host_entry,
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
