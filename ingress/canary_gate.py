"""Which requests go to a model's canary: read from Redis, cached for a second.

A Redis that fails or a record that does not parse sends everything to the stable route: a
canary is an experiment, and without its state the safe answer is the route that was there
before it. The read goes through the process's Redis circuit (``laneway.redis_circuit``): a
Redis that hangs holds a request back by the hot timeout at most, and not at all once the
circuit is open.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError

from laneway.canary import CanaryState, canary_route, get_canary
from laneway.constants import RedisKeys
from laneway.errors import LanewayError
from laneway.redis_circuit import circuit_of

__all__ = ["CANARY_CACHE_S", "CanaryGate"]

log = logging.getLogger(__name__)

CANARY_CACHE_S = 1.0


class CanaryGate:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.circuit = circuit_of(redis)
        self.keys = keys
        self.clock = clock
        self._cache: dict[str, tuple[float, CanaryState | None]] = {}

    async def route(self, model: str, team: str, sticky: str) -> str | None:
        """The canary target for this request, or None to keep the stable route."""
        return canary_route(await self._state(model), team, sticky)

    async def _state(self, model: str) -> CanaryState | None:
        now = self.clock()
        cached = self._cache.get(model)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            state = await self.circuit.hot(lambda: get_canary(self.redis, self.keys, model))
        except (RedisError, OSError) as exc:
            if not self.circuit.open:  # an open circuit has said so once already
                log.warning("canary of %s unreadable (%s): stable route only", model, exc)
            state = None
        except (ValidationError, LanewayError) as exc:
            log.error(  # noqa: TRY400 - the record is bad, not our code: no traceback
                "canary record of %s is unusable (%s): stable route only", model, exc
            )
            state = None
        self._cache[model] = (now + CANARY_CACHE_S, state)
        return state
