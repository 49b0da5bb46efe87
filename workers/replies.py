"""Where a worker's output goes: reply streams in Redis, usage and results topics in Kafka.

While Redis is unreachable, reply chunks travel on the ``replies`` Kafka topic instead
(every ingress tails it), so interactive traffic keeps flowing; quota settlement is then
skipped (the reservation expires with its hash) and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError, RedisError

from laneway.constants import REPLY_STREAM_MAXLEN, Topics
from laneway.schema import Reply, RequestEnvelope, UsageEvent
from quota import QuotaEnforcer
from workers import metrics

__all__ = ["ChunkStream", "Outbox"]

log = logging.getLogger(__name__)

# Queues one writer's commands on the shared pipeline.
_Commands = Callable[[Pipeline], None]

# After a Redis failure, replies go through Kafka for this long before Redis is tried again,
# so the chunks of one request do not alternate between two paths.
_REDIS_RETRY_S = 5.0


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
        self._redis_down_until = 0.0
        # Writes waiting for the next Redis round trip, and the task that makes it.
        self._queued: list[tuple[_Commands, asyncio.Future[list[Any] | None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    def _redis_usable(self) -> bool:
        return time.monotonic() >= self._redis_down_until

    def _redis_failed(self, exc: BaseException) -> None:
        if self._redis_usable():
            log.warning("Redis unreachable (%s): replies go through Kafka for now", exc)
        self._redis_down_until = time.monotonic() + _REDIS_RETRY_S
        metrics.REDIS_FALLBACK.inc()

    async def _reply_via_kafka(self, stream: str, reply: Reply) -> None:
        await self.producer.send_and_wait(self.topics.replies, reply.to_json(), key=stream.encode())

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
                    results = await pipe.execute(raise_on_error=False)
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
        actual = usage.prompt_tokens + usage.completion_tokens
        if self._redis_usable():

            def queue(pipe: Pipeline) -> None:
                if env.reply_to is not None:
                    _queue_reply(pipe, env.reply_to, final)
                if self.quota is not None:
                    self.quota.queue_settle(
                        pipe,
                        env.team,
                        env.id,
                        actual,
                        leased=env.quota_leased,
                        accepted_ts=env.accepted_ts,
                    )

            results = await self._round_trip(queue)
            if results is not None:  # None: Redis not reached
                try:
                    for result in results:
                        if isinstance(result, NoScriptError) and self.quota is not None:
                            # Redis restarted and lost its scripts; settle is idempotent.
                            await self.quota.settle(
                                env.team,
                                env.id,
                                actual,
                                leased=env.quota_leased,
                                accepted_ts=env.accepted_ts,
                            )
                        elif isinstance(result, Exception):
                            raise result
                except (RedisError, OSError) as exc:
                    self._redis_failed(exc)
                else:
                    return
        if env.reply_to is not None:
            await self._reply_via_kafka(env.reply_to, final)
        log.warning(
            "quota not settled for %s (Redis unreachable)", env.id, extra={"request_id": env.id}
        )


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
