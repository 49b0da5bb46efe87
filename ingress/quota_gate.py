"""Quota admission at the ingress: Redis when it answers, a local limiter when it does not."""

from __future__ import annotations

import logging
import time

from prometheus_client import Gauge
from redis.exceptions import RedisError

from quota import Admitted, LocalLimiter, QuotaEnforcer, QuotaPolicy, Team

__all__ = ["QUOTA_FALLBACK", "QuotaGate"]

log = logging.getLogger(__name__)

QUOTA_FALLBACK = Gauge(
    "laneway_quota_fallback_active", "1 while Redis is unreachable and the local limiter admits"
)
QUOTA_REMAINING = Gauge(
    "laneway_quota_remaining_tokens",
    "Tokens left in a team's pool at its last admission",
    ["team", "pool"],
)

# After a Redis failure, try it again this often; in between the local limiter answers
# at once instead of every request waiting for a connect timeout.
_RETRY_REDIS_S = 1.0


class QuotaGate:
    def __init__(
        self, enforcer: QuotaEnforcer, policy: QuotaPolicy, *, enabled: bool = True
    ) -> None:
        self.enforcer = enforcer
        self.policy = policy
        self.enabled = enabled
        self.local = LocalLimiter()
        self._redis_down_until = 0.0

    @property
    def degraded(self) -> bool:
        return self._redis_down_until > time.monotonic()

    async def admit(self, team: Team, request_id: str, tokens: int) -> Admitted | None:
        """Reserve interactive budget; raises ``QuotaExceeded`` when the team is over it."""
        if not self.enabled:
            return None
        if not self.degraded:
            try:
                admitted = await self.enforcer.reserve(team, "interactive", request_id, tokens)
            except (RedisError, OSError) as exc:
                self._redis_down(exc)
            else:
                if self._redis_down_until:
                    log.warning("Redis is back: quota enforcement is exact again")
                    self._redis_down_until = 0.0
                    QUOTA_FALLBACK.set(0)
                QUOTA_REMAINING.labels(team.name, "interactive").set(admitted.remaining)
                return admitted
        capacity = self.policy.budget_tokens(team, "interactive")
        remaining = self.local.reserve(team.name, tokens, capacity)
        return Admitted("interactive", int(remaining), int(capacity), 0.0)

    async def release(self, team: Team, request_id: str) -> None:
        if not self.enabled or self.degraded:
            return
        try:
            await self.enforcer.release(team.name, request_id)
        except (RedisError, OSError) as exc:
            self._redis_down(exc)

    def _redis_down(self, exc: BaseException) -> None:
        if not self._redis_down_until:
            log.warning(
                "Redis unreachable (%s): admitting interactive traffic with the local limiter", exc
            )
        self._redis_down_until = time.monotonic() + _RETRY_REDIS_S
        QUOTA_FALLBACK.set(1)
