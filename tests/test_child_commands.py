"""A child's new command (a reload's), on fake processes and a fake clock: taken at once by a
stopped child, kept back by a running one until its rollout says; a new command whose first
start fails is rolled back to the last good command, with what llama-server said; a command
llama-server refuses with nothing to go back to is FATAL at once."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
from pathlib import Path

from fake_launcher import Script
from test_child_lifecycle import Rig, quick_crash

from supervisor.config.schema import ChildConfig
from supervisor.policy.lifecycle import ChildState
from supervisor.policy.rollout import Outcome

S = ChildState
REFUSALS = Path(__file__).parent / "fixtures" / "refusals"
NP_ABC = tuple((REFUSALS / "np-abc.log").read_text().splitlines())


def with_args(cfg: ChildConfig, *args: str) -> ChildConfig:
    return dataclasses.replace(cfg, args=(*cfg.args, *args))


def refused(*lines: str) -> Script:
    """What llama-server does with a command it refuses: its lines, exit code 1, at once."""
    return Script(ready_after=None, exit_after_s=0.01, exit_code=1, last_words=lines)


async def test_a_running_child_keeps_a_new_command_back_until_it_is_asked_to_take_it() -> None:
    async with Rig() as rig:
        rig.child.start()
        await rig.until(S.READY)
        old = rig.child.cfg
        new = with_args(old, "-b", "512")
        assert rig.child.configure(new, rig.child.restart_cfg, 20.0) is True
        assert rig.child.cfg.args == old.args  # kept back: nothing restarts
        await rig.clock.sleep(5.0)
        assert rig.path() == ["STOPPED -> STARTING", "STARTING -> READY"]
        assert await rig.child.take_command(new) is Outcome.READY
        assert rig.path()[2:] == ["READY -> DRAINING", "DRAINING -> STOPPING",
                                  "STOPPING -> STOPPED", "STOPPED -> STARTING",
                                  "STARTING -> READY"]
        assert rig.launcher.spawns[-1][0][3:7] == ["-c", "4096", "-b", "512"]
        assert rig.child.rejected is None


async def test_a_stopped_child_takes_a_new_command_at_once_for_its_next_start() -> None:
    async with Rig() as rig:
        new = with_args(rig.child.cfg, "-b", "512")
        assert rig.child.configure(new, rig.child.restart_cfg, 20.0) is False
        assert rig.child.cfg is new
        assert await rig.child.take_command(new) is Outcome.STOPPED


async def test_a_new_command_refused_at_its_first_start_is_rolled_back() -> None:
    async with Rig(Script(), refused(*NP_ABC)) as rig:
        rig.child.start()
        await rig.until(S.READY)
        good = rig.child.cfg
        outcome = await rig.child.take_command(with_args(good, "-np", "abc"))
        assert outcome is Outcome.ROLLED_BACK
        await rig.until(S.READY)
        # The last good command runs again, at once, and the crash loop did not count it.
        argv = [a for a, _ in rig.launcher.spawns]
        assert "-np" in argv[1] and "-np" not in argv[2] and argv[2][3:5] == ["-c", "4096"]
        assert rig.child.cfg.args == good.args and rig.child.quick_failures == 0
        assert rig.path()[-4:] == ["STARTING -> EXITED", "EXITED -> BACKOFF",
                                   "BACKOFF -> STARTING", "STARTING -> READY"]
        assert rig.when(S.STARTING, 2) == rig.when(S.EXITED)  # no back-off waited
        rejected = rig.child.to_json()["rejected_command"]
        assert rejected["argument"] == "-np abc"
        assert rejected["said"] == ['error while handling argument "-np": stoi']
        assert "-np" in rejected["command"]
        assert "back to its last good command" in rig.reasons(S.STARTING)[2]
        assert rig.child.last_exit is not None and rig.child.last_exit.refusal is not None


async def test_a_new_command_that_never_gets_ready_is_rolled_back_at_the_start_timeout(
        ) -> None:
    async with Rig(Script(), Script(ready_after=None), start_timeout_s=30.0) as rig:
        rig.child.start()
        await rig.until(S.READY)
        outcome = await rig.child.take_command(with_args(rig.child.cfg, "-c", "999999"))
        assert outcome is Outcome.ROLLED_BACK
        await rig.until(S.READY)
        assert "start timeout" in rig.child.to_json()["rejected_command"]["why"]
        assert rig.launcher.spawns[-1][0][3:5] == ["-c", "4096"]


async def test_a_new_command_that_got_ready_once_is_good_and_is_not_rolled_back_later(
        ) -> None:
    async with Rig(Script(), Script(exit_after_s=100.0, exit_code=-6), Script()) as rig:
        rig.child.start()
        await rig.until(S.READY)
        new = with_args(rig.child.cfg, "-b", "512")
        assert await rig.child.take_command(new) is Outcome.READY
        await rig.reached(S.EXITED)  # it dies later, serving: an ordinary death
        await rig.until(S.READY)
        assert "-b" in rig.launcher.spawns[-1][0] and rig.child.rejected is None


async def test_a_newer_command_supersedes_one_still_loading() -> None:
    async with Rig(Script(), Script(ready_after=50), Script()) as rig:
        rig.child.start()
        await rig.until(S.READY)
        second = with_args(rig.child.cfg, "-b", "256")
        third = with_args(rig.child.cfg, "-b", "512")
        waiting = asyncio.ensure_future(rig.child.take_command(second))
        await rig.reached(S.STARTING, 1)
        assert await rig.child.take_command(third) is Outcome.READY
        assert await waiting is Outcome.SUPERSEDED
        assert rig.launcher.spawns[-1][0][5:7] == ["-b", "512"]


async def test_a_refused_command_with_nothing_to_go_back_to_is_fatal_at_once() -> None:
    async with Rig(refused(*NP_ABC), max_quick_failures=5) as rig:
        rig.child.cfg = with_args(rig.child.cfg, "-np", "abc")
        rig.child.start()
        await rig.until(S.FATAL)
        assert len(rig.launcher.spawns) == 1  # not five tries of the same refusal
        assert 'llama-server refused -np abc: error while handling argument "-np": stoi' in \
            rig.child.reason
        assert not rig.child.ever_ready and rig.child.rejected is None


async def test_a_missing_binary_is_refused_and_a_passing_spawn_error_is_retried() -> None:
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory")
    async with Rig(Script(spawn_error=missing)) as rig:
        rig.child.start()
        await rig.until(S.FATAL)
        assert len(rig.launcher.spawns) == 1
        last = rig.child.last_exit
        assert last is not None and last.refusal is not None
        assert last.refusal.summary().startswith("cannot start '/opt/llama/llama-server'")
    busy = BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
    async with Rig(Script(spawn_error=busy)) as rig:
        rig.child.start()
        await rig.until(S.READY)  # backed off, then started
        assert rig.path()[:4] == ["STOPPED -> STARTING", "STARTING -> EXITED",
                                  "EXITED -> BACKOFF", "BACKOFF -> STARTING"]
        assert len(rig.launcher.spawns) == 2


async def test_a_refused_first_start_of_a_stopped_child_with_a_good_command_rolls_back(
        ) -> None:
    async with Rig(Script(), quick_crash(1, *NP_ABC), Script()) as rig:
        rig.child.start()
        await rig.until(S.READY)
        await rig.child.stop()
        good = rig.child.cfg
        new = with_args(good, "-np", "abc")
        assert rig.child.configure(new, rig.child.restart_cfg, 20.0) is False
        rig.child.start()
        await rig.reached(S.READY, 1)
        assert rig.child.cfg.args == good.args
        assert rig.child.to_json()["rejected_command"]["argument"] == "-np abc"
