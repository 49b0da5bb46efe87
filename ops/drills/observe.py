"""What a drill watches while it runs: each pool's scaling signal (Redis), its consumer group's
members (Kafka) and the worker processes ``laneway up`` runs (the supervisor's metrics)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import httpx
import redis.asyncio as aioredis
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.constants import POOLS, RedisKeys, Topics
from laneway.errors import MalformedMessage
from laneway.schema import ScalingDecision, decode
from ops.group_members import GroupMembers

__all__ = ["Sample", "StackObserver"]


@dataclass
class Sample:
    """The stack at one moment (``t``: seconds since the drill began); None: not known."""

    t: float
    signal: dict[str, ScalingDecision | None] = field(default_factory=dict)
    members: dict[str, int | None] = field(default_factory=dict)
    processes: dict[str, int | None] = field(default_factory=dict)


class StackObserver:
    """Samples a running stack; ``async with`` opens and closes its clients."""

    def __init__(
        self,
        redis_url: str,
        bootstrap: str,
        supervisor_url: str,
        *,
        keys: RedisKeys,
        topics: Topics,
    ) -> None:
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
        self.groups = GroupMembers(bootstrap)
        self.http = httpx.AsyncClient(timeout=2.0)
        self.supervisor_url = supervisor_url
        self.keys, self.topics = keys, topics

    async def __aenter__(self) -> StackObserver:
        await self.groups.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.groups.stop()
        await self.redis.aclose()
        await self.http.aclose()

    async def sample(self, t: float) -> Sample:
        return Sample(t, await self._signals(), await self._members(), await self._processes())

    async def _signals(self) -> dict[str, ScalingDecision | None]:
        found: dict[str, ScalingDecision | None] = dict.fromkeys(POOLS)
        with contextlib.suppress(RedisError, OSError):
            raws = await self.redis.mget([self.keys.scaling(pool) for pool in POOLS])
            for pool, raw in zip(POOLS, raws, strict=True):
                with contextlib.suppress(MalformedMessage):
                    found[pool] = decode(ScalingDecision, raw) if raw is not None else None
        return found

    async def _members(self) -> dict[str, int | None]:
        found: dict[str, int | None] = dict.fromkeys(POOLS)
        for pool in POOLS:
            with contextlib.suppress(KafkaError, OSError):
                found[pool] = await self.groups.count(self.topics.consumer_group(pool))
        return found

    async def _processes(self) -> dict[str, int | None]:
        found: dict[str, int | None] = dict.fromkeys(POOLS)
        with contextlib.suppress(httpx.HTTPError):
            text = (await self.http.get(self.supervisor_url)).text
            for pool in POOLS:
                line = f'laneway_local_replicas{{pool="{pool}"}} '
                for row in text.splitlines():
                    if row.startswith(line):
                        found[pool] = int(float(row.removeprefix(line)))
        return found
