"""The worker's fetch loop: records in, work queued for dispatch.

The loop never waits on generation: fetched records wait in the dispatch queue
(``workers.dispatch``), up to ``max_inflight`` held at once. A whole fetched batch is
observed before any of it may start, so a keystroke is superseded by one fetched with it.
The ``hi`` band is drained before ``lo``: while ``hi`` partitions have a backlog (or memory
pressure holds the ``lo`` band back), the ``lo`` partitions are paused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from laneway.clients import make_consumer
from laneway.schema import RequestEnvelope
from workers.cancel_feed import backlog
from workers.dispatch import Work
from workers.lanes import Lane
from workers.memory import MemoryGuard
from workers.runs import Runs
from workers.settings import WorkerSettings

__all__ = ["Intake", "make_pool_consumer"]

log = logging.getLogger(__name__)


def make_pool_consumer(settings: WorkerSettings, lane: Lane) -> AIOKafkaConsumer:
    """The consumer of a pool's request topics, a member of the pool's group."""
    return make_consumer(
        settings,
        group_id=settings.topics.consumer_group(settings.pool),
        group_instance_id=settings.worker_id,
        client_id=settings.worker_id,
        max_poll_records=settings.max_inflight,
        session_timeout_ms=settings.session_timeout_ms,
        heartbeat_interval_ms=max(1000, settings.session_timeout_ms // 4),
        # Range keeps partition N of every band on one worker, so a session's keystrokes
        # reach the same shield whichever band they come in.
        partition_assignment_strategy=(RangePartitionAssignor,),
        **lane.consumer_options(),
    )


class Intake:
    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        lane: Lane,
        runs: Runs,
        memory: MemoryGuard,
        *,
        wake: Callable[[], None],
        max_inflight: int,
        held: Callable[[], int],
        stopping: asyncio.Event,
    ) -> None:
        self.consumer = consumer
        self.lane = lane
        self.runs = runs
        self.offsets = runs.offsets
        self.queue = runs.queue
        self.shield = runs.shield
        self.executor = runs.executor
        self.memory = memory
        self.wake = wake  # the dispatcher's: work is queued
        self.max_inflight = max_inflight
        self.held = held  # the work the worker holds (waiting, or on the engine)
        self.stopping = stopping
        self.failed = False

    async def run(self) -> None:
        """The loop; one that fails stops the worker (``stopping``), so the process exits
        and is restarted, and the partitions go to a live member: never fetch silently no
        more."""
        try:
            await self._loop()
        except Exception:
            log.exception("fetch loop failed; the worker stops")
            self.failed = True
            self.stopping.set()
            raise

    def room(self) -> int:
        """Records to take in now. In an interactive pool, the lo-band work memory pressure
        holds back leaves room (its partitions are paused meanwhile, so hi work comes)."""
        held_back = 0
        if self.memory.pressed and self.lane.interactive:
            held_back = sum(1 for work in self.queue if self.memory.holds(work.env))
        return self.max_inflight - self.held() + held_back

    async def _loop(self) -> None:
        while not self.stopping.is_set():
            room = self.room()
            if room <= 0:
                self.runs.room.clear()
                await self.runs.room.wait()
                continue
            await self._prioritise_bands()
            batches = await self.consumer.getmany(timeout_ms=200, max_records=room)
            if self.stopping.is_set():
                # Not started: leave them uncommitted for the next owner.
                return
            for work in await self._take_batch(batches):
                if not await self.lane.before_queue(work):
                    continue  # the lane holds it (a batch line waiting for its budget)
                if not self.offsets.current(work.tp, work.epoch):
                    continue  # revoked while it waited to queue
                stale = self.shield.verdict(work.env)
                if stale is not None:
                    # Superseded by a keystroke of its own batch (a backlog fetched at once:
                    # after a rebalance, a broker pause): answered now, not when a slot frees.
                    self.runs.drop(work, stale)
                    continue
                self.queue.push(work)
                self.wake()

    async def _take_batch(
        self, batches: dict[TopicPartition, list[ConsumerRecord[Any, Any]]]
    ) -> list[Work]:
        """The work a fetched batch brings, ``hi`` before ``lo``, all of it observed."""
        # The tenure each partition's records were fetched in. A rebalance that revokes a
        # partition while the batch is handled ends it, though the consumer reports the
        # partition assigned until the rebalance completes (and again if it is given back):
        # the rest of its records are its next tenure's to fetch again, from the committed
        # offset. Taken here, they ran as that tenure's and were committed past the line in
        # hand, which no one ran (the chaos drill: lines lost, others written twice).
        fetched_in = {tp: self.offsets.epoch(tp) for tp in batches}
        accepted: list[Work] = []
        for tp, records in sorted(batches.items(), key=lambda item: item[0].topic.endswith(".lo")):
            for record in records:
                if tp not in self.consumer.assignment() or not self.offsets.current(
                    tp, fetched_in[tp]
                ):
                    break  # taken away while this batch was handled: fetched again
                work = await self._take(tp, record)
                if work is not None:
                    accepted.append(work)
        return accepted

    async def _take(self, tp: TopicPartition, record: ConsumerRecord[Any, Any]) -> Work | None:
        """A fetched record: the work to queue, or None (skipped, adopted, or served from
        another request's generation)."""
        epoch = self.offsets.epoch(tp)
        self.offsets.begin(tp, record.offset)
        env = await self.lane.accept(tp, record)
        if not self.offsets.current(tp, epoch):
            return None  # revoked during the await: its next owner's
        if env is None:
            self.offsets.finish(tp, record.offset)
            return None
        work = Work(tp, record.offset, env, epoch)
        if self.runs.adopt(work):
            return None
        # Matched before it supersedes: the generation it types through keeps running for
        # it instead of being aborted.
        follower = self.runs.reusable(env)
        if follower is None:
            await self.executor.release(env)
        await self._observe(env)
        if follower is not None:
            self.runs.follow(work, follower)
            return None
        return work

    async def _observe(self, env: RequestEnvelope) -> None:
        """A newer keystroke: what it supersedes stops, running or waiting."""
        for rid in self.shield.observe(env):
            await self.executor.abort(rid)
        if self.shield.enabled:
            for work in self.queue.superseded(env):
                reason = self.shield.verdict(work.env)
                if reason is not None:
                    self.runs.drop(work, reason)
                else:  # within its team's supersede grace: it may still run
                    self.queue.push(work)

    async def lag(self, partitions: list[TopicPartition] | None = None) -> int:
        """Records fetched by nobody yet on ``partitions`` (default: all assigned)."""
        assigned = self.consumer.assignment() if partitions is None else partitions
        return await backlog(self.consumer, assigned)

    async def _prioritise_bands(self) -> None:
        assigned = self.consumer.assignment()
        hi = [tp for tp in assigned if tp.topic.endswith(".hi")]
        lo = [tp for tp in assigned if tp.topic.endswith(".lo")]
        if not lo:
            return
        waiting = await self.lag(hi)
        paused = self.consumer.paused()
        if waiting > 0 or self.memory.pressed:
            self.consumer.pause(*[tp for tp in lo if tp not in paused])
        elif paused:
            self.consumer.resume(*[tp for tp in lo if tp in paused])
