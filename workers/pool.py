"""A worker of one pool, assembled from its parts, and its life: start, commits, stop.

- the fetch loop (``workers.intake``) takes records in as work, ``max_inflight`` held at once;
- the dispatch queue and dispatcher (``workers.dispatch``) hand work to the engine only as it
  has room, the shield asked at that moment;
- the runs (``workers.runs``) hold work until its outcome is reported and its offset done;
- the lane (``workers.lanes``) is what makes it a completion, chat or batch worker: how a
  record becomes work, what a finished run leaves behind, how offsets are committed;
- the cancel feed, the heartbeat and the memory guard (``workers.memory``) run beside them.

Offsets are committed only below the lowest unfinished record of each partition, so a crash
re-runs (never loses) what was accepted into the pool's topics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.clients import make_consumer, make_producer, make_redis
from laneway.clock import RedisClock
from laneway.logs import described
from laneway.redis_circuit import circuit_of
from laneway.retry import Backoff
from laneway.schema import CancelRecord
from laneway.tasks import cancel_all, kept
from quota import QuotaEnforcer, QuotaPolicy
from workers import metrics
from workers.batch_lane import BatchLane
from workers.cache_salt import CacheSalts
from workers.cancel_feed import CancelFeed
from workers.dispatch import Dispatcher, DispatchQueue, Work
from workers.execution import RequestExecutor
from workers.fleet import fleet_share
from workers.heartbeat import Heartbeat
from workers.ingress_watch import IngressWatch
from workers.intake import Intake, make_pool_consumer
from workers.lanes import InteractiveLane, Lane, Rebalance, commit_loop
from workers.memory import MemoryGuard, announcer
from workers.offsets import OffsetTracker
from workers.outbox import Outbox
from workers.runs import Runs
from workers.scaling import ScalingSignal
from workers.settings import WorkerSettings
from workers.shield import CancelShield
from workers.status import heartbeat_record, set_gauges
from workers.types import Engine

__all__ = ["PoolWorker"]

log = logging.getLogger(__name__)

# The last commit of a stopping worker waits no longer than this.
_STOP_COMMIT_S = 10.0
# While a stopping worker drains, how often a shared engine hears what still runs here.
_DRAIN_LOOK_S = 0.5
_SALT_TIMEOUT_S = 2.0
_SALT_RETRY_MAX_S = 10.0


class PoolWorker:
    """Consumes one pool's request topics and runs them on ``engine``."""

    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.topics = settings.topics
        self.keys = settings.keys
        # Deadlines, acceptances and tombstones come stamped on Redis's clock; this machine's
        # may be off. The lane's accept moves deadlines onto the local clock; the ages of
        # acceptances and tombstones, the usage events' times and the hour quota counts
        # usage in are read on this one.
        self.clock = RedisClock()
        self.shield = CancelShield(enabled=settings.shield, wall=self.clock.now)
        self.offsets = OffsetTracker()
        self.queue = DispatchQueue()
        self.room = asyncio.Event()  # set when the fetch loop may take more in
        self._stopping = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._commit_s = settings.commit_interval_ms / 1000
        self._started = self._stopped = False
        self.digest = ""
        self.redis = make_redis(settings)
        # Usage events are awaited only before the offset commit, never by a client: let
        # 50 ms of them share one produce request (a broker round trip per request costs
        # more CPU than anything else a worker does).
        self.producer = make_producer(settings, linger_ms=50)
        self.quota = (
            QuotaEnforcer(
                self.redis, self.keys, QuotaPolicy.from_settings(settings), clock=self.clock.now
            )
            if settings.quota_enabled
            else None
        )
        # Interactive requests whose ingress replica is gone are stopped (a batch line's
        # result goes to a topic, whoever submitted it).
        self.ingresses = (
            IngressWatch(
                self.redis,
                self.keys,
                gone_after_s=settings.ingress_gone_s,
                interval_s=settings.heartbeat_interval_s,
            )
            if settings.ingress_gone_s and settings.pool != "batch"
            else None
        )
        self.lane: Lane = BatchLane(self) if settings.pool == "batch" else InteractiveLane(self)
        self.consumer = make_pool_consumer(settings, self.lane)
        # Batch keeps its final replies for the transaction that writes its results.
        self.outbox = Outbox(
            self.redis,
            self.producer,
            self.topics,
            self.quota,
            capture=settings.pool == "batch",
            keys=self.keys,
        )
        # The dispatcher and the runs, and the memory guard, call each other: the first
        # calls reach the others once all are built.
        self.dispatcher = Dispatcher(
            self.queue,
            capacity=self._capacity,
            verdict=self.shield.verdict,
            start=lambda work: self.runs.start(work),  # noqa: PLW0108
            drop=lambda work, reason: self.runs.drop(work, reason),  # noqa: PLW0108
            after=self._after_dispatch,
            held=lambda env: self.memory.holds(env),  # noqa: PLW0108
        )
        self.fleet = fleet_share(
            settings, self.redis, self.keys, self.clock.now, self.dispatcher.wake
        )
        self.executor = RequestExecutor.of_pool(
            settings, engine, self.shield, self.outbox, self.dispatcher.wake, clock=self.clock.now
        )
        self.runs = Runs(
            self.executor,
            self.shield,
            self.queue,
            self.offsets,
            self.lane,
            engine_done=self.dispatcher.done,
            wake=self.dispatcher.wake,
            room=self.room,
        )
        self.memory = MemoryGuard(
            settings,
            engine,
            self.executor,
            running=self.runs.running,
            announce=announcer(self.producer, self.topics.control),
            changed=self._wake,
            # On a shared engine, batch is shed before the lo band.
            batch_elsewhere=lambda: self.fleet.running()["batch"] if self.fleet else 0,
        )
        self.intake = Intake(
            self.consumer,
            self.lane,
            self.runs,
            self.memory,
            wake=self.dispatcher.wake,
            max_inflight=settings.max_inflight,
            held=lambda: self.held,
            stopping=self._stopping,
        )
        self.cancels: AIOKafkaConsumer = make_consumer(settings, self.topics.cancel)
        self.cancel_feed = CancelFeed(
            pool=self.pool,
            consumer=self.cancels,
            redis=self.redis,
            channel=self.keys.cancels(),
            fetch_pause_s=settings.cancel_fetch_wait_ms / 1000,
            apply=self.runs.cancel,
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
            scaling=ScalingSignal(settings, self.redis, self.producer, clock=self.clock.now),
            describe=lambda now: heartbeat_record(self, now),
            after=self._after_beat,
        )

    @property
    def pool(self) -> str:
        return self.settings.pool

    @property
    def running(self) -> dict[str, Work]:
        """Work on the engine, by request id, oldest first."""
        return self.runs.running

    @property
    def stopping(self) -> bool:
        """``stop`` has begun."""
        return self._stopping.is_set()

    @property
    def failed(self) -> bool:
        """The fetch loop failed: the worker stopped (its process exits non-zero)."""
        return self.intake.failed

    @property
    def held(self) -> int:
        """Requests waiting for the engine or on it (``max_inflight`` bounds them); those
        only reporting their outcome (their usage event on its way) do not count."""
        return len(self.queue) + self.dispatcher.running

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await self.engine.start()
        self.engine.watch_capacity(self.dispatcher.wake)
        if self.fleet is not None:
            self.fleet.local(0, 0, self.engine.capacity())
            await self.fleet.start()
        self.digest = self.engine.model_digest()
        # Before the cancel topic's replay: a tombstone's age is read on Redis's clock, and
        # one judged on a clock hours ahead would be forgotten at once (its request then
        # runs). Redis down: the heartbeat tries again, and ages are read on the local clock.
        with contextlib.suppress(RedisError, OSError):
            await self.clock.sync(self.redis, samples=3)
        await self.producer.start()
        await self.cancels.start()
        self.lane.subscribe(Rebalance(self.lane, moved=self.runs.withdraw_moved))
        await self.consumer.start()
        self._loops = [
            asyncio.create_task(self.intake.run(), name="fetch"),
            # A loop that fails starts again: a dead one would stop dispatch, commits, cancels
            # or the heartbeat quietly while the worker looks alive.
            kept("dispatch", self.dispatcher.run),
            kept("commit", partial(commit_loop, self.lane, self.consumer, self._commit_s)),
            kept("cancels", self.cancel_feed.topic_loop),
            kept("early-cancels", self.cancel_feed.redis_loop),
            kept("heartbeat", self.heartbeat.loop),
            kept("memory", self.memory.loop),
        ]
        if self.executor.cache_salts is not None:
            self._loops.append(
                asyncio.create_task(self._share_salts(self.executor.cache_salts), name="salts")
            )
        log.info(
            "worker %s serving pool %s with engine %s%s",
            self.settings.worker_id,
            self.pool,
            self.engine.name,
            " (SIMULATION)" if self.engine.is_simulation else "",
        )

    async def _share_salts(self, salts: CacheSalts) -> None:
        """The deployment's prefix-cache secret, tried until Redis gives it; meanwhile the
        worker salts with its own (teams stay apart)."""
        circuit = circuit_of(self.redis)
        backoff = Backoff(0.5, _SALT_RETRY_MAX_S)
        while True:
            try:
                await circuit.background(
                    partial(salts.adopt, self.redis, self.keys), timeout_s=_SALT_TIMEOUT_S
                )
            except ValueError as exc:
                log.error("prefix-cache salts stay this worker's own: %s", exc)  # noqa: TRY400
                return
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning(
                    "prefix-cache secret not read yet (%s): salting with this worker's own",
                    described(exc),
                )
                await backoff.wait()
            except Exception:
                log.exception("prefix-cache salts stay this worker's own")
                return
            else:
                return

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
        await cancel_all(dispatch)
        if self.runs.tasks:
            log.info("draining %d in-flight requests (grace %.1fs)", len(self.runs), grace)
            await cancel_all(await self._drain(grace))
        if self.fleet is not None:
            # After the drain: until then its requests still hold a shared engine's slots.
            await self.fleet.stop()
        await cancel_all([task for task in loops if task not in dispatch])
        # Bounded: a commit that cannot complete (the group in a rebalance that waits on a
        # member that is gone, a fenced producer) must not keep the process from exiting;
        # what it would have committed runs again on the partition's next owner.
        with contextlib.suppress(KafkaError, TimeoutError):
            async with asyncio.timeout(_STOP_COMMIT_S):
                await self.lane.commit()
        await self.lane.close()
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

    def _capacity(self) -> int:
        """Requests to have on the engine now: the engine's own capacity, or on a shared
        engine what this worker runs plus the room its class has (``workers.fleet``). Just
        after the engine said it had no room, what runs now and no more."""
        if time.monotonic() < self.runs.no_room_until:
            return self.dispatcher.running
        if self.fleet is not None:
            running = self.dispatcher.running
            return running + self.fleet.room(running, len(self.queue))
        return self.engine.capacity()

    async def _drain(self, grace: float) -> set[asyncio.Task[None]]:
        """Wait up to ``grace`` for what runs; returns what still does. Meanwhile a shared
        engine hears what still runs here and takes back what its interactive work needs (a
        batch line is preempted: its next owner runs it). With the dispatch loop stopped,
        the slots published were those held when the stop began, for the whole drain, and
        interactive work waited behind them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.runs.tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self.runs.tasks), timeout=min(left, _DRAIN_LOOK_S))
            if self.fleet is not None:
                self.fleet.local(self.dispatcher.running, 0, self.engine.capacity())
                self.lane.after_dispatch()
        return set(self.runs.tasks)

    def _after_dispatch(self) -> None:
        if self.fleet is not None:
            self.fleet.local(self.dispatcher.running, len(self.queue), self.engine.capacity())
        self.lane.after_dispatch()

    async def _stop_orphans(self) -> None:
        """Stop the requests of ingress replicas that are gone (``workers.ingress_watch``):
        as if their clients left, which they did."""
        watch = self.ingresses
        if watch is None or not self.shield.enabled:
            return
        await watch.look(writes=self.heartbeat.wrote)
        for work in [*self.queue, *self.runs.running.values(), *self.runs.following.values()]:
            env = work.env
            # An ingress before process names: its replica's id.
            replica = env.ingress or self.keys.reply_instance(env.reply_to)
            if replica is None or not watch.gone(replica) or self.shield.stale_reason(env.id):
                continue
            log.warning(
                "request %s stopped: its ingress replica %s is gone (its client with it)",
                env.id,
                replica,
                extra={"request_id": env.id, "team": env.team},
            )
            metrics.ORPHANS.labels(self.pool).inc()
            gone = CancelRecord(
                id=env.id, team=env.team, reason="ingress_gone", ts=self.clock.now()
            )
            await self.runs.cancel(gone)

    def _wake(self) -> None:
        """Memory pressure began or ended: held work may start, or hi work be fetched."""
        self.room.set()
        self.dispatcher.wake()

    async def _after_beat(self) -> None:
        await self._stop_orphans()
        await self.memory.follow_simulated_hold(self.redis, self.keys.sim_kv_hold())
        set_gauges(self)
        await self.lane.after_beat()
