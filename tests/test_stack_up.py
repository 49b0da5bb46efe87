"""`laneway up` as a user runs it (a subprocess on ports of its own): a process killed under
traffic is restarted, what was accepted is served, and the ingress keeps answering.

One stack serves the whole module; each test leaves it whole again. Where a test needs an
outage that lasts (to see /readyz report it and traffic flow through it), it freezes the
supervisor (SIGSTOP) so that nothing restarts the dead server until it is let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from laneway.apikeys import create_key, lookup_team
from laneway.constants import RedisKeys
from ops.leftovers import process_runs
from quota.teams import Team, set_team
from tests.stack import ROOT, eventually, free_port, free_port_pair

pytestmark = pytest.mark.slow

KEYS = RedisKeys("laneway")
SERVERS = ("redis", "kafka")


@dataclass
class UpStack:
    process: subprocess.Popen[bytes]
    data: Path
    output: Path
    base_url: str
    metrics_url: str
    kafka: str
    redis_url: str
    env: dict[str, str]  # what it was started with: the shell of its user
    # How a connection to the ingress went, made as soon as the "laneway is up" line came.
    after_the_up_line: str = "not seen"

    def pid(self, name: str) -> int:
        """The pid of a process of the stack now, from its pid file."""
        where = self.data / name if name in SERVERS else self.data / "logs"
        return int((where / f"{name}.pid").read_text())

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    async def restarts(self, name: str) -> float:
        async with httpx.AsyncClient() as http:
            text = (await http.get(self.metrics_url)).text
        line = f'laneway_supervisor_restarts_total{{process="{name}"}} '
        [value] = [row.removeprefix(line) for row in text.splitlines() if row.startswith(line)]
        return float(value)

    async def api_key(self, team: str) -> str:
        redis = aioredis.Redis.from_url(self.redis_url)
        try:
            await set_team(redis, KEYS, Team(team, size=1000))
            return await create_key(redis, KEYS, team)
        finally:
            await redis.aclose()

    def http(self, key: str) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=120)

    @contextlib.contextmanager
    def frozen_supervisor(self) -> Iterator[None]:
        """Nothing restarts a dead process of the stack inside this block."""
        self.process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.process.send_signal(signal.SIGCONT)


ADMIN_KEY = "stack-up-admin-0123"
HANG_TIMEOUT_S = 15
SERVICES = ("ingress", "streams", "worker-completion", "worker-chat", "worker-batch")
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _stack_env(data: Path, kafka_port: int, redis_port: int, port: int, metrics: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANEWAY_")}
    env.update(
        PYTHONPATH=str(ROOT),
        LANEWAY_DATA_DIR=str(data),
        LANEWAY_KAFKA_PORT=str(kafka_port),
        LANEWAY_REDIS_PORT=str(redis_port),
        LANEWAY_PORT=str(port),
        LANEWAY_SUPERVISOR_PORT=str(metrics),
        LANEWAY_KAFKA_HEAP_MB="256",
        LANEWAY_PARTITIONS="2",
        LANEWAY_PROBE_INTERVAL_S="0",
        LANEWAY_ADMIN_KEY=ADMIN_KEY,  # /readyz shows its checks to the operator
        LANEWAY_HEARTBEAT_INTERVAL_S="0.5",
        # Slow, one at a time: requests queue up behind each other at the completion worker.
        LANEWAY_SIM_DECODE_MS_PER_STEP="50",
        LANEWAY_SIM_BATCH_SLOTS="1",
        # What is tested is that queued requests are served, not the deadline policy.
        LANEWAY_COMPLETION_DEADLINE_MS="120000",
        # The chat pool may grow to two workers by its scaling signal, and shrinks 3 s after
        # its load is gone; the other pools keep one, as the tests above expect.
        LANEWAY_LOCAL_REPLICAS='{"completion": [1, 1], "chat": [1, 2], "batch": [1, 1]}',
        LANEWAY_SCALE_DOWN_WINDOW_S="3",
        # A hung worker is seen within the test's patience (the default is 30 s).
        LANEWAY_HANG_TIMEOUT_S=str(HANG_TIMEOUT_S),
    )
    return env


def _wait_ready(stack: UpStack, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if stack.process.poll() is not None:
            pytest.fail(f"laneway up exited with {stack.process.returncode}:\n{stack.log()}")
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{stack.base_url}/readyz", headers=ADMIN, timeout=5)
            if response.status_code == 200 and "workers.completion" in response.json()["checks"]:
                return
        time.sleep(0.2)
    pytest.fail(f"laneway up was not ready within {within_s:.0f}s:\n{stack.log()}")


def _connect_at_the_up_line(stack: UpStack, within_s: float) -> None:
    """Wait for the line a user waits for, then connect to the ingress at once, as they
    would (the outcome in ``after_the_up_line``)."""
    deadline = time.monotonic() + within_s
    while "laneway is up" not in stack.log():
        if stack.process.poll() is not None or time.monotonic() > deadline:
            return
        time.sleep(0.05)
    port = int(stack.base_url.rsplit(":", 1)[1])
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        stack.after_the_up_line = "connected"
    except OSError as exc:
        stack.after_the_up_line = repr(exc)


def start_up(data: Path, output: Path, **extra_env: str) -> tuple[UpStack, dict[str, str]]:
    """``laneway up`` as a child on free ports (its output to ``output``), and its env."""
    kafka_port, redis_port, port, metrics = free_port_pair(), free_port(), free_port(), free_port()
    env = {**_stack_env(data, kafka_port, redis_port, port, metrics), **extra_env}
    with output.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "up"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    stack = UpStack(
        process,
        data,
        output,
        base_url=f"http://127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{metrics}/metrics",
        kafka=f"127.0.0.1:{kafka_port}",
        redis_url=f"redis://127.0.0.1:{redis_port}/0",
        env=env,
    )
    return stack, env


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    data = tmp_path_factory.mktemp("up")
    stack, _ = start_up(data, data / "up.out")
    try:
        _connect_at_the_up_line(stack, 120)
        _wait_ready(stack, 120)
        yield stack
    finally:
        names = ["redis", "kafka", "ingress", "streams"]
        names += [f"worker-{pool}" for pool in ("completion", "chat", "batch")]
        pids = {}
        for name in names:
            with contextlib.suppress(OSError, ValueError):
                pids[name] = stack.pid(name)
        stack.process.send_signal(signal.SIGINT)  # Ctrl-C
        code = stack.process.wait(timeout=90)
    assert code == 0, stack.log()
    alive = [name for name, pid in pids.items() if Path(f"/proc/{pid}").exists()]
    assert not alive, f"still running after Ctrl-C: {alive}"
    assert len(pids) == len(names)


@contextlib.asynccontextmanager
async def healthz_watched(stack: UpStack) -> AsyncIterator[list[Any]]:
    """Ask /healthz over and over while the block runs; the answers (or errors) it got."""
    answers: list[Any] = []

    async def ask() -> None:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=5) as http:
            while True:
                try:
                    answers.append((await http.get("/healthz")).status_code)
                except httpx.HTTPError as exc:
                    answers.append(repr(exc))
                await asyncio.sleep(0.05)

    asking = asyncio.create_task(ask())
    try:
        yield answers
    finally:
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking


async def until(check: Callable[[], Awaitable[bool]], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within_s}s waiting for {what}")
        await asyncio.sleep(0.1)


async def _equals(value: Awaitable[float], expected: float) -> bool:
    return await value == expected


def _always_answered(health: list[Any]) -> None:
    assert health, "/healthz was never asked"
    assert set(health) == {200}, health


async def _first(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    """The first request of a key, sent again on a 503 as the OpenAI SDK does: on a loaded
    machine the ingress's first look at Redis for the key can take longer than it waits (a
    key it has not seen yet is then answered 503, retry shortly)."""
    for _ in range(5):
        reply = await http.post(path, json=body)
        if reply.status_code != 503:
            break
        await asyncio.sleep(float(reply.headers.get("retry-after", "1")))
    assert reply.status_code == 200, reply.text
    return reply


def _completion(i: int | str) -> dict[str, Any]:
    return {"model": "laneway-code", "prompt": f"def handler_{i}(request):", "max_tokens": 8}


async def test_a_killed_completion_worker_serves_every_accepted_request(up: UpStack) -> None:
    key = await up.api_key("team-worker")
    before = await up.restarts("worker-completion")
    async with up.http(key) as http, healthz_watched(up) as health:
        # One served first: the ingress knows the key from then on, so a Redis that a loaded
        # machine stalls for a moment costs the burst nothing (an unknown key gets 503 then).
        await _first(http, "/v1/completions", _completion("first"))
        sent = [
            asyncio.create_task(http.post("/v1/completions", json=_completion(i)))
            for i in range(12)
        ]
        served, _ = await asyncio.wait(sent, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        assert served, "no completion served before the kill"
        # The worker serves one at a time: the rest wait behind the one it is on.
        victim = up.pid("worker-completion")
        os.kill(victim, signal.SIGKILL)
        # Accepted while the pool has no worker at all: they wait in Kafka for the restart.
        sent += [
            asyncio.create_task(http.post("/v1/completions", json=_completion(f"late_{i}")))
            for i in range(4)
        ]
        responses = await asyncio.wait_for(asyncio.gather(*sent), 120)
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses]
    assert all(r.json()["choices"][0]["text"] for r in responses)
    assert await up.restarts("worker-completion") == before + 1
    assert up.pid("worker-completion") != victim
    # The same worker id both times: static membership gave the restart its partitions back.
    worker_log = (up.data / "logs" / "worker-completion.log").read_text()
    assert worker_log.count("worker completion-1 serving pool completion") == 2
    assert f"worker-completion (pid {victim}) exited: killed by SIGKILL" in up.log()
    _always_answered(health)


async def _local_replicas(up: UpStack, pool: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(up.metrics_url)).text
    line = f'laneway_local_replicas{{pool="{pool}"}} '
    [value] = [row.removeprefix(line) for row in text.splitlines() if row.startswith(line)]
    return float(value)


async def test_the_local_autoscaler_starts_and_stops_a_worker_by_the_signal(up: UpStack) -> None:
    key = await up.api_key("team-surge")
    assert await _local_replicas(up, "chat") == 1
    assert not (up.data / "logs" / "worker-chat-2.pid").exists()
    chat = {"model": "laneway-chat", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8}  # fmt: skip
    async with up.http(key) as http:
        # One served first: the ingress knows the key from then on. Else a Redis that a loaded
        # machine stalls for 0.2 s answers the whole burst 503 (its key unchecked: seen once),
        # nothing queues and no second worker is asked for.
        await _first(http, "/v1/chat/completions", chat)
        # One sim slot, 8 decode steps of 50 ms: a queue of 24 asks for a second worker.
        sent = [
            asyncio.create_task(http.post("/v1/chat/completions", json=chat)) for _ in range(24)
        ]

        async def two_workers() -> bool:
            return await _local_replicas(up, "chat") == 2

        await until(two_workers, 60, "a second chat worker")
        second = up.pid("worker-chat-2")
        responses = await asyncio.wait_for(asyncio.gather(*sent), 120)
    assert [r.status_code for r in responses] == [200] * 24, [
        (r.status_code, r.text) for r in responses if r.status_code != 200
    ]
    worker_log = up.data / "logs" / "worker-chat-2.log"

    async def joined() -> bool:
        return "assigned ['laneway.req.chat" in worker_log.read_text()

    # It joined the pool's consumer group and took partitions of its own.
    await until(joined, 60, "the second chat worker to be assigned partitions")

    async def one_worker() -> bool:
        return await _local_replicas(up, "chat") == 1

    await until(one_worker, 60, "the idle second chat worker to be stopped")
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(second, 0)
    assert "worker chat-2 serving pool chat" in worker_log.read_text()
    # That a parked process is never restarted is test_supervisor's to show, without a wait.
    assert await up.restarts("worker-chat-2") == 0, "a stopped standby worker is not restarted"
    assert "pool chat: 1 → 2 worker processes" in up.log()
    assert "pool chat: 2 → 1 worker processes" in up.log()
    # Out of the group at once, not after the session timeout (a static member stays).
    assert "removed chat-2 from laneway.workers.chat: partitions move on now" in up.log()


async def _consumed_to_the_end(
    up: UpStack, group: str, topic: str
) -> Callable[[], Awaitable[bool]]:
    """A check: ``group`` has committed every record ``topic`` holds now."""
    wanted = await _past_the_last_records(up, topic)

    async def check() -> bool:
        admin = AIOKafkaAdminClient(bootstrap_servers=up.kafka)
        await admin.start()
        try:
            committed = await admin.list_consumer_group_offsets(group)
        finally:
            await admin.close()
        # A consumer commits the next offset to read (Faust as well).
        return all(tp in committed and committed[tp].offset >= n for tp, n in wanted.items())

    return check


async def _past_the_last_records(up: UpStack, topic: str) -> dict[TopicPartition, int]:
    """Each partition's offset after its last record (a partition with none left out). The
    end offset is not it: a transaction's commit marker, never handed to a consumer, can
    come after the last record."""
    reader = AIOKafkaConsumer(
        topic,
        bootstrap_servers=up.kafka,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    await reader.start()  # no group: every partition of the topic is assigned
    past: dict[TopicPartition, int] = {}
    try:
        ends = await reader.end_offsets(list(reader.assignment()))  # read_committed: stable
        assert ends, f"{topic} has no partitions"
        deadline = time.monotonic() + 30
        while [tp for tp, end in ends.items() if await reader.position(tp) < end]:
            assert time.monotonic() < deadline, f"{topic} not read to its end within 30 s"
            for tp, records in (await reader.getmany(timeout_ms=500)).items():
                past[tp] = records[-1].offset + 1
    finally:
        await reader.stop()
    return past


async def test_a_killed_streams_app_catches_up_on_what_it_missed(up: UpStack) -> None:
    key = await up.api_key("team-streams")
    before = await up.restarts("streams")
    async with up.http(key) as http, healthz_watched(up) as health:
        victim = up.pid("streams")
        os.kill(victim, signal.SIGKILL)
        # Interactive traffic does not need the streams app; its usage events wait for it.
        for i in range(5):
            response = await http.post("/v1/completions", json=_completion(f"streams_{i}"))
            assert response.status_code == 200, response.text
        await until(lambda: _equals(up.restarts("streams"), before + 1), 60, "the restart")
        caught_up = await _consumed_to_the_end(up, "laneway-streams", "laneway.usage")
        await until(caught_up, 90, "the restarted streams app to commit every usage event")
    assert up.pid("streams") != victim
    assert f"streams (pid {victim}) exited: killed by SIGKILL" in up.log()
    _always_answered(health)


async def _readyz(up: UpStack) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(base_url=up.base_url, timeout=10, headers=ADMIN) as http:
        response = await http.get("/readyz")
    return response.status_code, response.json()["checks"]


async def test_interactive_traffic_flows_while_redis_is_down_and_redis_comes_back_whole(
    up: UpStack,
) -> None:
    key = await up.api_key("team-redis")
    before = await up.restarts("redis")
    async with up.http(key) as http, healthz_watched(up) as health:
        assert (await http.post("/v1/completions", json=_completion("warm"))).status_code == 200
        with up.frozen_supervisor():
            victim = up.pid("redis")
            os.kill(victim, signal.SIGKILL)

            async def redis_reported_down() -> bool:
                return (await _readyz(up))[1]["redis"]["ok"] is False

            await until(redis_reported_down, 20, "/readyz to report Redis down")
            for i in range(5):  # the ingress's fallback: local limiter, replies through Kafka
                response = await http.post("/v1/completions", json=_completion(f"redis_{i}"))
                assert response.status_code == 200, response.text
        await until(lambda: _equals(up.restarts("redis"), before + 1), 30, "the restart")

        async def redis_reported_up() -> bool:
            return (await _readyz(up))[1]["redis"]["ok"] is True

        await until(redis_reported_up, 30, "/readyz to report Redis back")
        response = await http.post("/v1/completions", json=_completion("redis_after"))
        assert response.status_code == 200, response.text
    # Its data is on disk: the key made before the crash is still there.
    redis = aioredis.Redis.from_url(up.redis_url)
    try:
        assert await lookup_team(redis, KEYS, key) == "team-redis"
    finally:
        await redis.aclose()
    assert f"redis (pid {victim}) exited: killed by SIGKILL" in up.log()
    _always_answered(health)


async def test_readyz_reports_kafka_down_until_it_is_restarted(up: UpStack) -> None:
    key = await up.api_key("team-kafka")
    before = await up.restarts("kafka")
    async with up.http(key) as http, healthz_watched(up) as health:
        with up.frozen_supervisor():
            victim = up.pid("kafka")
            os.kill(victim, signal.SIGKILL)

            async def kafka_reported_down() -> bool:
                status, checks = await _readyz(up)
                return status == 503 and checks["kafka"]["ok"] is False

            await until(kafka_reported_down, 20, "/readyz to report Kafka down")
        await until(lambda: _equals(up.restarts("kafka"), before + 1), 60, "the restart")

        async def ready() -> bool:
            return (await _readyz(up))[0] == 200

        await until(ready, 60, "/readyz to report the stack ready again")
        response = await http.post("/v1/completions", json=_completion("kafka_after"))
        assert response.status_code == 200, response.text
    assert f"kafka (pid {victim}) exited: killed by SIGKILL" in up.log()
    _always_answered(health)


async def test_a_worker_that_gives_no_sign_of_life_is_killed_and_restarted(up: UpStack) -> None:
    """Every service beats into its watchdog file; a worker that stops (as a loop blocked for
    good would) is killed once LANEWAY_HANG_TIMEOUT_S has passed, and restarted."""
    for name in SERVICES:
        alive = up.data / "logs" / f"{name}.alive"
        first = alive.stat().st_mtime_ns
        await eventually(
            lambda a=alive, f=first: a.stat().st_mtime_ns != f,  # type: ignore[misc]
            10,
            f"a beat of {name}",
        )
    before = await up.restarts("worker-chat")
    victim = up.pid("worker-chat")
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        await until(lambda: _equals(up.restarts("worker-chat"), before + 1), 60, "the restart")
    finally:
        if process_runs(victim):
            os.kill(victim, signal.SIGKILL)
    assert time.monotonic() - stopped_at >= HANG_TIMEOUT_S
    assert f"worker-chat (pid {victim}) gave no sign of life for" in up.log()
    assert f"worker-chat (pid {victim}) exited: hung (no sign of life" in up.log()

    async def ready() -> bool:
        return (await _readyz(up))[0] == 200

    await until(ready, 60, "/readyz to report the stack ready again")


def test_the_up_line_comes_once_the_ingress_takes_connections(up: UpStack) -> None:
    assert up.after_the_up_line == "connected", up.log()


async def test_the_supervisors_metrics_carry_every_services_own_series(up: UpStack) -> None:
    """A user of `laneway up` sets no metrics port of a worker or the streams app (one port
    for all would clash): the supervisor's /metrics serves their series, by process."""
    key = await up.api_key("team-metrics")
    async with up.http(key) as http:
        served = await http.post("/v1/completions", json=_completion("metrics"))
    assert served.status_code == 200, served.text

    async def families_by_process() -> dict[str, set[str]]:
        async with httpx.AsyncClient() as scrape:
            text = (await scrape.get(up.metrics_url)).text
        found: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "process" in sample.labels:
                    found.setdefault(sample.labels["process"], set()).add(family.name)
        return found

    async def all_there() -> bool:
        found = await families_by_process()
        return all(name in found for name in SERVICES)

    await eventually(
        all_there, 30, "every service's series on the supervisor's /metrics", every_s=1.0
    )
    found = await families_by_process()
    assert "laneway_dispatch_queue" in found["worker-completion"]  # a worker's own
    assert "laneway_engine_capacity" in found["worker-batch"]
    assert "laneway_ingress_responses" in found["ingress"]  # counters lose their _total
    assert "laneway_streams_events" in found["streams"]


def _cli(up: UpStack, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI in the shell that ran `laneway up` (its port variables, no URLs)."""
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", *args],
        env={**up.env, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_the_cli_in_the_shell_of_a_stack_on_other_ports_reaches_that_stack(
    up: UpStack, tmp_path: Path
) -> None:
    assert "LANEWAY_REDIS_URL" not in up.env
    assert "LANEWAY_INGRESS_URL" not in up.env
    made = _cli(up, "keys", "create", "--team", "cli-shell")
    assert made.returncode == 0, made.stderr
    key = made.stdout.splitlines()[-1]
    async with up.http(key) as http:
        assert (await http.get("/v1/models")).status_code == 200
    # The batch commands go to the ingress on LANEWAY_PORT.
    lines = tmp_path / "one.jsonl"
    body = {"model": "laneway-code", "prompt": "def f():", "max_tokens": 4}
    line = {"custom_id": "only", "method": "POST", "url": "/v1/completions", "body": body}
    lines.write_text(json.dumps(line) + "\n")
    submitted = _cli(
        up,
        "batch",
        "submit",
        str(lines),
        "--endpoint",
        "/v1/completions",
        "--wait",
        LANEWAY_API_KEY=key,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "completed, 1 ok, 0 failed of 1" in submitted.stdout


def test_a_second_up_in_the_same_place_is_refused_and_the_first_runs_on(up: UpStack) -> None:
    second = _cli(up, "up")
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"laneway is already running on {up.data} (pid {up.process.pid})" in second.stderr
    ready = httpx.get(f"{up.base_url}/readyz", headers=ADMIN, timeout=5)
    assert ready.status_code == 200, ready.text


async def test_a_laneway_up_killed_outright_leaves_nothing_in_the_way_of_the_next(
    up: UpStack, tmp_path: Path
) -> None:
    """A kill -9 of the supervisor leaves its children running (each in a process group of
    its own); the next `laneway up` in the same place stops them and comes up. Last in this
    module: the module's stack is the new one from here on."""
    names = ["redis", "kafka", "ingress", "streams"]
    names += [f"worker-{pool}" for pool in ("completion", "chat", "batch")]
    before = {name: up.pid(name) for name in names}
    up.process.kill()
    up.process.wait()
    try:
        assert all(process_runs(pid) for pid in before.values()), before
        up.output = tmp_path / "again.out"
        with up.output.open("wb") as out:
            up.process = subprocess.Popen(  # noqa: ASYNC220 - started, not waited for
                [sys.executable, "-m", "ops.cli", "up"],
                env=up.env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        # Not /readyz: until the new stack stops them, the old ingress still answers it.
        up.after_the_up_line = "not seen"
        _connect_at_the_up_line(up, 180)
        assert up.after_the_up_line == "connected", up.log()
        _wait_ready(up, 120)
        assert "an earlier laneway up here was killed and left" in up.log()
        assert not [name for name, pid in before.items() if process_runs(pid)], up.log()
    finally:  # whatever failed, nothing of the killed stack outlives the test
        for pid in before.values():
            if process_runs(pid):
                os.kill(pid, signal.SIGKILL)
    key = await up.api_key("after-the-kill")  # Redis came back with its data, and serves
    async with up.http(key) as http:
        answer = await http.post("/v1/completions", json=_completion("after"))
    assert answer.status_code == 200, answer.text
