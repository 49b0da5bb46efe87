"""Who is calling: bearer key → team, team → record, both cached briefly in-process."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from laneway.apikeys import lookup_team
from laneway.cache import TtlCache
from laneway.constants import API_KEY_CACHE_S, RedisKeys
from laneway.errors import ServiceUnavailable, Unauthorized
from quota.teams import Team, get_team

__all__ = ["Caller", "CallerResolver"]


@dataclass(frozen=True, slots=True)
class Caller:
    team: Team
    key_hint: str  # last characters of the key, for logs


class CallerResolver:
    def __init__(self, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self.redis = redis
        self.keys = keys
        self._teams_by_key: TtlCache[str] = TtlCache(API_KEY_CACHE_S)
        self._teams: TtlCache[Team] = TtlCache(API_KEY_CACHE_S)

    async def resolve(self, authorization: str | None) -> Caller:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthorized("missing 'Authorization: Bearer <key>' header")
        key = authorization[7:].strip()
        try:
            team_name = self._teams_by_key.get(key)
            if team_name is None:
                team_name = await lookup_team(self.redis, self.keys, key)
                if team_name is None:
                    raise Unauthorized(
                        "unknown API key (create one with `laneway keys create --team T`)"
                    )
                self._teams_by_key.put(key, team_name)
            team = self._teams.get(team_name)
            if team is None:
                team = await get_team(self.redis, self.keys, team_name)
                self._teams.put(team_name, team)
        except (RedisError, OSError) as exc:
            # Redis is down: a key seen before keeps working on its last known record.
            team_name = self._teams_by_key.get(key, stale_ok=True)
            team = self._teams.get(team_name, stale_ok=True) if team_name else None
            if team is None:
                raise ServiceUnavailable(
                    f"cannot check this API key now (key store unreachable: {exc})", retry_after=2
                ) from exc
        return Caller(team=team, key_hint=key[-4:])
