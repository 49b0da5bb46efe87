"""What differs between pools, as a lane: the worker's fetch, dispatch and runs are one; how a
record becomes work, what a finished run leaves behind and how offsets are committed are the
lane's.

- ``InteractiveLane`` (completion, chat): a record is a request envelope; a run's outcome
  went to its client already; offsets are committed with the consumer.
- ``BatchLane`` (``workers.batch_lane``): a record is a batch line; results and usage events
  are written in a transaction with the offsets they complete.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from laneway.errors import MalformedMessage
from laneway.schema import RequestEnvelope, UsageEvent, decode
from workers import metrics
from workers.dispatch import Work

if TYPE_CHECKING:
    from workers.pool import PoolWorker

__all__ = ["InteractiveLane", "Lane", "Rebalance", "commit_loop", "skip_record"]

log = logging.getLogger(__name__)


class Lane(Protocol):
    # Clients wait for its work (completion, chat), or nobody does (batch).
    interactive: bool

    def consumer_options(self) -> dict[str, Any]:
        """The lane's own options of the worker's consumer."""
        ...

    def subscribe(self, listener: ConsumerRebalanceListener) -> None:
        """Subscribe the worker's consumer to the lane's topics."""
        ...

    async def accept(
        self, tp: TopicPartition, record: ConsumerRecord[Any, Any]
    ) -> RequestEnvelope | None:
        """A fetched record as the work to run; None when it is done with already."""
        ...

    async def before_queue(self, work: Work) -> bool:
        """Whether ``work`` queues for the engine now; False: the lane holds it and queues
        it itself later."""
        ...

    def finished(self, work: Work, usage: UsageEvent) -> None:
        """``work`` ran to its end (or was reported dropped) with ``usage``."""
        ...

    def ended(self, work: Work) -> None:
        """``work`` left this worker unanswered: its partition went away while it ran, or its
        outcome could not be reported."""
        ...

    def after_dispatch(self) -> None:
        """The dispatcher handed work to the engine, or found none to hand."""
        ...

    async def commit(self, only: set[TopicPartition] | None = None) -> None:
        """Commit the offsets below each partition's lowest unfinished record."""
        ...

    async def assigned(self, partitions: set[TopicPartition]) -> None: ...

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        """Taken away by a rebalance: commit what is done, and the worker forgets the rest
        (``Runs.forget``): the next owner runs it."""
        ...

    def forgot(self, partitions: set[TopicPartition], gone: list[Work]) -> None:
        """The worker forgot ``partitions``; ``gone``: their work that had not started."""
        ...

    async def after_beat(self) -> None:
        """Once per heartbeat."""
        ...

    async def close(self) -> None:
        """The worker stops: after its last commit."""
        ...


def skip_record(pool: str, tp: TopicPartition, offset: int, exc: Exception) -> None:
    """A record that is not a request: counted, logged, and its offset moves on."""
    metrics.MALFORMED.labels(pool, tp.topic).inc()
    log.warning("skipped %s:%d@%d: %s", tp.topic, tp.partition, offset, exc)


class InteractiveLane:
    """Completion and chat: requests whose clients wait for them."""

    interactive = True

    def __init__(self, worker: PoolWorker) -> None:
        self.worker = worker

    def consumer_options(self) -> dict[str, Any]:
        return {"metadata_max_age_ms": 300_000, "isolation_level": "read_uncommitted"}

    def subscribe(self, listener: ConsumerRebalanceListener) -> None:
        topics = self.worker.topics.pool_topics(self.worker.settings.pool)
        self.worker.consumer.subscribe(topics, listener=listener)

    async def accept(
        self, tp: TopicPartition, record: ConsumerRecord[Any, Any]
    ) -> RequestEnvelope | None:
        try:
            env = decode(RequestEnvelope, record.value)
        except MalformedMessage as exc:
            skip_record(self.worker.pool, tp, record.offset, exc)
            return None
        clock = self.worker.clock
        if env.deadline_ts is not None and clock.material:
            # The deadline is on Redis's clock and this machine's clock is off: moved onto
            # the local clock once, here, so every later check (shield, dispatch queue,
            # upstream timer) compares it with time.time() as it is.
            env = env.model_copy(update={"deadline_ts": clock.to_local(env.deadline_ts)})
        return env

    async def before_queue(self, work: Work) -> bool:
        return True

    def ended(self, work: Work) -> None:
        pass

    def finished(self, work: Work, usage: UsageEvent) -> None:
        return None  # its client has its answer, the usage topic its event

    def after_dispatch(self) -> None:
        return None

    async def commit(self, only: set[TopicPartition] | None = None) -> None:
        offsets = self.worker.offsets.committable(only)
        if not offsets:
            return
        try:
            await self.worker.consumer.commit(offsets)
        except CommitFailedError as exc:
            log.info("commit skipped during a rebalance: %s", exc)
            return
        self.worker.offsets.mark_committed(offsets)

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        return None

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        await self.commit(only=partitions)
        self.worker.runs.forget(partitions)

    def forgot(self, partitions: set[TopicPartition], gone: list[Work]) -> None:
        return None

    async def after_beat(self) -> None:
        return None

    async def close(self) -> None:
        return None


class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Tells the lane of the partitions a rebalance takes away and gives."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.lane.revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("assigned %s", sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))
        await self.lane.assigned(set(assigned))


async def commit_loop(lane: Lane, consumer: AIOKafkaConsumer, interval_s: float) -> None:
    """Commit what is done every ``interval_s``; a failed commit is tried at the next."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await lane.commit(consumer.assignment())
        except KafkaError as exc:
            log.warning("offset commit failed (will retry): %s", exc)
