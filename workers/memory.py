"""Memory pressure: low-priority work makes way while the engine's KV cache is nearly full.

A KV cache that fills up stalls every sequence on the engine (vLLM preempts and recomputes
them; a GPU has no more to give). At ``LANEWAY_MEMORY_SHED_AT`` KV-cache usage or above (vLLM's
own figure, an upstream's ``/metrics``, the simulation's ``LANEWAY_SIM_KV_TOKENS``) a worker:

- starts no *sheddable* work (batch, and the lo band); hi-band work starts as ever, and the lo
  partitions are paused so that waiting lo work does not crowd hi work out of the worker;
- aborts the sheddable work that runs, the newest first (the least work lost), a quarter of
  it per check while usage stays at the mark; on a shared engine the lo band only once no
  batch runs on it (batch first). An aborted request goes back to the front of its worker's
  queue with its offset uncommitted: it runs again when the pressure ends, and a crash
  meanwhile re-runs it from Kafka. Nothing is lost; a batch line's result is still written
  once. The client sees only a longer wait (a stream pauses; the re-run repeats the text
  already sent, which the ingress skips), and the request's usage event counts its aborts
  (``preempted``). Work shed after it started is not held to its start deadline again (it
  met it); work that waits without having started keeps it: a lo completion that cannot
  start within its deadline ends as ``expired`` (504), as it would in any queue.

The pressure ends once usage has stayed below ``LANEWAY_MEMORY_RESUME_AT`` for
``LANEWAY_MEMORY_COOLDOWN_S``: one dip does not restart everything at once only to shed it
again. Each beginning and end is logged, put on ``laneway.control`` (``MemoryPressure``) and
exported (``laneway_memory_pressure``, ``laneway_memory_shed_total``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.redis_circuit import circuit_of
from laneway.schema import MemoryPressure, RequestEnvelope
from workers import metrics
from workers.dispatch import Work
from workers.execution import RequestExecutor
from workers.settings import WorkerSettings
from workers.sim import SimEngine
from workers.types import Engine

__all__ = ["MemoryGuard", "PressureGauge", "announcer", "sheddable"]

log = logging.getLogger(__name__)

# A read of the simulated hold that takes longer is given up (the next beat reads again).
_HOLD_READ_TIMEOUT_S = 1.0


def sheddable(env: RequestEnvelope) -> bool:
    """Work memory pressure may hold back and abort: batch and the lo band, never hi."""
    return env.cls == "batch" or env.band == "lo"


def announcer(
    producer: AIOKafkaProducer, topic: str
) -> Callable[[MemoryPressure], Awaitable[None]]:
    """Sends each beginning and end of pressure to ``topic`` (``laneway.control``)."""

    async def announce(record: MemoryPressure) -> None:
        try:
            await producer.send(topic, record.to_json(), key=record.subject.encode())
        except KafkaError as exc:
            log.warning("memory pressure record not sent to %s: %s", topic, exc)

    return announce


class PressureGauge:
    """When pressure begins and ends, from usage readings (pure: the clock is passed in)."""

    def __init__(self, shed_at: float, resume_at: float, cooldown_s: float) -> None:
        self.shed_at = shed_at
        self.resume_at = resume_at
        self.cooldown_s = cooldown_s
        self.pressed = False
        self._low_since: float | None = None

    def observe(self, now: float, usage: float) -> bool | None:
        """One reading: True when the pressure begins, False when it ends, else None."""
        if usage >= self.shed_at:
            self._low_since = None
            if self.pressed:
                return None
            self.pressed = True
            return True
        if not self.pressed:
            return None
        if usage >= self.resume_at:
            self._low_since = None
            return None
        if self._low_since is None:
            self._low_since = now
        if now - self._low_since < self.cooldown_s:
            return None
        self.pressed, self._low_since = False, None
        return False


class MemoryGuard:
    """One worker's watch on its engine's memory (module docstring).

    ``running`` is the worker's work on the engine (by request id), ``announce`` sends a
    record to ``laneway.control``, ``changed`` is called when the pressure begins or ends
    (the dispatcher and the fetch loop look again), and ``batch_elsewhere`` says how much
    batch runs on a shared engine (0 when the engine is the worker's own).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        executor: RequestExecutor,
        *,
        running: Mapping[str, Work],
        announce: Callable[[MemoryPressure], Awaitable[None]],
        changed: Callable[[], None],
        batch_elsewhere: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = settings.pool
        self.worker_id = settings.worker_id
        self.check_s = settings.memory_check_ms / 1000
        self.gauge = PressureGauge(
            settings.memory_shed_at, settings.memory_resume_at, settings.memory_cooldown_s
        )
        self.engine = engine
        self.executor = executor
        self.running = running
        self.announce = announce
        self.changed = changed
        self.batch_elsewhere = batch_elsewhere
        self.clock = clock
        self.shed_total = 0  # requests shed since the worker started
        self._shed_now = 0  # ... since the current pressure began

    @property
    def pressed(self) -> bool:
        return self.gauge.pressed

    def holds(self, env: RequestEnvelope) -> bool:
        """Whether ``env`` must wait before it starts (the dispatcher asks)."""
        return self.gauge.pressed and sheddable(env)

    async def loop(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.check_s)

    async def check(self) -> None:
        """Read the engine's usage once: begin or end the pressure, shed what must go."""
        usage = self.engine.stats().kv_cache_usage
        metrics.KV_CACHE_USAGE.labels(self.pool).set(usage)
        change = self.gauge.observe(self.clock(), usage)
        if change is not None:
            await self._turned(change, usage)
        if self.gauge.pressed and usage >= self.gauge.shed_at:
            await self._shed(usage)

    async def _shed(self, usage: float) -> None:
        """Abort the newest quarter (at least one) of the sheddable work on the engine."""
        if self.pool != "batch" and self.batch_elsewhere() > 0:
            return  # a shared engine: its batch goes first
        candidates = [
            work
            for work in self.running.values()
            if sheddable(work.env)
            and work.env.id in self.executor.live
            and work.env.id not in self.executor.preempted
        ]
        if not candidates:
            return
        count = max(1, math.ceil(len(candidates) / 4))
        asked = 0
        for work in reversed(candidates[-count:]):
            if await self.executor.preempt(work.env.id, taken=self._shed_one):
                asked += 1
        if asked:
            log.warning(
                "engine memory at %.0f%%: aborting %d of %d %s requests, to run again below %.0f%%",
                usage * 100,
                asked,
                len(candidates),
                "batch" if self.pool == "batch" else "lo-band",
                self.gauge.resume_at * 100,
            )

    def _shed_one(self, env: RequestEnvelope) -> None:
        """An abort asked for took effect: ``env`` runs again later. Counted here, not when
        asked: one that came during the request's last step found it ending as it would
        have, and nothing was shed."""
        self.shed_total += 1
        self._shed_now += 1
        metrics.MEMORY_SHED.labels(self.pool, env.band).inc()

    async def _turned(self, pressed: bool, usage: float) -> None:
        metrics.MEMORY_PRESSURE.labels(self.pool).set(1 if pressed else 0)
        if pressed:
            self._shed_now = 0
            log.warning(
                "engine memory at %.0f%% (shed at %.0f%%): %s work waits and is shed",
                usage * 100,
                self.gauge.shed_at * 100,
                "batch" if self.pool == "batch" else "lo-band",
            )
        else:
            log.warning(
                "engine memory back at %.0f%% (below %.0f%% for %.0f s): shed work runs again "
                "(%d requests were shed)",
                usage * 100,
                self.gauge.resume_at * 100,
                self.gauge.cooldown_s,
                self._shed_now,
            )
        self.changed()
        await self.announce(
            MemoryPressure(
                subject=f"memory:{self.worker_id}",
                pool=self.pool,
                worker=self.worker_id,
                pressed=pressed,
                kv_cache_usage=round(usage, 4),
                shed_at=self.gauge.shed_at,
                resume_at=self.gauge.resume_at,
                shed=self._shed_now,
            )
        )

    async def follow_simulated_hold(self, redis: aioredis.Redis, key: str) -> None:
        """Simulation only: take the share of KV memory a drill holds from Redis
        (``RedisKeys.sim_kv_hold``; gone: none). Other engines' memory is their own."""
        if not isinstance(self.engine, SimEngine):
            return
        try:
            raw = await circuit_of(redis).background(
                partial(redis.get, key), timeout_s=_HOLD_READ_TIMEOUT_S
            )
        except (RedisError, OSError):
            return  # kept as it was until Redis answers
        try:
            share = float(raw) if raw is not None else 0.0
        except ValueError:
            log.warning("simulated KV hold %r in %s is no number; ignored", raw, key)
            share = 0.0
        self.engine.hold_kv(share if 0.0 <= share <= 1.0 else 0.0)
