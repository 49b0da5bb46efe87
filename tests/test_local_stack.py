"""Parts of `laneway up` around its supervisor: what it stops before it starts, how long a
stop may take, the settings it refuses before it starts anything, and its local autoscaler
living through a standby that cannot start."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from laneway.constants import RedisKeys, Topics
from laneway.schema import ScalingDecision
from ops.autoscale import LocalAutoscaler
from ops.group_members import GroupMembers
from ops.leftovers import stop_grace_s, stop_leftovers
from ops.redis_server import RedisServer
from ops.supervisor import Supervisor
from tests.stack import eventually, free_port
from tests.test_supervisor import FAST, SLEEPER, _laneway_up, _python

_UNBUFFERED = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1"}


def _fake_service(root: Path, module: str, alive_file: Path) -> subprocess.Popen[bytes]:
    """A process whose command line is `<python> -m <module>`, as a service's is, without
    being one: a package of that name in ``root`` shadows laneway's. Its watchdog file says
    which stack started it."""
    package = root / module
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(SLEEPER)
    env = {**_UNBUFFERED, "LANEWAY_WATCHDOG_FILE": str(alive_file)}
    return subprocess.Popen(
        [sys.executable, "-m", module], cwd=root, env=env, stdout=subprocess.PIPE
    )


def test_a_leftover_service_this_stack_does_not_run_is_stopped_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker-completion-3 that a killed stack left running survives no restart with fewer
    replicas: its pid file, command line and watchdog file name it. A pid file of anything
    else is left, and so is one whose pid is now another stack's service."""
    caplog.set_level(logging.WARNING, "ops.leftovers")
    logs = tmp_path / "logs"
    logs.mkdir()
    stray = _fake_service(tmp_path / "fake", "workers", logs / "worker-completion-3.alive")
    foreign = _fake_service(tmp_path / "fake", "workers", tmp_path / "other" / "x.alive")
    other = subprocess.Popen(
        [sys.executable, "-c", SLEEPER], env=_UNBUFFERED, stdout=subprocess.PIPE
    )
    try:
        for process in (stray, foreign, other):
            assert process.stdout is not None
            assert process.stdout.readline().startswith(b"running")
        (logs / "worker-completion-3.pid").write_text(str(stray.pid))
        (logs / "worker-chat-2.pid").write_text(str(foreign.pid))  # its pid taken since
        (logs / "notes.pid").write_text(str(other.pid))
        stop_leftovers([], logs, grace_s=10)
        assert stray.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None
        assert foreign.poll() is None
        assert not (logs / "worker-completion-3.pid").exists()
        assert (logs / "notes.pid").exists()
    finally:
        for process in (stray, foreign, other):
            process.kill()
            process.communicate()
    assert f"left worker-completion-3 (pid {stray.pid}) running" in caplog.text


@pytest.mark.parametrize(("drain", "grace"), [(None, 25.0), ("0", 15.0), ("120", 135.0)])
def test_a_stop_waits_out_a_workers_drain(
    monkeypatch: pytest.MonkeyPatch, drain: str | None, grace: float
) -> None:
    monkeypatch.delenv("LANEWAY_DRAIN_GRACE_S", raising=False)
    if drain is not None:
        monkeypatch.setenv("LANEWAY_DRAIN_GRACE_S", drain)
    assert stop_grace_s() == grace


@pytest.mark.parametrize(
    ("where", "env", "said"),
    [
        ("a-file", {}, "cannot hold the stack's data and logs (it is not a directory)"),
        ("a-file/below", {}, "cannot hold the stack's data and logs (Not a directory)"),
        ("unused", {"LANEWAY_DATA_DIR": ""}, "LANEWAY_DATA_DIR='': must name a directory"),
        ("unused", {"LANEWAY_PORT": "0"}, "LANEWAY_PORT=0: `laneway up` needs a fixed"),
    ],
)
def test_up_refuses_a_data_dir_or_port_it_cannot_use_naming_the_setting(
    tmp_path: Path, where: str, env: dict[str, str], said: str
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    run = _laneway_up(tmp_path / where, **env)
    assert run.returncode == 2, run.stdout + run.stderr
    assert said in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "unused").exists()  # refused before it made anything


async def test_the_autoscaler_lives_through_a_standby_that_cannot_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "ops.autoscale")
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis")
    await asyncio.to_thread(server.start)
    redis = aioredis.Redis.from_url(server.url)
    python = tmp_path / "python"
    base = _python("worker-chat", SLEEPER, tmp_path)
    extra = _python("worker-chat-2", SLEEPER, tmp_path, python=str(python))
    supervisor = Supervisor([base, extra], FAST, standby=["worker-chat-2"])
    run = asyncio.create_task(supervisor.run())
    keys = RedisKeys("autoscale-test")
    autoscaler = LocalAutoscaler(
        supervisor,
        redis,
        keys,
        {"chat": ["worker-chat", "worker-chat-2"]},
        {"chat": 1},
        groups=GroupMembers("127.0.0.1:1"),  # never asked: nothing is parked here
        topics=Topics("autoscale-test"),
        worker_ids={"worker-chat": "chat-1", "worker-chat-2": "chat-2"},
        interval_s=0.05,
        metrics=supervisor.metrics,
    )
    try:
        await eventually(lambda: supervisor.is_up("worker-chat"), 20, "the pool's first")
        signal_ = ScalingDecision(subject="scaling:chat", pool="chat", desired=2, replicas=1, raw=2)
        await redis.set(keys.scaling("chat"), signal_.to_json())
        # Its python is missing: the start fails, the standby stays one, and the loop goes on.
        assert await autoscaler.adjust("chat") == 1
        assert supervisor.is_parked("worker-chat-2")
        assert "worker-chat-2 could not be started (" in caplog.text
        python.symlink_to(sys.executable)
        ready = asyncio.Event()
        ready.set()
        scaling = asyncio.create_task(autoscaler.run(ready))
        try:
            await eventually(lambda: supervisor.is_up("worker-chat-2"), 20, "the next try")
        finally:
            scaling.cancel()
            await asyncio.gather(scaling, return_exceptions=True)
    finally:
        supervisor.request_stop()
        await asyncio.wait_for(run, 30)
        await redis.aclose()
        await asyncio.to_thread(server.stop)
