"""The scaling signal: how many replicas a pool wants, from its lag, the lag's growth and its
engines' saturation.

Every worker computes its pool's signal at each heartbeat, from the heartbeats of all the
pool's live workers in Redis, and exports it as ``laneway_desired_replicas{pool}`` (so a
Prometheus trigger finds it on any replica). The pool's lead worker (the lowest live id) also
writes it to Redis for ``laneway up``'s local autoscaler and puts a ``ScalingDecision`` on
``laneway.control`` whenever the count changes. The rule (``desired_replicas``):

    demand = running + queued + lag + max(0, lag growth) × horizon        (requests)
    by load = ⌈demand / (capacity per replica × target utilisation)⌉
    by memory = ⌈replicas × KV-cache usage / KV high⌉ when usage is above KV high
    desired = clamp(max(by load, by memory), min, max)

Up is at once; down only once every count within the scale-down window was lower (as the
HPA's stabilisation window), so a pause between bursts does not stop a replica.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from prometheus_client import Gauge
from redis.exceptions import RedisError

from laneway.constants import HEARTBEAT_TTL_S, SCALING_DECISION_TTL_S
from laneway.schema import ScalingDecision
from workers.settings import WorkerSettings

__all__ = [
    "DESIRED_REPLICAS",
    "PoolLoad",
    "ScalingPolicy",
    "ScalingRule",
    "ScalingSignal",
    "desired_replicas",
    "pool_load",
]

log = logging.getLogger(__name__)

DESIRED_REPLICAS = Gauge(
    "laneway_desired_replicas",
    "Replicas the pool's scaling signal asks for (lag, its growth, engine saturation)",
    ["pool"],
)
LAG_GROWTH = Gauge(
    "laneway_lag_growth",
    "Growth of the pool's consumer lag, records per second (the scaling signal's view)",
    ["pool"],
)
# Lag growth is measured over this window: one heartbeat apart is too noisy (a fetch of 64
# records makes it jump), much longer reacts late to a surge.
_GROWTH_WINDOW_S = 10.0


@dataclass(frozen=True)
class PoolLoad:
    """A pool's work at one moment, summed over its live workers."""

    replicas: int
    lag: int = 0  # records on the pool's topics no worker fetched yet
    queued: int = 0  # fetched, waiting in dispatch queues (and engine queues)
    running: int = 0  # on the engines
    capacity: int = 0  # what the engines can run at once
    kv_cache_usage: float = 0.0  # the highest of the workers' engines (0..1)


@dataclass(frozen=True)
class ScalingPolicy:
    """The knobs of the rule (``LANEWAY_SCALE_*``)."""

    min_replicas: int = 1
    max_replicas: int = 6
    target_utilisation: float = 0.7
    growth_horizon_s: float = 10.0
    kv_high: float = 0.9
    scale_down_window_s: float = 60.0

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> ScalingPolicy:
        return cls(
            min_replicas=settings.scale_min_replicas,
            max_replicas=settings.scale_max_replicas,
            target_utilisation=settings.scale_target_utilisation,
            growth_horizon_s=settings.scale_growth_horizon_s,
            kv_high=settings.scale_kv_high,
            scale_down_window_s=settings.scale_down_window_s,
        )


def desired_replicas(load: PoolLoad, growth: float, policy: ScalingPolicy) -> tuple[int, str]:
    """Replicas ``load`` needs now (before the scale-down window), and why."""
    if load.replicas <= 0 or load.capacity <= 0:
        return policy.min_replicas, "no live worker to measure"
    per_replica = load.capacity / load.replicas
    demand = load.running + load.queued + load.lag + max(0.0, growth) * policy.growth_horizon_s
    by_load = math.ceil(demand / (per_replica * policy.target_utilisation) - 1e-9)
    by_memory = 0
    if load.kv_cache_usage > policy.kv_high:
        by_memory = math.ceil(load.replicas * load.kv_cache_usage / policy.kv_high - 1e-9)
    wanted = max(by_load, by_memory)
    desired = min(max(wanted, policy.min_replicas), policy.max_replicas)
    reason = (
        f"demand {demand:.0f} on {per_replica:.0f} slots per replica at "
        f"{policy.target_utilisation:.0%}"
    )
    if by_memory > by_load:
        reason = f"KV cache at {load.kv_cache_usage:.0%} (above {policy.kv_high:.0%})"
    if wanted != desired:
        reason += f"; {wanted} clamped to {policy.min_replicas}..{policy.max_replicas}"
    return desired, reason


class ScalingRule:
    """``desired_replicas`` over time: lag growth from the recent past, and the scale-down
    window. Pure (the clock is passed in), so it is tested without a broker."""

    def __init__(self, policy: ScalingPolicy) -> None:
        self.policy = policy
        self._lags: deque[tuple[float, int]] = deque()
        self._wanted: deque[tuple[float, int]] = deque()

    def growth(self, now: float, lag: int) -> float:
        """Records per second the lag grew by over the growth window (negative: shrank)."""
        self._lags.append((now, lag))
        while len(self._lags) > 2 and self._lags[1][0] <= now - _GROWTH_WINDOW_S:
            self._lags.popleft()
        then, before = self._lags[0]
        return (lag - before) / (now - then) if now > then else 0.0

    def decide(self, now: float, load: PoolLoad) -> tuple[int, int, float, str]:
        """(desired, raw, growth, reason): raw is what the load asks now; desired the highest
        raw within the scale-down window."""
        growth = self.growth(now, load.lag)
        raw, reason = desired_replicas(load, growth, self.policy)
        self._wanted.append((now, raw))
        while self._wanted and self._wanted[0][0] < now - self.policy.scale_down_window_s:
            self._wanted.popleft()
        desired = max(wanted for _, wanted in self._wanted)
        if desired > raw:
            reason += f"; holding {desired} for the scale-down window"
        return desired, raw, growth, reason


def pool_load(pool: str, beats: Iterable[dict[str, Any]]) -> PoolLoad:
    """Sum the heartbeat records (``workers.heartbeat.Heartbeat``) of ``pool``'s workers."""
    live = [beat for beat in beats if beat.get("pool") == pool]
    queued = sum(int(b.get("dispatch_queue", 0)) + int(b.get("waiting", 0)) for b in live)
    backlog = sum(int(b.get("backlog", 0)) for b in live)
    return PoolLoad(
        replicas=len(live),
        lag=max(0, backlog - queued),  # a heartbeat's backlog is lag + queued
        queued=queued,
        running=sum(int(b.get("engine_inflight", 0)) for b in live),
        capacity=sum(int(b.get("capacity", 0)) for b in live),
        kv_cache_usage=max((float(b.get("kv_cache_usage") or 0.0) for b in live), default=0.0),
    )


class ScalingSignal:
    """One worker's part in its pool's signal; ``beat()`` runs after each heartbeat."""

    def __init__(
        self,
        settings: WorkerSettings,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pool = settings.pool
        self.worker_id = settings.worker_id
        self.keys = settings.keys
        self.control = settings.topics.control
        self.redis = redis
        self.producer = producer
        self.rule = ScalingRule(ScalingPolicy.from_settings(settings))
        self.clock = clock
        self.published: int | None = None

    async def beat(self) -> ScalingDecision | None:
        """Compute and publish the signal; None when Redis could not be read (a missed
        beat never stops the worker)."""
        try:
            ids, beats = await self._live_workers()
        except (RedisError, OSError) as exc:
            log.warning("scaling signal of %s: heartbeats unreadable: %s", self.pool, exc)
            return None
        now = self.clock()
        load = pool_load(self.pool, beats)
        desired, raw, growth, reason = self.rule.decide(now, load)
        DESIRED_REPLICAS.labels(self.pool).set(desired)
        LAG_GROWTH.labels(self.pool).set(growth)
        decision = ScalingDecision(
            subject=f"scaling:{self.pool}",
            pool=self.pool,
            desired=desired,
            previous=self.published,
            replicas=load.replicas,
            raw=raw,
            reason=reason,
            lag=load.lag,
            lag_growth=round(growth, 3),
            queued=load.queued,
            running=load.running,
            capacity=load.capacity,
            kv_cache_usage=round(load.kv_cache_usage, 4),
            ts=now,
        )
        if ids and min(ids) == self.worker_id:
            await self._publish(decision)
        else:
            self.published = None  # a lead again later announces its first count anew
        return decision

    async def _live_workers(self) -> tuple[list[str], list[dict[str, Any]]]:
        since = self.clock() - HEARTBEAT_TTL_S
        raw_ids = await self.redis.zrangebyscore(self.keys.workers(self.pool), since, "+inf")
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in raw_ids]
        if not ids:
            return [], []
        infos = await self.redis.mget([self.keys.worker_info(i) for i in ids])
        beats: list[dict[str, Any]] = []
        for worker_id, raw in zip(ids, infos, strict=True):
            try:
                beat = orjson.loads(raw) if raw is not None else None
            except orjson.JSONDecodeError:
                log.warning("scaling signal: unreadable heartbeat of %s", worker_id)
                continue
            if isinstance(beat, dict):
                beats.append(beat)
        return ids, beats

    async def _publish(self, decision: ScalingDecision) -> None:
        payload = decision.to_json()
        try:
            await self.redis.set(
                self.keys.scaling(self.pool), payload, ex=int(SCALING_DECISION_TTL_S)
            )
        except (RedisError, OSError) as exc:
            log.warning("scaling signal of %s: not stored in Redis: %s", self.pool, exc)
        if decision.desired == self.published:
            return
        try:
            await self.producer.send(self.control, payload, key=decision.subject.encode())
        except KafkaError as exc:
            log.warning("scaling signal of %s: not sent to %s: %s", self.pool, self.control, exc)
            return
        log.info(
            "pool %s: %s → %d replicas (%d live): %s",
            self.pool,
            "-" if self.published is None else self.published,
            decision.desired,
            decision.replicas,
            decision.reason,
        )
        self.published = decision.desired
