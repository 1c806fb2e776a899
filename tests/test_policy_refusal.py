"""A command llama-server refused (policy/refusal.py), read from what the pinned llama-server
really wrote (tests/fixtures/refusals), and what is not a refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.policy.refusal import read_refusal

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


def argv(*args: str, model: str = MODEL) -> list[str]:
    return ["llama-server", "-m", model, *args, "--host", "127.0.0.1", "--port", "18999"]


@pytest.mark.parametrize(("log", "args", "argument", "first"), [
    ("np-abc.log", ("-c", "4096", "-np", "abc"), "-np abc",
     'error while handling argument "-np": stoi'),
    ("unknown-flag.log", ("--no-such-flag",), "--no-such-flag",
     "error: invalid argument: --no-such-flag"),
    ("missing-file.log", ("--chat-template-file", "/nonexistent/x.jinja"),
     "--chat-template-file /nonexistent/x.jinja",
     "error while handling argument \"--chat-template-file\": error: failed to open file "
     "'/nonexistent/x.jinja'"),
    ("mcp-json.log", ("--mcp-servers-json", "{bad"), "--mcp-servers-json {bad",
     "srv  llama_server: MCP starting failed: failed to parse MCP config JSON"),
])
def test_each_refusal_names_the_argument_and_keeps_llama_servers_words(
        log: str, args: tuple[str, ...], argument: str, first: str) -> None:
    refusal = read_refusal(1, lines(f"refusals/{log}"), argv(*args))
    assert refusal is not None
    assert refusal.argument == argument
    assert refusal.said[0].startswith(first), refusal.said
    # Only llama-server's own error lines: never its usage text, never a timestamp.
    assert not any(s.startswith(("usage", "0.0")) for s in refusal.said)
    assert argument in refusal.summary() and first[:30] in refusal.summary()


def test_a_missing_model_names_the_model_flag() -> None:
    model = "/nonexistent/model.gguf"
    refusal = read_refusal(1, lines("refusals/missing-model.log"), argv(model=model))
    assert refusal is not None and refusal.argument == f"-m {model}"
    assert "failed to open GGUF file '/nonexistent/model.gguf'" in refusal.said[0]
    assert 1 < len(refusal.said) <= 3


def test_a_load_time_oom_is_not_a_refusal() -> None:
    # The same command may fit once the card has room: evidence.py's load_oom, backed off.
    oom = lines("llama-server/cpu/load-oom-cpu.log")
    assert read_refusal(1, oom, argv()) is None


@pytest.mark.parametrize("returncode", [-6, -9, 134, 0])
def test_a_signal_or_a_clean_exit_is_not_a_refusal(returncode: int) -> None:
    assert read_refusal(returncode, lines("refusals/np-abc.log"), argv("-np", "abc")) is None


def test_an_exit_with_no_refusal_line_is_none() -> None:
    bind = ["0.00.1 E srv    init: couldn't bind HTTP server socket, hostname: 127.0.0.1, "
            "port: 18999"]  # a port taken under it: another try may well work
    assert read_refusal(1, bind, argv()) is None
