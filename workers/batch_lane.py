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
import hashlib
import logging
from collections.abc import Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson
from aiokafka import ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced
from pydantic import ValidationError
from redis.exceptions import RedisError

from laneway.batch import MAX_CUSTOM_ID_CHARS
from laneway.cache import TtlCache
from laneway.constants import API_KEY_CACHE_S, HEARTBEAT_TTL_S
from laneway.errors import DuplicateLine, Expired, LanewayError, MalformedMessage
from laneway.json_shape import top_level_strings
from laneway.retry import Backoff
from laneway.schema import BatchRequest, BatchResult, RequestEnvelope, UsageEvent, decode
from quota import Team, get_team
from workers import metrics
from workers.answered import Answered, commit_metadata, named_top
from workers.batch import (
    BatchIntake,
    BatchLedger,
    batch_request_id,
    batch_result,
    error_result,
    result_records,
)
from workers.batch_budget import RETRY_MAX_S, BudgetWait, NotReadBack
from workers.batch_txn import PartitionTransactions
from workers.dispatch import Work
from workers.lanes import read_commits, skip_record
from workers.reread import RecordGone, RecordReader

if TYPE_CHECKING:
    from workers.pool import PoolWorker

__all__ = ["BatchLane"]

log = logging.getLogger(__name__)

# Lines waiting for their team's budget beside the lane, at most: a team's, a whole job of
# the most lines a batch may have (LANEWAY_BATCH_MAX_LINES), and the worker's, two such
# jobs. Beyond them a line is answered with a 429 (never a wait: the lane's intake would
# hold up every team). Those past LANEWAY_BATCH_PARKED_BODIES hold no body (about 2 kB
# each, tests/test_batch_budget.py measures it): about 200 MB at the most.
_MAX_PARKED_A_TEAM = 50_000
_MAX_PARKED = 2 * _MAX_PARKED_A_TEAM
# A partition's transaction not ended after this is stuck: an aiokafka producer whose
# coordinator's broker died mid-transaction can wait for good (seen in the chaos drill, every
# commit stopped). Its producer is replaced, which ends that transaction one way or the other.
_TXN_STUCK_S = 30.0
# Bounds the stop of a stuck producer.
_PRODUCER_STOP_S = 10.0

_INTERACTIVE_POOLS = ("completion", "chat")


class BatchLane:
    """The batch pool's lane (``workers.lanes``), on the parts of its worker."""

    interactive = False

    def __init__(self, worker: PoolWorker) -> None:
        self.worker = worker
        self.ledger = BatchLedger()
        self.lines = BatchIntake(worker.settings, worker.redis, worker.keys)
        self.txns = PartitionTransactions(worker.settings, worker.topics.consumer_group("batch"))
        self._fenced: set[TopicPartition] = set()  # lost to another owner this tenure
        # Started this tenure: producers open, committed offset sought, what the previous
        # owner answered above it known. Only these are fetched (a yield's end resumes
        # these alone: one resumed before its seek ran lines already answered).
        self._started: set[TopicPartition] = set()
        self.fences = 0  # partitions lost so, in this worker's life
        self._cut_off: set[TopicPartition] = set()  # last transaction's outcome unknown
        self._committing = asyncio.Lock()
        self._teams: TtlCache[Team] = TtlCache(API_KEY_CACHE_S)
        self.budget = (
            None
            if worker.quota is None
            else BudgetWait(
                worker.quota,
                self._team,
                queue=self._queue,
                refuse=self._refuse,
                release=lambda work: self._release(
                    work.env.team, work.env.id, work.env.accepted_ts
                ),
                room=lambda: worker.held < worker.settings.max_inflight,
                freed=worker.room,
                current=lambda work: worker.offsets.current(work.tp, work.epoch),
                cancelled=self._job_cancelled,
                restore=self._restore,
                max_lines=_MAX_PARKED,
                max_team_lines=_MAX_PARKED_A_TEAM,
                bodies=worker.settings.batch_parked_bodies,
                team_changed=self._teams.expire,
            )
        )
        self.reread = RecordReader(worker.settings)
        # Per partition: the offset last committed and the highest offset its metadata names
        # answered (``workers.answered``), and what its previous owner's last commit said is
        # answered, skipped when fetched again.
        self._committed: dict[TopicPartition, tuple[int, int]] = {}
        self._inherited: dict[TopicPartition, Answered] = {}
        # The line (partition, offset) each request id on this worker belongs to, from its
        # intake until it is answered: the queue, the engine, the reservation and the reply
        # all know a line by its id, and a job sent again while its first copy is still here
        # would take the first's place in each (one of the two never answered).
        # (Its digest, ``_line_digest``: a copy of the line from another line of its id.)
        self._holding: dict[str, tuple[TopicPartition, int, bytes]] = {}
        self._aborting: set[asyncio.Task[None]] = set()
        # The tasks starting producers for an assignment, by the partitions they start.
        self._starting: dict[asyncio.Task[None], set[TopicPartition]] = {}
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
        starting = list(self._starting)
        if starting:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await asyncio.wait(starting)
        tasks = list(self._aborting)
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
        inherited = self._inherited.get(tp)
        if inherited is not None and record.offset in inherited:
            return None  # answered by the partition's last owner, above its committed offset
        line = self._line_of(tp, record)
        if line is None:
            return None
        request_id = self._id_of(tp, line)
        digest = _line_digest(tp, line)
        holder = self._holding.get(request_id)
        if holder is not None and holder[:2] != (tp, record.offset):
            if holder[2] == digest:
                # The same line again (its job sent twice): the one run answers both.
                log.info(
                    "%s@%d: a copy of a line still here, answered by it", request_id, record.offset
                )
                metrics.BATCH_COPIES.labels(self.worker.pool).inc()
                return None
            # Another line of the id: answered at once, the first's reservation untouched.
            self._answer(tp, record.offset, line, _twice(request_id, holder))
            return None
        self._holding[request_id] = (tp, record.offset, digest)  # before any wait: claimed
        stored_at = self._stored_at(record)  # once: its reservation is known by it
        backoff = Backoff(0.5, RETRY_MAX_S)
        while True:
            try:
                env = await self.lines.envelope(line, request_id, stored_at)
                await self._fits(env)
            except LanewayError as exc:
                result = self._answer(tp, record.offset, line, exc)
                await self._release(result.team, result.request_id, stored_at)
                return None
            except (RedisError, OSError) as exc:
                # The key cannot be checked without Redis: the lane waits, nothing is dropped.
                log.warning("batch intake paused, Redis unreachable: %s", exc)
                await backoff.wait()
            else:
                return env

    def _line_of(
        self, tp: TopicPartition, record: ConsumerRecord[Any, Any], *, read_back: bool = False
    ) -> BatchRequest | None:
        """The batch line ``record`` holds (one that is not valid carries its problem as its
        error); None, skipped, for a record that names no job and line. ``read_back``: the
        record read again for a parked line, which was valid at intake; None, and nothing
        counted or logged, for one that is not valid (another record at its offset)."""
        try:
            line = decode(BatchRequest, record.value)
        except MalformedMessage as exc:
            if read_back:
                return None
            salvaged = _salvage(record.value, exc)
            if salvaged is None:  # it names no job and line: there is nowhere to answer it
                skip_record(self.worker.pool, tp, record.offset, exc)
                return None
            # Answered with its error, as the line its submitter counts on.
            metrics.MALFORMED.labels(self.worker.pool, tp.topic).inc()
            log.warning(
                "answering %s:%d@%d with an error: %s", tp.topic, tp.partition, record.offset, exc
            )
            line = salvaged
        # A team's own topic names the team (its ACL lets that team's principal alone write
        # it): whatever team or key the line names is not read.
        topic_team = self.worker.topics.team_of_batch_topic(tp.topic)
        if topic_team is not None:
            line = line.model_copy(update={"team": topic_team, "api_key": None})
        return line

    def _id_of(self, tp: TopicPartition, line: BatchRequest) -> str:
        """The request id of ``line``, read from ``tp``: scoped by the team of a team's own
        topic, so that two teams' lines never share one (each tenant chooses its job ids)."""
        topic_team = self.worker.topics.team_of_batch_topic(tp.topic)
        return batch_request_id(line.job_id, line.line_id, topic_team)

    def _answer(
        self, tp: TopicPartition, offset: int, line: BatchRequest, exc: LanewayError
    ) -> BatchResult:
        """``line`` is answered with ``exc`` as its result, written with its offset."""
        result = error_result(line, self._id_of(tp, line), exc)
        self.ledger.add(tp, offset, result_records(self.worker.topics, result, None, tp.topic))
        self._let_go(result.request_id, tp, offset)
        return result

    def _let_go(self, request_id: str, tp: TopicPartition, offset: int) -> None:
        """The line at ``offset`` is answered: its id is free for another line."""
        holder = self._holding.get(request_id)
        if holder is not None and holder[:2] == (tp, offset):
            del self._holding[request_id]

    def ended(self, work: Work) -> None:
        self._let_go(work.env.id, work.tp, work.offset)

    async def _restore(self, work: Work) -> Work | None:
        """A line parked without its body (``workers.batch_budget``), admitted by its budget:
        read back from Kafka and made its envelope again, as at intake (its reservation is
        made). None when its partition went away meanwhile, or when it is answered here
        instead: its job was cancelled, or the topic no longer holds it. ``NotReadBack``
        when Kafka or Redis did not answer: it is tried again."""
        try:
            line, _ = await self._read_back(work)
            # Accepted when it was parked (the record's time then): its reservation is known
            # by it, and a time read again may differ.
            env = await self.lines.envelope(line, work.env.id, work.env.accepted_ts)
        except RecordGone as exc:
            log.warning("parked batch line %s answered: %s", work.env.id, exc)
            gone = Expired(f"the line was deleted from Kafka before it could run: {exc}")
            await self._answer_parked(work, gone)
            return None
        except LanewayError as exc:  # its job cancelled since, most likely
            await self._answer_parked(work, exc)
            return None
        except (KafkaError, TimeoutError, RedisError, OSError) as exc:
            log.warning("parked batch line %s not read back yet: %r", work.env.id, exc)
            raise NotReadBack(str(exc)) from exc
        if not self.worker.offsets.current(work.tp, work.epoch):
            return None
        return replace(work, env=env)

    async def _read_back(self, work: Work) -> tuple[BatchRequest, float]:
        """``work``'s line read again from its partition, and when it was stored."""
        for fresh in (False, True):
            if fresh:
                # Another record at its offset: the topic was deleted and made anew, before
                # or after the reader fetched it. What it kept may be the old topic's: asked
                # of the broker once more before the line is answered as gone.
                self.reread.forget({work.tp})
            record = await self.reread.read(work.tp, work.offset)
            line = self._line_of(work.tp, record, read_back=True)
            if line is not None and self._id_of(work.tp, line) == work.env.id:
                return line, self._stored_at(record)
        raise RecordGone(f"{work.tp.topic}:{work.tp.partition}@{work.offset} is another line")

    async def _answer_parked(self, work: Work, exc: LanewayError) -> None:
        """An admitted line that cannot run after all (its job was cancelled, it cannot be
        read back): answered with ``exc``, the reservation it was admitted with given back."""
        if self.worker.offsets.current(work.tp, work.epoch):
            self._refuse(work, exc)
            await self._release(work.env.team, work.env.id, work.env.accepted_ts)

    def _refuse(self, work: Work, exc: LanewayError) -> None:
        """A parked line that must not run (its team's budget can no longer ever cover it,
        its job was cancelled): answered with ``exc``. Not once its partition went away:
        its next owner answers it."""
        if not self.worker.offsets.current(work.tp, work.epoch):
            return
        env = work.env
        line = BatchRequest(job_id=str(env.job_id), line_id=str(env.line_id), team=env.team)
        self._answer(work.tp, work.offset, line, exc)
        self.worker.offsets.finish(work.tp, work.offset, work.epoch)

    async def _release(self, team: str, request_id: str, stored_at: float) -> None:
        """A line answered with an error may hold a reservation of an earlier run (taken at
        its intake, before a crash; its job cancelled since): it goes back whole, not held
        for a day. Only its own record's (``stored_at``): another record of its id, on
        another worker, keeps its reservation. Nothing to do for the others, and a Redis
        that does not answer leaves it to expire."""
        if self.worker.quota is None or not team:
            return
        with contextlib.suppress(RedisError, OSError):
            await self.worker.quota.settle(team, request_id, 0, min_charge=0, record=stored_at)

    def _stored_at(self, record: ConsumerRecord[Any, Any]) -> float:
        """When the broker stored the line (its topics keep the broker's time): a line's
        acceptance, the same in every run of it. Now, for a record that carries no time."""
        return record.timestamp / 1000 if record.timestamp > 0 else self.worker.clock.now()

    def finished(self, work: Work, usage: UsageEvent) -> None:
        """A line's result and usage event go in the ledger, to be written with its offset."""
        tp, offset, env = work.tp, work.offset, work.env
        final = self.worker.outbox.captured.pop(env.id)
        self._let_go(env.id, tp, offset)  # it left the engine, whoever owns its partition
        if not self.worker.offsets.current(tp, work.epoch):
            # Its partition was taken away while it ran: the new owner runs it again, and
            # this run's records would go out a second time if the partition came back.
            return
        result = batch_result(env, final)
        self.ledger.add(tp, offset, result_records(self.worker.topics, result, usage, tp.topic))

    def after_dispatch(self) -> None:
        fleet = self.worker.fleet
        if fleet is not None:
            self._preempt(fleet.excess() - len(self.worker.executor.preempted))

    def _preempt(self, count: int) -> None:
        """Abort the ``count`` newest running lines: interactive work needs their slots."""
        if count <= 0:
            return
        # Only lines still on the engine: one already reporting its outcome has nothing to
        # give back, and an abort of it would outlive it.
        victims = [
            work
            for work in reversed(self.worker.runs.running.values())
            if work.env.id in self.worker.executor.live
            and work.env.id not in self.worker.executor.preempted
        ][:count]
        for work in victims:
            self.worker.executor.preempted.add(work.env.id)
            metrics.FLEET_PREEMPTIONS.labels(self.worker.settings.engine_id).inc()
            task = asyncio.get_running_loop().create_task(self.worker.executor.abort(work.env.id))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)
        if victims:
            log.info("shared engine: %d batch lines preempted for interactive work", len(victims))

    async def before_queue(self, work: Work) -> bool:
        """A line its pool could not cover at intake waits beside the lane, not in it."""
        return self.budget is None or not await self.budget.park(work)

    def _queue(self, work: Work) -> None:
        """A parked line its pool covers now (or whose job was cancelled): it queues."""
        self.worker.queue.push(work)
        self.worker.dispatcher.wake()

    async def _fits(self, env: RequestEnvelope) -> None:
        """Reserve ``env``'s tokens once, as it comes in; raises ``QuotaExceeded`` for a line
        bigger than its team's whole batch budget, which becomes its result at once: waited
        for, it would never leave. A line the pool cannot cover yet is parked
        (``before_queue``) until it can."""
        if self.budget is not None:
            await self.budget.reserve(await self._team(env.team), env)

    async def _job_cancelled(self, env: RequestEnvelope) -> bool:
        """Whether ``env``'s job was cancelled (the shield then drops its lines not started
        yet); False while Redis cannot say."""
        if env.job_id is None:
            return False
        try:
            cancelled = await self.lines.job_cancelled(env.job_id)
        except (RedisError, OSError):
            return False
        if cancelled:
            self.worker.shield.cancel_job(env.job_id, env.team)
        return cancelled

    async def _team(self, name: str) -> Team:
        team = self._teams.get(name)
        if team is None:
            changes = self._teams.changes
            team = await get_team(self.worker.redis, self.worker.keys, name)
            self._teams.put_if(changes, name, team)
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
            if (only is not None and tp not in only) or tp in self._fenced:
                continue
            try:
                if not self.txns.has(tp):
                    # Its producer did not start when the partition was assigned: start it
                    # now (never for a partition fenced since: that would fence its owner).
                    await self.txns.open([tp])
                if tp in self._cut_off:
                    await self._settle_cut_off(tp)
                commit = self._next_commit(tp)
                if commit is None:
                    continue
                offset, metadata, answered, top = commit
                async with asyncio.timeout(_TXN_STUCK_S):
                    await self.txns.commit(tp, self.ledger.records(tp, answered), offset, metadata)
            except ProducerFenced:
                await self._lose(tp)
                continue
            except TimeoutError:
                await self._replace_stuck(tp)
                continue
            except KafkaError as exc:
                log.warning("batch transaction aborted (will retry): %s", exc)
                continue
            self.ledger.drop(tp, answered)
            self._committed[tp] = (offset, top)

    def _next_commit(self, tp: TopicPartition) -> tuple[int, str, list[int], int] | None:
        """What ``tp``'s next transaction commits: its offset, the metadata naming the lines
        above it still unanswered, the offsets whose results it writes, and the highest
        offset the metadata names answered; None when that would change nothing."""
        state = self.worker.offsets.snapshot(tp)
        if state is None:
            return None
        low, high, pending = state
        last = self._committed.get(tp)
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

    async def _replace_stuck(self, tp: TopicPartition) -> None:
        """Drop the producer of a transaction that does not end. The next commit starts a
        new one, which ends the old transaction (committed or aborted) before it begins."""
        log.warning(
            "batch transaction of %s:%d not ended after %.0fs: its producer is replaced",
            tp.topic,
            tp.partition,
            _TXN_STUCK_S,
        )
        self._cut_off.add(tp)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_PRODUCER_STOP_S):
                await self.txns.close([tp])

    async def _settle_cut_off(self, tp: TopicPartition) -> None:
        """After a cut-off transaction (its producer replaced, so it has ended): what it
        committed is out already and leaves the ledger."""
        answered = (await read_commits(self.worker.consumer, {tp})).get(tp)
        self._cut_off.discard(tp)
        if answered is None:
            return
        offset = answered.low
        self.ledger.drop(tp, self.ledger.ready(tp, answered))
        self._committed[tp] = (offset, _named_top(answered))

    async def _lose(self, tp: TopicPartition) -> None:
        """Another instance started a producer of ``tp`` (the group gave it the partition
        while this worker was expelled, or a start that came too late): what this worker
        holds of the partition is dropped, and it reads no more of it until the group assigns
        it here again. It asks the group at once: an expelled worker rejoins anyway, and one
        the group still gives ``tp`` gets it back through a rebalance (its producer started
        again, fencing the other; its reading from the committed offset) rather than wait,
        the partition stalled, for the next rebalance someone else causes."""
        log.warning(
            "partition %s:%d fenced by another producer: asking the group for it again",
            tp.topic,
            tp.partition,
        )
        self._fenced.add(tp)
        self._started.discard(tp)
        self.fences += 1
        metrics.BATCH_FENCES.labels(self.worker.pool).inc()
        if not self.worker.stopping:
            # Before anything below can fail or wait. aiokafka has no public call for it: the
            # next round of its coordinator rejoins, through the revoke and assignment
            # callbacks as any rebalance. Not while the worker stops: its last commit would
            # make it wait out a rejoin, and start producers after it closed them.
            self.worker.consumer._coordinator.request_rejoin()
        self.worker.runs.forget({tp})
        await self.txns.close([tp])
        if tp in self.worker.consumer.assignment():
            self.worker.consumer.pause(tp)

    def _background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)
        return task

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Fence any instance still writing for these partitions before running their lines:
        they stay paused until their producers started. Not in this callback: a producer's
        start can wait on a transaction its frozen predecessor left open, and the group's
        rebalance would wait with it."""
        self._fenced -= partitions
        self._started -= partitions
        self.worker.consumer.pause(*partitions)
        tenure = {tp: self.worker.offsets.epoch(tp) for tp in partitions}
        task = self._background(self._open_then_resume(tenure))
        self._starting[task] = set(partitions)
        task.add_done_callback(lambda done: self._starting.pop(done, None))

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
            self._committed[tp] = (offset, _named_top(answered))
            if answered.high > answered.low:
                self._inherited[tp] = answered
                self.worker.offsets.inherit(tp, answered.high, answered.pending)
        self._started.update(ready)
        if ready and not self.yielding:
            self.worker.consumer.resume(*ready)

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        # A start of their producers still under way (waiting on a transaction left open,
        # retrying) ends here, before the group hands them on: had it gone on, it would
        # fence their next owner's producers, started after it (seen in the chaos drill:
        # two partitions stalled for 47 s, until another rebalance).
        starting = [task for task, tps in self._starting.items() if tps & partitions]
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        self._started -= partitions
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
        self._holding = {
            rid: at
            for rid, at in self._holding.items()
            if at[0] not in partitions or rid in on_engine
        }
        for tp in partitions:
            self._committed.pop(tp, None)
            self._inherited.pop(tp, None)

    # --- yielding to interactive work -------------------------------------------------------

    async def after_beat(self) -> None:
        await self._yield_to_interactive()
        # Lines of a job cancelled after they were fetched: dropped when they would start.
        for work in {w.env.job_id: w for w in self.worker.queue if w.env.job_id}.values():
            await self._job_cancelled(work.env)
        if self.budget is not None:
            await self.budget.release_cancelled()

    async def _yield_to_interactive(self) -> None:
        backlog = await self._interactive_backlog()
        should_yield = backlog > self.worker.settings.batch_yield_backlog
        if should_yield == self.yielding:
            return
        self.yielding = should_yield
        assigned = list(self.worker.consumer.assignment())
        if should_yield:
            log.info("interactive backlog %d: batch lane pauses", backlog)
            self.worker.consumer.pause(*assigned)
        else:
            log.info("interactive backlog gone: batch lane resumes")
            # Not a partition still starting (its producer may be open already, its seek
            # not made), or fenced.
            self.worker.consumer.resume(
                *[tp for tp in assigned if tp in self._started and tp not in self._fenced]
            )
        metrics.BATCH_YIELDING.set(1 if should_yield else 0)

    async def _interactive_backlog(self) -> int:
        now = self.worker.clock.now()  # Redis's, as the beats are scored on
        try:
            ids: list[Any] = []
            for pool in _INTERACTIVE_POOLS:
                ids += await self.worker.redis.zrangebyscore(
                    self.worker.keys.workers(pool), now - HEARTBEAT_TTL_S, "+inf"
                )
            if not ids:
                return 0
            infos = await self.worker.redis.mget(
                [self.worker.keys.worker_info(i.decode()) for i in ids]
            )
        except (RedisError, OSError):
            return 0
        return sum(int(orjson.loads(raw).get("backlog", 0)) for raw in infos if raw)


def _line_digest(tp: TopicPartition, line: BatchRequest) -> bytes:
    """What makes two records the same line: its topic (another topic's is another team's
    line, answered to that team) and what it asks, not when it was sent."""
    fields = line.model_dump(mode="json", exclude={"submitted_ts", "api_key"})
    content = orjson.dumps([tp.topic, fields], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(content, digest_size=16).digest()


def _twice(request_id: str, holder: tuple[TopicPartition, int, bytes]) -> DuplicateLine:
    # The first is on the same topic (a team's own topic scopes its ids): its place names
    # nothing of another team's.
    where = f"{holder[0].topic}:{holder[0].partition}@{holder[1]}"
    return DuplicateLine(
        f"another line of the same id ({request_id}, at {where}) is still running: its job or "
        "its custom_id was used twice; this line is not run (send it again once the first is "
        "answered, or give it a custom_id of its own)",
        param="custom_id",
    )


def _named_top(answered: Answered) -> int:
    return named_top(answered.low, answered.high, sorted(answered.pending))


def _salvage(raw: bytes | None, exc: MalformedMessage) -> BatchRequest | None:
    """A record that is not a valid line but names its job and line (a wrong body, a newer
    version, a body nested too deep for any parser): the line its submitter counts on,
    carrying the problem as its error, so it is answered with an error result instead of
    never. None when it names no job and line."""
    fields: object
    try:
        fields = orjson.loads(raw or b"")
    except orjson.JSONDecodeError:
        # Not JSON orjson takes (nested past 1024 levels, say); its top level may still
        # name the line.
        fields = top_level_strings(raw or b"")
    if not isinstance(fields, dict):
        return None
    team = fields.get("team")
    line_id = fields.get("line_id")
    if isinstance(line_id, str) and len(line_id) > MAX_CUSTOM_ID_CHARS:
        # Answered under an id that fits, the same in every run, that starts as its own.
        digest = hashlib.blake2b(line_id.encode(), digest_size=6).hexdigest()
        line_id = f"{line_id[: MAX_CUSTOM_ID_CHARS - 13]}#{digest}"
    try:
        return BatchRequest(
            job_id=fields.get("job_id"),
            line_id=line_id,
            team=team if isinstance(team, str) and team else None,
            error=f"not a laneway batch line: {exc}",
        )
    except ValidationError:
        return None
