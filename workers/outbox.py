"""Where a finished request's outcome goes: its final reply, its settlement, its usage event.

The parts are separate (``workers.replies`` writes replies, ``workers.accounting`` charges);
this is the order they go in. The final reply and the settlement share one Redis round trip;
when Redis is not reached, the settlement is owed first (a failed Kafka send must not lose
the charge) and the reply goes through Kafka.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from redis.exceptions import RedisError

from laneway.constants import Topics
from laneway.schema import Reply, RequestEnvelope, UsageEvent
from quota import QuotaEnforcer
from workers.accounting import Accounting
from workers.replies import ReplyWriter, reply_command
from workers.round_trips import RoundTrips

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


class Outbox:
    def __init__(
        self,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        topics: Topics,
        quota: QuotaEnforcer | None = None,
        *,
        capture: bool = False,
    ) -> None:
        self.round_trips = RoundTrips(redis)
        self.replies = ReplyWriter(self.round_trips, producer, topics)
        self.accounting = Accounting(quota, producer, topics, self.round_trips)
        # Batch: final replies are kept for the lane, which writes them transactionally
        # with their usage events.
        self.capture = capture
        self.captured: dict[str, Reply] = {}

    async def finish(
        self, env: RequestEnvelope, final: Reply, usage: UsageEvent
    ) -> asyncio.Future[object] | None:
        """Final reply and quota settlement, delivered before return; the usage event is
        handed to the producer, and its delivery is returned for the caller to await before
        the request's offset may be committed (None: nothing to wait for)."""
        if self.capture:
            self.captured[env.id] = final
            await self._final_writes(env, final, usage)
            return None
        await self._final_writes(env, final, usage)
        return await self.accounting.send_usage(usage)

    async def send_usage(self, usage: UsageEvent) -> asyncio.Future[object]:
        return await self.accounting.send_usage(usage)

    async def _final_writes(self, env: RequestEnvelope, final: Reply, usage: UsageEvent) -> None:
        owed = self.accounting.settlement(env, usage)
        reply = [reply_command(env.reply_to, final)] if env.reply_to is not None else []
        commands = reply + self.accounting.commands(owed)
        if not commands:
            return
        results = await self.round_trips.send(commands)
        if results is not None:  # None: Redis not reached
            try:
                await self.accounting.settled(owed, results[len(reply) :])
                if reply and isinstance(results[0], Exception):
                    raise results[0]
            except (RedisError, OSError) as exc:
                log.info("a final Redis write failed (%s): through Kafka instead", exc)
            else:
                return
        if owed is not None:
            self.accounting.owe(owed)  # first: a failed Kafka send below must not lose it
        if env.reply_to is not None:
            await self.replies.via_kafka(env.reply_to, final)

    async def close(self) -> None:
        """Settlements owed since a Redis outage: one last try."""
        await self.accounting.close()
