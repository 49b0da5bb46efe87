"""API keys: created by the CLI or the admin API, stored hashed in Redis, revoked on Kafka.

A key is shown once, when it is created. Redis keeps its SHA-256 only
(``<prefix>:apikey:<hash>`` → team, created), and people name a key by its *id*: ``key-``
and the first 16 hex digits of that hash. A revocation deletes the record and is published
on the compacted ``laneway.keys`` topic, which every ingress reads: from then on it refuses
the key, also while Redis is away.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
import time
import unicodedata
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from redis.exceptions import RedisError

from laneway.constants import RedisKeys, Topics
from laneway.errors import BadRequest, NotFound
from laneway.redis_circuit import circuit_of
from laneway.schema import KeyRevocation

__all__ = [
    "KeyRecord",
    "check_team_name",
    "create_key",
    "find_key",
    "hash_key",
    "key_id",
    "list_keys",
    "lookup_hash",
    "lookup_team",
    "revoke_key",
    "well_formed",
]

KEY_PREFIX = "lw-"
_ID_PREFIX = "key-"
_ID_HEX = 16
_ID = re.compile(rf"^{_ID_PREFIX}[0-9a-f]{{{_ID_HEX}}}$")
# Keys are 35 characters; a bearer value much longer than that is not one of ours, and is
# refused before it is hashed or looked up.
_MAX_KEY_CHARS = 128


def hash_key(key: str) -> str:
    # Keys are 192-bit random tokens: a plain SHA-256 is enough, no slow KDF needed.
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key_hash: str) -> str:
    """The name of a key in lists and logs: safe to show, useless to call with."""
    return _ID_PREFIX + key_hash[:_ID_HEX]


def well_formed(key: str) -> bool:
    """Whether ``key`` can be a laneway key at all (no Redis read for anything else)."""
    return key.startswith(KEY_PREFIX) and len(key) <= _MAX_KEY_CHARS and key.isascii()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    hash: str
    team: str
    created: float

    def public(self) -> dict[str, Any]:
        """What the admin API and the CLI show of a key (never the key, nor its hash)."""
        return {"id": self.id, "team": self.team, "created": self.created}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


MAX_TEAM_NAME_CHARS = 200


async def check_team_name(redis: aioredis.Redis, keys: RedisKeys, team: str) -> None:
    """A new team's name as it is shown, logged, used as a label and as one path segment of
    the admin API and the console: not blank, without spaces around it, control or invisible
    characters or spaces other than the plain one (a name only those tell apart from another
    is a second team nobody can tell from the first), no '/' and not '.' or '..' (no URL
    reaches those), at most 200 characters. A team that has keys already keeps its name,
    whatever it is."""
    if not team.strip():
        raise BadRequest("team name is empty", param="team")
    shown = repr(team[:MAX_TEAM_NAME_CHARS])
    if "/" in team:
        problem = (
            f"team name {shown} must not contain '/': a team is one segment of the admin "
            "API's and the console's paths, and a '/' (even written %2F) splits it in two"
        )
    elif team in (".", ".."):
        problem = f"team name {shown} is a dot segment, which URLs resolve away"
    elif team != team.strip() or len(team) > MAX_TEAM_NAME_CHARS or any(_unseen(c) for c in team):
        problem = (
            f"team name {shown} must have no spaces around it, no control or invisible "
            "characters (a zero-width space, a right-to-left mark) and no spaces but the "
            f"plain one, and at most {MAX_TEAM_NAME_CHARS} characters"
        )
    else:
        return
    if not await redis.sismember(keys.teams(), team):
        raise BadRequest(problem, param="team")


def _unseen(char: str) -> bool:
    """A control or format character (a zero-width space, a bidirectional mark), a space or
    line break other than the plain space, a private or unassigned code point, or one of the
    letters and marks that show as nothing (Hangul fillers, a blank braille cell, variation
    selectors): shown as nothing, or as a plain space."""
    category = unicodedata.category(char)
    return (
        category in ("Cc", "Cf", "Co", "Cn", "Zl", "Zp")
        or (category == "Zs" and char != " ")
        or char in _BLANK
        or "\ufe00" <= char <= "\ufe0f"
    )


_BLANK = frozenset("\u034f\u115f\u1160\u3164\uffa0\u2800")


async def create_key(
    redis: aioredis.Redis, keys: RedisKeys, team: str, *, ttl_s: int | None = None
) -> str:
    """A new key for ``team``; only its hash is stored, so it is shown once. ``ttl_s``: the
    key stops working after that long (the health prober's own keys)."""
    await check_team_name(redis, keys, team)
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    record = keys.api_key(hash_key(key))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(record, mapping={"team": team, "created": str(time.time())})
        if ttl_s is not None:
            pipe.expire(record, ttl_s)
        pipe.sadd(keys.teams(), team)
        await pipe.execute()
    return key


async def lookup_team(redis: aioredis.Redis, keys: RedisKeys, key: str) -> str | None:
    """The team of ``key``, or None for a key that is malformed, unknown or revoked."""
    if not well_formed(key):
        return None
    return await lookup_hash(redis, keys, hash_key(key))


async def lookup_hash(redis: aioredis.Redis, keys: RedisKeys, key_hash: str) -> str | None:
    """The team of the key with this hash, or None."""
    team = await redis.hget(keys.api_key(key_hash), "team")
    return None if team is None else _text(team)


async def _record(redis: aioredis.Redis, keys: RedisKeys, key_hash: str) -> KeyRecord | None:
    raw = await redis.hgetall(keys.api_key(key_hash))
    if not raw:
        return None
    fields = {_text(k): _text(v) for k, v in raw.items()}
    created = float(fields.get("created") or 0.0)
    return KeyRecord(key_id(key_hash), key_hash, fields.get("team", ""), created)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


async def _hashes(redis: aioredis.Redis, keys: RedisKeys, hash_start: str = "") -> list[str]:
    """Hashes of the stored keys (those starting with ``hash_start``): a SCAN, fine for the
    admin's rare lists and revocations, never on the request path."""
    head = keys.api_key("")
    pattern = _glob_escape(head) + hash_start + "*"
    found = [_text(name)[len(head) :] async for name in redis.scan_iter(pattern, count=1000)]
    return sorted(found)


async def list_keys(
    redis: aioredis.Redis, keys: RedisKeys, team: str | None = None
) -> list[KeyRecord]:
    """The stored keys (of ``team``), oldest first."""
    records = [await _record(redis, keys, h) for h in await _hashes(redis, keys)]
    kept = [r for r in records if r is not None and (team is None or r.team == team)]
    return sorted(kept, key=lambda r: (r.created, r.id))


async def find_key(redis: aioredis.Redis, keys: RedisKeys, key_or_id: str) -> KeyRecord | None:
    """The stored key named by the key itself or by its id."""
    if _ID.match(key_or_id):
        hashes = await _hashes(redis, keys, key_or_id[len(_ID_PREFIX) :])
        return await _record(redis, keys, hashes[0]) if len(hashes) == 1 else None
    if not well_formed(key_or_id):
        raise BadRequest(
            f"{key_or_id[:20]!r}… is neither an API key ('{KEY_PREFIX}…') nor a key id "
            f"('{_ID_PREFIX}' and {_ID_HEX} hex digits, as `laneway keys list` shows)",
            param="key",
        )
    return await _record(redis, keys, hash_key(key_or_id))


async def revoke_key(
    redis: aioredis.Redis,
    producer: AIOKafkaProducer,
    topics: Topics,
    keys: RedisKeys,
    key_or_id: str,
) -> KeyRecord:
    """Revoke a key: first on ``laneway.keys`` (every ingress refuses it from then on, Redis
    or not), then its record in Redis. Raises ``NotFound`` for a key nobody stored, and
    Kafka's error when the revocation was not stored (then nothing is revoked).

    With Redis away, a key given as itself (not by id) is revoked all the same: its record
    goes once the ingresses, which delete what they read on the topic, reach Redis again.
    While Redis's circuit is open (it hangs), no Redis call waits at all.
    """
    circuit = circuit_of(redis)
    try:
        record = await circuit.background(lambda: find_key(redis, keys, key_or_id), timeout_s=None)
    except (RedisError, OSError):
        if not well_formed(key_or_id):
            raise
        digest = hash_key(key_or_id)
        record = KeyRecord(key_id(digest), digest, "", 0.0)
    if record is None:
        raise NotFound(
            f"no API key {key_or_id[:20]!r} (see `laneway keys list --team T`)", param="key"
        )
    revocation = KeyRevocation(hash=record.hash, id=record.id, team=record.team)
    await producer.send_and_wait(topics.keys, revocation.to_json(), key=record.hash.encode())
    stored = keys.api_key(record.hash)
    with contextlib.suppress(RedisError, OSError):
        await circuit.background(lambda: redis.delete(stored), timeout_s=None)
    return record
