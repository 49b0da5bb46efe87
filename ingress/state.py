"""What one ingress instance holds for its lifetime: clients, caches and the reply router."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from ingress import metrics
from ingress.admin_guesses import AdminGuesses
from ingress.admission import Admission
from ingress.auth import CallerResolver
from ingress.batches import BatchBook
from ingress.breaker import BreakerGate
from ingress.canary_gate import CanaryGate
from ingress.cancels import CancelOutbox
from ingress.files import FileStore
from ingress.prober import Prober
from ingress.quota_gate import ROLL_CALL_S, QuotaGate
from ingress.replies import ReplyRouter
from ingress.revocations import RevokedKeys
from ingress.settings import IngressSettings
from ingress.shadow_mirror import ShadowMirror
from laneway.clients import make_consumer, make_producer, make_redis
from laneway.clock import RedisClock
from laneway.constants import HEARTBEAT_TTL_S, POOLS
from laneway.logs import described
from laneway.loops import keep_running
from laneway.redis_circuit import circuit_of
from laneway.schema import CancelRecord, RequestEnvelope
from laneway.tasks import kept, stop_task
from quota import CancelRateLimit, QuotaEnforcer, QuotaPolicy
from quota.teams import follow_team_changes

__all__ = ["IngressState"]

log = logging.getLogger(__name__)

# How often the replica re-learns how far its clock is from Redis's: clocks drift by
# milliseconds a minute at worst, and a jump (a resumed VM) is caught within this.
_CLOCK_SYNC_S = 10.0


class IngressState:
    def __init__(self, settings: IngressSettings) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.keys = settings.keys
        self.reply_stream = self.keys.reply_stream(settings.instance_id)
        # This process of the replica: a replica restarted under the same id (compose's,
        # a pod's) is another, whose clients are not the dead one's. Its requests carry it,
        # and it is what the roll call names (``workers.ingress_watch``).
        self.incarnation = f"{settings.instance_id}#{secrets.token_hex(4)}"
        self.redis: aioredis.Redis = make_redis(settings)
        # Shared by every component below (they find it by the client): one learns that
        # Redis hangs, and none of the others waits on it.
        self.circuit = circuit_of(self.redis)
        self.producer: AIOKafkaProducer = make_producer(settings)
        # Tombstones have a producer (a connection) of their own: a Kafka client keeps one
        # produce request in flight per broker, so on a shared producer a storm of tombstones
        # would queue the requests of the keystrokes that users still wait for.
        self.cancel_producer: AIOKafkaProducer = make_producer(settings)
        # Redis's clock: deadlines, acceptances and tombstones are stamped on it, so a
        # machine whose own clock is off stamps what the workers read right.
        self.clock = RedisClock()
        self.cancels = CancelOutbox(
            self.cancel_producer,
            self.redis,
            self.topics,
            self.keys,
            hold_s=settings.cancel_hold_ms / 1000,
            clock=self.clock.now,
        )
        self.replies = ReplyRouter(self.redis, self.reply_stream)
        self.admin_guesses = AdminGuesses()  # wrong admin keys: past a burst, a pause
        self.revoked = RevokedKeys(settings, self.redis)
        self.callers = CallerResolver(self.redis, self.keys, self.revoked)
        self.admission = Admission(settings, self.producer, self.clock)
        self.cancel_limit = CancelRateLimit(self.redis, self.keys, settings.cancels_per_s)
        self.breaker = BreakerGate(self.redis, self.keys, settings)
        self.canaries = CanaryGate(self.redis, self.keys)
        # Mirrors have a producer of their own, for the reason tombstones do.
        self.shadows = ShadowMirror(
            self.redis,
            self.keys,
            self.topics,
            make_producer(settings, linger_ms=5),
            max_in_flight=settings.shadow_max_in_flight,
        )
        self.prober = Prober(self)
        self.files = FileStore(settings, self.redis, self.producer)
        self.batches = BatchBook(settings, self.redis, self.files, self.clock.now)
        policy = QuotaPolicy.from_settings(settings)
        self.quota = QuotaGate(
            QuotaEnforcer(self.redis, self.keys, policy, clock=self.clock.now),
            policy,
            enabled=settings.quota_enabled,
            lease_share=settings.quota_lease_share,
            lease_idle_s=settings.quota_lease_idle_s,
        )
        # Replies reach this instance through Kafka while Redis is down; tail from "now".
        self._reply_fallback = make_consumer(
            settings, self.topics.replies, auto_offset_reset="latest"
        )
        self._tail: asyncio.Task[None]
        self._team_changes: asyncio.Task[None]
        self._closing = False
        self._lease_returns: asyncio.Task[None]
        self._clock_sync: asyncio.Task[None]
        self._roll: asyncio.Task[None]
        self.started_at = time.time()

    async def start(self) -> None:
        await self.producer.start()
        try:
            await self.cancel_producer.start()
            await self.shadows.start()
        except BaseException:
            await self.cancel_producer.stop()
            await self.producer.stop()
            raise
        self.cancels.start()
        with contextlib.suppress(RedisError, OSError):  # down: the sync task tries again
            await self.clock.sync(self.redis, samples=3)
            await self.quota.roll_call(self.incarnation, self.clock.now())
        await self.revoked.start()
        await self.replies.start()
        await self._reply_fallback.start()
        await self.replies.tail_from_now(self._reply_fallback)
        self._tail = asyncio.create_task(
            keep_running(
                "the reply tail on Kafka",
                lambda: self.replies.tail_kafka(self._reply_fallback),
            ),
            name="reply-tail",
        )
        # A team's new record (an admin's change of its budget or tier) is used at once.
        self._team_changes = kept(
            "team changes",
            lambda: follow_team_changes(
                self.redis, self.keys, self.callers.team_changed, closing=lambda: self._closing
            ),
        )
        self._lease_returns = asyncio.create_task(self.quota.run_returns())
        self._clock_sync = kept("clock sync", self._sync_clock)
        self._roll = kept("roll call", self._roll_calls)
        await self.batches.start()
        await self.prober.start()

    async def stop(self) -> None:
        await self.prober.stop()
        await self.batches.stop()
        await self.cancels.stop()  # while Kafka and Redis are still there
        await self.shadows.stop()
        self._closing = True
        tasks = (self._roll, self._clock_sync, self._team_changes, self._lease_returns, self._tail)
        for task in tasks:
            await stop_task(task)
        await self.revoked.stop()
        await self._reply_fallback.stop()
        await self.replies.stop()
        await self.quota.return_idle(idle_s=0)  # unused leases back to their pools
        await self.quota.leave_roll(self.incarnation)
        try:
            await self.producer.stop()
        finally:
            await self.cancel_producer.stop()
        await self.circuit.stop()
        await self.redis.aclose()

    async def _sync_clock(self) -> None:
        """Keep the replica's view of Redis's clock, which deadlines are stamped on."""
        synced = 0.0
        while True:
            try:
                if time.monotonic() - synced >= _CLOCK_SYNC_S:
                    await self.clock.sync(self.redis)
                    synced = time.monotonic()
            except (RedisError, OSError) as exc:
                log.debug("clock not synced with Redis (the last stays): %s", exc)
            await asyncio.sleep(ROLL_CALL_S)

    async def _roll_calls(self) -> None:
        """Say that this replica runs, every ``ROLL_CALL_S`` (``QuotaGate.roll_call``); a
        loop of its own, so a slow clock sync does not space them out."""
        while True:
            try:
                await self.quota.roll_call(self.incarnation, self.clock.now())
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug("roll call not made (the last count of replicas stays): %s", exc)
            await asyncio.sleep(ROLL_CALL_S)

    async def send_cancel(self, request_id: str, team: str) -> None:
        """``DELETE``: publish a tombstone and wait until the broker stored it."""
        record = CancelRecord(id=request_id, team=team, reason="api", ts=self.clock.now())
        await self.cancels.send_now(record)

    async def produce(self, env: RequestEnvelope) -> None:
        """Store ``env`` on its lane (raises the broker's error); from then on it supersedes
        its session's older keystrokes."""
        await self.admission.produce(env)
        self.cancels.accepted(env)

    def client_gone(self, env: RequestEnvelope) -> None:
        """The client went away: count it as 499 and tell the worker to drop or abort."""
        metrics.CLIENT_GONE.labels(env.cls).inc()
        metrics.RESPONSES.labels(env.cls, "499").inc()
        log.info(
            "client gone before the end of %s (499)",
            env.id,
            extra={"request_id": env.id, "team": env.team, "cls": env.cls},
        )
        self.cancels.add(env)

    async def readiness(self) -> dict[str, dict[str, Any]]:
        """Each dependency's state, for the admin's ``/readyz`` (others see ready or not).
        Errors are named by kind; what the server said is in the log."""
        checks: dict[str, dict[str, Any]] = {}
        try:
            # A metadata round trip: the producer's cached metadata (partitions_for) answers
            # for a broker that has died.
            await asyncio.wait_for(self.producer.client.fetch_all_metadata(), 2.0)
            checks["kafka"] = {"ok": True}
        except (KafkaError, TimeoutError) as exc:
            log.warning("readiness: Kafka does not answer: %s", described(exc))
            checks["kafka"] = {"ok": False, "error": type(exc).__name__}
        try:
            # Through the circuit: a load balancer's probe must not wait on a Redis that hangs.
            await self.circuit.hot(self.redis.ping)
            checks["redis"] = {"ok": True}
            now = self.clock.now()  # workers stamp their beats on Redis's clock
            for pool in POOLS:
                live = await self.circuit.hot(
                    partial(
                        self.redis.zcount, self.keys.workers(pool), now - HEARTBEAT_TTL_S, "+inf"
                    )
                )
                checks[f"workers.{pool}"] = {
                    "ok": live > 0,
                    "live": live,
                    # As its probe's (below): a batch pool down leaves the ingress ready.
                    **({"degraded": True} if pool == "batch" and not live else {}),
                }
        except (RedisError, OSError) as exc:
            # Degraded, not down: keys and breaker levels come from memory, quota from the
            # local limiter, replies through Kafka.
            if not self.circuit.open:
                log.warning("readiness: Redis does not answer: %s", described(exc))
            checks["redis"] = {"ok": False, "degraded": True, "error": type(exc).__name__}
        checks["replies"] = {"ok": self.replies.healthy, "degraded": not self.replies.healthy}
        for probed, probe in self.prober.results.items():
            checks[f"probe.{probed}"] = {
                "ok": probe.ok,
                "latency_ms": round(probe.latency_s * 1000, 1),
                "at": probe.ts,
                **({"error": probe.error} if probe.error else {}),
                # Batch lines wait on Kafka for their pool, and no ingress serves them better
                # than another: a batch pool down or stalled must not take the ingresses, and
                # every team's completions with them, out of rotation.
                **({"degraded": True} if probed == "batch" and not probe.ok else {}),
            }
        return checks
