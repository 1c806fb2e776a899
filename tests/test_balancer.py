"""What a load balancer is told: HAProxy's agent-check reply (policy/balancer.py), table-driven,
and the agent port itself (service/agent_port.py), read as HAProxy reads it: connect, one line,
closed."""

from __future__ import annotations

import asyncio

import pytest
from harness import free_port

from supervisor.config import schema as config_module
from supervisor.service.agent_port import AgentServer
from supervisor.policy.balancer import MachineHealth, agent_reply

# (name, health, reply)
TABLE = [
    ("gpu idle", MachineHealth(True, True, 4, 0), "up ready 100%"),
    ("gpu one of four busy", MachineHealth(True, True, 4, 1), "up ready 75%"),
    ("gpu full: still a little weight", MachineHealth(True, True, 4, 4), "up ready 1%"),
    ("gpu router with no model loaded", MachineHealth(True, True, 0, 0), "up ready 100%"),
    ("gpu down, cpu serves: drain", MachineHealth(False, True, 4, 0), "up drain"),
    ("nothing serves: down with why", MachineHealth(False, False, 4, 0,
                                                    "no child is ready: gpu is FATAL"),
     "down #no child is ready: gpu is FATAL"),
    ("nothing serves, no reason given", MachineHealth(False, False, 0, 0), "down #no child "
                                                                           "can serve"),
]


@pytest.mark.parametrize("name,health,reply", TABLE, ids=[t[0] for t in TABLE])
def test_the_agent_reply_table(name: str, health: MachineHealth, reply: str) -> None:
    assert agent_reply(health) == reply


def test_a_reason_is_one_line() -> None:
    line = agent_reply(MachineHealth(False, False, 0, 0, "gpu is FATAL\n(x)\tcpu " + "y" * 500))
    assert "\n" not in line and "\t" not in line and len(line) < 220


@pytest.mark.asyncio
async def test_the_agent_port_answers_one_line_per_connection_then_closes() -> None:
    replies = iter(["up ready 50%", "up drain"])
    port = free_port()
    server = AgentServer(f"127.0.0.1:{port}", lambda: next(replies))
    await server.start()
    try:
        for expected in ("up ready 50%", "up drain"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"hello\n")  # HAProxy's agent-send string, if configured: ignored
            assert await asyncio.wait_for(reader.read(), 5) == f"{expected}\n".encode()
            writer.close()
        assert server.served == 2
    finally:
        await server.close()


def test_agent_listen_is_off_by_default_and_checked() -> None:
    assert config_module.build({"model": {"path": "m.gguf"}},
                               check_paths=False).balancer.agent_listen == ""
    ok = config_module.build({"model": {"path": "m.gguf"},
                              "balancer": {"agent_listen": "127.0.0.1:9701"}}, check_paths=False)
    assert ok.balancer.agent_listen == "127.0.0.1:9701"
    with pytest.raises(config_module.ConfigError) as e:
        config_module.build({"model": {"path": "m.gguf"},
                             "balancer": {"agent_listen": "nine-seven"}}, check_paths=False)
    assert "balancer.agent_listen" in str(e.value)
