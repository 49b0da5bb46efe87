"""How often a team may cancel by id (``DELETE /v1/requests/{id}``).

Each cancel becomes a tombstone that every worker reads, whoever's request it names, so a
team must not be able to send them without bound. One counter per team and second in Redis
(the second by Redis's clock) holds the limit across replicas; while Redis does not answer
(within the hot timeout of the process's Redis circuit), each replica counts on its own.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from laneway.constants import RedisKeys
from laneway.errors import RateLimited
from laneway.redis_circuit import circuit_of

__all__ = ["CancelRateLimit"]

# KEYS: 1 the team's counter; ARGV: 1 cancels a second.
# Returns 0 when the call may go ahead, else the microseconds left in the current second.
_COUNT = """
local t = redis.call('TIME')
local second, micros = tonumber(t[1]), tonumber(t[2])
local v = redis.call('HMGET', KEYS[1], 's', 'n')
local n = tonumber(v[2]) or 0
if tonumber(v[1]) ~= second then n = 0 end
n = n + 1
redis.call('HSET', KEYS[1], 's', second, 'n', n)
redis.call('EXPIRE', KEYS[1], 2)
if n > tonumber(ARGV[1]) then return 1000000 - micros end
return 0
"""


class CancelRateLimit:
    """``check(team)`` passes, or raises ``RateLimited`` (429) until the next second."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, per_s: int) -> None:
        self.keys = keys
        self.per_s = per_s
        self._circuit = circuit_of(redis)
        self._count = redis.register_script(_COUNT)
        self._local: dict[str, tuple[int, int]] = {}  # team → (second, cancels in it)

    async def check(self, team: str) -> None:
        counter = self.keys.cancel_rate(team)
        try:
            wait_us = int(
                await self._circuit.hot(lambda: self._count(keys=[counter], args=[self.per_s]))
            )
        except (RedisError, OSError):
            wait_us = self._check_locally(team)
        if wait_us > 0:
            raise RateLimited(
                f"team {team!r} is over its limit of {self.per_s} cancels a second "
                "(LANEWAY_CANCELS_PER_S); a client that disconnects cancels its request too",
                team=team,
                limit=self.per_s,
                retry_after=wait_us / 1e6,
            )

    def _check_locally(self, team: str) -> int:
        now = time.time()
        second = int(now)
        last, count = self._local.get(team, (second, 0))
        count = count + 1 if last == second else 1
        if len(self._local) > 10_000:  # bounded memory: an outage's worth of teams
            self._local.clear()
        self._local[team] = (second, count)
        return int((second + 1 - now) * 1e6) if count > self.per_s else 0
