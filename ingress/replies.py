"""Replies from workers: one Redis stream per ingress instance, demultiplexed in-process.

A single reader task blocks on the stream (``XREAD BLOCK``) and hands each message to the
waiting request's channel, so a request costs no Redis call of its own while it waits. While
Redis does not answer (the process's Redis circuit is open), workers send replies through
the ``replies`` topic, which ``tail_kafka`` reads; the reader waits for the circuit to close
and goes on from where it was, so what reached the stream meanwhile is read too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from redis.exceptions import RedisError

from laneway.constants import REPLY_STREAM_TTL_S
from laneway.errors import MalformedMessage
from laneway.redis_circuit import circuit_of
from laneway.retry import Backoff
from laneway.schema import Reply, decode
from laneway.tasks import kept, stop_task

__all__ = ["ReplyChannel", "ReplyRouter"]

log = logging.getLogger(__name__)


# A message that comes ahead of text not yet here waits this long for that text: a worker
# whose replies switched between Redis and Kafka (Redis went away, or came back) sends on two
# paths that keep no order between them.
GAP_WAIT_S = 2.0


class ReplyChannel:
    """The replies of one request, in order, repeats dropped, and never a silent splice.

    A worker that crashed mid-request is replaced and runs it again from the start; each
    message's text offset ``at`` lets the channel pass on only text the client has not
    received (message numbers ``n`` for a worker that sends no offsets). The re-run must
    repeat the text already passed on (the engines run it with the same seed); where it does
    not, the client gets an explicit error instead of one run's beginning and another's end.
    A message whose text starts beyond what has been passed on is held until the text before
    it arrives, for ``gap_wait_s`` at most; then the answer ends with an error, never with a
    quiet hole.
    """

    def __init__(self, request_id: str, team: str, *, gap_wait_s: float = GAP_WAIT_S) -> None:
        self.request_id = request_id
        self.team = team
        self.gap_wait_s = gap_wait_s
        self._ready: deque[Reply] = deque()
        self._arrival: asyncio.Future[None] | None = None  # set by the next reply
        self._seen = 0  # characters of text passed on
        self._passed: list[str] = []  # that text, to check a re-run's repeat of it
        self._next = 0  # message number expected next (workers without offsets)
        self._held: dict[int, Reply] = {}  # messages ahead of a gap, by offset
        self._gap_timer: asyncio.TimerHandle | None = None
        self.broken = False  # ended with an error of its own: nothing more is passed on

    def feed(self, reply: Reply) -> None:
        if self.broken:
            return
        if reply.at is None:
            if reply.n < self._next:
                if not reply.done:
                    return  # a re-run repeating a message already passed on
                reply = reply.model_copy(update={"text": ""})
            self._next = reply.n + 1
            self._seen += len(reply.text)
            self._put(reply)
            return
        if reply.at > self._seen:
            if reply.done or reply.at not in self._held:  # a re-run's repeat keeps the first
                self._held[reply.at] = reply
            if self._gap_timer is None:
                self._wait_for_gap()
            return
        self._pass_on(reply)
        self._release_held()

    def _pass_on(self, reply: Reply) -> None:
        """A message that starts within the text passed on: its new part, if any."""
        at = reply.at or 0
        end = at + len(reply.text)
        if at < self._seen:
            repeat = reply.text[: self._seen - at]
            if repeat != "".join(self._passed)[at : at + len(repeat)]:
                self._break(
                    f"the answer of {self.request_id} was cut: its worker restarted, and the "
                    f"re-run's text differs from the {self._seen} characters already sent"
                )
                return
            if end <= self._seen and not reply.done:
                return  # a re-run repeating text already passed on
            fresh = reply.text[self._seen - at :] if end > self._seen else ""
            reply = reply.model_copy(update={"text": fresh, "at": self._seen})
        self._seen = max(self._seen, end)
        self._passed.append(reply.text)
        self._next = reply.n + 1
        self._put(reply)

    def _break(self, message: str) -> None:
        """End the answer with an error the client sees."""
        log.warning("%s", message, extra={"request_id": self.request_id})
        self.broken = True
        self.close()
        self._put(Reply(id=self.request_id, n=self._next, done=True, status="error", error=message))

    def _wait_for_gap(self) -> None:
        loop = asyncio.get_running_loop()
        self._gap_timer = loop.call_later(self.gap_wait_s, self._gap_never_filled)

    def _release_held(self) -> None:
        """Pass on the held messages the text has now reached; a gap still open after them
        gets a wait of its own."""
        released = False
        while self._held and (at := min(self._held)) <= self._seen:
            self._pass_on(self._held.pop(at))
            released = True
        if self._gap_timer is not None and (released or not self._held):
            self._gap_timer.cancel()
            self._gap_timer = None
            if self._held:
                self._wait_for_gap()

    def _gap_never_filled(self) -> None:
        """The text before the held messages never came (this ingress fell behind and its
        reply stream was trimmed, or a message was lost): the answer ends with an error."""
        self._gap_timer = None
        if not self._held:
            return
        self._break(
            f"the answer of {self.request_id} has a hole: its text {self._seen}..{min(self._held)} "
            "never arrived"
        )

    def close(self) -> None:
        """The request is over: nothing more is held for it."""
        self._held.clear()
        if self._gap_timer is not None:
            self._gap_timer.cancel()
            self._gap_timer = None

    def _put(self, reply: Reply) -> None:
        self._ready.append(reply)
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)

    def take(self) -> Reply | None:
        """The next reply, if one is waiting."""
        return self._ready.popleft() if self._ready else None

    def arrival(self) -> asyncio.Future[None]:
        """A future that is done once a reply waits (at once if one does). A bare future,
        not a task: the request's handler waits on it beside its client's disconnect, and
        cancels it when it stops waiting, so nothing is left behind."""
        future = asyncio.get_running_loop().create_future()
        if self._ready:
            future.set_result(None)
        self._arrival = future
        return future

    async def get(self, wait_s: float) -> Reply:
        """The next reply; TimeoutError after ``wait_s``."""
        if not self._ready:
            await asyncio.wait_for(self.arrival(), wait_s)
        return self._ready.popleft()


class ReplyRouter:
    """Reads this instance's reply stream and routes messages to open channels."""

    def __init__(self, redis: aioredis.Redis, stream: str, *, block_ms: int = 1000) -> None:
        self.redis = redis
        self.stream = stream
        self.block_ms = block_ms
        self._channels: dict[str, ReplyChannel] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_id = b"$"  # the reply stream read up to here ("$": what comes next)
        self.circuit = circuit_of(redis)
        self._reading = False  # the last read of the stream succeeded

    @property
    def healthy(self) -> bool:
        """Whether replies come through the stream (else through Kafka only)."""
        return self._reading and not self.circuit.open

    def open(self, request_id: str, team: str) -> ReplyChannel:
        channel = ReplyChannel(request_id, team)
        self._channels[request_id] = channel
        return channel

    def close(self, request_id: str) -> None:
        channel = self._channels.pop(request_id, None)
        if channel is not None:
            channel.close()

    def owner(self, request_id: str) -> str | None:
        """The team of a request waiting here, or None when this instance does not hold it."""
        channel = self._channels.get(request_id)
        return channel.team if channel is not None else None

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    async def start(self) -> None:
        if self._task is None:
            self._task = kept("reply-router", self._read_loop)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def _read_loop(self) -> None:
        last_id = self._last_id  # where a previous run of this loop (``kept``) got to
        backoff = Backoff(0.1, 2.0)
        refreshed = 0.0
        while True:
            await self.circuit.wait_closed()  # meanwhile replies come through Kafka
            try:
                if last_id == b"$":
                    last_id = await self.circuit.background(self._stream_end, timeout_s=None)
                    self._last_id = last_id
                now = time.monotonic()
                if now - refreshed > REPLY_STREAM_TTL_S / 10:
                    await self.circuit.background(
                        lambda: self.redis.expire(self.stream, REPLY_STREAM_TTL_S), timeout_s=None
                    )
                    refreshed = now
                # Not the hot timeout: the read blocks for block_ms when nothing comes. The
                # socket timeout bounds it; the request path never waits on it.
                read = partial(
                    self.redis.xread, {self.stream: last_id}, block=self.block_ms, count=1000
                )
                response: Any = await self.circuit.background(read, timeout_s=None)
                self._reading = True
                backoff.reset()
            except (RedisError, OSError) as exc:
                self._reading = False
                wait = backoff.next_wait()
                log.warning(
                    "reply stream %s unreadable (%s); retrying in %.1fs", self.stream, exc, wait
                )
                await asyncio.sleep(wait)
                continue
            for _stream, messages in response:
                for message_id, fields in messages:
                    last_id = self._last_id = message_id
                    self._dispatch(fields.get(b"d"))

    async def _stream_end(self) -> bytes:
        """The id after which to read: what is there now is for an earlier run."""
        info = (
            await self.redis.xinfo_stream(self.stream)
            if await self.redis.exists(self.stream)
            else None
        )
        return info["last-generated-id"] if info else b"0-0"

    @staticmethod
    async def tail_from_now(consumer: AIOKafkaConsumer, within_s: float = 30.0) -> None:
        """Fix where the Kafka tail starts before this instance takes requests.

        aiokafka looks "latest" up lazily, on the first fetch, and retries while a fresh
        topic's partitions have no leader yet; a reply a worker sent through Kafka before
        that lookup landed would be skipped, and its request left waiting for an answer."""
        async with asyncio.timeout(within_s):
            for partition in consumer.assignment():
                await consumer.position(partition)

    async def tail_kafka(self, consumer: AIOKafkaConsumer) -> None:
        """Replies that workers sent through Kafka while Redis was unreachable."""
        key = self.stream.encode()
        while True:
            batches = await consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                for record in records:
                    if record.key == key:
                        self._dispatch(record.value)

    def _dispatch(self, raw: bytes | None) -> None:
        try:
            reply = decode(Reply, raw)
        except MalformedMessage as exc:
            log.warning("skipped reply on %s: %s", self.stream, exc)
            return
        channel = self._channels.get(reply.id)
        if channel is not None:
            channel.feed(reply)
