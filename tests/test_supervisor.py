"""The supervisor of `laneway up`, driving real child processes (small Python scripts and a
real Redis): restarts, crash loops, servers a process needs, Ctrl-C once and twice."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from laneway.errors import ConfigError
from laneway.settings import CommonSettings, load_settings, local_addresses
from ops.data_dir_lock import claimed
from ops.redis_server import RedisServer
from ops.restart_policy import CrashLoop, RestartPolicy
from ops.settings import StackSettings
from ops.stack_processes import stack_processes, standby_processes
from ops.supervised import LocalServer, ServiceProcess
from ops.supervisor import Supervisor
from ops.supervisor_metrics import SupervisorMetrics
from tests.stack import ROOT, eventually, free_port

FAST = RestartPolicy(backoff_s=0.01, backoff_max_s=0.05, crash_limit=3, crash_window_s=60)
SLEEPER = "import os, time\nprint('running', os.getpid())\ntime.sleep(600)"
STUBBORN = (  # ignores SIGTERM: only a kill ends it
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: print('SIGTERM ignored'))\n"
    "print('ready')\n"
    "while True: time.sleep(1)\n"
)


def _python(
    name: str, script: str, log_dir: Path, *, needs: Sequence[str] = (), python: str = ""
) -> ServiceProcess:
    argv = [python or sys.executable, "-c", script]
    return ServiceProcess(name, argv, {"PATH": os.environ["PATH"]}, log_dir=log_dir, needs=needs)


def _on_term(name: str, record: Path) -> str:
    """A script that notes its SIGTERM in ``record`` and exits."""
    return (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        f"    with open({str(record)!r}, 'a') as out: out.write({name!r} + '\\n')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready')\n"
        "while True: time.sleep(1)\n"
    )


def _gone(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _sample(supervisor: Supervisor, metric: str, process: str) -> float | None:
    return supervisor.metrics.registry.get_sample_value(metric, {"process": process})


@contextlib.asynccontextmanager
async def supervising(supervisor: Supervisor) -> AsyncIterator[asyncio.Task[None]]:
    """Run the supervisor until the block ends (then stop it) and wait for its processes."""
    run = asyncio.create_task(supervisor.run())
    names = [p.name for p in supervisor.processes]
    await eventually(lambda: run.done() or all(map(supervisor.is_up, names)), 20, "all up")
    try:
        yield run
    finally:
        supervisor.request_stop()
        await asyncio.wait_for(run, 30)


async def test_a_killed_process_is_restarted_while_the_others_keep_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ops.supervisor")
    victim, bystander = _python("victim", SLEEPER, tmp_path), _python("other", SLEEPER, tmp_path)
    supervisor = Supervisor([victim, bystander], FAST)
    async with supervising(supervisor):
        await eventually(lambda: "running" in victim.log_tail(), 10, "the first run's output")
        first, other = victim.pid, bystander.pid
        assert first is not None
        assert _sample(supervisor, "laneway_supervisor_restarts_total", "victim") == 0
        os.kill(first, signal.SIGKILL)
        await eventually(lambda: supervisor.restarts("victim") == 1, 10, "the restart")
        await eventually(lambda: "running" in victim.log_tail(), 10, "the new run's output")
        assert victim.pid != first
        assert bystander.pid == other
        assert _sample(supervisor, "laneway_supervisor_restarts_total", "victim") == 1
        assert _sample(supervisor, "laneway_supervisor_process_up", "victim") == 1
        assert _sample(supervisor, "laneway_supervisor_restarts_total", "other") == 0
    assert f"victim (pid {first}) exited: killed by SIGKILL" in caplog.text
    assert f"restarted victim (pid {victim.pid}; restart 1)" in caplog.text
    # Both runs are in its log; both processes are gone once the supervisor returned.
    assert victim.log_path.read_text().count("running") == 2
    assert _gone(victim.pid)
    assert _gone(bystander.pid)
    assert _sample(supervisor, "laneway_supervisor_process_up", "other") == 0


async def test_a_process_that_keeps_crashing_stops_the_stack_and_shows_its_last_lines(
    tmp_path: Path,
) -> None:
    crasher = _python("crasher", "print('boom: LANEWAY_X is wrong')\nraise SystemExit(3)", tmp_path)
    bystander = _python("other", SLEEPER, tmp_path)
    supervisor = Supervisor([bystander, crasher], FAST)
    with pytest.raises(CrashLoop) as caught:
        await asyncio.wait_for(supervisor.run(), 30)
    message = str(caught.value)
    assert caught.value.process == "crasher"
    assert "crasher exited 3 times within 60s" in message
    assert "LANEWAY_CRASH_LIMIT" in message
    assert "the last time: exit code 3" in message
    assert message.endswith(f"Last lines of {crasher.log_path}:\nboom: LANEWAY_X is wrong")
    assert supervisor.restarts("crasher") == 2
    assert _gone(bystander.pid)


async def test_a_restart_that_cannot_start_counts_as_a_crash(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.symlink_to(sys.executable)
    doomed = _python("doomed", SLEEPER, tmp_path, python=str(python))
    supervisor = Supervisor([doomed], RestartPolicy(backoff_s=0.01, crash_limit=2))
    run = asyncio.create_task(supervisor.run())
    await eventually(lambda: "running" in doomed.log_tail(), 20, "the first run")
    python.unlink()
    assert doomed.pid is not None
    os.kill(doomed.pid, signal.SIGKILL)
    with pytest.raises(CrashLoop, match=r"the last time: could not start again: .*No such file"):
        await asyncio.wait_for(run, 30)


async def test_an_exit_while_a_needed_server_was_away_is_not_held_against_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ops.supervisor")
    server = _python("server", SLEEPER, tmp_path)
    client = _python("client", SLEEPER, tmp_path, needs=["server"])
    # Two counted exits would stop the stack: the client exits twice, one of them counted.
    supervisor = Supervisor([server, client], dataclasses.replace(FAST, crash_limit=2))
    async with supervising(supervisor) as run:
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        await eventually(lambda: supervisor.restarts("server") == 1, 10, "the server back")
        for restarts in (1, 2):
            assert client.pid is not None
            os.kill(client.pid, signal.SIGKILL)
            await eventually(
                lambda n=restarts: supervisor.restarts("client") == n,  # type: ignore[misc]
                10,
                "the client's restart",
            )
        assert not run.done()
    assert "(not counted as a crash: server, which it needs, went down" in caplog.text


class _SlowStart:
    """A process whose start takes a while, as Kafka's does; every start is recorded."""

    def __init__(self, inner: ServiceProcess, starts: list[str], delay_s: float = 0.0) -> None:
        self.inner = inner
        self.starts = starts
        self.delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def start(self) -> None:
        await asyncio.sleep(self.delay_s)
        await self.inner.start()
        self.starts.append(self.inner.name)


class _FailsOnce(_SlowStart):
    """Its second start raises what a Kafka client raises (not a ServiceError), once."""

    async def start(self) -> None:
        await super().start()
        if self.starts.count(self.inner.name) == 2:
            raise RuntimeError("KafkaConnectionError: creating the topics (injected)")


async def test_a_restart_that_raises_any_error_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A start that raised something of another library's (a Kafka client's error creating
    the topics on a broker that came up) ended the watch of its process unsaid: it was never
    restarted again, and what needed it waited for good. Now it counts as an exit, and the
    next start runs."""
    caplog.set_level(logging.WARNING, "ops.supervisor")
    starts: list[str] = []
    flaky = _FailsOnce(_python("flaky", SLEEPER, tmp_path), starts)
    supervisor = Supervisor([flaky], FAST)  # type: ignore[list-item]
    async with supervising(supervisor):
        assert flaky.pid is not None
        os.kill(flaky.pid, signal.SIGKILL)
        await eventually(lambda: supervisor.restarts("flaky") == 1, 20, "its start again")
        assert supervisor.is_up("flaky")
    assert starts == ["flaky"] * 3
    assert "could not start again: RuntimeError('KafkaConnectionError" in caplog.text


async def test_a_restart_waits_for_the_servers_it_needs(tmp_path: Path) -> None:
    starts: list[str] = []
    server = _SlowStart(_python("server", SLEEPER, tmp_path), starts, delay_s=0.5)
    client = _SlowStart(_python("client", SLEEPER, tmp_path, needs=["server"]), starts)
    supervisor = Supervisor([server, client], FAST)  # type: ignore[list-item]
    async with supervising(supervisor):
        os.kill(server.pid, signal.SIGKILL)
        await eventually(lambda: not supervisor.is_up("server"), 10, "the server's exit seen")
        os.kill(client.pid, signal.SIGKILL)
        await eventually(lambda: supervisor.restarts("client") == 1, 20, "the client's restart")
    # Its own wait is a few ms, the server's start half a second: it waited for the server.
    assert starts == ["server", "client", "server", "client"]


async def test_ctrl_c_stops_services_before_the_servers_they_need(tmp_path: Path) -> None:
    record = tmp_path / "stopped"
    server = _python("server", _on_term("server", record), tmp_path)
    services = [
        _python(name, _on_term(name, record), tmp_path, needs=["server"]) for name in ("a", "b")
    ]
    supervisor = Supervisor([server, *services], FAST)
    async with supervising(supervisor):
        for process in (server, *services):
            await eventually(lambda p=process: "ready" in p.log_tail(), 10, "ready")  # type: ignore[misc]
    stopped = record.read_text().split()
    assert sorted(stopped[:2]) == ["a", "b"]
    assert stopped[2:] == ["server"]
    assert supervisor.restarts("server") == 0  # a stop is not a crash


class _Fake:
    """A supervised process without a process: its start and its stop (which takes
    ``stop_s``) are recorded in ``events``."""

    alive_file = None
    pid = None

    def __init__(
        self,
        name: str,
        events: list[str],
        *,
        needs: Sequence[str] = (),
        front: bool = False,
        stop_s: float = 0.05,
    ) -> None:
        self.name = name
        self.needs = tuple(needs)
        self.front = front
        self.events = events
        self.stop_s = stop_s
        self.log_path = Path(os.devnull)
        self._exited = asyncio.Event()

    async def start(self) -> None:
        self._exited = asyncio.Event()
        self.events.append(f"start {self.name}")

    async def wait(self) -> int:
        await self._exited.wait()
        return 0

    async def stop(self, grace_s: float) -> None:
        self.events.append(f"stop {self.name}")
        await asyncio.sleep(self.stop_s)
        self._exited.set()
        self.events.append(f"stopped {self.name}")

    def kill(self) -> None:
        self._exited.set()

    def log_tail(self) -> str:
        return ""

    def leftover_pid(self) -> int | None:
        return None


async def test_ctrl_c_stops_the_front_door_then_the_services_then_the_servers_in_reverse() -> None:
    """The ingress stops alone first (it finishes its open requests while the workers that
    answer them still run), then the other services together, then each server."""
    events: list[str] = []
    servers = [_Fake(name, events) for name in ("redis", "kafka")]
    needs = ("redis", "kafka")
    front = _Fake("ingress", events, needs=needs, front=True, stop_s=0.3)
    services = [_Fake(name, events, needs=needs) for name in ("worker-a", "worker-b", "streams")]
    supervisor = Supervisor([*servers, front, *services], FAST)
    assert [[p.name for p in wave] for wave in supervisor.stop_waves()] == [
        ["ingress"],
        ["worker-a", "worker-b", "streams"],
        ["kafka"],
        ["redis"],
    ]
    async with supervising(supervisor):
        pass
    stops = [e for e in events if not e.startswith("start ")]
    assert stops[:2] == ["stop ingress", "stopped ingress"]
    # The services together: each was told before any of them had stopped.
    assert sorted(stops[2:5]) == ["stop streams", "stop worker-a", "stop worker-b"]
    assert sorted(stops[5:8]) == ["stopped streams", "stopped worker-a", "stopped worker-b"]
    assert stops[8:] == ["stop kafka", "stopped kafka", "stop redis", "stopped redis"]


async def test_a_start_that_fails_after_the_spawn_leaves_no_child_behind(tmp_path: Path) -> None:
    doomed = _python("doomed", SLEEPER, tmp_path)
    doomed.pid_path.mkdir()  # the pid file cannot be written
    with pytest.raises(IsADirectoryError):
        await doomed.start()
    assert doomed.pid is not None
    assert _gone(doomed.pid)  # killed and reaped (a zombie would still take signals)


async def test_a_second_ctrl_c_kills_what_ignores_the_first(tmp_path: Path) -> None:
    stubborn = _python("stubborn", STUBBORN, tmp_path)
    supervisor = Supervisor([stubborn], FAST, grace_s=600)
    run = asyncio.create_task(supervisor.run())
    await eventually(lambda: "ready" in stubborn.log_tail(), 20, "ready")
    supervisor.request_stop()
    await eventually(lambda: "SIGTERM ignored" in stubborn.log_tail(), 10, "the SIGTERM")
    assert not run.done()  # it waits up to the grace for a graceful exit
    supervisor.request_stop()
    await asyncio.wait_for(run, 20)  # far less than the 600 s grace
    assert _gone(stubborn.pid)


CHATTY = (
    "import sys\nprint('ready', flush=True)\nwhile True: sys.stdout.write('x' * 1000 + '\\n')\n"
)


async def test_a_service_whose_terminal_hung_up_is_still_read_and_stops(tmp_path: Path) -> None:
    """The terminal closed (EIO) or a `| tee` died (EPIPE) while a service printed: its
    output is still read to the end. Unread, its pipe filled, the service blocked in its
    next print (deaf to SIGTERM), and the wait for its exit, which waits for the pipe to
    close too, never ended: a stop hung for good, a second Ctrl-C too."""
    echoed: list[str] = []

    def hung_up(line: str) -> None:
        echoed.append(line)
        raise OSError(5, "Input/output error")

    chatty = ServiceProcess(
        "chatty", [sys.executable, "-c", CHATTY], {"PATH": os.environ["PATH"]},
        log_dir=tmp_path, echo=hung_up,
    )  # fmt: skip
    await chatty.start()
    await eventually(lambda: chatty.log_path.stat().st_size > 1_000_000, 20, "a megabyte")
    await asyncio.wait_for(chatty.stop(grace_s=5), 30)
    assert _gone(chatty.pid)
    assert echoed == ["ready"]  # tried once, then no more


async def test_a_service_whose_log_cannot_be_written_is_still_read_and_stops(
    tmp_path: Path,
) -> None:
    """A full disk under the data dir: its log takes nothing (ENOSPC, /dev/full here), the
    rest of its output still goes on (to the terminal, and its last lines to a crash
    report), and it stops as any service does."""
    (tmp_path / "chatty.log").symlink_to("/dev/full")
    echoed: list[str] = []
    chatty = ServiceProcess(
        "chatty", [sys.executable, "-c", CHATTY], {"PATH": os.environ["PATH"]},
        log_dir=tmp_path, echo=echoed.append,
    )  # fmt: skip
    await chatty.start()
    await eventually(lambda: len(echoed) > 2000, 20, "two megabytes echoed")
    await asyncio.wait_for(chatty.stop(grace_s=5), 30)
    assert _gone(chatty.pid)
    assert chatty.log_tail().endswith("x" * 1000)


async def test_ctrl_c_while_a_crash_loop_stops_the_stack_kills_at_once(tmp_path: Path) -> None:
    """The stack already stops in order (a crash loop), and a service ignores its SIGTERM:
    the operator's Ctrl-C is a second stop, not a first that changes nothing."""
    stubborn = _python("stubborn", STUBBORN, tmp_path)
    crasher = _python("crasher", "raise SystemExit(3)", tmp_path)
    supervisor = Supervisor([stubborn, crasher], FAST, grace_s=600)
    run = asyncio.create_task(supervisor.run())
    await eventually(lambda: "SIGTERM ignored" in stubborn.log_tail(), 20, "the stop in order")
    supervisor.request_stop()
    with pytest.raises(CrashLoop):
        await asyncio.wait_for(run, 20)  # far less than the 600 s grace
    assert _gone(stubborn.pid)


async def test_a_killed_redis_comes_back_with_its_data(tmp_path: Path) -> None:
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis", persistent=True)
    supervisor = Supervisor([LocalServer(server)], FAST)
    async with supervising(supervisor):
        before = aioredis.Redis.from_url(server.url)
        try:
            await before.set("laneway:apikey:x", "team-a")
        finally:
            await before.aclose()
        first = server.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await eventually(lambda: supervisor.restarts("redis") == 1, 20, "redis restarted")
        second = server.pid
        assert second != first
        after = aioredis.Redis.from_url(server.url)
        try:
            assert await after.get("laneway:apikey:x") == b"team-a"
        finally:
            await after.aclose()
    assert _gone(second)


def test_restart_waits_double_with_jitter_up_to_the_max() -> None:
    policy = RestartPolicy(backoff_s=0.5, backoff_max_s=5.0)
    for exits, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 5.0), (500, 5.0)]:
        waits = [policy.delay(exits) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (exits, min(waits), max(waits))
        assert len(set(waits)) > 1  # jittered


def test_metrics_are_served_and_a_taken_port_names_the_setting() -> None:
    metrics = SupervisorMetrics()
    metrics.restarts.labels("worker-completion").inc()
    port = free_port()
    close = metrics.serve(port)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'laneway_supervisor_restarts_total{process="worker-completion"} 1.0' in text
        with pytest.raises(ConfigError, match=rf"port {port} is not free.*LANEWAY_SUPERVISOR_PORT"):
            SupervisorMetrics().serve(port)
    finally:
        close()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"LANEWAY_CRASH_LIMIT": "0"}, "LANEWAY_CRASH_LIMIT='0'"),
        ({"LANEWAY_CRASH_WINDOW_S": "-1"}, "LANEWAY_CRASH_WINDOW_S='-1'"),
        ({"LANEWAY_SUPERVISOR_PORT": "70000"}, "LANEWAY_SUPERVISOR_PORT='70000'"),
        (
            {"LANEWAY_RESTART_BACKOFF_S": "2", "LANEWAY_RESTART_BACKOFF_MAX_S": "1"},
            "LANEWAY_RESTART_BACKOFF_MAX_S='1': must be at least LANEWAY_RESTART_BACKOFF_S",
        ),
        # 0.5 + 1 + 2 + 4 + 8 + 16 + 13 × 30 s of restart waits between 20 exits
        (
            {"LANEWAY_CRASH_LIMIT": "20"},
            "LANEWAY_CRASH_LIMIT=20 exits can never fall within LANEWAY_CRASH_WINDOW_S=60: "
            "the restart waits between them alone take 421.5s (LANEWAY_RESTART_BACKOFF_S=0.5, "
            "doubling up to LANEWAY_RESTART_BACKOFF_MAX_S=30)",
        ),
        (
            {"LANEWAY_CRASH_WINDOW_S": "5", "LANEWAY_RESTART_BACKOFF_S": "2"},
            "LANEWAY_CRASH_LIMIT=5 exits can never fall within LANEWAY_CRASH_WINDOW_S=5: "
            "the restart waits between them alone take 30s",
        ),
        ({"LANEWAY_HANG_TIMEOUT_S": "2"}, "LANEWAY_HANG_TIMEOUT_S='2': must be 0 (off) or at"),
        ({"LANEWAY_HANG_TIMEOUT_S": "-1"}, "LANEWAY_HANG_TIMEOUT_S='-1'"),
        ({"LANEWAY_DATA_DIR": ""}, "LANEWAY_DATA_DIR='': must name a directory"),
    ],
)
def test_bad_supervisor_settings_fail_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        load_settings(StackSettings)
    assert named in str(caught.value)


@pytest.mark.parametrize(
    "env",
    [
        {"LANEWAY_HANG_TIMEOUT_S": "0"},
        {"LANEWAY_HANG_TIMEOUT_S": "5"},
        # The waits before the 20th exit (421.5 s) fit a window of ten minutes.
        {"LANEWAY_CRASH_LIMIT": "20", "LANEWAY_CRASH_WINDOW_S": "600"},
        # One exit stops the stack: no wait comes before it.
        {"LANEWAY_CRASH_LIMIT": "1", "LANEWAY_CRASH_WINDOW_S": "0.1"},
    ],
)
def test_supervisor_settings_that_can_work_are_taken(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    load_settings(StackSettings)


def test_the_stack_runs_workers_under_fixed_ids_and_keeps_its_own_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANEWAY_SUPERVISOR_PORT", "9101")
    monkeypatch.setenv("LANEWAY_MAX_INFLIGHT", "7")
    processes = stack_processes(StackSettings(data_dir=str(tmp_path), port=8123))
    assert [p.name for p in processes] == [
        "redis",
        "kafka",
        "ingress",
        "worker-completion",
        "worker-completion-2",
        "worker-completion-3",
        "worker-chat",
        "worker-batch",
        "streams",
    ]
    # Above a pool's minimum, workers wait for its scaling signal (LANEWAY_LOCAL_REPLICAS).
    settings = StackSettings(data_dir=str(tmp_path))
    assert standby_processes(settings) == ["worker-completion-2", "worker-completion-3"]
    redis, _, *services = processes
    assert isinstance(redis, LocalServer)
    assert redis.server.persistent  # type: ignore[attr-defined]
    env = {p.name: p.env for p in services if isinstance(p, ServiceProcess)}
    assert len(env) == 7
    assert env["worker-completion-3"]["LANEWAY_WORKER_ID"] == "completion-3"
    assert env["worker-completion-3"]["LANEWAY_SCALE_MAX_REPLICAS"] == "3"
    assert all(p.needs == ("redis", "kafka") for p in services)
    # A restart runs under the same id: static membership gives back its partitions.
    assert [env[f"worker-{pool}"]["LANEWAY_WORKER_ID"] for pool in ("completion", "chat")] == [
        "completion-1",
        "chat-1",
    ]
    assert env["ingress"]["LANEWAY_PORT"] == "8123"
    # The ingress is the front door, stopped first; each service beats into a file of its own.
    assert [p.name for p in services if p.front] == ["ingress"]
    assert all(
        e["LANEWAY_WATCHDOG_FILE"] == str(tmp_path.resolve() / "logs" / f"{name}.alive")
        for name, e in env.items()
    )
    assert all("LANEWAY_SUPERVISOR_PORT" not in e for e in env.values())
    assert all("LANEWAY_PORT" not in e for name, e in env.items() if name != "ingress")
    assert env["worker-batch"]["LANEWAY_MAX_INFLIGHT"] == "7"  # service settings pass through
    # A Kafka login from the shell (a secured stack's admin.env sourced earlier) goes with
    # another broker's address: the stack's own broker takes none, and every service failed.
    monkeypatch.setenv("LANEWAY_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("LANEWAY_KAFKA_USERNAME", "laneway-admin")
    monkeypatch.setenv("LANEWAY_KAFKA_PASSWORD", "from-the-shell")
    for process in stack_processes(StackSettings(data_dir=str(tmp_path), port=8123)):
        if isinstance(process, ServiceProcess):
            assert not {k for k in process.env if k.startswith("LANEWAY_KAFKA_")} - {
                "LANEWAY_KAFKA_BOOTSTRAP"
            }, process.name


def _watch_ended(supervisor: Supervisor, name: str) -> bool:
    """Whether every watcher of ``name`` returned (a restart would have kept one waiting)."""
    watchers = [t for t in supervisor._watchers if t.get_name() == name]
    return bool(watchers) and all(t.done() for t in watchers)


async def test_a_standby_process_runs_only_between_activate_and_park(tmp_path: Path) -> None:
    base, extra = _python("base", SLEEPER, tmp_path), _python("extra", SLEEPER, tmp_path)
    supervisor = Supervisor([base, extra], FAST, standby=["extra"])
    run = asyncio.create_task(supervisor.run())
    try:
        await eventually(lambda: supervisor.is_up("base"), 20, "the base process")
        assert extra.pid is None
        assert supervisor.is_parked("extra")
        assert await supervisor.activate("extra")
        assert not await supervisor.activate("extra")  # runs already
        await eventually(lambda: "running" in extra.log_tail(), 10, "the standby's output")
        pid = extra.pid
        assert await supervisor.park("extra")
        assert _gone(pid)
        # A parked process is not restarted: its watcher saw the exit and let it be.
        await eventually(lambda: _watch_ended(supervisor, "extra"), 10, "the watcher to end")
        assert not supervisor.is_up("extra")
        assert supervisor.restarts("extra") == 0
        assert not await supervisor.park("extra")
    finally:
        supervisor.request_stop()
        await asyncio.wait_for(run, 30)
    assert _gone(base.pid)
    assert not await supervisor.activate("extra")  # nothing starts once stopped


def test_standby_names_must_be_processes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"standby names that are none of them: \['nobody'\]"):
        Supervisor([_python("base", SLEEPER, tmp_path)], FAST, standby=["nobody"])


def _laneway_up(data: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``laneway up`` on ``data``, expected to stop before it starts anything."""
    free = {
        "LANEWAY_KAFKA_PORT": str(free_port()),
        "LANEWAY_REDIS_PORT": str(free_port()),
        "LANEWAY_PORT": str(free_port()),
        "LANEWAY_SUPERVISOR_PORT": "0",
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith("LANEWAY_")}
    argv = [sys.executable, "-m", "ops.cli", "up"]
    with subprocess.Popen(
        argv,
        env={**base, **free, "LANEWAY_DATA_DIR": str(data), **env},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as up:
        try:
            stdout, stderr = up.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            up.send_signal(signal.SIGINT)  # it started after all: Ctrl-C stops what it started
            stdout, stderr = up.communicate(timeout=90)
    return subprocess.CompletedProcess(argv, up.returncode, stdout, stderr)


def test_up_refuses_a_taken_ingress_port_before_it_starts_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = _laneway_up(tmp_path, LANEWAY_PORT=str(port))
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"the ingress port {port} is already in use; set LANEWAY_PORT" in run.stderr
    assert not (tmp_path / "redis").exists()
    assert not (tmp_path / "kafka").exists()


def test_a_second_up_on_the_same_data_dir_is_refused_naming_the_first(tmp_path: Path) -> None:
    with claimed(tmp_path):  # this test process stands for a running `laneway up`
        run = _laneway_up(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"laneway is already running on {tmp_path} (pid {os.getpid()})" in run.stderr
    assert "kill -INT" in run.stderr
    assert "LANEWAY_DATA_DIR" in run.stderr
    assert not (tmp_path / "redis").exists()
    # Once the first has gone, the data dir is free again (the kernel let go of the lock).
    with claimed(tmp_path):
        pass


def test_an_unset_address_is_the_local_stacks_on_its_port() -> None:
    env = {"LANEWAY_KAFKA_PORT": "19192", "LANEWAY_REDIS_PORT": "16479", "LANEWAY_PORT": "8100"}
    assert local_addresses(CommonSettings, env) == {
        "kafka_bootstrap": "127.0.0.1:19192",
        "redis_url": "redis://127.0.0.1:16479/0",
        "ingress_url": "http://127.0.0.1:8100/v1",
    }
    # Set addresses win; a port of 0 ("any free one") names no address; names are as
    # pydantic-settings reads them, in any case.
    env = {
        "LANEWAY_KAFKA_PORT": "19192",
        "LANEWAY_KAFKA_BOOTSTRAP": "k:9092",
        "LANEWAY_PORT": "0",
        "laneway_redis_port": "16479",
    }
    assert local_addresses(CommonSettings, env) == {"redis_url": "redis://127.0.0.1:16479/0"}
    with pytest.raises(ConfigError, match="LANEWAY_KAFKA_PORT='１９０９２': not a port number"):
        local_addresses(CommonSettings, {"LANEWAY_KAFKA_PORT": "１９０９２"})
