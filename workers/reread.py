"""One record read again from Kafka by its offset, for a batch line whose body was let go.

A team far over its batch budget can have thousands of lines waiting beside the lane
(``workers.batch_budget``). Past a bound, a waiting line keeps only its place and its
reservation's size, and its body is read back from the topic, which still holds it (the
group's committed offset is below it), when its budget admits it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import OffsetOutOfRangeError

from laneway.clients import make_consumer, start_client
from laneway.settings import CommonSettings

__all__ = ["RecordGone", "RecordReader"]

# One read waits this long for the broker's answer before it is tried again.
_READ_TIMEOUT_MS = 5_000


class RecordGone(Exception):
    """The record is no longer in its partition (retention deleted it)."""


class RecordReader:
    """Reads single records by offset with a consumer of its own, outside any group; one
    read at a time. Started at its first read."""

    def __init__(self, settings: CommonSettings) -> None:
        self.settings = settings
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()

    async def read(self, tp: TopicPartition, offset: int) -> ConsumerRecord[Any, Any]:
        """The record at ``offset`` of ``tp``. ``RecordGone`` if the partition no longer
        holds it; a ``KafkaError`` or ``TimeoutError`` (the caller tries again) if the broker
        cannot say."""
        async with self._lock:
            consumer = await self._started()
            consumer.assign([tp])
            consumer.seek(tp, offset)
            try:
                fetched = await consumer.getmany(tp, timeout_ms=_READ_TIMEOUT_MS, max_records=1)
            except OffsetOutOfRangeError as exc:
                raise RecordGone(
                    f"{tp.topic}:{tp.partition} no longer holds offset {offset} (retention)"
                ) from exc
            for record in fetched.get(tp, []):
                if record.offset == offset:
                    return record
                # Past it: the offset holds no data record (never the case for a line that
                # was fetched from it once, short of a compacted topic).
                raise RecordGone(f"{tp.topic}:{tp.partition} has no record at {offset}")
            raise TimeoutError(f"no answer for {tp.topic}:{tp.partition}@{offset}")

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = make_consumer(
                self.settings,
                group_id=None,
                # As the lane reads them: a line of an aborted transaction never ran.
                isolation_level="read_committed",
                # A deleted record is reported, not replaced by another one.
                auto_offset_reset="none",
                # One line is wanted, not the megabyte after it (the broker still sends the
                # first record batch whole, however large).
                max_partition_fetch_bytes=64 * 1024,
            )
            try:
                await start_client(consumer)
            except BaseException:
                with contextlib.suppress(Exception):
                    await consumer.stop()
                raise
            self._consumer = consumer
        return self._consumer
