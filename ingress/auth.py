"""Who is calling: bearer key → team, team → record, both cached briefly in-process (a
team's record until ``quota.set_team`` announces a change of it: ``team_changed``).

Keys are known by their hash here too (no key is kept in memory longer than a request). A
revoked key is refused first, from the revocations every replica reads off Kafka, so it
stays refused while Redis is away; an unknown key is refused from memory for a while, so a
client repeating a wrong key cannot make each request a Redis read. Redis reads go through
the process's Redis circuit: the hot timeout at most, none while Redis does not answer (then
a key seen before works on its last record, as when Redis refuses connections).
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from laneway.apikeys import hash_key, key_id, lookup_hash, well_formed
from laneway.cache import SharedReads, TtlCache
from laneway.constants import API_KEY_CACHE_S, UNKNOWN_KEY_CACHE_S, RedisKeys
from laneway.errors import ServiceUnavailable, Unauthorized
from laneway.redis_circuit import circuit_of
from quota.teams import Team, get_team

__all__ = ["Caller", "CallerResolver"]

log = logging.getLogger(__name__)

_UNKNOWN = "unknown API key (create one with `laneway keys create --team T`)"


@dataclass(frozen=True, slots=True)
class Caller:
    team: Team
    key_id: str  # names the key in logs (``laneway keys list``); not the key


class CallerResolver:
    def __init__(
        self, redis: aioredis.Redis, keys: RedisKeys, revoked: Container[str] = frozenset()
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.revoked = revoked
        self.circuit = circuit_of(redis)
        self._teams_by_key: TtlCache[str] = TtlCache(API_KEY_CACHE_S)  # by key hash
        self._unknown: TtlCache[bool] = TtlCache(UNKNOWN_KEY_CACHE_S)
        self._teams: TtlCache[Team] = TtlCache(API_KEY_CACHE_S)
        # A burst with one key not cached reads it (and its team) once.
        self._key_reads: SharedReads[str | None] = SharedReads()
        self._team_reads: SharedReads[Team] = SharedReads()

    async def resolve(self, authorization: str | None) -> Caller:
        if not authorization:
            raise Unauthorized("missing 'Authorization: Bearer <key>' header")
        if authorization[:7].lower() != "bearer ":
            # The value is not shown: it may be the key itself, sent without its scheme.
            raise Unauthorized("the Authorization header must be 'Bearer <key>'")
        key = authorization[7:].strip()
        if not well_formed(key):
            raise Unauthorized(_UNKNOWN)
        digest = hash_key(key)
        if digest in self.revoked:
            raise Unauthorized("this API key was revoked (ask for a new one)")
        if self._unknown.get(digest):
            raise Unauthorized(_UNKNOWN)
        try:
            team_name = self._teams_by_key.get(digest)
            if team_name is None:
                team_name = await self._key_reads.read(digest, lambda: self._read_key(digest))
                if team_name is None:
                    raise Unauthorized(_UNKNOWN)
            team = self._teams.get(team_name)
            if team is None:
                named = team_name
                team = await self._team_reads.read(named, lambda: self._read_team(named))
        except (RedisError, OSError) as exc:
            # Redis is down or hangs: a key seen before keeps working on its last known record
            # (a revoked one does not: the check above reads Kafka's revocations, not Redis).
            team_name = self._teams_by_key.get(digest, stale_ok=True)
            team = self._teams.get(team_name, stale_ok=True) if team_name else None
            if team is None:
                log.warning("API key %s not checked, Redis not answering: %s", key_id(digest), exc)
                raise ServiceUnavailable(
                    "cannot check this API key now (the key store does not answer); retry shortly",
                    retry_after=2,
                ) from exc
        return Caller(team=team, key_id=key_id(digest))

    async def _read_key(self, digest: str) -> str | None:
        """The team of a key hash, from Redis (None: unknown, remembered as such)."""
        team_name = await self.circuit.hot(lambda: lookup_hash(self.redis, self.keys, digest))
        if team_name is None:
            self._unknown.put(digest, True)
        else:
            self._teams_by_key.put(digest, team_name)
        return team_name

    async def _read_team(self, name: str) -> Team:
        changes = self._teams.changes
        team = await self.circuit.hot(lambda: get_team(self.redis, self.keys, name))
        self._teams.put_if(changes, name, team)
        return team

    def team_changed(self, name: str | None) -> None:
        """``name``'s record changed (None: any team's may have): read again at its next
        request, the cached one kept only as the fallback while Redis does not answer."""
        self._teams.expire(name)
