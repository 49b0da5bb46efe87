"""One transactional producer per input partition of the batch lane: zombie fencing.

aiokafka's transactional offset commit has no consumer-generation fencing (KIP-447), so a
worker expelled from the group but still alive (a long pause, a SIGSTOP) could commit the
results of a partition that now belongs to another. Naming the transactional id after the
partition fixes that as Kafka Streams did before KIP-447: the owner's producer starts with
``init_transactions``, which bumps the id's epoch and fences every other producer of it, so
the zombie's next commit for that partition fails with ``ProducerFenced``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced

from laneway.clients import make_producer
from workers.batch import KafkaRecord
from workers.settings import WorkerSettings

__all__ = ["PartitionTransactions"]

log = logging.getLogger(__name__)


class PartitionTransactions:
    """A started transactional producer for each partition this worker owns."""

    def __init__(self, settings: WorkerSettings, group: str) -> None:
        self.settings = settings
        self.group = group
        self._producers: dict[TopicPartition, AIOKafkaProducer] = {}
        # One open at a time: the commit loop may ask for a partition whose producer the
        # assignment is still starting, and a second producer of it would fence the first
        # (which then leaks, never closed).
        self._opening = asyncio.Lock()

    def transactional_id(self, tp: TopicPartition) -> str:
        return f"{self.settings.topic_prefix}.batch.{self.group}.{tp.topic}.{tp.partition}"

    def has(self, tp: TopicPartition) -> bool:
        return tp in self._producers

    async def open(self, partitions: Iterable[TopicPartition]) -> None:
        """Start (and so fence every other instance of) the producers of ``partitions``."""
        async with self._opening:
            await self._open(partitions)

    async def _open(self, partitions: Iterable[TopicPartition]) -> None:
        _quiet_fences(asyncio.get_running_loop())
        for tp in partitions:
            if tp not in self._producers:
                producer = make_producer(self.settings, transactional_id=self.transactional_id(tp))
                # Shielded: aiokafka's bootstrap leaves its connection open when cancelled
                # in it, so a cancel (the worker closing) lets the start end, then stops it.
                start = asyncio.ensure_future(producer.start())
                try:
                    await asyncio.shield(start)
                except BaseException:
                    with contextlib.suppress(BaseException):
                        await start
                    with contextlib.suppress(KafkaError):
                        await producer.stop()
                    raise
                self._producers[tp] = producer

    async def close(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in list(partitions):
            producer = self._producers.pop(tp, None)
            if producer is not None:
                with contextlib.suppress(KafkaError):
                    await producer.stop()

    async def close_all(self) -> None:
        await self.close(list(self._producers))

    async def commit(
        self, tp: TopicPartition, records: list[KafkaRecord], offset: int, metadata: str = ""
    ) -> None:
        """``records`` and the input offset (with ``metadata``: the lines above it answered,
        ``workers.answered``) they complete, in one transaction. Raises
        ``ProducerFenced`` when another instance owns the partition now (or this worker has
        no producer for it: one is started only when the group assigns the partition, never
        here, or a worker that woke up late would fence the partition's real owner)."""
        producer = self._producers.get(tp)
        if producer is None:
            raise ProducerFenced(f"no transactional producer for {tp.topic}:{tp.partition}")
        try:
            async with producer.transaction():
                for topic, key, value in records:
                    await producer.send(topic, value, key=key)
                await producer.send_offsets_to_transaction({tp: (offset, metadata)}, self.group)
        except AssertionError as exc:
            # aiokafka asserts when a fenced producer (its transaction state fatal) is asked
            # for another transaction: it is fenced all the same.
            raise ProducerFenced(f"{tp.topic}:{tp.partition}: {exc}") from exc


def _quiet_fences(loop: asyncio.AbstractEventLoop) -> None:
    """A fenced producer leaves its fence on futures nobody awaits (its transaction's end,
    its records' deliveries), and asyncio logs each as an error with a traceback when they
    are collected: several alarming errors for one fence, which the lane handles and logs
    once ("fenced by its new owner"). Those go to the debug log; anything else as before."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiets_fences", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), ProducerFenced) and "future" in context:
            log.debug("a fenced producer's %s", context.get("message", "future"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.quiets_fences = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)
