"""A worker's heartbeat: what it holds and what its engine does, written to Redis every
``LANEWAY_HEARTBEAT_INTERVAL_S`` (the ingress's readiness, the console and the pool's scaling
signal read it), the worker's view of Redis's clock kept in step, and the pool's scaling
signal computed from every beat. A missed beat never stops the worker: while Redis does not
answer (its circuit open) the beat is skipped at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
import redis.asyncio as aioredis

from laneway.clock import RedisClock
from laneway.constants import HEARTBEAT_TTL_S, RedisKeys
from laneway.redis_circuit import circuit_of
from workers.scaling import ScalingSignal

__all__ = ["BEAT_TIMEOUT_S", "Heartbeat"]

log = logging.getLogger(__name__)

# A heartbeat is written within this long or counted as a Redis failure (every 2 s by default).
BEAT_TIMEOUT_S = 1.0


class Heartbeat:
    def __init__(
        self,
        *,
        pool: str,
        worker_id: str,
        interval_s: float,
        redis: aioredis.Redis,
        keys: RedisKeys,
        clock: RedisClock,
        scaling: ScalingSignal,
        describe: Callable[[float], Awaitable[dict[str, Any]]],
        after: Callable[[], Awaitable[None]],
    ) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.redis = redis
        self.keys = keys
        self.clock = clock
        self.scaling = scaling
        self.describe = describe  # the beat's record, at Redis's time
        self.after = after  # the worker's own periodic work, after each beat
        self.wrote = False  # the last beat's write succeeded (Redis takes writes)

    async def loop(self) -> None:
        circuit = circuit_of(self.redis)
        while True:
            now = self.clock.now()  # Redis's clock, as the ingress reads the beats on it
            info = await self.describe(now)
            self.wrote = False
            try:
                await circuit.background(partial(self._write, info, now), timeout_s=BEAT_TIMEOUT_S)
                self.wrote = True
                await self.clock.sync(self.redis)
            except Exception as exc:  # noqa: BLE001 - a missed beat must never stop the worker
                if not circuit.open:  # an open circuit said so once already
                    log.warning("heartbeat to Redis failed: %s", exc)
            if not circuit.open:  # the signal reads every beat from Redis
                await self.scaling.beat()
            await self.after()
            await asyncio.sleep(self.interval_s)

    async def leave(self) -> None:
        """Take this worker off the pool's list (a clean stop), unless Redis does not answer."""
        await circuit_of(self.redis).background(
            partial(self.redis.zrem, self.keys.workers(self.pool), self.worker_id),
            timeout_s=BEAT_TIMEOUT_S,
        )

    async def _write(self, info: dict[str, Any], now: float) -> None:
        key = self.keys.workers(self.pool)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {self.worker_id: now})
            pipe.zremrangebyscore(key, 0, now - 10 * HEARTBEAT_TTL_S)
            pipe.set(
                self.keys.worker_info(self.worker_id),
                orjson.dumps(info),
                ex=int(HEARTBEAT_TTL_S * 2),
            )
            await pipe.execute()
