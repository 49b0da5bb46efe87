"""A worker of one pool: the Kafka fetch loop, dispatch to the engine, commits and shutdown.

The fetch loop never waits on generation: fetched records wait in the worker's dispatch
queue (``workers.dispatch``), up to ``max_inflight`` held at once, and go to the engine only
as it has room, the shield asked at that moment. Offsets are committed only below the lowest
unfinished record of each partition, so a crash re-runs (never loses) what was accepted into
the pool's topics. The ``hi`` band is drained before ``lo``: while ``hi`` partitions have a
backlog, the ``lo`` partitions are paused, and waiting ``hi`` work starts first. Under memory
pressure (``workers.memory``) the ``lo`` band and batch wait, and what of them runs is
aborted and queued again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import CommitFailedError, KafkaError
from redis.exceptions import RedisError

from laneway.clients import make_consumer, make_producer, make_redis
from laneway.clock import RedisClock
from laneway.errors import Cancelled, Dropped, MalformedMessage
from laneway.loops import keep_running
from laneway.metrics import CONSUMER_LAG
from laneway.redis_circuit import circuit_of
from laneway.schema import CancelRecord, MemoryPressure, RequestEnvelope, UsageEvent, decode
from quota import QuotaEnforcer, QuotaPolicy
from workers import metrics
from workers.cancel_feed import CancelFeed, backlog
from workers.dispatch import Dispatcher, DispatchQueue, Work
from workers.execution import RequestExecutor
from workers.fleet import FleetShare
from workers.heartbeat import Heartbeat
from workers.memory import MemoryGuard
from workers.offsets import OffsetTracker
from workers.outbox import Outbox
from workers.reuse import Follower, ReuseRegistry
from workers.scaling import ScalingSignal
from workers.settings import WorkerSettings
from workers.shield import CancelShield
from workers.types import Engine

__all__ = ["PoolWorker"]

log = logging.getLogger(__name__)

# The last commit of a stopping worker waits no longer than this.
_STOP_COMMIT_S = 10.0


class _CommitOnRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: PoolWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.worker._revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("assigned %s", sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))
        await self.worker._assigned(set(assigned))


class PoolWorker:
    """Consumes one pool's request topics and runs them on ``engine``."""

    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.topics = settings.topics
        self.keys = settings.keys
        self.shield = CancelShield(enabled=settings.shield)
        # Deadlines come stamped on Redis's clock; this machine's may be off (see _accept).
        self.clock = RedisClock()
        self.offsets = OffsetTracker()
        self.queue = DispatchQueue()
        self.dispatcher = Dispatcher(
            self.queue,
            capacity=self._capacity,
            verdict=self.shield.verdict,
            start=self._start,
            drop=self._drop,
            after=self._after_dispatch,
        )
        self.running: dict[str, Work] = {}  # on the engine, oldest first
        self._following: dict[str, Work] = {}  # served from another request's generation
        # Started or dropped work until its offset may be finished; with the queue, what
        # this worker holds (max_inflight bounds it).
        self._inflight: dict[asyncio.Task[None], RequestEnvelope] = {}
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._started = False
        self._stopped = False
        self.failed = False
        self._digest = ""
        self.redis = make_redis(settings)
        # Usage events are awaited only before the offset commit, never by a client: let
        # 50 ms of them share one produce request (a broker round trip per request costs
        # more CPU than anything else a worker does).
        self.producer = make_producer(settings, linger_ms=50)
        self.consumer: AIOKafkaConsumer = make_consumer(
            settings,
            group_id=self.topics.consumer_group(settings.pool),
            group_instance_id=settings.worker_id,
            client_id=settings.worker_id,
            max_poll_records=settings.max_inflight,
            session_timeout_ms=settings.session_timeout_ms,
            heartbeat_interval_ms=max(1000, settings.session_timeout_ms // 4),
            # Range keeps partition N of every band on one worker, so a session's keystrokes
            # reach the same shield whichever band they come in.
            partition_assignment_strategy=(RangePartitionAssignor,),
            # The batch pool subscribes by pattern: a team topic created later is found at
            # the next metadata refresh.
            metadata_max_age_ms=30_000 if settings.pool == "batch" else 300_000,
            # Batch lines are written in transactions (a job submitted over HTTP): a line of
            # an aborted one must never run.
            isolation_level="read_committed" if settings.pool == "batch" else "read_uncommitted",
        )
        self.cancels: AIOKafkaConsumer = make_consumer(settings, self.topics.cancel)
        self.cancel_feed = CancelFeed(
            pool=self.pool,
            consumer=self.cancels,
            redis=self.redis,
            channel=self.keys.cancels(),
            fetch_pause_s=settings.cancel_fetch_wait_ms / 1000,
            apply=self._apply_cancel,
            after_fetch=self.shield.expire,
            stopping=self._stopping,
        )
        self.heartbeat = Heartbeat(
            pool=self.pool,
            worker_id=settings.worker_id,
            interval_s=settings.heartbeat_interval_s,
            redis=self.redis,
            keys=self.keys,
            clock=self.clock,
            scaling=ScalingSignal(settings, self.redis, self.producer),
            describe=self._describe,
            after=self._after_beat,
        )
        self.quota: QuotaEnforcer | None = None
        if settings.quota_enabled:
            self.quota = QuotaEnforcer(self.redis, self.keys, QuotaPolicy.from_settings(settings))
        # Batch keeps its final replies for the transaction that writes its results.
        self.outbox = Outbox(
            self.redis, self.producer, self.topics, self.quota, capture=settings.pool == "batch"
        )
        self.fleet: FleetShare | None = None
        if settings.engine_id:
            self.fleet = FleetShare(
                self.redis,
                self.keys,
                settings.engine_id,
                settings.worker_id,
                settings.pool,
                reserve_min=settings.fleet_reserve_min,
                peak_window_s=settings.fleet_peak_window_s,
                # Members' beats are compared across machines: on Redis's clock.
                clock=self.clock.now,
            )
            self.fleet.on_change = self.dispatcher.wake
        self.executor = RequestExecutor(
            engine,
            self.shield,
            self.outbox,
            reuse=ReuseRegistry(ttl_s=settings.reuse_ttl_s, max_entries=settings.reuse_max_entries),
            reuse_hold_s=settings.reuse_hold_ms / 1000,
            worker_id=settings.worker_id,
            pool=settings.pool,
            price_of=settings.price_of,
            stream_interval=settings.stream_interval,
            on_first_output=self.dispatcher.wake,
        )
        self.memory = MemoryGuard(
            settings,
            engine,
            self.executor,
            running=self.running,
            announce=self._announce,
            changed=self._memory_changed,
            batch_elsewhere=self._batch_on_engine,
        )
        self.dispatcher.held = self.memory.holds

    @property
    def pool(self) -> str:
        return self.settings.pool

    @property
    def held(self) -> int:
        """Requests waiting for the engine or on it (``max_inflight`` bounds them); those
        only reporting their outcome (their usage event on its way) do not count."""
        return len(self.queue) + self.dispatcher.running

    def _held_back(self) -> int:
        """In an interactive pool, lo-band work memory pressure holds back: it leaves room
        to fetch (its partitions are paused meanwhile, so hi work is what comes)."""
        if not self.memory.pressed or self.pool == "batch":
            return 0
        return sum(1 for work in self.queue if self.memory.holds(work.env))

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await self.engine.start()
        self.engine.watch_capacity(self.dispatcher.wake)
        if self.fleet is not None:
            self.fleet.local(0, 0, self.engine.capacity())
            await self.fleet.start()
        self._digest = self.engine.model_digest()
        await self.producer.start()
        await self.cancels.start()
        if self.settings.pool == "batch":
            # The lane and every team's own batch topic, those created later included.
            self.consumer.subscribe(
                pattern=self.topics.batch_pattern(), listener=_CommitOnRevoke(self)
            )
        else:
            self.consumer.subscribe(
                self.topics.pool_topics(self.settings.pool), listener=_CommitOnRevoke(self)
            )
        await self.consumer.start()
        self._loops = [
            asyncio.create_task(self._fetch_loop(), name="fetch"),
            _kept("dispatch", self.dispatcher.run),
            # A loop that fails starts again: a dead one would stop dispatch, commits, cancels
            # or the heartbeat quietly while the worker looks alive.
            _kept("commit", self._commit_loop),
            _kept("cancels", self.cancel_feed.topic_loop),
            _kept("early-cancels", self.cancel_feed.redis_loop),
            _kept("heartbeat", self.heartbeat.loop),
            _kept("memory", self.memory.loop),
        ]
        log.info(
            "worker %s serving pool %s with engine %s%s",
            self.settings.worker_id,
            self.pool,
            self.engine.name,
            " (SIMULATION)" if self.engine.is_simulation else "",
        )

    async def __aenter__(self) -> PoolWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop fetching and dispatching, let what runs finish within the grace period,
        commit, close.

        Work still waiting is left to the partition's next owner; work still running after
        the grace period is cancelled without committing its offset, so it is run again.
        """
        if self._stopped or not self._started:
            return
        self._stopped = True
        self._stopping.set()
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        loops, self._loops = self._loops, []
        dispatch = [task for task in loops if task.get_name() == "dispatch"]
        await _cancel(dispatch)
        if self._inflight:
            log.info("draining %d in-flight requests (grace %.1fs)", len(self._inflight), grace)
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace)
            await _cancel(pending)
        if self.fleet is not None:
            # After the drain: until then its requests still hold a shared engine's slots.
            await self.fleet.stop()
        await _cancel([task for task in loops if task not in dispatch])
        # Bounded: a commit that cannot complete (the group in a rebalance that waits on a
        # member that is gone, a fenced producer) must not keep the process from exiting;
        # what it would have committed runs again on the partition's next owner.
        with contextlib.suppress(KafkaError, TimeoutError):
            async with asyncio.timeout(_STOP_COMMIT_S):
                await self.commit()
        await self.consumer.stop()
        await self.cancels.stop()
        await self.producer.stop()
        circuit = circuit_of(self.redis)
        with contextlib.suppress(Exception):
            await self.heartbeat.leave()
        await self.outbox.close()  # settlements owed since a Redis outage: one last try
        await circuit.stop()
        await self.redis.aclose()
        await self.engine.stop()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    # --- fetch ---------------------------------------------------------------------------

    async def _fetch_loop(self) -> None:
        # Learn the clock's offset before the first envelope's deadline is read (Redis
        # down: the heartbeat tries again, and deadlines are read on the local clock).
        with contextlib.suppress(RedisError, OSError):
            await self.clock.sync(self.redis, samples=3)
        try:
            await self._fetch()
        except Exception:
            # Never fetch silently no more: stop, so the process exits and is restarted, and
            # the partitions go to a live member.
            log.exception("fetch loop failed; worker %s stops", self.settings.worker_id)
            self.failed = True
            self._stopping.set()
            raise

    async def _fetch(self) -> None:
        while not self._stopping.is_set():
            room = self.settings.max_inflight - self.held + self._held_back()
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            await self._prioritise_bands()
            batches = await self.consumer.getmany(timeout_ms=200, max_records=room)
            if self._stopping.is_set():
                # Not started: leave them uncommitted for the next owner.
                return
            ordered = sorted(batches.items(), key=lambda item: item[0].topic.endswith(".lo"))
            # The tenure each partition's records were fetched in. A rebalance that revokes a
            # partition while the batch is handled ends it, though the consumer reports the
            # partition assigned until the rebalance completes (and again if it is given
            # back): the rest of its records are its next tenure's to fetch again, from the
            # committed offset. Taken here, they ran as that tenure's and were committed
            # past the line in hand, which no one ran (the chaos drill: lines lost, others
            # written twice).
            fetched_in = {tp: self.offsets.epoch(tp) for tp in batches}
            accepted: list[Work] = []
            for tp, records in ordered:
                for record in records:
                    if tp not in self.consumer.assignment() or not self.offsets.current(
                        tp, fetched_in[tp]
                    ):
                        break  # taken away while this batch was handled: fetched again
                    work = await self._take(tp, record)
                    if work is not None:
                        accepted.append(work)
            # Observe the whole batch before any of it may start: a keystroke is superseded
            # by one fetched with it.
            for work in accepted:
                await self._before_queue(work)
                if not self.offsets.current(work.tp, work.epoch):
                    continue  # revoked while it waited to queue
                self.queue.push(work)
                self.dispatcher.wake()

    async def _take(self, tp: TopicPartition, record: ConsumerRecord[Any, Any]) -> Work | None:
        """A fetched record: the work to queue, or None (skipped, adopted, or served from
        another request's generation)."""
        epoch = self.offsets.epoch(tp)
        self.offsets.begin(tp, record.offset)
        env = await self._accept(tp, record)
        if not self.offsets.current(tp, epoch):
            return None  # revoked during the await: its next owner's
        if env is None:
            self.offsets.finish(tp, record.offset)
            return None
        work = Work(tp, record.offset, env, epoch)
        if self._adopt(work):
            return None
        # Matched before it supersedes: the generation it types through keeps running for
        # it instead of being aborted.
        follower = self._reusable(env)
        if follower is None:
            await self.executor.release(env)
        await self._observe(env)
        if follower is not None:
            self._follow(work, follower)
            return None
        return work

    def _adopt(self, work: Work) -> bool:
        """A record of a request already in hand (its partition went away and came back
        while it ran, so it was fetched again): the run under way finishes it, as of this
        tenure, instead of a second run of the same id."""
        known = self.running.get(work.env.id) or self._following.get(work.env.id)
        if known is None:
            return False
        known.tp, known.offset, known.epoch = work.tp, work.offset, work.epoch
        return True

    async def _before_queue(self, work: Work) -> None:
        """Wait until ``work`` may queue for the engine (batch: until its budget allows)."""

    async def _accept(
        self, tp: TopicPartition, record: ConsumerRecord[Any, Any]
    ) -> RequestEnvelope | None:
        """Decode a fetched record; None when it is done with already (skipped)."""
        try:
            env = decode(RequestEnvelope, record.value)
        except MalformedMessage as exc:
            self._skip(tp, record.offset, exc)
            return None
        if env.deadline_ts is not None and self.clock.material:
            # The deadline is on Redis's clock and this machine's clock is off: moved onto
            # the local clock once, here, so every later check (shield, dispatch queue,
            # upstream timer) compares it with time.time() as it is.
            env = env.model_copy(update={"deadline_ts": self.clock.to_local(env.deadline_ts)})
        return env

    async def _observe(self, env: RequestEnvelope) -> None:
        """A newer keystroke: what it supersedes stops, running or waiting."""
        for rid in self.shield.observe(env):
            await self.executor.abort(rid)
        if self.shield.enabled:
            for work in self.queue.superseded(env):
                reason = self.shield.verdict(work.env)
                if reason is not None:
                    self._drop(work, reason)
                else:  # within its team's supersede grace: it may still run
                    self.queue.push(work)

    def _reusable(self, env: RequestEnvelope) -> Follower | None:
        """The generation ``env`` may be served from (type-through), if any."""
        if not env.reuse or self.shield.verdict(env) is not None:
            return None
        return self.executor.reuse.match(env)

    def _follow(self, work: Work, follower: Follower) -> None:
        # Known to the shield at once: a newer keystroke or a tombstone ends it like any other.
        self.shield.started(work.env)
        self._following[work.env.id] = work
        self._track(self._serve(work, follower), work, f"reuse-{work.env.id}")

    async def _serve(self, work: Work, follower: Follower) -> None:
        try:
            try:
                await self.executor.follow(follower)
            finally:
                self._following.pop(work.env.id, None)
            await self.executor.delivered(work.env.id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "reused request %s failed",
                work.env.id,
                extra={"request_id": work.env.id, "team": work.env.team},
            )
        self.offsets.finish(work.tp, work.offset, work.epoch)

    def _skip(self, tp: TopicPartition, offset: int, exc: Exception) -> None:
        metrics.MALFORMED.labels(self.pool, tp.topic).inc()
        log.warning("skipped %s:%d@%d: %s", tp.topic, tp.partition, offset, exc)

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
        backlog = await self.lag(hi)
        paused = self.consumer.paused()
        if backlog > 0 or self.memory.pressed:
            self.consumer.pause(*[tp for tp in lo if tp not in paused])
        elif paused:
            self.consumer.resume(*[tp for tp in lo if tp in paused])

    # --- dispatch ------------------------------------------------------------------------

    def _capacity(self) -> int:
        """Requests to have on the engine now: the engine's own capacity, or on a shared
        engine what this worker runs plus the room its class has (``workers.fleet``)."""
        if self.fleet is not None:
            running = self.dispatcher.running
            return running + self.fleet.room(running, len(self.queue))
        return self.engine.capacity()

    def _after_dispatch(self) -> None:
        if self.fleet is not None:
            self.fleet.local(self.dispatcher.running, len(self.queue), self.engine.capacity())

    def _start(self, work: Work) -> None:
        env = work.env
        if env.reuse:
            # An identical request started a moment ago (in this pass, say) is followed, not
            # run again; else this one's output becomes reusable from now on.
            follower = self._reusable(env)
            if follower is not None:
                self.dispatcher.done()
                self._follow(work, follower)
                return
            self.executor.reuse.begin(env)
        self.running[env.id] = work
        self._track(self._run(work), work, f"req-{env.id}")

    def _drop(self, work: Work, reason: Dropped) -> None:
        self._track(self._report_drop(work, reason), work, f"drop-{work.env.id}")
        self._room.set()

    def _track(self, coro: Any, work: Work, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._inflight[task] = work.env
        task.add_done_callback(self._untrack)

    def _untrack(self, task: asyncio.Task[None]) -> None:
        self._inflight.pop(task, None)
        self._room.set()

    async def _execute(self, work: Work, dropped: Dropped | None = None) -> UsageEvent | None:
        """Run the work on the engine, or report it ``dropped`` before it got there; None
        when it left the engine to run again later (preempted): it is queued again, first in
        line, with its offset pending, and no start deadline (it started in time; that it
        waits again is the engine's doing, not its client's)."""
        if dropped is not None:
            return await self.executor.drop(work.env, dropped)
        usage = await self.executor.run(work.env)
        if usage is None:
            if self.offsets.current(work.tp, work.epoch):
                work.env = work.env.model_copy(update={"deadline_ts": None})
                self.queue.push(work, front=True)
            else:  # its partition went away meanwhile: the next owner runs it
                self.executor.preemptions.pop(work.env.id, None)
        return usage

    async def _run(self, work: Work) -> None:
        env = work.env
        try:
            try:
                usage = await self._execute(work)
            finally:
                # The engine is done with it: its slot takes the next work while the usage
                # event is still on its way to the broker.
                self.running.pop(env.id, None)
                self.dispatcher.done()
                self._room.set()
            if usage is None:
                return  # queued again: its offset stays pending
            await self.executor.delivered(env.id)
        except asyncio.CancelledError:
            # Shutdown past the grace period: leave the offset pending so it is re-run.
            raise
        except Exception:
            # A reply or usage write failed after retries; the offset must still move on or
            # the partition would stall. The ingress times the client out with a 504.
            log.exception(
                "request %s failed outside the engine",
                env.id,
                extra={"request_id": env.id, "team": env.team},
            )
        self.offsets.finish(work.tp, work.offset, work.epoch)

    async def _report_drop(self, work: Work, reason: Dropped) -> None:
        try:
            await self._execute(work, reason)
            await self.executor.delivered(work.env.id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "dropped request %s could not be reported",
                work.env.id,
                extra={"request_id": work.env.id, "team": work.env.team},
            )
        self.offsets.finish(work.tp, work.offset, work.epoch)

    # --- commits, cancels, heartbeats -----------------------------------------------------

    async def commit(self, only: set[TopicPartition] | None = None) -> None:
        offsets = self.offsets.committable(only)
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except CommitFailedError as exc:
            log.info("commit skipped during a rebalance: %s", exc)
            return
        self.offsets.mark_committed(offsets)

    async def _revoked(self, partitions: set[TopicPartition]) -> None:
        """Taken away by a rebalance: commit what is done, leave the rest to the next owner."""
        await self.commit(only=partitions)
        self._forget(partitions)

    async def _assigned(self, partitions: set[TopicPartition]) -> None:
        """Given by a rebalance (the batch lane fences other writers of them here)."""

    def _forget(self, partitions: set[TopicPartition]) -> list[Work]:
        """Partitions taken away by a rebalance: their next owner re-runs what is pending
        (waiting work included: it leaves the queue unstarted, and is returned)."""
        gone = self.queue.forget(partitions)
        self.offsets.forget(partitions)
        for work in gone:
            self.executor.preemptions.pop(work.env.id, None)
        # What was queued left: room to fetch again (nothing running may set it).
        self._room.set()
        self.dispatcher.wake()
        return gone

    async def _commit_loop(self) -> None:
        interval = self.settings.commit_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await self.commit(self.consumer.assignment())
            except KafkaError as exc:
                log.warning("offset commit failed (will retry): %s", exc)

    async def _apply_cancel(self, cancel: CancelRecord) -> None:
        """A tombstone: work still queued leaves the queue; work running is aborted."""
        waiting = self.queue.get(cancel.id) if self.shield.enabled else None
        if waiting is not None and waiting.env.team == cancel.team:
            self.queue.remove(cancel.id)
            self._drop(waiting, Cancelled("cancelled before it started"))
            return
        rid = self.shield.cancel(cancel)
        if rid is not None:
            # A gone keystroke's client usually sent the next keystroke a moment before: it
            # may type through this generation, so the abort waits for it, briefly.
            await self.executor.abort(rid, hold=True)

    async def _describe(self, now: float) -> dict[str, Any]:
        """This worker's heartbeat record (the ingress, the console and the signal read it)."""
        stats = self.engine.stats()
        return {
            "pool": self.pool,
            "engine": self.engine.name,
            "simulation": self.engine.is_simulation,
            "inflight": self.held,
            "dispatch_queue": len(self.queue),
            "engine_inflight": self.dispatcher.running,
            "capacity": self.dispatcher.capacity_seen,
            "backlog": await self._record_lag() + len(self.queue) + stats.waiting,
            "cancels_held": len(self.shield),
            "running": stats.running,
            "waiting": stats.waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "prefix_cache_hit_rate": (
                stats.prefix_cache_hits / stats.prefix_cache_queries
                if stats.prefix_cache_queries
                else None
            ),
            "memory_free_bytes": stats.memory_free_bytes,
            "memory_pressure": self.memory.pressed,
            "memory_shed": self.memory.shed_total,
            "model_digest": self._digest,
            "ts": now,
        }

    def _batch_on_engine(self) -> int:
        """Batch lines running on this worker's engine when it is shared (else 0)."""
        return self.fleet.running()["batch"] if self.fleet is not None else 0

    def _memory_changed(self) -> None:
        """Memory pressure began or ended: held work may start, or hi work be fetched."""
        self._room.set()
        self.dispatcher.wake()

    async def _announce(self, record: MemoryPressure) -> None:
        try:
            await self.producer.send(
                self.topics.control, record.to_json(), key=record.subject.encode()
            )
        except KafkaError as exc:
            log.warning("memory pressure record not sent to %s: %s", self.topics.control, exc)

    async def _after_beat(self) -> None:
        await self.memory.follow_simulated_hold(self.redis, self.keys.sim_kv_hold())
        metrics.DISPATCH_QUEUE.labels(self.pool).set(len(self.queue))
        metrics.ENGINE_INFLIGHT.labels(self.pool).set(self.dispatcher.running)
        metrics.ENGINE_CAPACITY.labels(self.pool).set(self.dispatcher.capacity_seen)
        metrics.INFLIGHT.labels(self.pool).set(self.held)
        await self._after_heartbeat()

    async def _record_lag(self) -> int:
        total = 0
        assigned = {tp.topic for tp in self.consumer.assignment()}
        for topic in sorted(assigned | set(self.topics.pool_topics(self.settings.pool))):
            lag = await self.lag([tp for tp in self.consumer.assignment() if tp.topic == topic])
            CONSUMER_LAG.labels(self.pool, topic).set(lag)
            total += lag
        return total

    async def _after_heartbeat(self) -> None:
        """Periodic hook for subclasses (the batch lane checks interactive backlog here)."""


def _kept(name: str, loop: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
    return asyncio.create_task(keep_running(f"the {name} loop", loop), name=name)


async def _cancel(tasks: Collection[asyncio.Task[Any]], ask_again_s: float = 2.0) -> None:
    """Cancel ``tasks`` and wait until they are done, asking again every ``ask_again_s``.

    A library may swallow a cancellation: redis-py has, when it lands as a timeout inside it
    expires, turning it into a timeout error. A loop that catches that error goes on, and a
    single cancel would leave the worker's stop (and its SIGTERM) waiting for good.
    """
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=ask_again_s)
        for task in pending:
            log.warning("%s went on after it was cancelled; cancelling it again", task.get_name())
            task.cancel()
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved (each loop logs its own failure)
