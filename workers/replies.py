"""Replies to the ingress that holds a request's connection.

Each ingress reads its own Redis stream. While Redis is not reached (its circuit open, or a
write lost), replies travel on the ``replies`` Kafka topic instead, which every ingress
tails, so interactive traffic keeps flowing. Chunks share Redis round trips with each other
and with final replies and settlements (``workers.round_trips``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner

from laneway.constants import REPLY_STREAM_MAXLEN, REPLY_STREAM_TTL_S, Topics
from laneway.logs import described
from laneway.schema import Reply
from workers import metrics
from workers.round_trips import Command, RoundTrips

__all__ = ["ChunkStream", "ReplyWriter", "final_reply_commands", "reply_command"]

log = logging.getLogger(__name__)

# A reply Redis took just before it stopped answering may never have been read: the ingress's
# next XREAD waits on the stopped server like everything else, past the request's deadline.
# When the circuit opens, the replies Redis took in the last REPLAY_S before its last answer
# go again through Kafka; the ingress drops what it already has (a repeat, or a closed
# request). Bounded: a stream's chunks in that second are at most this many.
REPLAY_S = 1.0
_REPLAY_MAX = 4096


def reply_command(stream: str, reply: Reply) -> Command:
    """The XADD of one reply to an ingress's stream (trimmed, approximately)."""
    return ("XADD", stream, "MAXLEN", "~", str(REPLY_STREAM_MAXLEN), "*", "d", reply.to_json())


def final_reply_commands(stream: str, reply: Reply) -> list[Command]:
    """A request's final reply: its XADD, then an EXPIRE of a stream that has none. An XADD
    to the stream of an ingress gone for longer than its TTL makes the stream again, and
    nothing else would ever expire it; a request's last write is enough to give it one (its
    chunks go without: one command each, not two)."""
    return [reply_command(stream, reply), ("EXPIRE", stream, str(REPLY_STREAM_TTL_S), "NX")]


class ReplyWriter:
    """Writes a request's replies to its ingress: through Redis, or else through Kafka."""

    def __init__(self, round_trips: RoundTrips, producer: AIOKafkaProducer, topics: Topics) -> None:
        self.round_trips = round_trips
        self.producer = producer
        self.topics = topics
        self._partitioner = DefaultPartitioner()
        self._taken: deque[tuple[float, str, Reply]] = deque(maxlen=_REPLAY_MAX)
        self._replay: asyncio.Task[None] | None = None
        round_trips.circuit.listen(self._on_circuit)

    def _on_circuit(self, opened: bool) -> None:
        if not opened:
            return
        log.warning("Redis does not answer: replies go through Kafka, settlements wait")
        recent = [(stream, reply) for _, stream, reply in self._taken]
        self._taken.clear()
        if recent:
            self._replay = asyncio.get_running_loop().create_task(
                self._send_again(recent), name="replies-again"
            )

    def taken(self, stream: str, reply: Reply) -> None:
        """Redis took ``reply``: kept for ``REPLAY_S`` in case Redis stops before it is read."""
        now = time.monotonic()
        while self._taken and self._taken[0][0] < now - REPLAY_S:
            self._taken.popleft()
        self._taken.append((now, stream, reply))

    async def _send_again(self, recent: list[tuple[str, Reply]]) -> None:
        for stream, reply in recent:
            try:
                await self.via_kafka(stream, reply)
            except KafkaError as exc:
                log.warning(
                    "%d replies Redis took before it stopped not sent again: %s",
                    len(recent),
                    described(exc),
                )
                return
        log.info("%d replies Redis took before it stopped sent again through Kafka", len(recent))

    async def stop(self) -> None:
        """Finish sending again what Redis took before it stopped (the worker is stopping)."""
        if self._replay is not None:
            with contextlib.suppress(Exception):
                await self._replay

    async def reply(self, stream: str, reply: Reply) -> None:
        """A chunk for the ingress that holds the connection."""
        results = await self.round_trips.send([reply_command(stream, reply)])
        if results is not None:
            if not isinstance(results[0], Exception):
                self.taken(stream, reply)
                return
            log.info("a reply's Redis write failed (%s): through Kafka instead", results[0])
        await self.via_kafka(stream, reply)

    async def via_kafka(self, stream: str, reply: Reply) -> None:
        """The reply on the ``replies`` topic, keyed by the ingress's stream."""
        metrics.REDIS_FALLBACK.inc()
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

    def __init__(
        self,
        writer: ReplyWriter,
        stream: str,
        request_id: str,
        interval: int = 1,
        *,
        call_ids: dict[str, str] | None = None,
    ) -> None:
        self._writer = writer
        self._stream = stream
        self._id = request_id
        self._interval = interval
        self._call_ids = call_ids  # a chat with tools: its calls' ids, as they begin
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
            ids = dict(self._call_ids) if self._call_ids else None
            reply = Reply(id=self._id, n=self.count, at=self.sent, text=text, call_ids=ids)
            try:
                await self._writer.reply(self._stream, reply)
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
