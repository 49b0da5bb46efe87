"""Where a finished request's outcome goes: its final reply, its settlement, its usage event.

The parts are separate (``workers.replies`` writes replies, ``workers.accounting`` charges);
this is the order they go in. The final reply and the settlement share one Redis round trip;
when Redis is not reached, the settlement is owed first (a failed Kafka send must not lose
the charge) and the reply goes through Kafka. A client waits for that reply: when Kafka does
not take it either (an overloaded broker, a Redis that timed out under the same load), it is
tried again, through either, for ``FINAL_REPLY_PATIENCE_S``; a reply lost even so leaves the
usage event to go out all the same (the work was done), and the ingress answers its client
with a 504 when its wait ends.

An interactive request's usage event also rides in that round trip, held in Redis until the
broker stores it (``release``): a worker that stops between the two (SIGKILL, a crash) has
answered its client and charged the team, and the request's offset is not committed. The
partition's next owner finds the held event (``held_usage``) and sends it again instead of
running the request a second time, which would find it stale and record a drop instead of
the tokens the client got.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.constants import RedisKeys, Topics
from laneway.errors import MalformedMessage
from laneway.logs import described
from laneway.retry import Backoff
from laneway.schema import Reply, RequestEnvelope, UsageEvent, decode
from quota import QuotaEnforcer
from workers.accounting import Accounting
from workers.replies import ReplyWriter, final_reply_commands
from workers.round_trips import RoundTrips

__all__ = ["FINAL_REPLY_PATIENCE_S", "Outbox"]

log = logging.getLogger(__name__)

# How long a final reply that neither Redis nor Kafka took is tried again. Past it the
# worker's commits behind the request would wait on a reply few clients still want.
FINAL_REPLY_PATIENCE_S = 30.0
# How long a usage event is held in Redis at most: a partition's next owner reads it within
# this (a session timeout and a restart, a backlog's wait); one released when the broker
# stored it (the usual) is gone within ``_RELEASE_EVERY_S``.
USAGE_HELD_MS = 15 * 60 * 1000
_RELEASE_EVERY_S = 0.5
# Held events this worker keeps track of at most: far more than its requests in flight.
_MAX_HELD = 100_000


class Outbox:
    def __init__(
        self,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        topics: Topics,
        quota: QuotaEnforcer | None = None,
        *,
        capture: bool = False,
        keys: RedisKeys | None = None,
    ) -> None:
        self.round_trips = RoundTrips(redis)
        self.replies = ReplyWriter(self.round_trips, producer, topics)
        self.accounting = Accounting(quota, producer, topics, self.round_trips)
        self._expire_refused = False  # Redis refused a reply stream's EXPIRE NX (before 7.0)
        # Batch: final replies are kept for the lane, which writes them transactionally
        # with their usage events.
        self.capture = capture
        self.captured: dict[str, Reply] = {}
        # Where usage events are held until stored (None: not held; batch needs not).
        self.keys = None if capture else keys
        # Request ids whose event Redis holds, oldest first (bounded: one never released
        # expires in Redis all the same).
        self._held: dict[str, None] = {}
        self._releasing: list[str] = []
        self._releaser: asyncio.Task[None] | None = None

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
        reply = final_reply_commands(env.reply_to, final) if env.reply_to is not None else []
        settle = self.accounting.commands(owed)
        commands = reply + settle
        if not commands:
            return
        if self.keys is not None:
            held = self.keys.usage_held(env.id)
            commands.append(("SET", held, usage.to_json(), "PX", str(USAGE_HELD_MS)))
        results = await self.round_trips.send(commands)
        if results is not None:  # None: Redis not reached
            if self.keys is not None:
                self._note_held(env.id, results[-1])
            if reply and isinstance(results[1], Exception) and not self._expire_refused:
                self._expire_refused = True  # said once
                log.warning(
                    "Redis refused EXPIRE … NX on a reply stream (%s): laneway needs Redis 7.0 "
                    "or newer, or the streams of ingress replicas that went away stay",
                    results[1],
                )
            try:
                await self.accounting.settled(owed, results[len(reply) : len(reply) + len(settle)])
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

    def _note_held(self, request_id: str, result: object) -> None:
        if isinstance(result, Exception):  # full (noeviction), say: a crash then re-runs it
            log.info("usage event of %s not held in Redis: %s", request_id, described(result))
        else:
            self._held[request_id] = None
            if len(self._held) > _MAX_HELD:
                del self._held[next(iter(self._held))]

    def release(self, request_id: str) -> None:
        """The broker stored ``request_id``'s usage event: Redis need not hold it (its keys
        go in one UNLINK every ``_RELEASE_EVERY_S``)."""
        if request_id in self._held:
            del self._held[request_id]
            self._unlink_soon(request_id)

    def _unlink_soon(self, request_id: str) -> None:
        self._releasing.append(request_id)
        if self._releaser is None or self._releaser.done():
            self._releaser = asyncio.create_task(self._release_soon(), name="usage-release")

    async def _release_soon(self) -> None:
        await asyncio.sleep(_RELEASE_EVERY_S)
        await self._release_now()

    async def _release_now(self) -> None:
        ids, self._releasing = self._releasing, []
        if not ids or self.keys is None:
            return
        # Not reached or refused: each expires (USAGE_HELD_MS), and a next owner that finds
        # one sends a usage event the streams app has counted already (by id: once).
        results = await self.round_trips.send([("UNLINK", *map(self.keys.usage_held, ids))])
        if results is None or isinstance(results[0], Exception):
            log.info("%d held usage events not released: they expire", len(ids))

    def release_held(self, request_id: str) -> None:
        """A held event found and sent again (``held_usage``): Redis need not hold it."""
        self._unlink_soon(request_id)

    async def held_usage(self, request_id: str) -> UsageEvent | None:
        """The usage event Redis holds for ``request_id`` (a worker answered it and stopped
        before the broker stored the event); None when none is held, or Redis does not
        answer (the request then runs again, as it would without this)."""
        if self.keys is None:
            return None
        key = self.keys.usage_held(request_id)
        try:
            raw = await self.round_trips.circuit.hot(lambda: self.round_trips.redis.get(key))
        except (RedisError, OSError) as exc:
            log.info("held usage event of %s not read: %s", request_id, described(exc))
            return None
        if raw is None:
            return None
        try:
            usage = decode(UsageEvent, raw)
        except MalformedMessage as exc:
            log.warning("held usage event of %s not readable: %s", request_id, exc)
            return None
        return usage if usage.id == request_id else None

    async def close(self) -> None:
        """Replies being sent again after a Redis outage finished; settlements owed since
        then: one last try; held usage events the broker stored: released."""
        if self._releaser is not None:
            self._releaser.cancel()
        with contextlib.suppress(RedisError, OSError):
            await self._release_now()
        await self.replies.stop()
        await self.accounting.close()
