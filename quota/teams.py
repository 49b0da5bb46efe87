"""Team records: size, complexity factor, priority tier and supersession policy, in Redis."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from laneway.constants import Band, RedisKeys
from laneway.errors import BadRequest

__all__ = ["Team", "get_team", "set_team"]


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
        if self.size < 1:
            raise BadRequest(f"team size {self.size} must be at least 1", param="size")
        if not 0 < self.complexity <= 10:
            raise BadRequest(
                f"complexity factor {self.complexity} must be in (0, 10]", param="complexity"
            )
        if self.tier not in ("hi", "lo"):
            raise BadRequest(f"tier {self.tier!r} must be 'hi' or 'lo'", param="tier")
        if self.supersede_grace_tokens < 0:
            raise BadRequest(
                f"supersede_grace_tokens {self.supersede_grace_tokens} must be 0 or more",
                param="supersede_grace_tokens",
            )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def set_team(redis: aioredis.Redis, keys: RedisKeys, team: Team) -> None:
    """Store ``team``'s record and announce the change (``RedisKeys.team_changes``), in one
    transaction: stored and announced, or neither."""
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
    return Team(
        name,
        size=int(fields.get("size", 1)),
        complexity=float(fields.get("complexity", 1.0)),
        tier="lo" if tier == "lo" else "hi",
        supersede_grace_tokens=int(fields.get("supersede_grace_tokens", 0)),
        type_through=fields.get("type_through", "1") != "0",
    )
