"""Quota admission at the ingress: a lease when the budget is big enough, Redis per request
when it is not, and a local limiter while Redis does not answer.

Every Redis call here is on the request path and goes through the process's Redis circuit
(``laneway.redis_circuit``): it waits the hot timeout at most, and not at all while the
circuit is open, except for a team the local limiter has heard nothing of, which waits up to
a second for Redis first (``quota.fallback``). What the local limiter admits meanwhile is
charged when it is settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from functools import partial

from prometheus_client import Gauge
from redis.exceptions import RedisError

from laneway.constants import INGRESS_GONE_S, INGRESS_ROLL_CALL_S
from laneway.errors import QuotaExceeded
from laneway.metrics import team_label
from laneway.redis_circuit import RedisUnavailable, circuit_of
from quota import Admitted, LocalLimiter, QuotaEnforcer, QuotaPolicy, Team

__all__ = ["QUOTA_FALLBACK", "ROLL_CALL_S", "QuotaGate"]

log = logging.getLogger(__name__)

QUOTA_FALLBACK = Gauge(
    "laneway_quota_fallback_active", "1 while Redis does not answer and the local limiter admits"
)
QUOTA_REMAINING = Gauge(
    "laneway_quota_remaining_tokens",
    "Tokens left in a team's pool at its last admission",
    ["team", "pool"],
)
QUOTA_REPLICAS = Gauge(
    "laneway_quota_fallback_replicas",
    "Ingress replicas that last said they run (this one included), as Redis last told: "
    "while Redis is silent, each admits this share of a team's pool",
)
QUOTA_LEASED = Gauge(
    "laneway_quota_leased_tokens",
    "Interactive tokens this ingress holds as a lease and has not admitted yet",
    ["team"],
)

# A team the local limiter knows nothing of waits this long for a silent Redis to answer
# again before it is admitted locally (a circuit opened by a busy moment closes within a
# probe interval, 200 ms by default).
_UNHEARD_WAIT_S = 1.0
# Giving idle leases back is background work: it may wait this long for Redis.
_GIVE_BACK_TIMEOUT_S = 1.0
ROLL_CALL_S = INGRESS_ROLL_CALL_S
REPLICA_GONE_S = INGRESS_GONE_S
_ROLL_CALL_TIMEOUT_S = 1.0
_ROLL_KEPT_S = 600.0


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
        self.circuit = circuit_of(enforcer.redis)
        self.circuit.listen(self._on_circuit)

    @property
    def degraded(self) -> bool:
        """Whether the local limiter admits (Redis does not answer)."""
        return self.circuit.open

    def _on_circuit(self, opened: bool) -> None:
        QUOTA_FALLBACK.set(1 if opened else 0)
        if opened:
            log.warning("Redis does not answer: admitting interactive traffic locally")
        else:
            log.warning("Redis answers again: quota admission is exact again")

    async def roll_call(self, member: str, now: float) -> None:
        """Say that this replica runs (at ``now``, Redis's clock) and learn how many do: while
        Redis is silent, each admits its share of a team's pool. Workers read it too: a
        replica that stopped saying so is gone, and so are its clients (``workers.
        ingress_watch``). Raises Redis's errors (the last count stays).

        Not through the circuit: an open one (this replica's own round trips slow, Redis
        well) would silence it, and its clients' requests would be stopped as orphans. Only
        entries far older than any clock's error are removed: one replica's clock seconds
        off must not remove another that runs."""
        key = self.enforcer.keys.ingresses()
        pipe = self.enforcer.redis.pipeline(transaction=True)
        pipe.zadd(key, {member: now})
        pipe.zremrangebyscore(key, "-inf", now - _ROLL_KEPT_S)
        pipe.zcount(key, now - REPLICA_GONE_S, "+inf")
        pipe.expire(key, int(_ROLL_KEPT_S))  # no replica left: nothing left behind
        async with asyncio.timeout(_ROLL_CALL_TIMEOUT_S):
            *_, count, _ = await pipe.execute()
        self.local.replicas = max(1, int(count))
        QUOTA_REPLICAS.set(self.local.replicas)

    async def leave_roll(self, instance: str) -> None:
        """This replica stops: not counted any more (else it is, until ``REPLICA_GONE_S``)."""
        with contextlib.suppress(RedisError, OSError):
            await self.circuit.background(
                partial(self.enforcer.redis.zrem, self.enforcer.keys.ingresses(), instance),
                timeout_s=_GIVE_BACK_TIMEOUT_S,
            )

    async def admit(self, team: Team, request_id: str, tokens: int) -> Admitted | None:
        """Reserve interactive budget; raises ``QuotaExceeded`` when the team is over it."""
        if not self.enabled:
            return None
        lease = self._leases.get(team.name)
        if lease is not None and lease.tokens >= tokens:
            return self._spend(team, lease, tokens)  # no Redis at all, even while it is down
        capacity = self.policy.budget_tokens(team, "interactive")
        for waited in (False, True):
            admitted = await self._exact(team, request_id, tokens, capacity)
            if admitted is not None:
                return admitted
            if waited or self.local.heard(team.name):
                break
            # Nothing known here of the team's pool: wait a moment for Redis first. A burst
            # on a busy host often makes it seem silent for a probe interval or two, and the
            # local limiter would start this team from a small share of its budget.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.circuit.wait_closed(), _UNHEARD_WAIT_S)
        remaining = self.local.reserve(team.name, tokens, capacity)
        # Charged in full by its settlement (nothing was taken from the pool for it).
        return Admitted("interactive", int(remaining), int(capacity), 0.0, local=tokens)

    async def _exact(
        self, team: Team, request_id: str, tokens: int, capacity: float
    ) -> Admitted | None:
        """Admission by Redis (a lease, or a reservation); None when Redis does not answer."""
        if self.degraded:
            return None
        chunk = int(capacity * self.lease_share)
        try:
            if chunk >= tokens:
                admitted = await self._from_lease(team, tokens, chunk)
            else:
                admitted = await self.circuit.hot(
                    lambda: self.enforcer.reserve(team, "interactive", request_id, tokens)
                )
        except (RedisError, OSError) as exc:
            log.info("quota of %s not admitted by Redis: %s", request_id, exc)
            return None
        except QuotaExceeded:
            self.local.note(team.name, 0.0, capacity)  # spent: not a new budget if silent
            raise
        QUOTA_REMAINING.labels(team_label(team.name), "interactive").set(admitted.remaining)
        # Should Redis go silent next, the local limiter starts from what was left.
        self.local.note(team.name, admitted.remaining, capacity)
        return admitted

    async def _from_lease(self, team: Team, tokens: int, chunk: int) -> Admitted:
        lease = self._leases.setdefault(team.name, _Lease())
        async with lease.refill:  # one refill at a time: the others wait and spend from it
            # Smaller requests may spend from the lease while a refill is in flight: loop.
            while lease.tokens < tokens:
                if self.degraded:  # a refill before this one found Redis gone
                    raise RedisUnavailable("Redis does not answer: a lease refill just failed")
                need = tokens - lease.tokens
                got = await self.circuit.hot(
                    partial(self.enforcer.lease, team, need=need, want=need + chunk)
                )
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
        from a lease (or locally) is then settled in Redis, whose mark makes the worker's own
        settle a no-op, instead of going back to the lease and being refunded a second time
        (or charged by the worker). When that settle cannot be made (Redis away) or its
        answer is lost, what was leased is not kept here either: the settle may have run, or
        the worker settles a stored copy (dropped on its tombstone), and tokens counted twice
        would be budget nobody granted. Lost rather than kept, as in ``return_idle``.
        """
        if not self.enabled or admitted is None:
            return
        if not self.degraded:
            try:
                # No minimum charge: the request never reached a lane, through no fault of
                # the team's.
                await self.circuit.hot(
                    lambda: self.enforcer.settle(
                        team.name,
                        request_id,
                        0,
                        leased=admitted.leased,
                        local=admitted.local,
                        accepted_ts=accepted_ts,
                        min_charge=0,
                    )
                )
            except (RedisError, OSError) as exc:
                log.info("budget of %s not given back in Redis: %s", request_id, exc)

    async def give_back_cut_short(self, team: Team, request_id: str, *, accepted_ts: float) -> None:
        """Give back what an ``admit`` cancelled before its answer (a stopping ingress) may
        have reserved in Redis: the script may have run though its answer was never read.

        Settled as a reservation of nothing: one that was made goes back whole, and where
        none was made the settle changes nothing. A lease refill cut short is not given back
        (whether its script ran is unknown: lost rather than counted twice, as in
        ``release``), and nothing of a lease or of the local limiter was spent on the request.
        """
        await self.release(
            team, request_id, Admitted("interactive", 0, 0, 0.0), accepted_ts=accepted_ts
        )

    async def return_idle(self, *, idle_s: float | None = None) -> int:
        """Give unused leases idle for ``idle_s`` (default: ``lease_idle_s``) back to their
        pools; returns the tokens given back."""
        idle_s = self.lease_idle_s if idle_s is None else idle_s
        now = time.monotonic()
        returned = 0
        for team, lease in list(self._leases.items()):
            if lease.tokens <= 0 or now - lease.used < idle_s or lease.refill.locked():
                continue
            if self.degraded:
                break  # kept until Redis answers: a lease is spent without Redis meanwhile
            tokens, lease.tokens = lease.tokens, 0
            QUOTA_LEASED.labels(team_label(team)).set(0)
            try:
                await self.circuit.background(
                    partial(self.enforcer.give_back, team, tokens), timeout_s=_GIVE_BACK_TIMEOUT_S
                )
            except (RedisError, OSError) as exc:
                # Lost rather than kept: the script may have run before the error, and
                # tokens counted twice would be budget nobody granted.
                log.warning("%d leased tokens of team %r not given back: %s", tokens, team, exc)
                break
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
