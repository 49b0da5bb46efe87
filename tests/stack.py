"""A live laneway stack for tests: real Kafka and Redis, in-process ingress and workers.

Each test gets its own topic and key prefix, so tests never see each other's records.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import redis.asyncio as aioredis
import uvicorn
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import murmur2

from ingress import create_app
from ingress.connections import server_config
from ingress.settings import IngressSettings
from laneway.apikeys import create_key
from laneway.redis_circuit import DEFAULT_FAILURES, DEFAULT_PROBE_INTERVAL_MS, attach_circuit
from laneway.schema import CancelRecord, RequestEnvelope
from ops.devstack import port_in_use
from ops.kafka_topics import create_topics
from quota.teams import Team, set_team
from workers.factory import create_worker
from workers.pool import PoolWorker
from workers.select import choose_engine
from workers.settings import WorkerSettings
from workers.sim import SimEngine
from workers.types import Engine, EngineRequest

PARTITIONS = 2


def partition_of(affinity: str) -> int:
    """The partition the producer's default partitioner gives records of ``affinity``."""
    return (murmur2(affinity.encode()) & 0x7FFFFFFF) % PARTITIONS


ROOT = Path(__file__).resolve().parent.parent
# The suite runs on two shared cores beside other suites: Redis itself may go without the
# CPU for 50 ms (the default hot timeout), which looks just like a Redis that hangs. Tests
# that are not about that must not see their requests fall back, so their stacks wait
# longer; the Redis-pause test (test_redis_pause.py) runs with the defaults.
TEST_HOT_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class Services:
    bootstrap: str
    redis_url: str
    # A secured broker: the admin principal's SASL options, which the stack's own set-up and
    # reads use (the components under test get principals of their own).
    admin_auth: dict[str, Any] = field(default_factory=dict)
    # The session broker's process, for the tests that freeze it (None: not ours to freeze).
    broker_pid: int | None = None

    def admin_settings(self) -> dict[str, Any]:
        """Settings fields that make a laneway client the admin principal (none if plain)."""
        if not self.admin_auth:
            return {}
        return {
            "kafka_security_protocol": self.admin_auth["security_protocol"],
            "kafka_username": self.admin_auth["sasl_plain_username"],
            "kafka_password": self.admin_auth["sasl_plain_password"],
        }


def free_port() -> int:
    """A TCP port nothing listens on now, below the kernel's ephemeral range: a port from
    that range (what binding port 0 gives) can be taken by any outgoing connection between
    this pick and the server's bind, and a bench beside the suite makes thousands (a Redis
    of `laneway up` once found its port taken so).

    Never the same port twice in one test process: picks made before any server binds (an
    ingress port and a metrics port for one `laneway up`) would otherwise collide now and
    then, and a `/readyz` once got the supervisor's metrics page. Under `make test`'s test
    processes (pytest-xdist) each picks from its own slice of the range, so two never race
    for one port."""
    low, ceiling = _port_range()
    for _ in range(200):
        port = random.randrange(low, ceiling)
        if port in _HANDED_OUT or port - 1 in _HANDED_OUT:  # port - 1: a pair's controller
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free port in {low}..{ceiling - 1}")


_LOWEST_TEST_PORT = 10_000
_HANDED_OUT: set[int] = set()


def xdist_process() -> tuple[int, int]:
    """This test process's index and the number of them (pytest-xdist's ``gw<i>`` workers;
    ``(0, 1)`` in a plain pytest run)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    return index, max(count, index + 1)


def _port_range() -> tuple[int, int]:
    """The ports this test process picks from: its slice of the range below the ephemeral
    ports."""
    index, count = xdist_process()
    low, ceiling = _LOWEST_TEST_PORT, _ephemeral_low()
    width = (ceiling - low) // count
    return low + index * width, low + (index + 1) * width


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: 32768 unless tuned)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return max(low, _LOWEST_TEST_PORT + 1000)


def free_port_pair() -> int:
    """A port whose successor is free too (the broker's controller listens on port + 1)."""
    for _ in range(50):
        port = free_port()
        if port < 65535 and port + 1 not in _HANDED_OUT and not port_in_use(port + 1):
            return port
    raise RuntimeError("no two adjacent free ports")


def free_port_block(count: int) -> int:
    """A port from which ``count`` consecutive ports are free (a cluster's nodes)."""
    for _ in range(50):
        port = free_port()
        block = range(port + 1, port + count)
        if port + count <= 65535 and not any(p in _HANDED_OUT or port_in_use(p) for p in block):
            _HANDED_OUT.update(block)
            return port
    raise RuntimeError(f"no {count} adjacent free ports")


def redis_client(url: str, **options: Any) -> aioredis.Redis:
    """A client for tests, whose circuit (shared by the components built on it, as in a
    process) waits ``TEST_HOT_TIMEOUT_MS``."""
    client = aioredis.Redis.from_url(url, **options)
    attach_circuit(
        client,
        hot_timeout_ms=TEST_HOT_TIMEOUT_MS,
        failures=DEFAULT_FAILURES,
        probe_interval_ms=DEFAULT_PROBE_INTERVAL_MS,
    )
    return client


def envelope(**fields: Any) -> RequestEnvelope:
    """A completion's envelope as the ingress would make it; ``fields`` override."""
    now = time.time()
    values: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex[:12]}",
        "team": "team-a",
        "cls": "completion",
        "band": "hi",
        "kind": "completion",
        "model": "laneway-code",
        "route": "laneway-code",
        "prompt": "def main():",
        "max_tokens": 64,
        "affinity": "s:doc",
        "reply_to": None,
        "accepted_ts": now,
        "deadline_ts": now + 30,
    }
    return RequestEnvelope(**{**values, **fields})


async def eventually(
    check: Callable[[], Any], within_s: float, what: str, *, every_s: float = 0.05
) -> Any:
    """Poll a sync or async ``check`` until it returns something truthy, and return that;
    ``TimeoutError`` naming ``what`` after ``within_s``. The one polling helper of the tests:
    what a test waits for is a condition, never a sleep."""
    deadline = time.monotonic() + within_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within_s}s waiting for {what}")
        await asyncio.sleep(every_s)


@contextlib.contextmanager
def frozen(pid: int, *, at_most_s: float = 60.0) -> Iterator[None]:
    """The process ``pid`` (the session's broker, say) stopped for the block; a timer thread
    lets it go after ``at_most_s`` whatever becomes of the test (a timeout raised in the event
    loop would leave the block's own ``finally`` unrun, and every later test on a frozen
    broker)."""
    thaw = threading.Timer(at_most_s, os.kill, (pid, signal.SIGCONT))
    thaw.daemon = True
    os.kill(pid, signal.SIGSTOP)
    thaw.start()
    try:
        yield
    finally:
        thaw.cancel()
        os.kill(pid, signal.SIGCONT)


async def clear_of_the_hour_turn(needed_s: float, *, into_hour_s: float = 0.0) -> None:
    """Return once at least ``needed_s`` seconds are left in this UTC hour, waiting for the
    next hour if fewer are, and at least ``into_hour_s`` seconds of it have gone. Usage is
    rolled up by hour, so live traffic that a test counts as "this hour" is split in two
    when the hour turns mid-test: the split is right, the count the test expects is not.
    Costs nothing in most runs, at most ``needed_s`` + ``into_hour_s`` + 1 s (a test that
    may wait longer than the suite's 120 s hang guard allows raises its own)."""
    into = time.time() % 3600
    if 3600 - into < needed_s:
        await asyncio.sleep(3600 - into + 1)
        into = time.time() % 3600
    if into < into_hour_s:
        await asyncio.sleep(into_hour_s - into)


class Ingress:
    def __init__(self, settings: IngressSettings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        # The server as ``python -m ingress`` runs it (its protocol, its grace).
        config = server_config(
            self.app, settings, host="127.0.0.1", port=0, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> Any:
        return self.app.state.laneway

    async def start(self) -> None:
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._task = asyncio.create_task(self.server.serve())
        await eventually(lambda: self.server.started or self._task.done(), 30, "ingress start")  # type: ignore[union-attr]
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._task is not None:
            self.server.should_exit = True
            await self._task
            self._task = None


class LiveStack:
    def __init__(self, services: Services, prefix: str) -> None:
        self.services = services
        self.prefix = prefix
        self.common: dict[str, Any] = {
            "kafka_bootstrap": services.bootstrap,
            "redis_url": services.redis_url,
            "topic_prefix": prefix,
            "redis_prefix": prefix,
            "redis_hot_timeout_ms": TEST_HOT_TIMEOUT_MS,
            **services.admin_settings(),
        }
        self.redis = redis_client(services.redis_url)
        self.ingresses: list[Ingress] = []
        self.workers: list[PoolWorker] = []
        self._clients: list[Any] = []

    @property
    def topics(self) -> Any:
        return IngressSettings(**self.common).topics

    async def create_topics(self) -> None:
        await asyncio.to_thread(
            create_topics,
            self.services.bootstrap,
            self.topics.specs(PARTITIONS),
            1,
            self.services.admin_auth,
        )

    async def start_ingress(self, **overrides: Any) -> Ingress:
        # Probes would add their own usage events; tests that want them turn them on.
        options = {"probe_interval_s": 0, **overrides}
        settings = IngressSettings(**{**self.common, **options})
        ingress = Ingress(settings)
        await ingress.start()
        self.ingresses.append(ingress)
        return ingress

    def worker_settings(self, pool: str = "completion", **overrides: Any) -> WorkerSettings:
        options: dict[str, Any] = {
            "pool": pool,
            "engine": "sim",
            "worker_id": f"{self.prefix}-{pool}-{len(self.workers)}",
            "sim_prefill_ms_per_token": 0.0,
            "sim_decode_ms_per_step": 0.0,
            "heartbeat_interval_s": 0.5,
            "commit_interval_ms": 50,
            "drain_grace_s": 2.0,
        }
        options.update(overrides)
        return WorkerSettings(**{**self.common, **options})

    async def start_worker(
        self,
        pool: str = "completion",
        *,
        engine: Engine | str | None = None,
        wait_assigned: bool = True,
        **overrides: Any,
    ) -> PoolWorker:
        """A worker of ``pool``; ``engine`` is an engine object or the engine setting."""
        if isinstance(engine, str):
            overrides["engine"], engine = engine, None
        settings = self.worker_settings(pool, **overrides)
        worker = create_worker(settings, engine or choose_engine(settings)[0])
        await worker.start()
        self.workers.append(worker)
        if wait_assigned:
            await eventually(
                lambda: bool(worker.consumer.assignment()), 30, f"{pool} worker assignment"
            )
        return worker

    async def api_key(self, team: str = "team-a", **team_fields: Any) -> str:
        if team_fields:
            await set_team(
                self.redis, IngressSettings(**self.common).keys, Team(team, **team_fields)
            )
        return await create_key(self.redis, IngressSettings(**self.common).keys, team)

    def http(self, ingress: Ingress, key: str | None = None, **kwargs: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        kwargs.setdefault("timeout", 30)
        client = httpx.AsyncClient(base_url=ingress.base_url, headers=headers, **kwargs)
        self._clients.append(client)
        return client

    def sdk(self, ingress: Ingress, key: str) -> openai.AsyncOpenAI:
        """The official SDK on ``ingress`` with ``key`` (no retries: a test sees each
        answer), closed when the stack stops."""
        client = openai.AsyncOpenAI(base_url=ingress.base_url + "/v1", api_key=key, max_retries=0)
        self._clients.append(client)
        return client

    def track(self, client: Any) -> None:
        """Close ``client`` (aclose, close or stop) when the stack stops."""
        self._clients.append(client)

    async def producer(self) -> AIOKafkaProducer:
        producer = AIOKafkaProducer(
            bootstrap_servers=self.services.bootstrap, **self.services.admin_auth
        )
        await producer.start()
        self._clients.append(producer)
        return producer

    async def send_records(self, *records: RequestEnvelope | CancelRecord) -> None:
        """Store ``records`` as the ingress does: requests on their class and band's topic
        keyed by affinity, tombstones on the cancel topic keyed by request id; in order."""
        producer = await self.producer()
        for record in records:
            if isinstance(record, CancelRecord):
                topic, key = self.topics.cancel, record.id
            else:
                topic, key = self.topics.request(record.cls, record.band), record.affinity
            await producer.send_and_wait(topic, record.to_json(), key=key.encode())

    async def usage_counts(self, ids: set[str]) -> Counter[str]:
        """How many usage events of each of ``ids`` the topic holds now."""
        events = await self.read_all(self.topics.usage, where=lambda e: e["id"] in ids)
        return Counter(e["id"] for e in events)

    async def usage_of(self, *ids: str) -> dict[str, dict[str, Any]]:
        """The usage event of each of ``ids``, by id (fails unless every one arrives)."""
        wanted = set(ids)
        events = await self.read_topic(
            self.topics.usage, count=len(wanted), where=lambda e: e["id"] in wanted
        )
        assert {e["id"] for e in events} == wanted
        return {e["id"]: e for e in events}

    def _reader(self, topic: str) -> AIOKafkaConsumer:
        """A consumer of every partition of ``topic`` from its start, outside any group."""
        return AIOKafkaConsumer(
            topic,
            bootstrap_servers=self.services.bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            isolation_level="read_committed",
            **self.services.admin_auth,
        )

    async def read_topic(
        self,
        topic: str,
        *,
        count: int,
        within_s: float = 20.0,
        where: Callable[[dict[str, Any]], bool] | None = None,
    ) -> list[dict[str, Any]]:
        """The first ``count`` JSON records of ``topic`` (matching ``where``), from the start.

        Fewer than ``count`` within ``within_s`` fails: a slow consumer must never pass for an
        absent record. To see what a topic holds now (absence, or "at most"), ``read_all``.
        """
        consumer = self._reader(topic)
        await consumer.start()
        found: list[dict[str, Any]] = []
        try:
            deadline = time.monotonic() + within_s
            while len(found) < count and time.monotonic() < deadline:
                batches = await consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for record in records:
                        value = orjson.loads(record.value)
                        if where is None or where(value):
                            found.append(value)
        finally:
            await consumer.stop()
        if len(found) < count:
            raise AssertionError(f"{topic}: {len(found)} of {count} records within {within_s}s")
        return found[:count]

    async def read_all(
        self,
        topic: str,
        *,
        within_s: float = 20.0,
        where: Callable[[dict[str, Any]], bool] | None = None,
    ) -> list[dict[str, Any]]:
        """Every JSON record ``topic`` holds now (matching ``where``): read up to the end
        offsets the broker reports at the start, however long the fetches take (up to
        ``within_s``), so what it leaves out was not written by then."""
        consumer = self._reader(topic)
        await consumer.start()  # waits for the topic's metadata; no group: every partition
        found: list[dict[str, Any]] = []
        try:
            ends = await consumer.end_offsets(list(consumer.assignment()))
            if not ends:
                raise LookupError(f"topic {topic} has no partitions")
            deadline = time.monotonic() + within_s
            while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{topic}: not read to its end within {within_s}s")
                batches = await consumer.getmany(timeout_ms=200)
                found.extend(orjson.loads(r.value) for rs in batches.values() for r in rs)
        finally:
            await consumer.stop()
        return found if where is None else [value for value in found if where(value)]

    def process_env(self, **extra: str) -> dict[str, str]:
        """Environment of a laneway subprocess on this stack's broker, Redis and prefixes."""
        environ = {k: v for k, v in os.environ.items() if not k.startswith("LANEWAY_")}
        environ.update(
            PYTHONPATH=str(ROOT),
            LANEWAY_KAFKA_BOOTSTRAP=self.services.bootstrap,
            LANEWAY_REDIS_URL=self.services.redis_url,
            LANEWAY_TOPIC_PREFIX=self.prefix,
            LANEWAY_REDIS_PREFIX=self.prefix,
            LANEWAY_REDIS_HOT_TIMEOUT_MS=str(TEST_HOT_TIMEOUT_MS),
        )
        environ.update(extra)  # a test may set any of the above its own way
        return environ

    async def cli(self, *argv: str, **extra: str) -> tuple[int, str]:
        """``laneway <argv>`` run on this stack: its exit code and its output (both streams)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ops.cli",
            *argv,
            env=self.process_env(**extra),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode()

    def spawn(self, module: str, **extra: str) -> subprocess.Popen[bytes]:
        """``python -m module`` (ingress, workers, streams) as a real process of this stack."""
        return subprocess.Popen(
            [sys.executable, "-m", module], env=self.process_env(**extra), cwd=ROOT
        )

    async def stop(self) -> None:
        for client in reversed(self._clients):
            for closer in ("aclose", "close", "stop"):
                if hasattr(client, closer):
                    await _stops(type(client).__name__, getattr(client, closer)())
                    break
        for ingress in self.ingresses:
            await _stops("ingress", ingress.stop())
        for worker in self.workers:
            await _stops(f"{worker.pool} worker", worker.stop(grace_s=1.0))
        await self.redis.aclose()
        await _stops("topic deletion", self._delete_topics())

    async def _delete_topics(self) -> None:
        """Delete this test's topics (its prefix's, its streams app's changelogs too): a
        broker that kept every test's (hundreds of stacks, thousands of partitions) took
        three times as long to create the next test's, and twice the CPU when idle."""
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.services.bootstrap, **self.services.admin_auth
        )
        await admin.start()
        try:
            ours = [t for t in await admin.list_topics() if t.startswith(self.prefix)]
            if ours:
                await admin.delete_topics(ours)
        finally:
            await admin.close()


async def _stops(name: str, stopping: Coroutine[Any, Any, None], within_s: float = 30.0) -> None:
    """Await a component's stop; one that hangs fails the test by name, with every task's
    stack printed, instead of running into the suite's timeout."""
    stop = asyncio.ensure_future(stopping)
    done, _ = await asyncio.wait({stop}, timeout=within_s)
    if not done:
        for task in asyncio.all_tasks():  # the stuck stop's stack among them
            print(await_chain(task), file=sys.stderr)
        stop.cancel()
        raise AssertionError(f"{name} did not stop within {within_s:.0f} s")
    stop.result()


def await_chain(task: asyncio.Task[Any]) -> str:
    """A task and everything it awaits, down to the innermost future: ``print_stack`` shows
    a coroutine task's outermost frame only, which does not say where it is stuck."""
    lines = [f"{task!r} awaits:"]
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
        if frame is None:
            lines.append(f"    {awaited!r}")
            break
        lines.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    return "\n".join(lines)


async def status_before_the_body_ends(
    port: int, path: str, content_type: str, first_chunk: bytes
) -> bytes:
    """The status line a server sends to a chunked POST of ``path`` whose body has begun
    (``first_chunk``) and not ended: an answer that does not wait for the whole body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: laneway\r\nTransfer-Encoding: chunked\r\n".encode()
            + f"Content-Type: {content_type}\r\n\r\n".encode()
            + f"{len(first_chunk):x}\r\n".encode()
            + first_chunk
            + b"\r\n"
        )
        await writer.drain()  # and nothing more: the body has not ended
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()


def long_prompt(
    min_tokens: int, *, route: str = "laneway-code", max_tokens: int = 128, chat: bool = False
) -> str:
    """A prompt whose deterministic sim answer has at least ``min_tokens`` tokens."""
    for i in range(1000):
        prompt = f"def handler_{i}(request):"
        text = f"user: {prompt}\nassistant: " if chat else prompt
        if sim_answer_tokens(text, route=route, max_tokens=max_tokens) >= min_tokens:
            return prompt
    raise ValueError(f"no prompt with a {min_tokens}-token answer")


def sim_answer_tokens(prompt: str, *, route: str = "laneway-code", max_tokens: int = 128) -> int:
    """How many tokens the simulated engine answers ``prompt`` with, run to its end: a
    request stopped early got fewer."""
    request = EngineRequest(id="probe", route=route, prompt=prompt, max_tokens=max_tokens)
    return len(SimEngine()._completion_words(request))
