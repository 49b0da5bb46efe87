"""API keys: created by the CLI, stored hashed in Redis, looked up by the ingress."""

from __future__ import annotations

import hashlib
import secrets
import time

import redis.asyncio as aioredis

from laneway.constants import RedisKeys

__all__ = ["create_key", "hash_key", "lookup_team", "revoke_key"]

_KEY_PREFIX = "lw-"


def hash_key(key: str) -> str:
    # Keys are 192-bit random tokens: a plain SHA-256 is enough, no slow KDF needed.
    return hashlib.sha256(key.encode()).hexdigest()


async def create_key(redis: aioredis.Redis, keys: RedisKeys, team: str) -> str:
    """A new key for ``team``; only its hash is stored, so it is shown once."""
    key = _KEY_PREFIX + secrets.token_urlsafe(24)
    await redis.hset(
        keys.api_key(hash_key(key)), mapping={"team": team, "created": str(time.time())}
    )
    await redis.sadd(keys.teams(), team)
    return key


async def revoke_key(redis: aioredis.Redis, keys: RedisKeys, key: str) -> bool:
    return bool(await redis.delete(keys.api_key(hash_key(key))))


async def lookup_team(redis: aioredis.Redis, keys: RedisKeys, key: str) -> str | None:
    if not key.startswith(_KEY_PREFIX):
        return None
    team = await redis.hget(keys.api_key(hash_key(key)), "team")
    if team is None:
        return None
    return team.decode() if isinstance(team, bytes) else team
