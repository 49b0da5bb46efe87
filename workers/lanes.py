"""What differs between pools, as a lane: the worker's fetch, dispatch and runs are one; how a
record becomes work, what a finished run leaves behind and how offsets are committed are the
lane's.

- ``InteractiveLane`` (completion, chat): a record is a request envelope; a run's outcome
  went to its client already; offsets are committed with the consumer, each commit naming
  the requests above it that are answered (``workers.answered``), which the partition's
  next owner (this worker again, after a rebalance) skips.
- ``BatchLane`` (``workers.batch_lane``): a record is a batch line; results and usage events
  are written in a transaction with the offsets they complete.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from laneway.errors import MalformedMessage
from laneway.schema import RequestEnvelope, UsageEvent, decode
from workers import metrics
from workers.answered import Answered, answered_by, commit_metadata
from workers.dispatch import Work

if TYPE_CHECKING:
    from workers.pool import PoolWorker

__all__ = ["InteractiveLane", "Lane", "Rebalance", "commit_loop", "read_commits", "skip_record"]

log = logging.getLogger(__name__)

# Reading what the last commit of newly assigned partitions says is answered waits no longer:
# past it their records are taken as they come (what was answered above the commit runs
# again, as before laneway named it), rather than the worker fetching nothing.
_READ_COMMITS_S = 30.0


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


async def read_commits(
    consumer: AIOKafkaConsumer, partitions: set[TopicPartition]
) -> dict[TopicPartition, Answered]:
    """What the group's last commit of each of ``partitions`` says is answered (its offset
    and the metadata ``workers.answered`` writes), in one request to the coordinator (the
    consumer's ``committed()`` leaves the metadata out); partitions with no commit are left
    out."""
    found = await consumer._coordinator.fetch_committed_offsets(partitions)
    return {
        tp: answered_by(found[tp].offset, found[tp].metadata or "")
        for tp in partitions
        if tp in found and found[tp].offset >= 0
    }


def skip_record(pool: str, tp: TopicPartition, offset: int, exc: Exception) -> None:
    """A record that is not a request: counted, logged, and its offset moves on."""
    metrics.MALFORMED.labels(pool, tp.topic).inc()
    log.warning("skipped %s:%d@%d: %s", tp.topic, tp.partition, offset, exc)


class InteractiveLane:
    """Completion and chat: requests whose clients wait for them."""

    interactive = True

    def __init__(self, worker: PoolWorker) -> None:
        self.worker = worker
        # Per partition, what its last commit named answered above the committed offset:
        # skipped when fetched again (each was run, and its usage event stored, already).
        self._answered: dict[TopicPartition, Answered] = {}
        # The reads of newly assigned partitions' last commits, until each is done: their
        # records wait for it, and the partition is not committed before it.
        self._reading: dict[TopicPartition, asyncio.Task[None]] = {}
        # Per partition, its end when this tenure began: a record below it may have been
        # answered by the last owner, which stopped before its usage event was stored.
        self._inherited_end: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, tuple[int, str]] = {}  # last commit sent

    def consumer_options(self) -> dict[str, Any]:
        return {"metadata_max_age_ms": 300_000, "isolation_level": "read_uncommitted"}

    def subscribe(self, listener: ConsumerRebalanceListener) -> None:
        topics = self.worker.topics.pool_topics(self.worker.settings.pool)
        self.worker.consumer.subscribe(topics, listener=listener)

    async def accept(
        self, tp: TopicPartition, record: ConsumerRecord[Any, Any]
    ) -> RequestEnvelope | None:
        reading = self._reading.get(tp)
        if reading is not None:
            await asyncio.wait({reading})  # not cancelled with the fetch loop: others wait
        answered = self._answered.get(tp)
        if answered is not None and record.offset in answered:
            return None  # answered in the partition's last tenure, above its commit
        if self.worker.offsets.finished_late(tp, record.offset):
            return None  # its run went on while the partition was away, and answered
        try:
            env = decode(RequestEnvelope, record.value)
        except MalformedMessage as exc:
            skip_record(self.worker.pool, tp, record.offset, exc)
            return None
        clock = self.worker.clock
        if (
            record.offset < self._inherited_end.get(tp, 0)
            # Not one this worker still has in hand (its partition came back while its
            # outcome was reported): that run finishes it (``Runs.adopt``), sending its own.
            and env.id not in self.worker.runs.unfinished
            and await self._answered_before(env)
        ):
            return None
        if env.deadline_ts is not None and clock.material:
            # The deadline is on Redis's clock and this machine's clock is off: moved onto
            # the local clock once, here, so every later check (shield, dispatch queue,
            # upstream timer) compares it with time.time() as it is.
            env = env.model_copy(update={"deadline_ts": clock.to_local(env.deadline_ts)})
        return env

    async def _answered_before(self, env: RequestEnvelope) -> bool:
        """Whether the partition's last owner answered ``env`` and stopped before the broker
        stored its usage event (``workers.outbox``): the event it left in Redis is sent
        now, and the request is not run a second time (its client has its answer; a run
        now would find it stale, and record a drop instead of what it used)."""
        outbox = self.worker.outbox
        usage = await outbox.held_usage(env.id)
        if usage is None:
            return False
        try:
            await (await outbox.send_usage(usage))
        except KafkaError as exc:
            log.warning("held usage event of %s not sent (%s): it runs again", env.id, exc)
            return False
        outbox.release_held(env.id)
        metrics.USAGE_RESENT.labels(self.worker.pool).inc()
        log.info(
            "%s was answered before its last worker stopped: its usage event sent again",
            env.id,
            extra={"request_id": env.id, "team": env.team},
        )
        return True

    async def before_queue(self, work: Work) -> bool:
        return True

    def ended(self, work: Work) -> None:
        pass

    def finished(self, work: Work, usage: UsageEvent) -> None:
        return None  # its client has its answer, the usage topic its event

    def after_dispatch(self) -> None:
        return None

    async def commit(self, only: set[TopicPartition] | None = None) -> None:
        """Commit each partition's lowest unfinished offset, its metadata naming the
        requests above it that are finished (``workers.answered``): a long chat holds the
        commit back, and what finished behind it is not run a second time after a
        rebalance."""
        offsets = self._commits(only)
        if not offsets:
            return
        try:
            await self.worker.consumer.commit(offsets)
        except CommitFailedError as exc:
            log.info("commit skipped during a rebalance: %s", exc)
            return
        self._committed.update(offsets)
        self.worker.offsets.mark_committed({tp: offset for tp, (offset, _) in offsets.items()})

    def _commits(self, only: set[TopicPartition] | None) -> dict[TopicPartition, tuple[int, str]]:
        """The commits that would change what the group holds. None for a partition whose
        last commit is still being read: written now, it would name less answered."""
        out: dict[TopicPartition, tuple[int, str]] = {}
        for tp in self.worker.offsets.partitions():
            if (only is not None and tp not in only) or tp in self._reading:
                continue
            state = self.worker.offsets.snapshot(tp)
            if state is None:
                continue
            low, high, pending = state
            commit = (low, commit_metadata(low, high, pending)[0])
            if self._committed.get(tp) != commit:
                out[tp] = commit
        return out

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Read what the partitions' last commits name answered, beside the rebalance (it
        waits for no coordinator round trip); their records wait for it in ``accept``."""
        if not partitions:
            return
        tenure = {tp: self.worker.offsets.epoch(tp) for tp in partitions}
        task = asyncio.create_task(self._inherit(tenure), name="read-commits")
        for tp in partitions:
            self._reading[tp] = task

    async def _inherit(self, tenure: dict[TopicPartition, int]) -> None:
        partitions = set(tenure)
        named = sorted(f"{tp.topic}:{tp.partition}" for tp in partitions)
        answered: dict[TopicPartition, Answered] | None = None
        ends: dict[TopicPartition, int] = {}
        try:
            async with asyncio.timeout(_READ_COMMITS_S):
                answered = await read_commits(self.worker.consumer, partitions)
                ends = await self.worker.consumer.end_offsets(list(partitions))
        except (KafkaError, TimeoutError) as exc:
            if answered is None:
                log.warning(
                    "last commits of %s not read (%r): requests answered above them run again",
                    named,
                    exc,
                )
            else:  # the commits were read: what they name is skipped all the same
                log.warning(
                    "end offsets of %s not read (%r): a request answered by a worker that "
                    "stopped before its usage event was stored runs again",
                    named,
                    exc,
                )
        finally:
            for tp in partitions:
                if self._reading.get(tp) is asyncio.current_task():
                    del self._reading[tp]
        for tp, commit in (answered or {}).items():
            # Not a partition taken away meanwhile (its next tenure reads its own commit).
            if commit.high > commit.low and self.worker.offsets.current(tp, tenure[tp]):
                self._answered[tp] = commit
                self.worker.offsets.inherit(tp, commit.high, commit.pending)
        for tp, end in ends.items():
            if self.worker.offsets.current(tp, tenure[tp]):
                self._inherited_end[tp] = end

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        try:
            await self.commit(only=partitions)
        except KafkaError as exc:
            # What it would have committed runs again on the partitions' next owners.
            log.warning("commit of revoked partitions failed: %s", exc)
        finally:
            self.worker.runs.forget(partitions)

    def forgot(self, partitions: set[TopicPartition], gone: list[Work]) -> None:
        for tp in partitions:
            self._answered.pop(tp, None)
            self._inherited_end.pop(tp, None)
            self._committed.pop(tp, None)
            reading = self._reading.pop(tp, None)
            if reading is not None:
                reading.cancel()

    async def after_beat(self) -> None:
        return None

    async def close(self) -> None:
        reading = set(self._reading.values())
        for task in reading:
            task.cancel()
        await asyncio.gather(*reading, return_exceptions=True)


class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Tells the lane of the partitions a rebalance takes away and gives; once it gave,
    ``moved`` stops what still runs of the partitions that went elsewhere."""

    def __init__(
        self, lane: Lane, moved: Callable[[set[TopicPartition]], Awaitable[None]] | None = None
    ) -> None:
        self.lane = lane
        self.moved = moved

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.lane.revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("assigned %s", sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))
        try:
            await self.lane.assigned(set(assigned))
        finally:
            if self.moved is not None:
                await self.moved(set(assigned))


async def commit_loop(lane: Lane, consumer: AIOKafkaConsumer, interval_s: float) -> None:
    """Commit what is done every ``interval_s``; a failed commit is tried at the next."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await lane.commit(consumer.assignment())
        except KafkaError as exc:
            log.warning("offset commit failed (will retry): %s", exc)
