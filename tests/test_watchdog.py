"""The hang watch of `laneway up`: a service touches its watchdog file from its event loop
(``laneway.watchdog``), and the supervisor kills and restarts one whose file stands still
(a stopped process, a blocked loop) while leaving one that beats alone."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from laneway.watchdog import AliveFile
from ops import hang_watch
from ops.restart_policy import RestartPolicy
from ops.supervised import ServiceProcess
from ops.supervisor import Supervisor
from tests.stack import eventually
from tests.test_supervisor import _gone, supervising

# Many restarts are allowed: a process that blocks its loop again after each restart must not
# stop the stack as a crash loop before the test has seen what it waits for.
POLICY = RestartPolicy(backoff_s=0.01, backoff_max_s=0.05, crash_limit=10, crash_window_s=60)
HANG_TIMEOUT_S = 1.5


def _beating(block_after_s: float = 600.0) -> str:
    """A service's shape: its loop beats (every 0.1 s) and, after ``block_after_s``, blocks
    in a synchronous call."""
    return (
        "import asyncio, os, time\n"
        "from laneway.watchdog import AliveFile\n"
        "async def main():\n"
        "    async with AliveFile(os.environ['LANEWAY_WATCHDOG_FILE'], interval_s=0.1):\n"
        "        print('beating', os.getpid(), flush=True)\n"
        f"        await asyncio.sleep({block_after_s})\n"
        "        print('blocking', flush=True)\n"
        "        time.sleep(600)\n"
        "asyncio.run(main())\n"
    )


def _service(name: str, script: str, log_dir: Path) -> ServiceProcess:
    argv = [sys.executable, "-c", script]
    env = {"PATH": os.environ["PATH"]}
    return ServiceProcess(name, argv, env, log_dir=log_dir, watchdog=True)


async def test_the_alive_file_is_touched_while_the_loop_runs_and_off_without_a_path(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.alive"
    async with AliveFile(str(path), interval_s=0.05):
        first = path.stat().st_mtime_ns  # touched at the start already
        await eventually(lambda: path.stat().st_mtime_ns > first, 5, "a second beat")
    async with AliveFile("") as off:
        assert off.path is None


async def test_a_stopped_process_is_killed_and_restarted_and_one_that_beats_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ops.supervisor")
    stopped = _service("stopped", _beating(), tmp_path)
    blocker = _service("blocker", _beating(block_after_s=2 * HANG_TIMEOUT_S), tmp_path)
    supervisor = Supervisor([stopped, blocker], POLICY, hang_timeout_s=HANG_TIMEOUT_S)
    async with supervising(supervisor):
        await eventually(lambda: "beating" in stopped.log_tail(), 20, "the first beat")
        assert stopped.alive_file is not None
        assert stopped.env["LANEWAY_WATCHDOG_FILE"] == str(stopped.alive_file)
        first = stopped.pid
        assert first is not None
        # A run slow to start (a loaded machine) may have been taken for hung already.
        before = supervisor.restarts("stopped")
        os.kill(first, signal.SIGSTOP)
        frozen_at = time.monotonic()
        await eventually(lambda: supervisor.restarts("stopped") > before, 20, "the restart")
        took = time.monotonic() - frozen_at
        # Judged every timeout / 4: killed past the timeout, and not long after it.
        assert HANG_TIMEOUT_S <= took < 3 * HANG_TIMEOUT_S, took
        assert _gone(first)
        await eventually(lambda: "beating" in stopped.log_tail(), 20, "the new run's beat")

        # The blocker beat for twice the timeout untouched (its first run got as far as its
        # block); once its loop blocks, it goes.
        await eventually(lambda: "blocking" in blocker.log_tail(), 20, "its block")
        blocked = supervisor.restarts("blocker")
        await eventually(lambda: supervisor.restarts("blocker") > blocked, 20, "its restart")
    lines = caplog.text
    assert re.search(
        rf"stopped \(pid {first}\) gave no sign of life for \d+s \(its event loop is blocked "
        r"or the process is stopped\); killing it to restart it",
        lines,
    )
    assert re.search(
        rf"stopped \(pid {first}\) exited: hung \(no sign of life for \d+s, "
        r"LANEWAY_HANG_TIMEOUT_S\), killed by SIGKILL",
        lines,
    )


async def test_a_run_has_longer_for_its_first_beat_than_between_beats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before its first beat a run is importing its packages, which on a loaded machine
    takes longer than a loop may stay blocked: it was killed before it could beat."""
    monkeypatch.setattr(hang_watch, "_FIRST_BEAT_S", 4.0)
    silent = _service("silent", "import time\nprint('up', flush=True)\ntime.sleep(600)\n", tmp_path)
    supervisor = Supervisor([silent], POLICY, hang_timeout_s=HANG_TIMEOUT_S)
    before_spawn = time.monotonic()
    async with supervising(supervisor):
        await eventually(lambda: supervisor.restarts("silent") >= 1, 20, "its restart")
        assert time.monotonic() - before_spawn >= 4.0  # not at the 1.5 s between beats
