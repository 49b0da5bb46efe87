"""Per-instance limiter used while Redis does not answer, so interactive traffic keeps flowing.

It decides admission only, and approximately: each instance grants, on its own, what the
team's pool had left when this instance last heard from Redis (``note``: every exact
admission and refusal says), refilling at the budget's rate; a team it never heard of gets
its full interactive budget. N replicas may so admit up to N times that during an outage,
but a team that had spent its budget before Redis went silent is not given a new one (as
when a busy process takes Redis for silent for a moment).
What it admits is still charged: each request carries its amount (``quota_local``) and is
charged to the team's pool when its worker settles it, once Redis answers again (a pool
whose bucket expired meanwhile, two hours unused, is charged from a full bucket made for it).
Exact admission returns with Redis, when its circuit closes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from laneway.errors import QuotaExceeded

__all__ = ["LocalLimiter"]


@dataclass(slots=True)
class _Bucket:
    capacity: float
    tokens: float
    ts: float


class LocalLimiter:
    def __init__(self) -> None:
        self._buckets: dict[str, _Bucket] = {}

    def note(self, team: str, remaining: float, capacity: float, now: float | None = None) -> None:
        """Redis said the team's pool holds ``remaining`` of ``capacity``: the local bucket
        starts from that if Redis goes silent."""
        now = time.monotonic() if now is None else now
        self._buckets[team] = _Bucket(capacity, min(capacity, max(0.0, remaining)), now)

    def reserve(self, team: str, tokens: int, capacity: float, now: float | None = None) -> float:
        """Take ``tokens`` from the team's local bucket; returns what is left."""
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(team)
        if bucket is None or bucket.capacity != capacity:
            bucket = self._buckets[team] = _Bucket(capacity, capacity, now)
        rate = capacity / 3600
        bucket.tokens = min(capacity, bucket.tokens + (now - bucket.ts) * rate)
        bucket.ts = now
        if bucket.tokens < tokens:
            retry = (tokens - bucket.tokens) / rate if rate > 0 else 3600.0
            raise QuotaExceeded(
                f"team {team!r} is over its interactive budget (local limit while Redis is down)",
                team=team,
                limit=int(capacity),
                retry_after=retry,
            )
        bucket.tokens -= tokens
        return bucket.tokens
