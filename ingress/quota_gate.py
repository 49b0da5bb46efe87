"""Quota admission at the ingress: a lease when the budget is big enough, Redis per request
when it is not, and a local limiter while Redis does not answer."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import Gauge
from redis.exceptions import RedisError

from laneway.metrics import team_label
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
QUOTA_LEASED = Gauge(
    "laneway_quota_leased_tokens",
    "Interactive tokens this ingress holds as a lease and has not admitted yet",
    ["team"],
)

# After a Redis failure, try it again this often; in between the local limiter answers
# at once instead of every request waiting for a connect timeout.
_RETRY_REDIS_S = 1.0


@dataclass(slots=True)
class _Lease:
    tokens: int = 0  # taken from the pool and not admitted yet
    remaining: float = 0.0  # left in the pool after the last lease
    capacity: float = 0.0
    used: float = 0.0  # monotonic time of the last admission
    refill: asyncio.Lock = field(default_factory=asyncio.Lock)


class QuotaGate:
    """Admits interactive requests against their team's budget.

    With ``lease_share`` > 0, a team whose hourly budget is big enough that this share
    covers the request is served from a lease: the share is taken from Redis in one
    script and admissions spend it locally, so a typing user's completions cost no Redis
    round trip each. A lease unused for ``lease_idle_s`` goes back to the pool, and so
    does every lease when the ingress stops.
    """

    def __init__(
        self,
        enforcer: QuotaEnforcer,
        policy: QuotaPolicy,
        *,
        enabled: bool = True,
        lease_share: float = 0.0,
        lease_idle_s: float = 10.0,
    ) -> None:
        self.enforcer = enforcer
        self.policy = policy
        self.enabled = enabled
        self.lease_share = lease_share
        self.lease_idle_s = lease_idle_s
        self.local = LocalLimiter()
        self._leases: dict[str, _Lease] = {}
        self._redis_down_until = 0.0

    @property
    def degraded(self) -> bool:
        return self._redis_down_until > time.monotonic()

    async def admit(self, team: Team, request_id: str, tokens: int) -> Admitted | None:
        """Reserve interactive budget; raises ``QuotaExceeded`` when the team is over it."""
        if not self.enabled:
            return None
        lease = self._leases.get(team.name)
        if lease is not None and lease.tokens >= tokens:
            return self._spend(team, lease, tokens)  # no Redis at all, even while it is down
        chunk = int(self.policy.budget_tokens(team, "interactive") * self.lease_share)
        if not self.degraded:
            try:
                if chunk >= tokens:
                    admitted = await self._from_lease(team, tokens, chunk)
                else:
                    admitted = await self.enforcer.reserve(team, "interactive", request_id, tokens)
            except (RedisError, OSError) as exc:
                self._redis_down(exc)
            else:
                self._redis_up()
                QUOTA_REMAINING.labels(team_label(team.name), "interactive").set(admitted.remaining)
                return admitted
        capacity = self.policy.budget_tokens(team, "interactive")
        remaining = self.local.reserve(team.name, tokens, capacity)
        return Admitted("interactive", int(remaining), int(capacity), 0.0)

    async def _from_lease(self, team: Team, tokens: int, chunk: int) -> Admitted:
        lease = self._leases.setdefault(team.name, _Lease())
        async with lease.refill:  # one refill at a time: the others wait and spend from it
            # Smaller requests may spend from the lease while a refill is in flight: loop.
            while lease.tokens < tokens:
                if self.degraded:  # a refill before this one found Redis gone
                    raise OSError("Redis unreachable: a lease refill just failed")
                need = tokens - lease.tokens
                got = await self.enforcer.lease(team, need=need, want=need + chunk)
                lease.tokens += got.taken
                lease.remaining, lease.capacity = got.remaining, got.capacity
            return self._spend(team, lease, tokens)

    def _spend(self, team: Team, lease: _Lease, tokens: int) -> Admitted:
        lease.tokens -= tokens
        lease.used = time.monotonic()
        QUOTA_LEASED.labels(team_label(team.name)).set(lease.tokens)
        # What the pool had at the last lease plus what this replica still holds: other
        # replicas' use since then is not in it.
        remaining = lease.remaining + lease.tokens
        reset = (lease.capacity - remaining) * 3600 / lease.capacity if lease.capacity else 0.0
        return Admitted(
            "interactive", int(remaining), int(lease.capacity), max(0.0, reset), leased=tokens
        )

    async def release(
        self, team: Team, request_id: str, admitted: Admitted | None, *, accepted_ts: float
    ) -> None:
        """Give back what ``admit`` took for a request whose produce to Kafka failed.

        The produce may have stored the request all the same (a timeout): a request admitted
        from a lease is then settled in Redis, whose mark makes the worker's own settle a
        no-op, instead of going back to the lease and being refunded a second time.
        """
        if not self.enabled or admitted is None:
            return
        lease = self._leases.get(team.name)
        if not self.degraded:
            try:
                # No minimum charge: the request never reached a lane, through no fault of
                # the team's.
                await self.enforcer.settle(
                    team.name,
                    request_id,
                    0,
                    leased=admitted.leased,
                    accepted_ts=accepted_ts,
                    min_charge=0,
                )
            except (RedisError, OSError) as exc:
                self._redis_down(exc)
            else:
                return
        if admitted.leased and lease is not None:
            lease.tokens += admitted.leased  # Redis is away: keep the tokens here

    async def return_idle(self, *, idle_s: float | None = None) -> int:
        """Give unused leases idle for ``idle_s`` (default: ``lease_idle_s``) back to their
        pools; returns the tokens given back."""
        idle_s = self.lease_idle_s if idle_s is None else idle_s
        now = time.monotonic()
        returned = 0
        for team, lease in list(self._leases.items()):
            if lease.tokens <= 0 or now - lease.used < idle_s or lease.refill.locked():
                continue
            tokens, lease.tokens = lease.tokens, 0
            QUOTA_LEASED.labels(team_label(team)).set(0)
            try:
                await self.enforcer.give_back(team, tokens)
            except (RedisError, OSError) as exc:
                # Lost rather than kept: the script may have run before the error, and
                # tokens counted twice would be budget nobody granted.
                log.warning("%d leased tokens of team %r not given back: %s", tokens, team, exc)
                self._redis_down(exc)
                break
            self._redis_up()
            returned += tokens
        return returned

    async def run_returns(self) -> None:
        """Background task: idle leases go back to their pools."""
        while True:
            await asyncio.sleep(max(0.5, self.lease_idle_s / 4))
            try:
                await self.return_idle()
            except Exception:
                log.exception("giving idle quota leases back failed; trying again")

    def _redis_up(self) -> None:
        if self._redis_down_until:
            log.warning("Redis is back: quota enforcement is exact again")
            self._redis_down_until = 0.0
            QUOTA_FALLBACK.set(0)

    def _redis_down(self, exc: BaseException) -> None:
        if not self._redis_down_until:
            log.warning(
                "Redis unreachable (%s): admitting interactive traffic with the local limiter", exc
            )
        self._redis_down_until = time.monotonic() + _RETRY_REDIS_S
        QUOTA_FALLBACK.set(1)
