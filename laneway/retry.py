"""One way to wait before trying again: a jittered wait that doubles up to a ceiling.

Every reconnect loop of laneway (the reply stream, the early-cancel channel, a batch lane
waiting for Redis or for its transactional producers, a background loop that failed) waits
with a ``Backoff``, so that a hundred processes that lost the same Redis at once do not come
back in step ("full jitter" halved: each wait is uniform in [½, 1] of the current step).
"""

from __future__ import annotations

import asyncio
import random

__all__ = ["Backoff"]


class Backoff:
    """``await backoff.wait()`` sleeps about ``step`` seconds, then doubles it up to
    ``max_s``; ``reset()`` after a success starts again from ``first_s``."""

    def __init__(self, first_s: float = 0.2, max_s: float = 10.0) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff needs 0 < first_s ({first_s}) <= max_s ({max_s})")
        self.first_s = first_s
        self.max_s = max_s
        self.step = first_s

    def reset(self) -> None:
        self.step = self.first_s

    def next_wait(self) -> float:
        """The next wait, jittered, and the step doubled for the one after."""
        wait = self.step * random.uniform(0.5, 1.0)
        self.step = min(self.step * 2, self.max_s)
        return wait

    async def wait(self) -> None:
        await asyncio.sleep(self.next_wait())
