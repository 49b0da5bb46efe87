"""Team records: size, complexity factor, priority tier and supersession policy, in Redis."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from laneway.apikeys import check_team_name
from laneway.constants import Band, RedisKeys
from laneway.errors import BadRequest
from laneway.redis_circuit import circuit_of
from laneway.retry import Backoff

__all__ = [
    "MAX_GRACE_TOKENS",
    "MAX_TEAM_SIZE",
    "Team",
    "follow_team_changes",
    "get_team",
    "set_team",
]

log = logging.getLogger(__name__)

# The channel of team changes is read in waits this long, so a closing or a circuit that
# opened is noticed.
_CHANGES_POLL_S = 1.0


# Bounds that keep a team's budget, and every number derived from it, a plain 64-bit one.
MAX_TEAM_SIZE = 100_000
MAX_GRACE_TOKENS = 1_000_000


@dataclass(frozen=True, slots=True)
class Team:
    name: str
    size: int = 1
    complexity: float = 1.0
    tier: Band = "hi"
    # A superseded completion that already streamed this many tokens may finish (0: drop at
    # once, the default: the newer keystroke made it stale).
    supersede_grace_tokens: int = 0
    # Type-through: a completion may be served from the session's running or recent
    # generation when the user typed what it suggested (workers/reuse.py).
    type_through: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise BadRequest("team name is empty", param="team")
        if not 1 <= self.size <= MAX_TEAM_SIZE:
            raise BadRequest(
                f"team size {self.size} must be from 1 to {MAX_TEAM_SIZE:,}", param="size"
            )
        if not 0 < self.complexity <= 10:
            raise BadRequest(
                f"complexity factor {self.complexity} must be in (0, 10]", param="complexity"
            )
        if self.tier not in ("hi", "lo"):
            raise BadRequest(f"tier {self.tier!r} must be 'hi' or 'lo'", param="tier")
        if not 0 <= self.supersede_grace_tokens <= MAX_GRACE_TOKENS:
            raise BadRequest(
                f"supersede_grace_tokens {self.supersede_grace_tokens} must be from 0 to "
                f"{MAX_GRACE_TOKENS:,}",
                param="supersede_grace_tokens",
            )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def set_team(redis: aioredis.Redis, keys: RedisKeys, team: Team) -> None:
    """Store ``team``'s record and announce the change (``RedisKeys.team_changes``), in one
    transaction: stored and announced, or neither. A new name must be one people can tell
    apart (``check_team_name``); a record read back need only have one."""
    await check_team_name(redis, keys, team.name)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(
            keys.team(team.name),
            mapping={
                "size": team.size,
                "complexity": team.complexity,
                "tier": team.tier,
                "supersede_grace_tokens": team.supersede_grace_tokens,
                "type_through": int(team.type_through),
            },
        )
        pipe.sadd(keys.teams(), team.name)
        pipe.publish(keys.team_changes(), team.name)
        await pipe.execute()


async def get_team(redis: aioredis.Redis, keys: RedisKeys, name: str) -> Team:
    """The stored record, or the defaults for a team nobody configured yet."""
    raw = await redis.hgetall(keys.team(name))
    if not raw:
        return Team(name)
    fields = {_text(k): _text(v) for k, v in raw.items()}
    tier = fields.get("tier", "hi")
    size = int(fields.get("size", 1))
    grace = int(fields.get("supersede_grace_tokens", 0))
    if size > MAX_TEAM_SIZE or grace > MAX_GRACE_TOKENS:
        # Stored before the bounds: read within them (the team keeps working) until an admin
        # sets it again.
        log.warning(
            "team %s: size %d or grace %d beyond the bounds, read at them", name, size, grace
        )
        size, grace = min(size, MAX_TEAM_SIZE), min(grace, MAX_GRACE_TOKENS)
    return Team(
        name,
        size=size,
        complexity=float(fields.get("complexity", 1.0)),
        tier="lo" if tier == "lo" else "hi",
        supersede_grace_tokens=grace,
        type_through=fields.get("type_through", "1") != "0",
    )


async def follow_team_changes(
    redis: aioredis.Redis,
    keys: RedisKeys,
    changed: Callable[[str | None], None],
    *,
    closing: Callable[[], bool],
) -> None:
    """Calls ``changed`` with each team name ``set_team`` announces, and with None at each
    new subscription (a change made while none was live went unheard: any team's record may
    have changed), until ``closing()``. While Redis does not answer (its circuit open) it
    waits, then subscribes anew: a subscription that lived through a partition may be dead
    without a word. Meanwhile the callers' cached records expire as they would anyway."""
    circuit = circuit_of(redis)
    backoff = Backoff(0.5, 10.0)
    # The flag too: redis-py's timed read swallows a cancellation now and then.
    while not closing():
        await circuit.wait_closed()
        closings = circuit.closings
        try:
            async with redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                await pubsub.subscribe(keys.team_changes())
                backoff.reset()
                changed(None)
                while circuit.closings == closings and not circuit.open:
                    if closing():
                        return
                    message = await pubsub.get_message(timeout=_CHANGES_POLL_S)
                    if message is not None:
                        raw = message["data"]
                        changed(raw.decode(errors="replace") if isinstance(raw, bytes) else raw)
        except (RedisError, OSError) as exc:
            log.info("team changes not followed (%s); cached records expire as usual", exc)
            await backoff.wait()
