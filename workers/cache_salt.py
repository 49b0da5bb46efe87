"""Prefix-cache salts: an engine's prefix cache is shared within a team, never across teams.

An engine that caches prompt prefixes (vLLM's automatic prefix caching) answers a prompt that
starts as an earlier one did faster, and reports the tokens it found cached
(``usage.prompt_tokens_details.cached_tokens``). Shared by every tenant, that cache tells one
team whether another team sent a given text lately: a probe of guessed secrets, answered by
the usage field and by the time to first token. vLLM salts the cache per request
(``cache_salt``): blocks are shared only between requests with the same salt. Each request
carries its team's salt, HMAC-SHA256 of the team's name under a secret of the deployment
(256 bits, base64url: what vLLM asks of a salt), so a team still reuses its own prefixes
(its system prompt, its repository's context) and nobody can compute another team's salt.

The secret is kept in Redis, made by the first worker that asks (``SET NX``), so every
worker in front of one engine salts a team alike. Until a worker has read it (Redis down at
its start) it salts with a secret of its own: teams stay apart, only reuse across workers
waits.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from laneway.constants import RedisKeys

__all__ = ["CacheSalts"]

log = logging.getLogger(__name__)

_SECRET_BYTES = 32
_MAX_TEAMS = 10_000  # salts kept; past it the table starts again (a salt is cheap to make)


class CacheSalts:
    """The salt of each team's requests."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secrets.token_bytes(_SECRET_BYTES) if secret is None else secret
        self.shared = secret is not None  # the deployment's secret, not this process's own
        self._salts: dict[str, str] = {}

    def of(self, team: str) -> str:
        salt = self._salts.get(team)
        if salt is None:
            if len(self._salts) >= _MAX_TEAMS:
                self._salts.clear()
            mac = hmac.new(self._secret, team.encode(), hashlib.sha256).digest()
            salt = self._salts[team] = base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
        return salt

    async def adopt(self, redis: aioredis.Redis, keys: RedisKeys) -> None:
        """Take the deployment's secret from Redis, making it if no worker has yet; raises
        Redis's errors, and ValueError for a key that holds no such secret (this process's
        own secret stays)."""
        key = keys.cache_salt_secret()
        stored = None
        for _ in range(3):  # deleted between the two commands: made again
            try:
                await redis.set(key, secrets.token_hex(_SECRET_BYTES), nx=True)
                stored = await redis.get(key)
            except ResponseError as exc:
                if "WRONGTYPE" in str(exc):  # no secret; other answers (read-only) pass
                    raise ValueError(f"{key} holds another type of value: {exc}") from exc
                raise
            if stored is not None:
                break
        if stored is None:
            raise ValueError(f"{key} is deleted as soon as it is made")
        text = stored.decode(errors="replace") if isinstance(stored, bytes) else str(stored)
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            secret = b""
        if len(secret) < _SECRET_BYTES:
            raise ValueError(
                f"{key} is not a secret laneway made ({_SECRET_BYTES} bytes in hex): delete "
                "it and restart the workers (teams' cached prefixes are then made anew)"
            )
        self._secret = secret
        self._salts.clear()
        self.shared = True
