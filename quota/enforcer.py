"""Quota enforcement in Redis: one atomic Lua script per decision.

Each team pool is a token bucket holding one hour of budget and refilling continuously.
Admission reserves ``prompt_tokens + max_tokens``; the end of the request settles the
reservation to the real count (refund or charge) and a drop releases it. Because every
decision is one script on the one Redis, the limit holds with any number of ingress
replicas: concurrent admissions overshoot by at most one reservation.

An ingress may also take a *lease*: a share of a team's interactive pool moved to it in one
script, from which it admits requests locally without a round trip each. The pool loses the
tokens when they are leased, as it does reserved ones; what leases cost is precision at the
edge (a replica may refuse a request while another holds unused lease) and a lease's unused
tokens for as long as a crashed replica would have held them. Requests admitted from a lease
carry the amount in their envelope and are settled against the pool like reservations.
While Redis does not answer, an ingress admits with its local limiter (``quota.fallback``);
those requests carry their amount too (``quota_local``) and are charged in full when settled.

The scripts (``quota.scripts``) read the time in Redis, so no caller's clock enters a bucket.
A settlement charges what the request used (``min_charge_tokens`` when it used none: a request
dropped before it ran is not free), at most its reservation plus ``max_excess`` of it. A charge
to a pool whose bucket is gone (idle two hours, a new team, lost with Redis's data) is taken
from a full bucket made for it: what an outage served is charged even so.

A batch line's reservation belongs to its record (``record``: when the broker stored it), not
only to its id, which its submitter chooses: two records of one id, on two workers, are two
lines, each reserving, settling and releasing its own.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

import redis.asyncio as aioredis

from laneway.constants import RedisKeys
from laneway.errors import LanewayError, QuotaExceeded
from quota.model import Pool, QuotaPolicy
from quota.scripts import GIVE_BACK, LEASE, RESERVE, SETTLE
from quota.teams import Team, get_team

__all__ = ["Admitted", "Lease", "QuotaEnforcer", "Settled"]

log = logging.getLogger(__name__)

# Buckets, reservations and hourly counters outlive any idle period that matters: a bucket
# idle for an hour is full again anyway, and a reservation open for a day is a leak.
_BUCKET_TTL_S = 2 * 3600
_RESERVATION_TTL_S = 24 * 3600
_USED_TTL_S = 48 * 3600
# A request admitted from a lease has no reservation record to delete when it is settled; a
# mark per request id, kept this long, makes a second settle (a re-run after a crash) a no-op.
# Re-runs come within a minute or so (a partition moving to a live worker); a request re-run
# later than this has expired long before and is dropped.
_SETTLED_MARK_S = 900
_SETTLED_SLOT_S = 300  # marks are grouped by the five minutes the request was accepted in
# A leased request settled later than this after its acceptance is refunded nothing: its mark
# may be gone (it lives _SETTLED_MARK_S from the settle that made it, at the earliest from the
# acceptance), and a replay refunded again would be budget nobody granted. The margin covers
# the stamp's clock, which is Redis's only to within its last sync.
_REFUND_WINDOW_S = _SETTLED_MARK_S - 60


def _line_field(request_id: str, record: float) -> str:
    """A batch line's name in the reservations and the settled marks: its id and its record."""
    return f"{request_id}@{record!r}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class Admitted:
    pool: Pool
    remaining: int
    capacity: int
    reset_s: float  # seconds until the bucket is full again
    leased: int = 0  # tokens taken from the ingress's lease (0: a reservation in Redis)
    local: int = 0  # tokens the local limiter admitted it for, Redis not answering


@dataclass(frozen=True, slots=True)
class Lease:
    taken: int  # tokens moved from the pool to the holder
    remaining: float  # left in the pool after that
    capacity: float


@dataclass(frozen=True, slots=True)
class Settled:
    found: bool
    pool: str
    reserved: int
    charged: int = 0


# SETTLE's ``found`` when it needs the pool's base to charge a bucket that is gone.
_NEEDS_BASE = -1


class QuotaEnforcer:
    """Reserve, settle and release team budget in Redis."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        policy: QuotaPolicy,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.policy = policy
        # Redis's clock (``laneway.clock``): the hour usage is counted in and the off-peak
        # window are read on it, so a process whose clock is off counts in the hour the
        # others count in and the admin API reports.
        self.clock = clock
        self._reserve = redis.register_script(RESERVE)
        self._settle = redis.register_script(SETTLE)
        self._lease = redis.register_script(LEASE)
        self._give_back = redis.register_script(GIVE_BACK)

    async def reserve(
        self,
        team: Team,
        pool: Pool,
        request_id: str,
        tokens: int,
        *,
        borrow: bool | None = None,
        record: float | None = None,
    ) -> Admitted:
        """Take ``tokens`` from the team's pool or raise ``QuotaExceeded``. A request that
        holds a reservation already is admitted again without taking more; ``record`` (a
        batch line's: when the broker stored it) makes the reservation that record's alone."""
        if borrow is None:
            borrow = pool == "batch" and self.policy.in_offpeak(
                datetime.fromtimestamp(self.clock(), UTC)
            )
        lender: Pool = "interactive"
        result = await self._reserve(
            keys=[
                self.keys.quota_bucket(team.name, pool),
                self.keys.quota_reservations(team.name),
                self.keys.quota_factor(team.name),
                self.keys.quota_bucket(team.name, lender),
            ],
            args=[
                self.policy.base_tokens(team, pool),
                tokens,
                request_id if record is None else _line_field(request_id, record),
                pool,
                1 if borrow else 0,
                self.policy.base_tokens(team, lender),
                self.policy.borrow_reserve,
                lender,
                _BUCKET_TTL_S,
                _RESERVATION_TTL_S,
            ],
        )
        ok, remaining, retry, capacity = (float(x) for x in result[:4])
        if not ok:
            raise self._exceeded(
                team, pool, tokens, remaining=remaining, retry=retry, capacity=capacity
            )
        reset = (capacity - remaining) * 3600 / capacity if capacity > 0 else 0.0
        taken_from: Pool = "interactive" if _text(result[4]) == "interactive" else "batch"
        return Admitted(taken_from, int(remaining), int(capacity), reset)

    @staticmethod
    def _exceeded(
        team: Team, pool: Pool, tokens: int, *, remaining: float, retry: float, capacity: float
    ) -> QuotaExceeded:
        if retry < 0:
            return QuotaExceeded(
                f"a request of {tokens} tokens can never fit team {team.name!r}'s {pool} "
                f"budget of {capacity:.0f} tokens/hour (raise it with `laneway teams set`)",
                team=team.name,
                limit=int(capacity),
                retry_after=3600.0,
                never=True,
            )
        return QuotaExceeded(
            f"team {team.name!r} is over its {pool} budget: {tokens} tokens asked, "
            f"{max(0.0, remaining):.0f} of {capacity:.0f} tokens/hour left; it fits again in "
            f"about {max(1, math.ceil(retry))} s",
            team=team.name,
            limit=int(capacity),
            retry_after=retry,
            remaining=remaining,
        )

    async def settle(
        self,
        team: str,
        request_id: str,
        actual_tokens: int,
        *,
        leased: int = 0,
        local: int = 0,
        accepted_ts: float = 0.0,
        min_charge: int | None = None,
        once: bool = False,
        record: float | None = None,
    ) -> Settled:
        """Turn a reservation into the real count: refund the rest, or charge the excess
        (up to the policy's ``max_excess``); ``min_charge`` (default: the policy's) when the
        request used no tokens.

        ``leased`` is what the ingress admitted the request for from its lease, ``local``
        what its local limiter admitted it for while Redis did not answer (the envelope
        carries both, with ``accepted_ts``); then there is no reservation record in Redis.
        Idempotent: a second settle of the same request (a re-run after a crash, a settle
        sent again after a timeout) is a no-op; one of a leased request later than the marks
        live is refunded nothing. ``once`` (a batch line, which a crash before its
        transaction commits runs again, reserving anew): a settle after the first gives that
        new reservation back whole, within ``accepted_ts``'s mark window. A batch line's
        settle acts on its record's reservation only: ``record``, ``accepted_ts`` with
        ``once``.
        """
        call = partial(
            self._settle_call,
            team,
            request_id,
            actual_tokens,
            leased=leased,
            local=local,
            accepted_ts=accepted_ts,
            min_charge=min_charge,
            once=once,
            record=record,
        )
        keys, args = call()
        result = await self._settle(keys=keys, args=args)
        if self.needs_base(result):
            keys, args = call(bases=await self._team_or_default(team))
            result = await self._settle(keys=keys, args=args)
        found, pool, reserved, charged = result
        return Settled(int(found) == 1, _text(pool), int(float(reserved)), int(float(charged)))

    async def _team_or_default(self, name: str) -> Team:
        try:
            return await get_team(self.redis, self.keys, name)
        except LanewayError as exc:
            # A record no admin command wrote: charged as a team of the defaults rather than
            # not at all (the next reservation sizes the bucket by the team's real budget).
            log.warning("team %s has an unusable record, charged by the defaults: %s", name, exc)
            return Team(name)

    @staticmethod
    def needs_base(result: Any) -> bool:
        """Whether a settle's answer asks for the team's budget (its pool's bucket is gone and
        it charges more than was taken): then nothing changed, and ``settle`` sends it whole."""
        return isinstance(result, list) and bool(result) and int(result[0]) == _NEEDS_BASE

    def settle_command(
        self,
        team: str,
        request_id: str,
        actual_tokens: int,
        *,
        leased: int = 0,
        local: int = 0,
        accepted_ts: float = 0.0,
        once: bool = False,
        min_charge: int | None = None,
    ) -> tuple[Any, ...]:
        """``settle`` as the words of one Redis command, for a pipeline the worker shares
        with its reply.

        A bare EVALSHA: a pipeline that holds a registered script first asks Redis
        ``SCRIPT EXISTS``, a round trip per reply. When Redis answers NOSCRIPT (it restarted
        and lost its script cache), or an answer ``needs_base``, the caller runs ``settle``,
        which loads the script and reads the team's budget.
        """
        keys, args = self._settle_call(
            team,
            request_id,
            actual_tokens,
            leased=leased,
            local=local,
            accepted_ts=accepted_ts,
            once=once,
            min_charge=min_charge,
        )
        return ("EVALSHA", self._settle.sha, len(keys), *keys, *args)

    def _settle_call(
        self,
        team: str,
        request_id: str,
        actual_tokens: int,
        *,
        leased: int,
        local: int = 0,
        accepted_ts: float,
        min_charge: int | None = None,
        once: bool = False,
        record: float | None = None,
        bases: Team | None = None,
    ) -> tuple[list[str], list[Any]]:
        hour = int(self.clock() // 3600)
        if once and record is None:
            record = accepted_ts
        keys = [
            self.keys.quota_reservations(team),
            self.keys.quota_bucket(team, "interactive"),
            self.keys.quota_bucket(team, "batch"),
            self.keys.quota_used(team, "interactive", hour),
            self.keys.quota_used(team, "batch", hour),
            self.keys.quota_settled(team, int(accepted_ts // _SETTLED_SLOT_S), lines=once),
            self.keys.quota_factor(team),
        ]
        policy = self.policy
        field = request_id if record is None else _line_field(request_id, record)
        return keys, [
            request_id,
            actual_tokens,
            _USED_TTL_S,
            leased,
            # A batch line has no deadline: its re-run may come after hours waiting for
            # budget, and its mark lives as long as a reservation may.
            _RESERVATION_TTL_S if once else _SETTLED_MARK_S,
            policy.min_charge_tokens if min_charge is None else min_charge,
            policy.max_excess,
            _BUCKET_TTL_S,
            local,
            1 if once else 0,
            field if once else request_id,
            field,
            accepted_ts,
            _REFUND_WINDOW_S,
            "" if bases is None else policy.base_tokens(bases, "interactive"),
            "" if bases is None else policy.base_tokens(bases, "batch"),
        ]

    async def lease(self, team: Team, need: int, want: int) -> Lease:
        """Take between ``need`` and ``want`` tokens of the team's interactive pool for an
        ingress to admit from, or raise ``QuotaExceeded`` when not even ``need`` is left."""
        result = await self._lease(
            keys=[
                self.keys.quota_bucket(team.name, "interactive"),
                self.keys.quota_factor(team.name),
            ],
            args=[
                self.policy.base_tokens(team, "interactive"),
                need,
                max(need, want),
                _BUCKET_TTL_S,
            ],
        )
        ok, remaining, taken_or_retry, capacity = (float(x) for x in result)
        if not ok:
            raise self._exceeded(
                team,
                "interactive",
                need,
                remaining=remaining,
                retry=taken_or_retry,
                capacity=capacity,
            )
        return Lease(int(taken_or_retry), remaining, capacity)

    async def give_back(self, team: str, tokens: int) -> None:
        """Return the unused part of a lease to the team's interactive pool."""
        await self._give_back(
            keys=[self.keys.quota_bucket(team, "interactive")], args=[tokens, _BUCKET_TTL_S]
        )

    async def snapshot(self, team: Team) -> dict[str, object]:
        """Budget, remaining, reservations, usage this hour and the factor (admin API)."""
        seconds, micros = await self.redis.time()
        now = seconds + micros / 1e6  # the clock the scripts refill on
        hour = int(now // 3600)
        factor_raw = await self.redis.get(self.keys.quota_factor(team.name))
        factor = float(factor_raw) if factor_raw is not None else 1.0
        reservations = await self.redis.hgetall(self.keys.quota_reservations(team.name))
        pools: dict[str, object] = {}
        for pool in ("interactive", "batch"):
            capacity = self.policy.budget_tokens(team, pool, factor)
            state = await self.redis.hmget(
                self.keys.quota_bucket(team.name, pool), ["tokens", "ts"]
            )
            if state[0] is None or capacity <= 0:
                remaining = capacity
            else:
                tokens, ts = float(state[0]), float(state[1] or now)
                remaining = min(capacity, tokens + max(0.0, now - ts) * capacity / 3600)
            used = await self.redis.get(self.keys.quota_used(team.name, pool, hour))
            held = [_text(v).split() for v in reservations.values()]
            pools[pool] = {
                "budget_tokens_per_hour": round(capacity),
                "remaining_tokens": round(remaining),
                "used_tokens_this_hour": int(used or 0),
                "reservations": sum(1 for p, _ in held if p == pool),
                "reserved_tokens": sum(int(t) for p, t in held if p == pool),
            }
        return {
            "team": team.name,
            "size": team.size,
            "complexity": team.complexity,
            "tier": team.tier,
            "supersede_grace_tokens": team.supersede_grace_tokens,
            "type_through": team.type_through,
            "factor": factor,
            "pools": pools,
        }
