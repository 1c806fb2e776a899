"""What a request may say, the pure parts, table-driven: Spillway's own headers (one rule for all
of them), its body read as JSON (a depth limit), the drill's arm (only a well-formed one arms),
and what a log line shows of a request aiohttp's parser refused (no byte of it). The same rules
through a running daemon are in test_hostile.py, test_proxy_functional.py, test_own_routes.py."""

from __future__ import annotations

import io
import json
import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage, ContentEncodingError, LineTooLong
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from supervisor.proxy.bodies import MAX_JSON_DEPTH, parse_json_object
from supervisor.proxy.headers import HeaderProblem, OwnHeaders, own_headers
from supervisor.proxy.identity import loggable
from supervisor.service.drill_window import Arm, read_arm
from supervisor.service.logs import MalformedRequests

CHILDREN = ("gpu", "cpu")


def read(**headers: str) -> OwnHeaders | HeaderProblem:
    return own_headers(CIMultiDict((k.replace("_", "-"), v) for k, v in headers.items()),
                       lambda: CHILDREN)


@pytest.mark.parametrize("headers,expected", [
    ({}, OwnHeaders()),
    ({"X_Spillway_Child": " GPU "}, OwnHeaders(pin="gpu")),
    ({"X_Spillway_Child": ""}, OwnHeaders()),  # empty: not given
    ({"X_Spillway_Replay": "Never"}, OwnHeaders(replay=False)),
    ({"X_Spillway_Deadline": "2.5"}, OwnHeaders(deadline_s=2.5)),
    ({"X_Spillway_Fallback": "smaller"}, OwnHeaders(fallback="smaller")),
    ({"X_Spillway_Fallback": "NONE"}, OwnHeaders(fallback="none")),
    # The OpenAI SDKs' timeout stands for a deadline; the smaller of the two counts.
    ({"X_Stainless_Timeout": "600"}, OwnHeaders(deadline_s=600.0)),
    ({"X_Stainless_Timeout": "600", "X_Spillway_Deadline": "30"}, OwnHeaders(deadline_s=30.0)),
    # ... and is never a 400, whatever an SDK sends (the Node SDK: "0" under a second).
    ({"X_Stainless_Timeout": "0"}, OwnHeaders()),
    ({"X_Stainless_Timeout": "soon"}, OwnHeaders()),
    ({"X_Stainless_Timeout": "nan", "X_Spillway_Deadline": "5"}, OwnHeaders(deadline_s=5.0)),
    ({"X_Request_Id": "x", "X_Custom": "y"}, OwnHeaders()),  # not Spillway's: not read here
    # Nor is a load balancer's own header in the namespace (examples/haproxy.cfg's).
    ({"X_Spillway_Route": "session-1"}, OwnHeaders()),
])
def test_good_own_headers_are_read(headers: dict[str, str], expected: OwnHeaders) -> None:
    assert read(**headers) == expected


@pytest.mark.parametrize("headers,header,words", [
    ({"X_Spillway_Child": "tpu"}, "X-Spillway-Child", 'must name a child: "gpu" or "cpu"'),
    ({"X_Spillway_Replay": "nevr"}, "X-Spillway-Replay", 'must be "never"'),
    ({"X_Spillway_Replay": "always"}, "X-Spillway-Replay", 'must be "never"'),
    ({"X_Spillway_Deadline": "30s"}, "X-Spillway-Deadline", "a number over 0"),
    ({"X_Spillway_Deadline": "0"}, "X-Spillway-Deadline", "a number over 0"),
    ({"X_Spillway_Deadline": "-5"}, "X-Spillway-Deadline", "a number over 0"),
    ({"X_Spillway_Deadline": "inf"}, "X-Spillway-Deadline", "a number over 0"),
    ({"X_Spillway_Deadline": "nan"}, "X-Spillway-Deadline", "a number over 0"),
    ({"X_Spillway_Fallback": "bigger"}, "X-Spillway-Fallback", 'must be "smaller"'),
])
def test_a_bad_own_header_is_a_problem_naming_it(headers: dict[str, str], header: str,
                                                 words: str) -> None:
    found = read(**headers)
    assert isinstance(found, HeaderProblem), found
    assert found.header == header and words in found.message, found


def test_an_own_header_twice_is_refused_only_when_the_values_differ() -> None:
    same = CIMultiDict([("X-Spillway-Deadline", "5"), ("X-Spillway-Deadline", " 5 ")])
    assert own_headers(same, lambda: CHILDREN) == OwnHeaders(deadline_s=5.0)
    differ = CIMultiDict([("X-Spillway-Replay", "never"), ("X-Spillway-Replay", "sometimes")])
    found = own_headers(differ, lambda: CHILDREN)
    assert isinstance(found, HeaderProblem) and "more than once" in found.message


def nested(depth: int) -> bytes:
    return b'{"a": ' * (depth - 1) + b"[1]" + b"}" * (depth - 1)


@pytest.mark.parametrize("body,problem", [
    (nested(MAX_JSON_DEPTH), None),
    (nested(MAX_JSON_DEPTH + 1), "nested more than 128 levels deep"),
    (b"[" * 1000 + b"]" * 1000, "nested more than 128 levels deep"),  # a RecursionError
    (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "nested more than 128 levels deep"),
    # Brackets inside strings are text: many of them do not make a body deep.
    (json.dumps({"messages": [{"role": "user", "content": "[{" * 500}]}).encode(), None),
    (b"[1, 2]", "must be a JSON object, not list"),
    (b"", "empty"),
])
def test_a_body_is_a_json_object_no_deeper_than_the_limit(body: bytes,
                                                         problem: str | None) -> None:
    found, parsed = parse_json_object(body)
    if problem is None:
        assert found is None and parsed == json.loads(body)
    else:
        assert found is not None and problem in found and parsed is None


@pytest.mark.parametrize("body,expected", [
    ({}, Arm()),
    ({"disarm": True}, Arm(disarm=True)),
    ({"disarm": False}, Arm()),
    ({"now": True}, Arm(now=True)),
    ({"model": "alpha"}, Arm(model="alpha")),
    ({"model": "alpha", "when": "neighbour_load"}, Arm(model="alpha", when="neighbour_load")),
    ({"model": "alpha", "now": True}, Arm(model="alpha", now=True)),
    ({"model": None}, Arm()),
])
def test_a_well_formed_arm_is_read(body: object, expected: Arm) -> None:
    assert read_arm(body) == expected


@pytest.mark.parametrize("body,words", [
    ([], "must be a JSON object"),
    ("arm", "must be a JSON object"),
    ({"disarm": "true"}, 'disarm must be true or false, not "true"'),
    ({"disarm": 1}, "disarm must be true or false, not 1"),
    ({"now": "yes"}, "now must be true or false"),
    ({"disarn": True}, "not 'disarn'"),
    ({"model": 7}, "model must be a model's name"),
    ({"model": ""}, "model must be a model's name"),
    ({"model": "alpha", "when": "later"}, "when must be 'task'"),
    ({"when": "task"}, "when goes with model"),
    ({"model": "alpha", "now": True, "when": "task"}, "not with now"),
    ({"now": True, "disarm": True}, "ask for two things"),
])
def test_anything_but_a_well_formed_arm_is_refused(body: object, words: str) -> None:
    found = read_arm(body)
    assert isinstance(found, str) and words in found, found


SECRET = "sk-the-operators-key-0123456789"


def _logged(message: str, exc: BaseException, *args: object) -> tuple[str, int]:
    """What the MalformedRequests filter leaves of an aiohttp.server record: its text as the
    daemon's formatter writes it, and its level."""
    logger = logging.Logger("aiohttp.server", logging.DEBUG)  # outside the logging tree
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.addFilter(MalformedRequests(logger))
    levels: list[int] = []

    def level_of(record: logging.LogRecord) -> bool:
        levels.append(record.levelno)
        return True

    logger.addFilter(level_of)
    logger.exception(message, *args, exc_info=exc)
    return stream.getvalue(), levels[0]


@pytest.mark.parametrize("error,words", [
    # What aiohttp 3.14's parser raises (its messages quote the raw line).
    (BadHttpMessage(f"Invalid header token:\n\n  b'Authorization : Bearer {SECRET}'\n   ^"),
     "Invalid header token"),
    (BadHttpMessage(f"Invalid header value char:\n\n  b'Authorization: Bearer \\x01{SECRET}'"
                    "\n   ^"), "Invalid header value char"),
    (LineTooLong(f"Bearer {SECRET}kkkk...".encode(), 16384), "a line over 16384 bytes"),
])
def test_a_refused_request_is_one_short_line_without_its_bytes(error: BadHttpMessage,
                                                               words: str) -> None:
    text, level = _logged("Error handling request from %s", error, "127.0.0.1")
    assert SECRET not in text and "Traceback" not in text
    assert text == f"INFO aiohttp.server: refused a malformed request from 127.0.0.1 (400): " \
                   f"{words}\n"
    assert level == logging.INFO


def test_a_body_left_unread_that_is_not_its_encoding_is_a_debug_line() -> None:
    """aiohttp reads what a handler left of a body after the answer; when that is not what its
    Content-Encoding says, the handler has said so (the proxy's 400) or did not need it."""
    payload = RequestPayloadError("Can not decode content-encoding: gzip")
    payload.__cause__ = ContentEncodingError("Can not decode content-encoding: gzip")
    text, level = _logged("Unhandled exception", payload)
    assert text == "DEBUG aiohttp.server: refused a malformed request (400): Can not decode " \
                   "content-encoding\n"
    assert level == logging.DEBUG


def test_a_failure_of_spillways_own_keeps_its_traceback() -> None:
    try:
        raise RuntimeError("a bug")
    except RuntimeError as e:
        text, level = _logged("Error handling request from %s", e, "::1")
    assert "Traceback" in text and "RuntimeError: a bug" in text and level == logging.ERROR


@pytest.mark.parametrize("text,shown", [
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/a\x1b[2J\rFORGED 200\n", "/a\\x1b[2J\\x0dFORGED 200\\x0a"),
    ("/\x00\x7f\x85\u2028/日本", "/\\x00\\x7f\\x85\\u2028/日本"),
    ("/" + "p" * 2000, "/" + "p" * 1023 + "..."),
])
def test_a_logged_path_shows_no_control_character(text: str, shown: str) -> None:
    assert loggable(text) == shown
