"""Where a finished request's outcome goes: its final reply, its settlement, its usage event.

The parts are separate (``workers.replies`` writes replies, ``workers.accounting`` charges);
this is the order they go in. The final reply and the settlement share one Redis round trip;
when Redis is not reached, the settlement is owed first (a failed Kafka send must not lose
the charge) and the reply goes through Kafka. A client waits for that reply: when Kafka does
not take it either (an overloaded broker, a Redis that timed out under the same load), it is
tried again, through either, for ``FINAL_REPLY_PATIENCE_S``; a reply lost even so leaves the
usage event to go out all the same (the work was done), and the ingress answers its client
with a 504 when its wait ends.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.constants import Topics
from laneway.retry import Backoff
from laneway.schema import Reply, RequestEnvelope, UsageEvent
from quota import QuotaEnforcer
from workers.accounting import Accounting
from workers.replies import ReplyWriter, reply_command
from workers.round_trips import RoundTrips

__all__ = ["FINAL_REPLY_PATIENCE_S", "Outbox"]

log = logging.getLogger(__name__)

# How long a final reply that neither Redis nor Kafka took is tried again. Past it the
# worker's commits behind the request would wait on a reply few clients still want.
FINAL_REPLY_PATIENCE_S = 30.0


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
        try:
            await self._final_writes(env, final, usage)
        except KafkaError as exc:
            log.error(  # noqa: TRY400 - the broker's answer says it all: no traceback
                "final reply of %s not delivered in %.0f s (%r): its client gets a 504",
                env.id,
                FINAL_REPLY_PATIENCE_S,
                exc,
                extra={"request_id": env.id, "team": env.team},
            )
        if self.capture:
            return None
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
                if env.reply_to is not None:
                    self.replies.taken(env.reply_to, final)
                return
        if owed is not None:
            self.accounting.owe(owed)  # first: a failed Kafka send below must not lose it
        if env.reply_to is not None:
            await self._deliver(env.reply_to, final)

    async def _deliver(self, stream: str, final: Reply) -> None:
        """``final`` through Kafka (Redis did not take it), else again through whichever
        takes it, until ``FINAL_REPLY_PATIENCE_S`` has passed (then the last error)."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + FINAL_REPLY_PATIENCE_S
        backoff = Backoff(0.1, 2.0)
        attempt = self.replies.via_kafka
        while True:
            try:
                await attempt(stream, final)
            except KafkaError as exc:
                if loop.time() >= give_up_at:
                    raise
                log.warning("a final reply not delivered (%r): trying again", exc)
            else:
                return
            await backoff.wait()
            attempt = self.replies.reply  # Redis first, if it answers again

    async def close(self) -> None:
        """Replies being sent again after a Redis outage finished; settlements owed since
        then: one last try."""
        await self.replies.stop()
        await self.accounting.close()
