"""The CLI's way to run a command that needs Redis: settings loaded, a client closed after."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from laneway.clients import make_redis
from laneway.settings import CommonSettings, load_settings

__all__ = ["with_redis"]


def with_redis(work: Callable[[CommonSettings, aioredis.Redis], Awaitable[int]]) -> int:
    """Run ``work`` with the settings and a Redis client that is closed after it; its exit
    code."""
    settings = load_settings(CommonSettings)

    async def run() -> int:
        redis = make_redis(settings)
        try:
            return await work(settings, redis)
        finally:
            await redis.aclose()

    return asyncio.run(run())
