"""Where a worker's output goes: reply streams in Redis, usage and results topics in Kafka.

Redis writes go through the process's Redis circuit (``laneway.redis_circuit``): they wait
the hot timeout at most, and none while the circuit is open. Then reply chunks travel on the
``replies`` Kafka topic instead (every ingress tails it), so interactive traffic keeps
flowing, and quota settlements are owed: kept, and sent once Redis answers again
(settlement is idempotent per request id, so one that did reach Redis is not charged twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner
from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError, RedisError

from laneway.constants import REPLY_STREAM_MAXLEN, Topics
from laneway.redis_circuit import circuit_of
from laneway.schema import Reply, RequestEnvelope, UsageEvent
from quota import QuotaEnforcer
from workers import metrics

__all__ = ["ChunkStream", "Outbox"]

log = logging.getLogger(__name__)

# Queues one writer's commands on the shared pipeline.
_Commands = Callable[[Pipeline], None]

# Owed settlements are sent in the background, one at a time, each within this long.
_OWED_SETTLE_TIMEOUT_S = 1.0
# Settlements owed at most: an outage's worth at thousands of requests a second. Beyond it
# the oldest are given up (and logged): a worker's memory is not the record, usage events are.
_MAX_OWED = 200_000
# A stopping worker tries to pay what it owes for this long at most.
_STOP_SETTLE_S = 5.0


@dataclass(frozen=True, slots=True)
class _Owed:
    """A settlement not known to have reached Redis."""

    team: str
    request_id: str
    tokens: int
    leased: int
    local: int
    accepted_ts: float


class Outbox:
    """Sends reply chunks to the ingress that holds the connection, and terminal records."""

    def __init__(
        self,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        topics: Topics,
        quota: QuotaEnforcer | None = None,
        *,
        capture: bool = False,
    ) -> None:
        self.redis = redis
        self.producer = producer
        self.topics = topics
        self.quota = quota
        # Batch: final replies are kept for the worker, which writes them transactionally.
        self.capture = capture
        self.captured: dict[str, Reply] = {}
        self.circuit = circuit_of(redis)
        self.circuit.listen(self._on_circuit)
        # Writes waiting for the next Redis round trip, and the task that makes it.
        self._queued: list[tuple[_Commands, asyncio.Future[list[Any] | None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.owed: dict[str, _Owed] = {}  # by request id, oldest first
        self._paying: asyncio.Task[int] | None = None
        self._partitioner = DefaultPartitioner()

    def _redis_usable(self) -> bool:
        return not self.circuit.open

    def _redis_failed(self, exc: BaseException) -> None:
        log.info("a Redis write failed (%s): through Kafka instead", exc)
        metrics.REDIS_FALLBACK.inc()

    def _on_circuit(self, opened: bool) -> None:
        if opened:
            log.warning("Redis does not answer: replies go through Kafka, settlements wait")
        else:
            self._pay_owed_soon()

    async def _reply_via_kafka(self, stream: str, reply: Reply) -> None:
        # A batch of its own, closed, goes out at once: the producer lingers for the usage
        # events (50 ms), and a client waits for this. The key's partition, as send() picks
        # it: one ingress's replies stay in order.
        key = stream.encode()
        topic = self.topics.replies
        partitions = sorted(await self.producer.partitions_for(topic))
        batch = self.producer.create_batch()
        batch.append(key=key, value=reply.to_json(), timestamp=None)
        batch.close()
        partition = self._partitioner(key, partitions, partitions)
        delivered = await self.producer.send_batch(batch, topic, partition=partition)
        await delivered

    async def reply(self, stream: str, reply: Reply) -> None:
        """A chunk for the ingress that holds the connection.

        Chunks that come together share one Redis round trip: one engine step gives every
        running sequence its next token at once, and a round trip per token and request is
        what a streaming worker would otherwise spend most of its time on.
        """
        if self._redis_usable():
            results = await self._round_trip(lambda pipe: _queue_reply(pipe, stream, reply))
            if results is not None:
                if not isinstance(results[0], Exception):
                    return
                self._redis_failed(results[0])
        await self._reply_via_kafka(stream, reply)

    async def _round_trip(self, queue: _Commands) -> list[Any] | None:
        """Commands that share the next Redis pipeline with all that is queued meanwhile
        (chunks, final replies, settlements of other requests); their results, or None when
        Redis was not reached."""
        done: asyncio.Future[list[Any] | None] = asyncio.get_running_loop().create_future()
        self._queued.append((queue, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="redis-writes")
        return await done

    async def _flush(self) -> None:
        """Send everything queued in one pipeline; what is queued meanwhile goes in the next."""
        while self._queued:
            batch, self._queued = self._queued, []
            counts: list[int] = []  # commands each writer queued
            results: list[Any] | None = None  # None: each writer falls back to Kafka
            try:
                if not self._redis_usable():
                    continue  # the batch before this one found Redis gone
                async with self.redis.pipeline(transaction=False) as pipe:
                    for queue, done in batch:
                        before = len(pipe.command_stack)
                        try:
                            queue(pipe)
                        except Exception as exc:  # noqa: BLE001 - that writer's own error
                            del pipe.command_stack[before:]
                            if not done.done():
                                done.set_exception(exc)
                        counts.append(len(pipe.command_stack) - before)
                    results = await self.circuit.hot(partial(pipe.execute, raise_on_error=False))
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
            except BaseException:
                # Cancelled (shutdown): nobody is left to write what was queued meanwhile.
                batch += self._queued
                self._queued = []
                raise
            finally:
                start = 0
                for i, (_, done) in enumerate(batch):
                    count = counts[i] if i < len(counts) else 0
                    if not done.done():
                        # Not reached, or queued while the batch was being cancelled: None.
                        mine = None
                        if results is not None and i < len(counts):
                            mine = results[start : start + count]
                        done.set_result(mine)
                    start += count

    async def finish(
        self, env: RequestEnvelope, final: Reply, usage: UsageEvent
    ) -> asyncio.Future[object] | None:
        """Final reply and quota settlement, delivered before return; the usage event is
        handed to the producer, and its delivery is returned for the caller to await before
        the request's offset may be committed (None: nothing to wait for)."""
        if self.capture:
            self.captured[env.id] = final
            await self._final_redis_writes(env, final, usage)
            return None
        await self._final_redis_writes(env, final, usage)
        return await self.send_usage(usage)

    async def send_usage(self, usage: UsageEvent) -> asyncio.Future[object]:
        """Hand a usage event to the producer; the future says when the broker stored it."""
        delivery: asyncio.Future[object] = await self.producer.send(
            self.topics.usage, usage.to_json(), key=usage.team.encode()
        )
        return delivery

    async def _final_redis_writes(
        self, env: RequestEnvelope, final: Reply, usage: UsageEvent
    ) -> None:
        """Final reply and settlement in one round trip."""
        owed = None
        if self.quota is not None and not env.shadow:  # a mirror reserved nothing: owes nothing
            owed = _Owed(
                env.team,
                env.id,
                usage.prompt_tokens + usage.completion_tokens,
                env.quota_leased,
                env.quota_local,
                env.accepted_ts,
            )
        if self._redis_usable():
            results = await self._round_trip(lambda pipe: self._queue_final(pipe, env, final, owed))
            if results is not None:  # None: Redis not reached
                try:
                    for result in results:
                        if isinstance(result, NoScriptError) and owed is not None:
                            # Redis restarted and lost its scripts; settle is idempotent.
                            await self.circuit.hot(lambda: self._settle(owed))
                        elif isinstance(result, Exception):
                            raise result
                except (RedisError, OSError) as exc:
                    self._redis_failed(exc)
                else:
                    if self.owed:
                        self._pay_owed_soon()  # Redis answers: what an outage left is due
                    return
        if owed is not None:
            self._owe(owed)  # first: a failed Kafka send below must not lose the charge
        if env.reply_to is not None:
            await self._reply_via_kafka(env.reply_to, final)

    def _queue_final(
        self, pipe: Pipeline, env: RequestEnvelope, final: Reply, owed: _Owed | None
    ) -> None:
        if env.reply_to is not None:
            _queue_reply(pipe, env.reply_to, final)
        if owed is not None and self.quota is not None:
            self.quota.queue_settle(
                pipe,
                owed.team,
                owed.request_id,
                owed.tokens,
                leased=owed.leased,
                local=owed.local,
                accepted_ts=owed.accepted_ts,
            )

    async def _settle(self, owed: _Owed) -> None:
        if self.quota is None:
            return  # nothing is owed without quotas
        await self.quota.settle(
            owed.team,
            owed.request_id,
            owed.tokens,
            leased=owed.leased,
            local=owed.local,
            accepted_ts=owed.accepted_ts,
        )

    def _owe(self, owed: _Owed) -> None:
        """Keep a settlement Redis may not have seen, to send once it answers (idempotent:
        one that did reach it is not charged again)."""
        if not self.owed:
            log.warning("quota settlements wait until Redis answers (from %s)", owed.request_id)
        self.owed[owed.request_id] = owed
        while len(self.owed) > _MAX_OWED:
            lost = self.owed.pop(next(iter(self.owed)))
            log.warning(
                "settlement of %s given up (over %d owed): %d tokens of team %r not charged",
                lost.request_id,
                _MAX_OWED,
                lost.tokens,
                lost.team,
            )
        if self._redis_usable():
            self._pay_owed_soon()  # one write failed, Redis still answers others

    def _pay_owed_soon(self) -> None:
        if self.owed and (self._paying is None or self._paying.done()):
            self._paying = asyncio.create_task(self.pay_owed(), name="owed-settlements")

    async def pay_owed(self) -> int:
        """Send the owed settlements, oldest first, until one fails; returns how many went."""
        paid = 0
        while self.owed:
            owed = next(iter(self.owed.values()))
            try:
                await self.circuit.background(
                    partial(self._settle, owed), timeout_s=_OWED_SETTLE_TIMEOUT_S
                )
            except (RedisError, OSError) as exc:
                log.info("owed settlements wait (%d): %s", len(self.owed), exc)
                break
            self.owed.pop(owed.request_id, None)
            paid += 1
        if paid:
            log.warning("%d owed settlements sent, %d still owed", paid, len(self.owed))
        return paid

    async def close(self) -> None:
        """Stop paying in the background; one last try for what is owed (5 s at most)."""
        paying, self._paying = self._paying, None
        if paying is not None:
            paying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await paying
        if self.owed and self._redis_usable():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_STOP_SETTLE_S):
                    await self.pay_owed()
        if self.owed:
            log.warning("%d quota settlements owed at stop are not charged", len(self.owed))


def _queue_reply(pipe: Pipeline, stream: str, reply: Reply) -> None:
    pipe.xadd(stream, {"d": reply.to_json()}, maxlen=REPLY_STREAM_MAXLEN, approximate=True)


class ChunkStream:
    """The streamed text of one request, written to its ingress one message at a time.

    The engine never waits for a write: text that arrives while one is in flight goes out
    together in the next, so a busy worker sends fewer, larger chunks instead of falling
    behind one token at a time. Each message carries its number ``n`` and its text's offset
    ``at``. If a write fails (Redis and Kafka both refused it), streaming stops and the text
    not yet written stays for the final reply.

    ``interval`` is the stream interval in tokens, as vLLM's and SGLang's
    ``--stream-interval``: after the first text, which goes at once, a message goes out only
    once ``interval`` tokens have come since the last one; the final reply carries the rest.
    Every message costs the worker, Redis, the ingress and the client a wake-up each, so a
    larger interval spends less CPU per token for a coarser stream.
    """

    def __init__(self, outbox: Outbox, stream: str, request_id: str, interval: int = 1) -> None:
        self._outbox = outbox
        self._stream = stream
        self._id = request_id
        self._interval = interval
        self._pending: list[str] = []
        self._tokens = 0  # tokens generated so far
        self._released: int | None = None  # tokens at the last message taken; None: none yet
        self.sent = 0  # characters written
        self.count = 0  # messages written
        self._wake = asyncio.Event()
        self._closing = False
        self._task = asyncio.create_task(self._write(), name=f"chunks-{request_id}")

    def add(self, text: str, tokens: int | None = None) -> None:
        """Text the engine generated; ``tokens``: the request's tokens so far (default: one
        more than before)."""
        self._pending.append(text)
        self._tokens = self._tokens + 1 if tokens is None else tokens
        if self._due():
            self._wake.set()

    def _due(self) -> bool:
        return bool(self._pending) and (
            self._released is None or self._tokens - self._released >= self._interval
        )

    async def _write(self) -> None:
        while not self._closing:
            if not self._due():
                self._wake.clear()
                await self._wake.wait()
                continue
            text = "".join(self._pending)
            self._pending.clear()
            self._released = self._tokens
            reply = Reply(id=self._id, n=self.count, at=self.sent, text=text)
            try:
                await self._outbox.reply(self._stream, reply)
            except KafkaError as exc:
                self._pending.insert(0, text)
                log.warning(
                    "streaming of %s stopped, its text goes with the final reply: %s",
                    self._id,
                    exc,
                    extra={"request_id": self._id},
                )
                return
            self.sent += len(text)
            self.count += 1

    async def close(self) -> tuple[int, int, str]:
        """Finish the write in flight; returns the messages and characters written and the
        text not yet written, which the caller sends with the final reply."""
        self._closing = True
        self._wake.set()
        await self._task
        rest = "".join(self._pending)
        self._pending.clear()
        return self.count, self.sent, rest

    def cancel(self) -> None:
        self._task.cancel()
