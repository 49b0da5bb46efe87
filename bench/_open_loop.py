"""Open-loop pacing: request *i* goes out at *i*/rate seconds after the first, whatever the
earlier ones do, as independent clients send it. A closed loop (send when the last answer
came) would slow down with the system it measures and hide its queueing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator


async def open_loop(rate: float, total: int) -> AsyncIterator[int]:
    """0 .. ``total`` - 1, each yielded when its turn comes (the caller starts its request)."""
    start = time.perf_counter()
    for i in range(total):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield i
