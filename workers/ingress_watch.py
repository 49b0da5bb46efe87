"""Which ingress replicas are gone, so a worker stops the work that no one can receive.

An ingress replica holds its clients' connections and reads their replies from its own
reply stream. One that died (a SIGKILL, the OOM killer, its node lost) took the connections
with it, yet its requests ran on to their end on the engine and were billed in full as
``ok``, and the SDK's retry at another replica ran and was billed once more.

Each replica says that it runs every ``INGRESS_ROLL_CALL_S`` (a sorted set in Redis scored by
when, named by the process: ``ingress.quota_gate``), and each request names the process that
holds its client (``RequestEnvelope.ingress``; a replica restarted under the same id is
another process). A worker reads the set at every heartbeat and takes a process for gone
once its score has stood still, or it has been missing, for ``gone_after_s`` of reads that
all succeeded, came at most ``_GAP_BEATS`` beats apart and followed a beat whose own write
Redis took: a Redis that did not answer, or took no writes (full, its disk failing), says
nothing of the replicas, and one restarted without the set has it filled again by the live
replicas within a roll call. A score is only compared with itself, never with a clock. The
gone process's requests then end as those of a client that left (``cancelled``, billed what
the engine made of them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from laneway.constants import RedisKeys
from laneway.redis_circuit import circuit_of

__all__ = ["IngressWatch"]

# Reads further apart than this many beats (Redis did not answer, the loop was held) start
# the count again: what happened between them is not known.
_GAP_BEATS = 3.0
_READ_TIMEOUT_S = 1.0
# A replica unheard of this long is forgotten: longer than any request runs.
_FORGET_S = 3600.0
# Replicas asked about that never showed up, kept at most (oldest out).
_MAX_ABSENT = 1000


class IngressWatch:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        *,
        gone_after_s: float,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.gone_after_s = gone_after_s
        self.max_gap_s = _GAP_BEATS * interval_s
        self.clock = clock
        self._since: float | None = None  # the first of the unbroken reads
        self._last_read: float | None = None
        self._changed: dict[str, tuple[float, float]] = {}  # replica → (score, when it moved)
        self._absent: dict[str, float] = {}  # replica never seen → when first asked about

    async def look(self, *, writes: bool) -> None:
        """Read the replicas' roll call; one that fails breaks the unbroken reads, and so
        does a beat whose own write failed (``writes`` False): a Redis that refuses writes
        (full, its disk failing, paused) refuses the replicas' roll calls too, while it
        still answers reads."""
        if not writes:
            self._since = None
            return
        try:
            read = partial(self.redis.zrange, self.keys.ingresses(), 0, -1, withscores=True)
            entries = await circuit_of(self.redis).background(read, timeout_s=_READ_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError):
            self._since = None
            return
        now = self.clock()
        if self._last_read is None or now - self._last_read > self.max_gap_s:
            self._since = None
        self._last_read = now
        if self._since is None:
            self._since = now
        seen = _scores(entries)
        for replica, score in seen.items():
            known = self._changed.get(replica)
            if known is None or known[0] != score:
                self._changed[replica] = (score, now)
            self._absent.pop(replica, None)
        # A replica gone from the set for long is forgotten (its requests are long over).
        for replica, (_, moved) in list(self._changed.items()):
            if replica not in seen and now - moved > _FORGET_S:
                del self._changed[replica]

    def gone(self, replica: str) -> bool:
        """Whether ``replica`` is gone: not heard of for ``gone_after_s`` of unbroken reads."""
        if self._since is None or self._last_read is None:
            return False
        known = self._changed.get(replica)
        if known is not None:
            heard = known[1]
        else:
            heard = self._absent.setdefault(replica, self._last_read)
            while len(self._absent) > _MAX_ABSENT:
                del self._absent[next(iter(self._absent))]
        return self._last_read - max(heard, self._since) >= self.gone_after_s


def _scores(entries: Any) -> dict[str, float]:
    """ZRANGE ... WITHSCORES as redis-py answers it ((member, score) pairs), by member."""
    return {
        member.decode() if isinstance(member, bytes) else str(member): float(score)
        for member, score in entries
    }
