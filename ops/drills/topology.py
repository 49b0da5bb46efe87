"""The chaos drill's own local topology: a 3-node KRaft cluster (replication 3, min ISR 2),
Redis with an append-only file, two ingress replicas, two workers per pool on the simulated
engine, and the streams app, each on ports of its own above ``base_port``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient
from redis.exceptions import RedisError

from laneway.constants import POOLS, RedisKeys, Topics
from laneway.errors import ServiceError
from ops.group_members import GroupMembers
from ops.kafka_broker import Replication
from ops.kafka_cluster import KafkaCluster
from ops.kafka_topics import create_topics
from ops.redis_server import RedisServer
from ops.supervised import ServiceProcess

__all__ = ["ChaosTopology", "TopologyPlan"]

log = logging.getLogger(__name__)

_READY_WITHIN_S = 120.0
_STOP_GRACE_S = 15.0
# A process that exits on its own is started again after this, as a supervisor would.
_RESTART_AFTER_S = 1.0


@dataclass(frozen=True)
class TopologyPlan:
    """Sizes and settings of the topology."""

    # Below Linux's ephemeral range (32768-60999): there, the outgoing connections of the
    # topology's own clients could take a port of the block before its server binds it.
    base_port: int = 24000
    brokers: int = 3
    partitions: int = 4
    ingresses: int = 2
    workers_per_pool: int = 2
    session_timeout_ms: int = 6000
    batch_slots: int = 2  # sim engine slots of the batch workers: a job that lasts
    kafka_heap_mb: int = 384

    @property
    def redis_port(self) -> int:
        return self.base_port + 2 * self.brokers + 10

    def ingress_port(self, index: int) -> int:
        return self.base_port + 2 * self.brokers + 20 + index

    @property
    def last_port(self) -> int:
        return self.ingress_port(self.ingresses - 1)


@dataclass
class ChaosTopology:
    """Starts, breaks and stops the topology; ``events`` records what happened to it."""

    plan: TopologyPlan
    data_dir: Path
    started: float = field(default_factory=time.monotonic)
    events: list[tuple[float, str]] = field(default_factory=list)
    topics: Topics = field(default_factory=Topics)
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    # The streams app's id names its table changelogs, which the drill's count reads.
    streams_app_id: str = "laneway-chaos-streams"

    def __post_init__(self) -> None:
        plan = self.plan
        self.kafka = KafkaCluster(
            port=plan.base_port,
            data_dir=self.data_dir / "kafka",
            size=plan.brokers,
            heap_mb=plan.kafka_heap_mb,
            partitions=plan.partitions,
            replication=Replication(),
        )
        # Persistent: keys and team records outlive the restart the drill inflicts.
        self.redis = RedisServer(
            port=plan.redis_port, data_dir=self.data_dir / "redis", persistent=True
        )
        self.urls = [f"http://127.0.0.1:{plan.ingress_port(i)}" for i in range(plan.ingresses)]
        self.services: dict[str, ServiceProcess] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._meant_down: set[str] = set()  # exits the drill caused
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LANEWAY_")}
        env.update(
            LANEWAY_KAFKA_BOOTSTRAP=self.kafka.bootstrap,
            LANEWAY_REDIS_URL=self.redis.url,
            LANEWAY_LOG_LEVEL="INFO",
            # Batch budgets alike at any hour: off-peak, batch would borrow interactive budget.
            LANEWAY_QUOTA_OFFPEAK="",
        )
        for i in range(plan.ingresses):
            self._service(
                f"ingress-{i + 1}",
                "ingress",
                env,
                LANEWAY_PORT=str(plan.ingress_port(i)),
                LANEWAY_INSTANCE_ID=f"ingress-{i + 1}",
                LANEWAY_ADMIN_KEY=self.admin_key,
                # No synthetic probes: every request on the topics is one of the drill's.
                LANEWAY_PROBE_INTERVAL_S="0",
                # An answer that never comes ends as an error before the client gives up.
                LANEWAY_REPLY_TIMEOUT_S="45",
            )
        for pool in POOLS:
            for i in range(1, plan.workers_per_pool + 1):
                extra = {
                    "LANEWAY_POOL": pool,
                    "LANEWAY_WORKER_ID": f"{pool}-{i}",
                    "LANEWAY_ENGINE": "sim",
                    "LANEWAY_SESSION_TIMEOUT_MS": str(plan.session_timeout_ms),
                }
                if pool == "batch":
                    # The job runs beside the interactive load instead of yielding to it:
                    # the drill is about what survives the faults, not about priorities.
                    extra["LANEWAY_BATCH_YIELD_BACKLOG"] = "1000000"
                    extra["LANEWAY_SIM_BATCH_SLOTS"] = str(plan.batch_slots)
                    # Lines waiting for their team's budget beyond the first few wait without
                    # their bodies and are read back from Kafka when admitted.
                    extra["LANEWAY_BATCH_PARKED_BODIES"] = "16"
                self._service(f"worker-{pool}-{i}", "workers", env, **extra)
        self._service(
            "streams",
            "streams",
            env,
            LANEWAY_STREAMS_APP_ID=self.streams_app_id,
            LANEWAY_STREAMS_DATA_DIR=str(self.data_dir / "streams"),
            LANEWAY_STREAMS_REPLICATION_FACTOR="3",
            LANEWAY_SESSION_TIMEOUT_MS=str(plan.session_timeout_ms),
        )

    def _service(self, name: str, module: str, env: dict[str, str], **extra: str) -> None:
        self.services[name] = ServiceProcess(
            name, [sys.executable, "-m", module], {**env, **extra}, log_dir=self.data_dir / "logs"
        )

    @property
    def rollups_changelog(self) -> str:
        """The topic the streams app's hourly rollups table is kept in (Faust's name)."""
        return f"{self.streams_app_id}-rollups-changelog"

    def now(self) -> float:
        return time.monotonic() - self.started

    def note(self, text: str) -> None:
        self.events.append((self.now(), text))
        log.info("chaos: %s", text)

    # --- start and stop ----------------------------------------------------------------

    async def start(self) -> None:
        """Servers, topics (replication 3), then every service; returns once each ingress
        is ready and every pool's group has all its workers."""
        await asyncio.to_thread(self.kafka.start)
        await asyncio.to_thread(self.redis.start)
        specs = self.topics.specs(self.plan.partitions)
        await asyncio.to_thread(create_topics, self.kafka.bootstrap, specs, 3)
        for name in self.services:
            await self._start(name)
        await self._wait_ready()
        self.note(
            f"topology up: {self.plan.brokers} brokers, {len(self.urls)} ingresses, "
            f"{self.plan.workers_per_pool} workers per pool (sim engine), streams, Redis"
        )

    async def _start(self, name: str) -> None:
        self._meant_down.discard(name)
        service = self.services[name]
        await service.start()
        self._watchers[name] = asyncio.create_task(self._watch(name), name=f"watch-{name}")

    async def _watch(self, name: str) -> None:
        """A process that exits without the drill asking is started again (and noted)."""
        code = await self.services[name].wait()
        if name in self._meant_down:
            return
        self.note(f"{name} exited on its own (code {code}); starting it again")
        await asyncio.sleep(_RESTART_AFTER_S)
        if name not in self._meant_down:
            await self._start(name)

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_WITHIN_S
        async with httpx.AsyncClient(timeout=5.0) as http:
            for url in self.urls:

                async def ready(url: str = url) -> bool:
                    return await _ready(http, url)

                await _until(deadline, f"200 from {url}/readyz", ready)
        async with GroupMembers(self.kafka.bootstrap) as groups:
            for pool in POOLS:
                group = self.topics.consumer_group(pool)

                async def full(group: str = group) -> bool:
                    return await groups.count(group) >= self.plan.workers_per_pool

                await _until(deadline, f"all members of {group}", full)

    async def stop(self) -> None:
        """Stop every service, then the servers; safe when parts never started."""
        self._meant_down.update(self.services)
        for task in self._watchers.values():
            task.cancel()
        for service in self.services.values():
            if service.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(service.pid, signal.SIGCONT)  # a paused one must hear SIGTERM
        await asyncio.gather(
            *(s.stop(_STOP_GRACE_S) for s in self.services.values() if s.pid is not None)
        )
        await asyncio.to_thread(self.kafka.stop)
        await asyncio.to_thread(self.redis.stop)

    # --- faults --------------------------------------------------------------------------

    async def kill(self, name: str) -> None:
        """SIGKILL a service; it stays down until ``restart``."""
        self._meant_down.add(name)
        self.services[name].kill()
        await self.services[name].wait()

    async def restart(self, name: str) -> None:
        """Start a killed service again, with the same settings (a worker: the same id)."""
        await self._start(name)

    def pause(self, name: str) -> None:
        """SIGSTOP: alive to the kernel, silent to Kafka (no heartbeats, no commits)."""
        self._signal(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self._signal(name, signal.SIGCONT)

    def _signal(self, name: str, signum: int) -> None:
        pid = self.services[name].pid
        if pid is None:
            raise ServiceError(f"{name} does not run")
        os.kill(pid, signum)

    async def busiest(self, pool: str) -> str:
        """The worker process of ``pool`` that holds the most requests, by its heartbeat."""
        names = [f"{pool}-{i}" for i in range(1, self.plan.workers_per_pool + 1)]
        held = dict.fromkeys(names, -1)
        redis = aioredis.Redis.from_url(self.redis.url, socket_timeout=2.0)
        try:
            infos = await redis.mget([RedisKeys().worker_info(name) for name in names])
        except (RedisError, OSError):
            infos = []
        finally:
            await redis.aclose()
        for name, raw in zip(names, infos, strict=False):
            if raw:
                held[name] = int(orjson.loads(raw).get("inflight", 0))
        return f"worker-{max(names, key=lambda name: held[name])}"

    async def leaders(self) -> dict[int, tuple[int, int]]:
        """Per broker node: partitions it leads of the request topics and of the usage topic."""
        requests = [t for pool in POOLS for t in self.topics.pool_topics(pool)]
        admin = AIOKafkaAdminClient(bootstrap_servers=self.kafka.bootstrap)
        await admin.start()
        try:
            described = await admin.describe_topics([*requests, self.topics.usage])
        finally:
            await admin.close()
        counts = {node.node_id: [0, 0] for node in self.kafka.nodes}
        for topic in described:
            for partition in topic["partitions"]:
                leader = partition["leader"]
                if leader in counts:
                    counts[leader][topic["topic"] == self.topics.usage] += 1
        return {node: (req, usage) for node, (req, usage) in counts.items()}


async def _ready(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(f"{url}/readyz")).status_code == 200
    except httpx.HTTPError:
        return False


async def _until(deadline: float, what: str, check: Callable[[], Awaitable[bool]]) -> None:
    while True:
        try:
            if await check():
                return
        except Exception as exc:  # noqa: BLE001 - not there yet, whatever the reason
            log.debug("waiting for %s: %s", what, exc)
        if time.monotonic() > deadline:
            raise ServiceError(f"the chaos topology did not get ready: no {what} in time")
        await asyncio.sleep(0.5)
