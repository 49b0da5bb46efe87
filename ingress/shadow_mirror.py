"""The ingress's side of shadow routes: after a request is stored, a copy may go to its model's
shadow route, and nothing about it can slow or fail the request itself.

- No wait on the request path: the shadow state is read from a per-model cache that a
  background task refreshes once a second (the request uses what the cache holds meanwhile),
  and the copy is produced by a task of its own, on a producer of its own (a shared one would
  queue keystrokes behind mirrors: one produce request per broker is in flight).
- Bounded: at most ``LANEWAY_SHADOW_MAX_IN_FLIGHT`` copies on their way to Kafka per replica;
  beyond that a mirror is skipped, not queued. So is every mirror of a model whose breaker is
  above level 0: the shadow is the first thing to go when the model is in trouble.
- A Redis that does not answer, or a record that does not parse, means no mirroring.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from pydantic import ValidationError
from redis.exceptions import RedisError

from ingress import metrics
from laneway.constants import RedisKeys, Topics
from laneway.errors import LanewayError
from laneway.redis_circuit import circuit_of
from laneway.schema import RequestEnvelope
from laneway.shadow import ShadowState, get_shadow, mirrored, shadow_envelope

__all__ = ["SHADOW_CACHE_S", "ShadowMirror"]

log = logging.getLogger(__name__)

SHADOW_CACHE_S = 1.0
# How long a stopping replica lets the copies still on their way reach Kafka.
_STOP_GRACE_S = 2.0

Skip = Literal["breaker", "busy"]


class ShadowMirror:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        topics: Topics,
        producer: AIOKafkaProducer,
        *,
        max_in_flight: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.circuit = circuit_of(redis)
        self.keys = keys
        self.topics = topics
        self.producer = producer
        self.max_in_flight = max_in_flight
        self.clock = clock
        self._cache: dict[str, tuple[float, ShadowState | None]] = {}
        self._reading: dict[str, asyncio.Task[None]] = {}
        self._sending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.producer.start()

    async def stop(self) -> None:
        """Let the copies on their way arrive (briefly), then close the producer."""
        for task in list(self._reading.values()):
            task.cancel()
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=_STOP_GRACE_S)
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, *self._reading.values(), return_exceptions=True)
        await self.producer.stop()

    def offer(self, env: RequestEnvelope, *, breaker_level: int) -> None:
        """Mirror ``env`` (already stored) when its model has a shadow that takes its key."""
        state = self._state(env.model)
        if state is None or not mirrored(state, env.team, env.session or env.id):
            return
        skip: Skip | None = None
        if breaker_level > 0:
            skip = "breaker"
        elif len(self._sending) >= self.max_in_flight:
            skip = "busy"
        if skip is not None:
            metrics.SHADOW.labels(env.model, f"skipped_{skip}").inc()
            return
        task = asyncio.create_task(self._send(shadow_envelope(env, state.target)))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, shadow: RequestEnvelope) -> None:
        try:
            delivery = await self.producer.send(
                self.topics.request(shadow.cls, shadow.band),
                shadow.to_json(),
                key=shadow.affinity.encode(),
            )
            await delivery
        except KafkaError as exc:
            metrics.SHADOW.labels(shadow.model, "failed").inc()
            log.info("shadow copy %s not stored: %r", shadow.id, exc)
            return
        metrics.SHADOW.labels(shadow.model, "mirrored").inc()

    def _state(self, model: str) -> ShadowState | None:
        """What the cache holds; a read in the background when it is older than a second."""
        cached = self._cache.get(model)
        if (cached is None or cached[0] <= self.clock()) and model not in self._reading:
            task = asyncio.create_task(self._read(model))
            self._reading[model] = task
            task.add_done_callback(lambda _: self._reading.pop(model, None))
        return cached[1] if cached is not None else None

    async def _read(self, model: str) -> None:
        try:
            state = await self.circuit.hot(lambda: get_shadow(self.redis, self.keys, model))
        except (RedisError, OSError) as exc:
            if not self.circuit.open:  # an open circuit has said so once already
                log.warning("shadow of %s unreadable (%s): no mirroring", model, exc)
            state = None
        except (ValidationError, LanewayError) as exc:
            log.error(  # noqa: TRY400 - the record is bad, not our code: no traceback
                "shadow record of %s is unusable (%s): no mirroring", model, exc
            )
            state = None
        self._cache[model] = (self.clock() + SHADOW_CACHE_S, state)
