"""The ingress side of the tiered breaker: which route serves a request, or a 503.

The streams app writes breaker levels to Redis per model route and per (route, team); the
gate reads both for a request's model and acts on the higher one:

| level | route                        | queue         |
|-------|------------------------------|---------------|
| 0     | the model                    | fail fast     |
| 1     | its quantized variant        | wait until the deadline |
| 2     | its fallback model           | wait until the deadline |
| 3     | refused: 503 + Retry-After   | (the team, or everyone when the route is at 3) |

Levels are cached in-process for at most one second per (model, team), so the admission path
does not pay a Redis round trip per request. The read goes through the process's Redis circuit
(the hot timeout at most); while Redis does not answer, the last levels read stay in force.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from laneway.cache import SharedReads
from laneway.constants import RedisKeys
from laneway.errors import ServiceUnavailable
from laneway.metrics import BREAKER_LEVEL
from laneway.redis_circuit import circuit_of

__all__ = ["BREAKER_CACHE_S", "BreakerGate", "BreakerGateSettings", "RouteDecision"]

log = logging.getLogger(__name__)

# How stale a breaker level may be at the ingress: one second bounds the delay from a
# decision of the streams app to its effect, and spares Redis a read per request.
BREAKER_CACHE_S = 1.0
ISOLATED = 3
_DEFAULT_RETRY_AFTER_S = 30.0


class BreakerGateSettings(Protocol):
    """``IngressSettings.breaker_routes``: model → {"quantized": name, "fallback": name}."""

    @property
    def breaker_routes(self) -> Mapping[str, Mapping[str, str]]: ...


@dataclass(frozen=True, slots=True)
class RouteDecision:
    route: str
    level: int
    wait_in_queue: bool  # level ≥ 1: admit into the queue up to the deadline, don't fail fast


@dataclass(frozen=True, slots=True)
class _Levels:
    route: int
    team: int
    retry_after: float
    expires: float


def _parse(raw: bytes | str | None) -> tuple[int, float]:
    if raw is None:
        return 0, _DEFAULT_RETRY_AFTER_S
    try:
        data = orjson.loads(raw)
        level = min(max(int(data["level"]), 0), ISOLATED)
        retry_after = float(data.get("cooldown_s") or _DEFAULT_RETRY_AFTER_S)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        log.warning("unreadable breaker state %r: treated as level 0", raw)
        return 0, _DEFAULT_RETRY_AFTER_S
    return level, retry_after


class BreakerGate:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        settings: BreakerGateSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.circuit = circuit_of(redis)
        self.routes = settings.breaker_routes
        self.clock = clock
        self._cache: dict[tuple[str, str], _Levels] = {}
        self._reads: SharedReads[_Levels] = SharedReads()

    async def route_for(self, team: str, model: str) -> RouteDecision:
        """The route of ``team``'s request for ``model``; ``ServiceUnavailable`` at level 3."""
        levels = await self._levels(team, model)
        level = max(levels.route, levels.team)
        if level >= ISOLATED:
            who = f"model {model!r}" if levels.route >= ISOLATED else f"team {team!r} on {model!r}"
            raise ServiceUnavailable(
                f"{who} is isolated by the breaker (error rate above the level-3 threshold); "
                f"retry after {levels.retry_after:.0f}s",
                retry_after=levels.retry_after,
            )
        alternatives = self.routes.get(model, {})
        if level == 2:
            route = alternatives.get("fallback") or alternatives.get("quantized") or model
        elif level == 1:
            route = alternatives.get("quantized") or model
        else:
            route = model
        return RouteDecision(route=route, level=level, wait_in_queue=level >= 1)

    async def _levels(self, team: str, model: str) -> _Levels:
        cached = self._cache.get((model, team))
        if cached is not None and cached.expires > self.clock():
            return cached
        # Requests that find the levels expired at once share one read.
        return await self._reads.read(f"{model}\0{team}", lambda: self._read(team, model))

    async def _read(self, team: str, model: str) -> _Levels:
        now = self.clock()
        cached = self._cache.get((model, team))
        names = [self.keys.breaker(model), self.keys.breaker(model, team)]
        try:
            raw_route, raw_team = await self.circuit.hot(lambda: self.redis.mget(names))
        except (RedisError, OSError) as exc:
            if cached is not None:
                # The streams app cannot move a level while Redis is away either: the last
                # levels read stay, until Redis answers.
                self._cache[(model, team)] = replace(cached, expires=now + BREAKER_CACHE_S)
                return cached
            # Fail open: an unreachable Redis must not take the whole service down with it.
            log.warning("breaker levels unreadable (%s): serving %s at level 0", exc, model)
            raw_route = raw_team = None
        route_level, route_retry = _parse(raw_route)
        BREAKER_LEVEL.labels(model).set(route_level)
        team_level, team_retry = _parse(raw_team)
        levels = _Levels(
            route=route_level,
            team=team_level,
            retry_after=route_retry if route_level >= ISOLATED else team_retry,
            expires=now + BREAKER_CACHE_S,
        )
        if len(self._cache) > 10_000:  # bound memory on many (model, team) pairs
            self._cache = {k: v for k, v in self._cache.items() if v.expires > now}
        self._cache[(model, team)] = levels
        return levels
