"""The pieces of an upgrade in place (issue 40) on their own: the control socket (mode 0600, one
JSON line each way, its own user only), the handover's description in SPILLWAY_HANDOVER, and
the state file's records."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from supervisor.service import handover
from supervisor.upstreams.owned import ChildRecord, State, StateFile, state_id


@pytest.mark.asyncio
async def test_the_control_socket_answers_one_json_line_to_its_own_user(tmp_path: Path) -> None:
    asked: list[dict[str, Any]] = []

    async def handler(request: dict[str, Any]) -> dict[str, Any]:
        asked.append(request)
        return {"ok": True, "echo": request.get("op")}

    path = tmp_path / "run" / "abc.sock"
    control = handover.Control(path, handler)
    assert await control.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        answer = await asyncio.to_thread(handover.ask, path, {"op": "ping"}, 5)
        assert answer == {"ok": True, "echo": "ping"} and asked == [{"op": "ping"}]

        def raw(line: bytes) -> dict[str, Any]:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(path))
                s.sendall(line)
                return dict(json.loads(s.makefile("rb").readline()))

        bad = await asyncio.to_thread(raw, b"not json\n")
        assert bad["ok"] is False and "one JSON line" in bad["error"]
        assert len(asked) == 1  # the handler never saw it
    finally:
        await control.close()
    assert not path.exists()
    with pytest.raises(OSError):
        handover.ask(path, {"op": "ping"}, 1)


def test_the_handover_description_goes_through_the_environment_once() -> None:
    h = handover.Handover(123, ((5, "127.0.0.1:8080"), (6, "[::1]:8080")), 7, 30.0, 1.5)
    env = {handover.HANDOVER_ENV: h.to_env(), "OTHER": "x"}
    assert handover.Handover.from_env(env) == h
    assert env == {"OTHER": "x"}  # unset: nothing started later inherits it
    assert handover.Handover.from_env(env) is None
    assert handover.Handover.from_env({handover.HANDOVER_ENV: "{nonsense"}) is None


def test_the_state_file_is_private_and_keeps_each_record_whole(tmp_path: Path) -> None:
    config = tmp_path / "spillway.toml"
    config.write_text("")
    file = StateFile(str(config), folder=tmp_path / "run")
    assert file.id == state_id(str(tmp_path / "." / "spillway.toml"))  # the real path's
    record = ChildRecord(name="gpu", pid=os.getpid(), start_ticks=1, boot_id="b",
                         argv=("llama-server", "--port", "1"), port=1, api_key="k",
                         owner="id:gpu:n", media_marker="<m>", fingerprint="f", started=2.0,
                         daemon_pid=3)
    file.write(State(3, "<m>", (record,)))
    assert stat.S_IMODE(file.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(file.folder.stat().st_mode) == 0o700
    assert file.read() == State(3, "<m>", (record,))
    file.write(State(3, "<m>", ()))  # no child left: no file
    assert not file.path.exists() and file.read() is None
    file.path.write_text('{"version": 99, "children": []}')
    assert file.read() is None  # not understood: nothing acted on
