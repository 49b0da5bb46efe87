"""One record read again from Kafka by its offset, for a batch line whose body was let go.

A team far over its batch budget can have thousands of lines waiting beside the lane
(``workers.batch_budget``). Past a bound, a waiting line keeps only its place and its
reservation's size, and its body is read back from the topic, which still holds it (the
group's committed offset is below it), when its budget admits it.

A team's parked lines are admitted in the order they came, so the next line asked for most
often follows the last one on its partition: the records a fetch brings past the one asked
for (up to 64 kB of them) are kept, the latest fetch of each of the last partitions read,
and a drain takes one fetch per few dozen lines instead of one per line. A kept record is
served even if retention deleted it since: it was in the topic when fetched. An offset
without a kept record is asked of the broker, and what is kept of a partition is let go
when the worker no longer owns it, or when the caller finds a kept record is not the line
it wanted (the topic deleted and made anew): ``forget``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import OffsetOutOfRangeError

from laneway.clients import make_consumer, start_client
from laneway.settings import CommonSettings
from workers import metrics

__all__ = ["RecordGone", "RecordReader"]

# One read waits this long for the broker's answer before it is tried again.
_READ_TIMEOUT_MS = 5_000
# The latest fetch is kept for this many partitions, the least recently read let go first,
# and for fewer while their records' keys and values add up to more than _KEPT_BYTES (the
# latest kept whole, however large): a fetch is 64 kB, but the broker sends a partition's
# first record batch whole, up to a megabyte (a batch line's bound) or the topic's
# max.message.bytes, and 16 of those would be 16 MB or more.
_KEPT_PARTITIONS = 16
_KEPT_BYTES = 4 * 1024 * 1024


class RecordGone(Exception):
    """The record is no longer in its partition (retention deleted it)."""


class RecordReader:
    """Reads single records by offset with a consumer of its own, outside any group; one
    read at a time, the records each fetch brings kept (see the module). Started at its
    first read."""

    def __init__(self, settings: CommonSettings) -> None:
        self.settings = settings
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        self._kept: OrderedDict[TopicPartition, _Fetched] = OrderedDict()
        self._kept_bytes = 0
        # The partition of the fetch under way (one at a time), and whether it was
        # forgotten meanwhile: then what it brings answers its read and is not kept.
        self._fetching: TopicPartition | None = None
        self._fetch_forgotten = False

    async def read(self, tp: TopicPartition, offset: int) -> ConsumerRecord[Any, Any]:
        """The record at ``offset`` of ``tp``. ``RecordGone`` if the partition no longer
        holds it; a ``KafkaError`` or ``TimeoutError`` (the caller tries again) if the broker
        cannot say."""
        async with self._lock:
            kept = self._kept.get(tp)
            record = None if kept is None else kept.records.get(offset)
            if record is not None:
                self._kept.move_to_end(tp)
                return record
            # Not kept, or kept without a data record there (a transaction's marker or an
            # aborted line, or a fetch of a topic since deleted and made anew): the broker
            # is asked.
            self._fetching, self._fetch_forgotten = tp, False
            try:
                fetched = await self._fetch(tp, offset)
            finally:
                self._fetching = None
            if not self._fetch_forgotten:
                self._keep(tp, fetched)
            record = fetched.records.get(offset)
            if record is None:
                # No data record there (never the case for a line that was fetched from it
                # once, short of a compacted topic).
                raise RecordGone(f"{tp.topic}:{tp.partition} has no record at {offset}")
            return record

    def forget(self, partitions: set[TopicPartition]) -> None:
        """What was kept of ``partitions`` is let go (the worker no longer owns them, or a
        kept record turned out not to be the one at that offset now)."""
        if self._fetching in partitions:
            self._fetch_forgotten = True
        for tp in partitions:
            self._drop(tp)

    def _keep(self, tp: TopicPartition, fetched: _Fetched) -> None:
        self._drop(tp)
        self._kept[tp] = fetched
        self._kept_bytes += fetched.size
        # The latest fetch stays, however large.
        while len(self._kept) > 1 and (
            len(self._kept) > _KEPT_PARTITIONS or self._kept_bytes > _KEPT_BYTES
        ):
            _, oldest = self._kept.popitem(last=False)
            self._kept_bytes -= oldest.size

    def _drop(self, tp: TopicPartition) -> None:
        dropped = self._kept.pop(tp, None)
        if dropped is not None:
            self._kept_bytes -= dropped.size

    async def _fetch(self, tp: TopicPartition, offset: int) -> _Fetched:
        consumer = await self._started()
        # Assigned anew, so unpaused (see below).
        consumer.assign([tp])
        consumer.seek(tp, offset)
        try:
            fetched = await consumer.getmany(tp, timeout_ms=_READ_TIMEOUT_MS)
        except OffsetOutOfRangeError as exc:
            self._drop(tp)
            raise RecordGone(
                f"{tp.topic}:{tp.partition} no longer holds offset {offset} (retention)"
            ) from exc
        finally:
            # No fetch ahead: the consumer would ask for the records after these once they
            # are handed over, for the next read's ``assign`` to throw away, and an idle
            # reader would long-poll the broker. Paused before this task yields, so before
            # the consumer's fetch task runs again.
            consumer.pause(tp)
        records = fetched.get(tp, [])
        if not records:
            raise TimeoutError(f"no answer for {tp.topic}:{tp.partition}@{offset}")
        metrics.BATCH_READ_BACK_FETCHES.inc()
        return _Fetched(records)

    async def close(self) -> None:
        self._kept.clear()
        self._kept_bytes = 0
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
                # The few dozen lines after the one wanted, not the megabyte after it (the
                # broker still sends the first record batch whole, however large).
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


class _Fetched:
    """One fetch of a partition: the data records it brought, by offset (an offset in
    between without one held a transaction marker, or an aborted transaction's record)."""

    def __init__(self, records: list[ConsumerRecord[Any, Any]]) -> None:
        self.records = {record.offset: record for record in records}
        self.size = sum(len(record.value or b"") + len(record.key or b"") for record in records)
