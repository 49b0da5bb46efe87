"""The cancel tombstones a worker acts on, from two feeds.

The compacted topic ``laneway.cancel`` is the record: every worker of every pool reads all of
it (replayed at start) and it is the only path while Redis is away. The ingress also publishes
each tombstone on a Redis channel, which brings it a Kafka hop sooner to a request already
running. A tombstone seen on both changes nothing the second time: applying one is the
worker's business (``apply``), this module only delivers them, decoded, exactly as read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.errors import MalformedMessage
from laneway.redis_circuit import circuit_of
from laneway.retry import Backoff
from laneway.schema import CancelRecord, decode
from workers import metrics

__all__ = ["CancelFeed", "backlog"]

log = logging.getLogger(__name__)

# Redis's channel is read in waits this long, so a circuit that opened is noticed.
_POLL_S = 1.0


class CancelFeed:
    def __init__(
        self,
        *,
        pool: str,
        consumer: AIOKafkaConsumer,
        redis: aioredis.Redis,
        channel: str,
        fetch_pause_s: float,
        apply: Callable[[CancelRecord], Awaitable[None]],
        after_fetch: Callable[[], None],
        stopping: asyncio.Event,
    ) -> None:
        self.pool = pool
        self.consumer = consumer
        self.redis = redis
        self.channel = channel
        self.fetch_pause_s = fetch_pause_s
        self.apply = apply
        self.after_fetch = after_fetch  # called after each fetch (expiry of old ones)
        self.stopping = stopping

    async def topic_loop(self) -> None:
        """Read ``laneway.cancel``. Once caught up, in batches: every worker of every pool
        reads all tombstones, and a fetch for each would cost the broker and each worker a
        round trip, while the Redis channel has brought the same tombstone a moment after it
        was sent. A lone tombstone still comes at once (the fetch is a long poll)."""
        while True:
            batches = await self.consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                for record in records:
                    await self._deliver(record.value, record.topic, f"@{record.offset}")
            self.after_fetch()
            # Caught up: nothing left behind the records just read (a replay is not).
            if self.fetch_pause_s and batches and not await backlog(self.consumer, batches):
                await asyncio.sleep(self.fetch_pause_s)

    async def redis_loop(self) -> None:
        """Read the Redis channel. While Redis does not answer (its circuit open) the loop
        waits, then subscribes anew: a subscription that lived through a partition may be
        dead without a word."""
        circuit = circuit_of(self.redis)
        backoff = Backoff(0.5, 10.0)
        # The stop flag too: redis-py's timed read swallows a cancellation now and then.
        while not self.stopping.is_set():
            await circuit.wait_closed()
            closings = circuit.closings
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.channel)
                    backoff.reset()
                    while circuit.closings == closings and not circuit.open:
                        if self.stopping.is_set():
                            return
                        message = await pubsub.get_message(timeout=_POLL_S)
                        if message is not None:
                            await self._deliver(message["data"], self.channel)
            except (RedisError, OSError) as exc:
                log.info("early cancels paused (%s); the cancel topic still carries them", exc)
                await backoff.wait()

    async def _deliver(self, raw: bytes | None, source: str, at: str = "") -> None:
        try:
            cancel = decode(CancelRecord, raw)
        except MalformedMessage as exc:
            metrics.MALFORMED.labels(self.pool, source).inc()
            log.warning("skipped cancel record on %s%s: %s", source, at, exc)
            return
        await self.apply(cancel)


async def backlog(consumer: AIOKafkaConsumer, partitions: Iterable[TopicPartition]) -> int:
    """Records on ``partitions`` past the consumer's position, as of its last fetch."""
    behind = 0
    for tp in partitions:
        high = consumer.highwater(tp)
        if high is None:
            continue
        with contextlib.suppress(KafkaError, AssertionError):
            behind += max(0, high - await consumer.position(tp))
    return behind
