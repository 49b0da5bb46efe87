"""Health probes: a synthetic request per pool through the whole chain, on a timer.

Completion and chat probes go ingress → Kafka → worker → reply stream like any request;
the batch probe is a one-line job whose result must appear on the results topic. Each
result is a metric, a record on ``laneway.control`` and a line of ``/readyz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner
from redis.exceptions import RedisError

from laneway.apikeys import hash_key
from laneway.clients import make_consumer, start_client
from laneway.constants import POOLS, RequestClass
from laneway.errors import ProbeFailed
from laneway.metrics import PROBE_LATENCY, PROBE_SUCCESS
from laneway.schema import BatchRequest, RequestEnvelope
from laneway.tasks import kept, stop_task

if TYPE_CHECKING:
    from ingress.state import IngressState

__all__ = ["PROBE_TEAM", "ProbeResult", "Prober"]

log = logging.getLogger(__name__)

PROBE_TEAM = "laneway-probe"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    latency_s: float
    ts: float
    error: str | None = None


class Prober:
    def __init__(self, state: IngressState) -> None:
        self.state = state
        self.settings = state.settings
        self.results: dict[str, ProbeResult] = {}
        self._task: asyncio.Task[None] | None = None
        # The batch probes' reader of the results, one for all of them: a consumer per probe
        # paid a bootstrap each time, and a probe's timeout could cut that start short.
        self._results: AIOKafkaConsumer | None = None

    async def start(self) -> None:
        if self.settings.probe_interval_s > 0 and self._task is None:
            self._results = make_consumer(self.settings, isolation_level="read_committed")
            await start_client(self._results)
            self._task = kept("prober", self._loop)
        with contextlib.suppress(RedisError, OSError):
            await self._forget_legacy_key()

    async def _forget_legacy_key(self) -> None:
        """Versions before this one kept the probe key in plain text: it goes, and so does
        the key."""
        state = self.state
        stored = await state.redis.get(state.keys.legacy_probe_key())
        if stored is not None:
            key = stored.decode() if isinstance(stored, bytes) else str(stored)
            await state.redis.delete(
                state.keys.api_key(hash_key(key)), state.keys.legacy_probe_key()
            )
            log.info("removed the plain-text probe key older versions stored")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)
        results, self._results = self._results, None
        if results is not None:
            await results.stop()

    async def _loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(pool) for pool in POOLS))
            await asyncio.sleep(self.settings.probe_interval_s)

    async def probe(self, pool: RequestClass) -> ProbeResult:
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s):
                if pool == "batch":
                    await self._probe_batch()
                else:
                    await self._probe_interactive(pool)
            result = ProbeResult(True, time.monotonic() - started, time.time())
        except (TimeoutError, KafkaError, RedisError, OSError, ProbeFailed) as exc:
            error = str(exc) or f"no answer within {self.settings.probe_timeout_s}s"
            result = ProbeResult(False, time.monotonic() - started, time.time(), error)
            log.warning("probe of pool %s failed: %s", pool, error)
        self.results[pool] = result
        PROBE_SUCCESS.labels(pool).set(1 if result.ok else 0)
        PROBE_LATENCY.labels(pool).set(result.latency_s)
        await self._announce(pool, result)
        return result

    async def _probe_interactive(self, pool: RequestClass) -> None:
        state = self.state
        now = state.clock.now()
        env = RequestEnvelope(
            id=f"probe-{secrets.token_hex(8)}",
            team=PROBE_TEAM,
            cls=pool,
            kind="completion" if pool == "completion" else "chat",
            model=self.settings.models[0],
            route=self.settings.models[0],
            prompt="probe",
            max_tokens=1,
            affinity=f"probe:{secrets.token_hex(4)}",
            reply_to=state.reply_stream,
            ingress=state.incarnation,
            accepted_ts=now,
            deadline_ts=now + self.settings.probe_timeout_s,
        )
        channel = state.replies.open(env.id, env.team)
        try:
            await state.admission.produce(env)
            while True:
                reply = await channel.get(self.settings.probe_timeout_s)
                if reply.done:
                    if reply.status != "ok":
                        raise ProbeFailed(f"{reply.status}: {reply.error}")
                    return
        finally:
            state.replies.close(env.id)

    async def _probe_batch(self) -> None:
        state = self.state
        job = f"probe_{secrets.token_hex(6)}"
        line = BatchRequest(
            job_id=job,
            line_id="probe",
            team=PROBE_TEAM,
            url="/v1/completions",
            body={"model": self.settings.models[0], "prompt": "probe", "max_tokens": 1},
        )
        topic = state.topics.results_batch
        partitions = sorted(await state.producer.partitions_for(topic))
        tp = TopicPartition(topic, DefaultPartitioner()(job.encode(), partitions, partitions))
        consumer = self._results
        if consumer is None:
            raise ProbeFailed("the prober is not started")
        try:
            consumer.assign([tp])
            await consumer.seek_to_end(tp)
            await consumer.position(tp)
            await state.producer.send_and_wait(
                state.topics.request("batch"), line.to_json(), key=f"{job}:probe".encode()
            )
            while True:
                batches = await consumer.getmany(tp, timeout_ms=200)
                for record in batches.get(tp, []):
                    if record.key == job.encode():
                        status = orjson.loads(record.value).get("status")
                        if status != "ok":
                            raise ProbeFailed(f"batch probe ended {status}")
                        return
        finally:
            consumer.unsubscribe()  # nothing fetched between probes

    async def _announce(self, pool: str, result: ProbeResult) -> None:
        subject = f"probe:{pool}"
        record = {
            "v": 1,
            "kind": "probe",
            "subject": subject,
            "pool": pool,
            "ok": result.ok,
            "latency_ms": round(result.latency_s * 1000, 2),
            "error": result.error,
            "ingress": self.settings.instance_id,
            "ts": result.ts,
        }
        with contextlib.suppress(KafkaError):
            await self.state.producer.send(
                self.state.topics.control, orjson.dumps(record), key=subject.encode()
            )
