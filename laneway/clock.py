"""The one clock deadlines are written in: Redis's, read through ``TIME``.

The ingress stamps ``accepted_ts`` and ``deadline_ts`` on this clock and the workers judge
deadlines on it, so a machine whose own clock is off (NTP down, a VM resumed) neither drops
work that is still fresh nor runs work that is long stale. Each process learns how far its
clock is from Redis's (half a round trip is the error) and reads its own clock plus that.
The quota scripts read ``TIME`` inside Redis and need none of this. While Redis does not
answer (its circuit is open, ``laneway.redis_circuit``), the last offset stays and no sync
waits.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import redis.asyncio as aioredis

from laneway.redis_circuit import circuit_of

__all__ = ["RedisClock"]

log = logging.getLogger(__name__)

# The offset is read off the sample with the shortest round trip among the last few (its
# error is at most half that round trip): a sample taken while the event loop was busy says
# little. A clock that jumps is followed within this many syncs.
_SAMPLES = 8
# An offset below this changes no decision a deadline makes (they are 100s of milliseconds
# and more): envelopes are left as they are.
_MATERIAL_OFFSET_S = 0.02
# Offsets this large are worth a warning: the machine's clock should be fixed.
_WARN_OFFSET_S = 1.0
# A sync runs in the background, never on the request path: a round trip may take this long
# (a slower one says little about the offset anyway) before Redis counts as not answering.
_SYNC_TIMEOUT_S = 1.0


class RedisClock:
    """This process's clock corrected to Redis's; ``sync`` refreshes the correction."""

    def __init__(self, local: Callable[[], float] = time.time) -> None:
        self.local = local
        self.offset = 0.0  # Redis time minus local time, seconds
        self._samples: deque[tuple[float, float]] = deque(maxlen=_SAMPLES)  # (trip, offset)

    def now(self) -> float:
        """Epoch seconds on Redis's clock (the local clock until the first sync)."""
        return self.local() + self.offset

    @property
    def material(self) -> bool:
        """Whether local and Redis time differ enough to matter to a deadline."""
        return abs(self.offset) >= _MATERIAL_OFFSET_S

    def to_local(self, ts: float) -> float:
        """A Redis-clock timestamp as this process's clock reads it."""
        return ts - self.offset

    async def sync(self, redis: aioredis.Redis, samples: int = 1) -> None:
        """``samples`` ``TIME`` round trips; raises Redis's errors (the last offset stays),
        at once while Redis's circuit is open."""
        circuit = circuit_of(redis)
        for _ in range(samples):
            sent = self.local()
            seconds, micros = await circuit.background(redis.time, timeout_s=_SYNC_TIMEOUT_S)
            got = self.local()
            trip = max(0.0, got - sent)
            self._samples.append((trip, seconds + micros / 1e6 - (sent + got) / 2))
        trip, offset = min(self._samples)
        # Within what the round trip leaves unknown, the clocks agree: no correction at all.
        offset = 0.0 if abs(offset) <= trip / 2 else offset
        if abs(offset) >= _WARN_OFFSET_S and abs(offset - self.offset) >= _WARN_OFFSET_S / 2:
            log.warning(
                "this machine's clock is %.3f s %s Redis's: deadlines follow Redis's",
                abs(offset),
                "behind" if offset > 0 else "ahead of",
            )
        self.offset = offset
