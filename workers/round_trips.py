"""One Redis round trip for the writes a worker makes together.

One engine step gives every running sequence its next token at once, and requests that end
on the same step write their final replies and settlements at once: a round trip per write
is what a streaming worker would otherwise spend most of its time on. Writers hand over
their commands as data; what is handed over while one pipeline is in flight goes in the
next. A writer's command that Redis refuses fails that writer alone.

Writes go through the process's Redis circuit (``laneway.redis_circuit``): they wait the
hot timeout at most, and none while the circuit is open; then the writer falls back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from laneway.redis_circuit import circuit_of

__all__ = ["Command", "RoundTrips"]

log = logging.getLogger(__name__)

# A Redis command as its words, e.g. ("XADD", stream, "*", "d", data).
Command = tuple[Any, ...]


class RoundTrips:
    """Shares Redis pipelines among the writers of one worker."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.circuit = circuit_of(redis)
        self._queued: list[tuple[Sequence[Command], asyncio.Future[list[Any] | None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    @property
    def usable(self) -> bool:
        """Whether Redis is worth a try (its circuit is closed)."""
        return not self.circuit.open

    async def send(self, commands: Sequence[Command]) -> list[Any] | None:
        """The results of ``commands``, in order (an exception in place of each one Redis
        refused), or None when Redis was not reached: the caller falls back."""
        if not self.usable:
            return None
        done: asyncio.Future[list[Any] | None] = asyncio.get_running_loop().create_future()
        self._queued.append((commands, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="redis-writes")
        return await done

    async def _flush(self) -> None:
        """Send everything queued in one pipeline; what is queued meanwhile goes in the next."""
        while self._queued:
            batch, self._queued = self._queued, []
            results: list[Any] | None = None  # None: each writer falls back
            try:
                if self.usable:  # else the pipeline before this one found Redis gone
                    results = await self._execute([c for commands, _ in batch for c in commands])
            except (RedisError, OSError) as exc:
                log.info("a Redis write failed (%s): its writers fall back", exc)
            except BaseException:
                # Cancelled (shutdown): nobody is left to write what was queued meanwhile.
                batch += self._queued
                self._queued = []
                raise
            finally:
                start = 0
                for commands, done in batch:
                    if not done.done():
                        mine = None if results is None else results[start : start + len(commands)]
                        done.set_result(mine)
                    start += len(commands)

    async def _execute(self, commands: list[Command]) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            results: list[Any] = await self.circuit.hot(partial(pipe.execute, raise_on_error=False))
            return results
