"""Per-instance limiter used while Redis does not answer, so interactive traffic keeps flowing.

It decides admission only, and approximately: each of the N ingress replicas that last said
they run (``replicas``) grants, on its own, its share (1/N) of what the team's pool had left
when this instance last heard from Redis (``note``: every exact admission and refusal says),
refilling at its share of the budget's rate, so that together they grant no more than the
pool had left, however the load balancer spreads the team (a team whose requests all reach
one replica gets that replica's share). A team it never heard of starts with
``UNHEARD_START_SHARE`` of its budget (at least the request at hand) and the same refill:
most often Redis only seemed silent for a moment (a burst on a busy host, the first requests
after a start), and a whole budget on each replica for each new team made that moment admit
N budgets.
What it admits is still charged: each request carries its amount (``quota_local``) and is
charged to the team's pool when its worker settles it, once Redis answers again (a pool
whose bucket expired meanwhile, two hours unused, is charged from a full bucket made for it).
Exact admission returns with Redis, when its circuit closes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from laneway.errors import QuotaExceeded

__all__ = ["LocalLimiter"]


@dataclass(slots=True)
class _Bucket:
    capacity: float
    tokens: float
    ts: float


# What a team this instance never heard Redis report on starts with (see the module).
UNHEARD_START_SHARE = 0.01


class LocalLimiter:
    def __init__(self) -> None:
        self._buckets: dict[str, _Bucket] = {}
        # How many ingress replicas last said they run (this one included), as Redis last
        # told: each grants its share of a team's pool while Redis is silent.
        self.replicas = 1

    def note(self, team: str, remaining: float, capacity: float, now: float | None = None) -> None:
        """Redis said the team's pool holds ``remaining`` of ``capacity``: the local bucket
        starts from this replica's share of that if Redis goes silent."""
        now = time.monotonic() if now is None else now
        share = min(capacity, max(0.0, remaining)) / self.replicas
        self._buckets[team] = _Bucket(capacity, share, now)

    def heard(self, team: str) -> bool:
        """Whether this limiter holds anything of ``team``'s (a note, or a bucket in use)."""
        return team in self._buckets

    def reserve(self, team: str, tokens: int, capacity: float, now: float | None = None) -> float:
        """Take ``tokens`` from the team's local bucket; returns what is left."""
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(team)
        if bucket is None or bucket.capacity != capacity:
            start = min(capacity, max(float(tokens), capacity * UNHEARD_START_SHARE))
            bucket = self._buckets[team] = _Bucket(capacity, start, now)
        rate = capacity / 3600 / self.replicas
        # Refilled up to its share of the budget, or to the request at hand if that is more
        # (a request larger than a replica's share is admitted when the share has refilled
        # to it, as its Retry-After says; a start above the share, one request, stays).
        full = max(bucket.tokens, min(capacity, max(capacity / self.replicas, float(tokens))))
        bucket.tokens = min(full, bucket.tokens + (now - bucket.ts) * rate)
        bucket.ts = now
        if bucket.tokens < tokens:
            retry = (tokens - bucket.tokens) / rate if rate > 0 else 3600.0
            raise QuotaExceeded(
                f"team {team!r} is over its interactive budget (local limit while Redis does "
                f"not answer in time); it fits again in about {max(1, math.ceil(retry))} s",
                team=team,
                limit=int(capacity),
                retry_after=retry,
                remaining=bucket.tokens,
            )
        bucket.tokens -= tokens
        return bucket.tokens
