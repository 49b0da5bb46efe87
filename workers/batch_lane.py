"""The batch lane: exactly-once results, its own quota pool, and it yields.

Differences from the interactive pools: records are batch lines (``BatchRequest``), each
result and usage event is written in a Kafka transaction with the input offset it
completes (and, in the commit's metadata, the lines above it still unanswered:
``workers.answered``), a line waits (never fails) for its team's batch budget beside the lane
(``workers.batch_budget``), and the whole lane pauses while the interactive lanes have a
backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from aiokafka import ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced

from laneway.cache import TtlCache
from laneway.constants import API_KEY_CACHE_S
from laneway.retry import Backoff
from laneway.schema import RequestEnvelope, UsageEvent
from quota import Team, get_team
from workers import batch_lines
from workers.answered import Answered, commit_metadata, named_top
from workers.batch import BatchIntake, BatchLedger, batch_result, result_records
from workers.batch_parked import budget_wait, job_cancelled
from workers.batch_txn import PartitionTransactions
from workers.batch_txn_failures import lose, replace_stuck, settle_cut_off
from workers.batch_yield import preempt, yield_to_interactive
from workers.dispatch import Work
from workers.lanes import read_commits
from workers.reread import RecordReader

if TYPE_CHECKING:
    from workers.pool import PoolWorker

__all__ = ["BatchLane"]

log = logging.getLogger(__name__)

# A partition's transaction not ended after this is stuck: an aiokafka producer whose
# coordinator's broker died mid-transaction can wait for good (seen in the chaos drill, every
# commit stopped). Its producer is replaced, which ends that transaction one way or the other.
_TXN_STUCK_S = 30.0


class BatchLane:
    """The batch pool's lane (``workers.lanes``), on the parts of its worker."""

    interactive = False

    def __init__(self, worker: PoolWorker) -> None:
        self.worker = worker
        self.ledger = BatchLedger()
        self.lines = BatchIntake(worker.settings, worker.redis, worker.keys)
        self.txns = PartitionTransactions(worker.settings, worker.topics.consumer_group("batch"))
        self.fenced: set[TopicPartition] = set()  # lost to another owner this tenure
        # Started this tenure: producers open, committed offset sought, what the previous
        # owner answered above it known. Only these are fetched (a yield's end resumes
        # these alone: one resumed before its seek ran lines already answered).
        self.started: set[TopicPartition] = set()
        self.fences = 0  # partitions lost so, in this worker's life
        self.cut_off: set[TopicPartition] = set()  # last transaction's outcome unknown
        self._committing = asyncio.Lock()
        self.teams: TtlCache[Team] = TtlCache(API_KEY_CACHE_S)
        self.budget = budget_wait(self)
        self.reread = RecordReader(worker.settings)
        # Per partition: the offset last committed and the highest offset its metadata names
        # answered (``workers.answered``), and what its previous owner's last commit said is
        # answered, skipped when fetched again.
        self.committed: dict[TopicPartition, tuple[int, int]] = {}
        self.inherited: dict[TopicPartition, Answered] = {}
        # The line (partition, offset) each request id on this worker belongs to, from its
        # intake until it is answered: the queue, the engine, the reservation and the reply
        # all know a line by its id, and a job sent again while its first copy is still here
        # would take the first's place in each (one of the two never answered).
        # (And its digest, which tells a copy of the line from another line of its id:
        # ``workers.batch_lines``.)
        self.holding: dict[str, tuple[TopicPartition, int, bytes]] = {}
        self.aborting: set[asyncio.Task[None]] = set()
        # The tasks starting producers for an assignment, by the partitions they start.
        self.starting: dict[asyncio.Task[None], set[TopicPartition]] = {}
        self.yielding = False

    def consumer_options(self) -> dict[str, Any]:
        return {
            # The lane subscribes by pattern: a team topic created later is found at the
            # next metadata refresh.
            "metadata_max_age_ms": 30_000,
            # Batch lines are written in transactions (a job submitted over HTTP): a line of
            # an aborted one must never run.
            "isolation_level": "read_committed",
        }

    def subscribe(self, listener: ConsumerRebalanceListener) -> None:
        # The lane and every team's own batch topic, those created later included.
        self.worker.consumer.subscribe(
            pattern=self.worker.topics.batch_pattern(), listener=listener
        )

    async def close(self) -> None:
        # Producers being started are let finish first (then closed below with the rest): one
        # cancelled in its start can leave its bootstrap connection open (aiokafka's
        # bootstrap does not close it on a cancel).
        starting = list(self.starting)
        if starting:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await asyncio.wait(starting)
        tasks = list(self.aborting)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await asyncio.gather(*tasks, return_exceptions=True)
        if self.budget is not None:
            await self.budget.close()
        await self.reread.close()
        try:
            async with asyncio.timeout(10):
                await self.txns.close_all()
        except TimeoutError:
            # The worker goes on closing: a partition's next owner fences what is left open.
            log.warning("batch transactional producers not closed within 10 s")

    # --- intake and execution -------------------------------------------------------------

    async def accept(
        self, tp: TopicPartition, record: ConsumerRecord[Any, Any]
    ) -> RequestEnvelope | None:
        return await batch_lines.accept(self, tp, record)

    async def before_queue(self, work: Work) -> bool:
        """A line its pool could not cover at intake waits beside the lane, not in it."""
        return self.budget is None or not await self.budget.park(work)

    def ended(self, work: Work) -> None:
        batch_lines.let_go(self, work.env.id, work.tp, work.offset)

    def finished(self, work: Work, usage: UsageEvent) -> None:
        """A line's result and usage event go in the ledger, to be written with its offset."""
        tp, offset, env = work.tp, work.offset, work.env
        final = self.worker.outbox.captured.pop(env.id)
        # It left the engine, whoever owns its partition.
        batch_lines.let_go(self, env.id, tp, offset)
        if not self.worker.offsets.current(tp, work.epoch):
            # Its partition was taken away while it ran: the new owner runs it again, and
            # this run's records would go out a second time if the partition came back.
            return
        result = batch_result(env, final)
        self.ledger.add(tp, offset, result_records(self.worker.topics, result, usage, tp.topic))

    def after_dispatch(self) -> None:
        fleet = self.worker.fleet
        if fleet is not None:
            preempt(self, fleet.excess() - len(self.worker.executor.preempted))

    async def team_of(self, name: str) -> Team:
        """The team's record, from a cache that its changes on ``laneway.control`` expire."""
        team = self.teams.get(name)
        if team is None:
            changes = self.teams.changes
            team = await get_team(self.worker.redis, self.worker.keys, name)
            self.teams.put_if(changes, name, team)
        return team

    # --- exactly-once commit --------------------------------------------------------------

    async def commit(self, only: set[TopicPartition] | None = None) -> None:
        """Per partition: the results below its committable offset and that offset, in one
        transaction of the partition's own producer (``workers.batch_txn``)."""
        # One at a time: the commit loop's and a rebalance's would otherwise share a
        # producer, the second begun while the first runs (taken for a fence: the partition
        # forgotten) or just after it ended (its results written twice; the chaos drill).
        async with self._committing:
            await self._commit(only)

    async def _commit(self, only: set[TopicPartition] | None) -> None:
        for tp in self.worker.offsets.partitions():
            if (only is not None and tp not in only) or tp in self.fenced:
                continue
            try:
                if not self.txns.has(tp):
                    if tp not in self.cut_off or tp not in self.started:
                        # Its producer starts where the group assigns the partition
                        # (``assigned``). Here only again, after a stuck one was closed while
                        # the group still counted this worker in (``replace_stuck``): one
                        # started for a partition the group gave another worker meanwhile
                        # (this one cut off, or a revoke under way) would fence that owner.
                        continue
                    await self.txns.open([tp])
                if tp in self.cut_off:
                    await settle_cut_off(self, tp)
                commit = self._next_commit(tp)
                if commit is None:
                    continue
                offset, metadata, answered, top = commit
                async with asyncio.timeout(_TXN_STUCK_S):
                    await self.txns.commit(tp, self.ledger.records(tp, answered), offset, metadata)
            except ProducerFenced:
                await lose(self, tp)
                continue
            except TimeoutError:
                await replace_stuck(self, tp, _TXN_STUCK_S)
                continue
            except KafkaError as exc:
                log.warning("batch transaction aborted (will retry): %s", exc)
                continue
            self.ledger.drop(tp, answered)
            self.committed[tp] = (offset, top)

    def _next_commit(self, tp: TopicPartition) -> tuple[int, str, list[int], int] | None:
        """What ``tp``'s next transaction commits: its offset, the metadata naming the lines
        above it still unanswered, the offsets whose results it writes, and the highest
        offset the metadata names answered; None when that would change nothing."""
        state = self.worker.offsets.snapshot(tp)
        if state is None:
            return None
        low, high, pending = state
        last = self.committed.get(tp)
        if last is not None and last[0] == low and not self.ledger.holds(tp):
            return None  # only lines fetched since: nothing for a next owner to skip
        metadata, covered = commit_metadata(low, high, pending)
        if last is not None and covered <= last[1]:
            # The waiting lines are split into more runs than the metadata holds: this
            # commit would un-say lines the last one named answered (their results are out,
            # and a next owner would run them again). It waits until the list fits again,
            # as lines are answered.
            return None
        answered = self.ledger.ready(tp, Answered(low, covered, frozenset(pending)))
        if not answered and last is not None and last[0] == low:
            return None  # the results held are all above the cut: a later commit's
        return low, metadata, answered, named_top(low, covered, pending)

    def _background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self.aborting.add(task)
        task.add_done_callback(self.aborting.discard)
        return task

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Fence any instance still writing for these partitions before running their lines:
        they stay paused until their producers started. Not in this callback: a producer's
        start can wait on a transaction its frozen predecessor left open, and the group's
        rebalance would wait with it."""
        self.fenced -= partitions
        self.started -= partitions
        self.worker.consumer.pause(*partitions)
        tenure = {tp: self.worker.offsets.epoch(tp) for tp in partitions}
        task = self._background(self._open_then_resume(tenure))
        self.starting[task] = set(partitions)
        task.add_done_callback(lambda done: self.starting.pop(done, None))

    async def _open_then_resume(self, tenure: dict[TopicPartition, int]) -> None:
        partitions = set(tenure)
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                await self.txns.open(partitions)
                # The producers' start ended any transaction a previous owner (or this
                # worker's previous tenure) left open, so only now are the group's offsets
                # final: one fetched at the assignment may predate that transaction's commit,
                # and its lines would run and be written again (aiokafka fetches offsets
                # without KIP-447's require_stable). Seen in the chaos drill: one duplicate.
                committed = await read_commits(self.worker.consumer, partitions)
            except KafkaError as exc:
                log.warning("transactional producers not started yet (retrying): %s", exc)
                await backoff.wait()
                continue
            break
        # Not a partition taken away since (maybe given back, its next tenure begun): that
        # tenure's own task seeks it and reads its commit.
        ready = [
            tp
            for tp in partitions
            if tp in self.worker.consumer.assignment()
            and self.worker.offsets.current(tp, tenure[tp])
        ]
        for tp in ready:
            answered = committed.get(tp)
            if answered is None:
                continue
            offset = answered.low
            self.worker.consumer.seek(tp, offset)
            self.committed[tp] = (offset, answered.top())
            if answered.high > answered.low:
                self.inherited[tp] = answered
                self.worker.offsets.inherit(tp, answered.high, answered.pending)
        self.started.update(ready)
        if ready and not self.yielding:
            self.worker.consumer.resume(*ready)

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        # A start of their producers still under way (waiting on a transaction left open,
        # retrying) ends here, before the group hands them on: had it gone on, it would
        # fence their next owner's producers, started after it (seen in the chaos drill:
        # two partitions stalled for 47 s, until another rebalance).
        starting = [task for task, tps in self.starting.items() if tps & partitions]
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        self.started -= partitions
        await self.commit(only=partitions)
        self.worker.runs.forget(partitions)
        await self.txns.close(partitions)

    def forgot(self, partitions: set[TopicPartition], gone: list[Work]) -> None:
        self.ledger.forget(partitions)
        self.reread.forget(partitions)
        if self.budget is not None:
            self.budget.forget(partitions)
        # A line still on the engine keeps its id until it leaves (``finished``, ``ended``):
        # until then another line of its id must not start beside it.
        on_engine = {env.id for env in self.worker.runs.tasks.values()}
        self.holding = {
            rid: at
            for rid, at in self.holding.items()
            if at[0] not in partitions or rid in on_engine
        }
        for tp in partitions:
            self.committed.pop(tp, None)
            self.inherited.pop(tp, None)

    # --- yielding to interactive work -------------------------------------------------------

    async def after_beat(self) -> None:
        await yield_to_interactive(self)
        # Lines of a job cancelled after they were fetched: dropped when they would start.
        jobs = {(w.env.team, w.env.job_id): w for w in self.worker.queue if w.env.job_id}
        for work in jobs.values():
            await job_cancelled(self, work.env)
        if self.budget is not None:
            await self.budget.release_cancelled()
