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
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from laneway.constants import RedisKeys
from laneway.errors import QuotaExceeded
from quota.model import Pool, QuotaPolicy
from quota.teams import Team

__all__ = ["Admitted", "Lease", "QuotaEnforcer", "Settled"]

# Buckets, reservations and hourly counters outlive any idle period that matters: a bucket
# idle for an hour is full again anyway, and a reservation open for a day is a leak.
_BUCKET_TTL_S = 2 * 3600
_RESERVATION_TTL_S = 24 * 3600
_USED_TTL_S = 48 * 3600
# A request admitted from a lease has no reservation record to delete when it is settled; a
# mark per request id, kept this long, makes a second settle (a re-run after a crash) a no-op.
# Re-runs come within a minute or so (a partition moving to a live worker); a request re-run
# later than this has expired long before and is dropped, released at most once more.
_SETTLED_MARK_S = 900
_SETTLED_SLOT_S = 300  # marks are grouped by the five minutes the request was accepted in

# The token bucket every script shares: load (refilled to now), save, credit (refill, then
# add what a settle or a returned lease gives back; a bucket that expired is full anyway),
# and the wait until ``amount`` fits (-1: it never will).
_BUCKET = """
local function load(key, cap, now)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil then return cap end
  return math.min(cap, tokens + math.max(0, now - ts) * cap / 3600)
end
local function save(key, tokens, now, cap, ttl)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(now), 'cap', tostring(cap))
  redis.call('EXPIRE', key, ttl)
end
local function credit(key, amount, now)
  local v = redis.call('HMGET', key, 'tokens', 'ts', 'cap')
  local tokens, ts, cap = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  if tokens == nil then return end
  tokens = math.min(cap, tokens + math.max(0, now - ts) * cap / 3600)
  tokens = math.min(cap, tokens + amount)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(now))
end
local function retry_after(amount, tokens, cap)
  if amount <= cap and cap > 0 then return (amount - tokens) * 3600 / cap end
  return -1
end
"""

# KEYS: 1 bucket, 2 reservations, 3 factor, 4 lender bucket (batch borrowing interactive)
# ARGV: 1 base tokens/h, 2 now, 3 amount, 4 request id, 5 pool, 6 borrow 0|1,
#       7 lender base tokens/h, 8 reserve share, 9 lender pool, 10 bucket ttl, 11 resv ttl
_RESERVE = (
    _BUCKET
    + """
local factor = tonumber(redis.call('GET', KEYS[3]) or '1') or 1
local now, amount = tonumber(ARGV[2]), tonumber(ARGV[3])
local cap = tonumber(ARGV[1]) * factor
local bucket_ttl = tonumber(ARGV[10])
local resv_ttl = tonumber(ARGV[11])
local tokens = load(KEYS[1], cap, now)
local held = redis.call('HGET', KEYS[2], ARGV[4])
if held then
  return {1, tostring(tokens), '0', tostring(cap), ARGV[5]}
end
if tokens >= amount then
  save(KEYS[1], tokens - amount, now, cap, bucket_ttl)
  redis.call('HSET', KEYS[2], ARGV[4], ARGV[5] .. ' ' .. ARGV[3])
  redis.call('EXPIRE', KEYS[2], resv_ttl)
  return {1, tostring(tokens - amount), '0', tostring(cap), ARGV[5]}
end
if ARGV[6] == '1' then
  local lcap = tonumber(ARGV[7]) * factor
  local ltokens = load(KEYS[4], lcap, now)
  if ltokens - amount >= tonumber(ARGV[8]) * lcap then
    save(KEYS[4], ltokens - amount, now, lcap, bucket_ttl)
    redis.call('HSET', KEYS[2], ARGV[4], ARGV[9] .. ' ' .. ARGV[3])
    redis.call('EXPIRE', KEYS[2], resv_ttl)
    return {1, tostring(tokens), '0', tostring(cap), ARGV[9]}
  end
end
local retry = retry_after(amount, tokens, cap)
return {0, tostring(tokens), tostring(retry), tostring(cap), ARGV[5]}
"""
)

# A lease: an ingress takes a share of the interactive pool at once and admits from it
# locally, so most admissions cost no round trip. The bucket loses the tokens when they are
# leased; requests admitted from a lease are settled against the pool like reservations.
# KEYS: 1 bucket, 2 factor
# ARGV: 1 base tokens/h, 2 now, 3 need (fewest to take), 4 want (most), 5 bucket ttl
_LEASE = (
    _BUCKET
    + """
local factor = tonumber(redis.call('GET', KEYS[2]) or '1') or 1
local now, need, want = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cap = tonumber(ARGV[1]) * factor
local tokens = load(KEYS[1], cap, now)
if tokens < need then
  return {0, tostring(tokens), tostring(retry_after(need, tokens, cap)), tostring(cap)}
end
local take = math.max(need, math.floor(math.min(want, tokens)))
save(KEYS[1], tokens - take, now, cap, tonumber(ARGV[5]))
return {1, tostring(tokens - take), tostring(take), tostring(cap)}
"""
)

# Unused lease back to the pool. KEYS: 1 bucket; ARGV: 1 tokens, 2 now
_GIVE_BACK = (
    _BUCKET
    + """
credit(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))
return 1
"""
)

# KEYS: 1 reservations, 2 interactive bucket, 3 batch bucket, 4 interactive used, 5 batch used,
#       6 settled marks (request ids admitted from a lease and settled already)
# ARGV: 1 request id, 2 actual tokens, 3 now, 4 used ttl, 5 leased tokens (0: none),
#       6 marks ttl
_SETTLE = (
    _BUCKET
    + """
local held = redis.call('HGET', KEYS[1], ARGV[1])
local pool, amount
if held then
  pool, amount = string.match(held, '^(%S+) (%S+)$')
  amount = tonumber(amount)
elseif tonumber(ARGV[5]) > 0 then
  if redis.call('HSETNX', KEYS[6], ARGV[1], '1') == 0 then return {0, '', '0'} end
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[6]))
  pool, amount = 'interactive', tonumber(ARGV[5])
else
  return {0, '', '0'}
end
local actual, now = tonumber(ARGV[2]), tonumber(ARGV[3])
local bucket, used = KEYS[2], KEYS[4]
if pool == 'batch' then bucket, used = KEYS[3], KEYS[5] end
credit(bucket, amount - actual, now)
if held then redis.call('HDEL', KEYS[1], ARGV[1]) end
if actual > 0 then
  redis.call('INCRBY', used, actual)
  redis.call('EXPIRE', used, tonumber(ARGV[4]))
end
return {1, pool, tostring(amount)}
"""
)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class Admitted:
    pool: Pool
    remaining: int
    capacity: int
    reset_s: float  # seconds until the bucket is full again
    leased: int = 0  # tokens taken from the ingress's lease (0: a reservation in Redis)


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


class QuotaEnforcer:
    """Reserve, settle and release team budget in Redis."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, policy: QuotaPolicy) -> None:
        self.redis = redis
        self.keys = keys
        self.policy = policy
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)
        self._lease = redis.register_script(_LEASE)
        self._give_back = redis.register_script(_GIVE_BACK)

    async def reserve(
        self,
        team: Team,
        pool: Pool,
        request_id: str,
        tokens: int,
        *,
        now: float | None = None,
        borrow: bool | None = None,
    ) -> Admitted:
        """Take ``tokens`` from the team's pool or raise ``QuotaExceeded``."""
        now = time.time() if now is None else now
        if borrow is None:
            borrow = pool == "batch" and self.policy.in_offpeak()
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
                now,
                tokens,
                request_id,
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
            )
        return QuotaExceeded(
            f"team {team.name!r} is over its {pool} budget: {tokens} tokens asked, "
            f"{max(0.0, remaining):.0f} of {capacity:.0f} tokens/hour left",
            team=team.name,
            limit=int(capacity),
            retry_after=retry,
        )

    async def settle(
        self,
        team: str,
        request_id: str,
        actual_tokens: int,
        *,
        now: float | None = None,
        leased: int = 0,
        accepted_ts: float = 0.0,
    ) -> Settled:
        """Turn a reservation into the real count: refund the rest, or charge the excess.

        ``leased`` is what the ingress admitted the request for from its lease (the envelope
        carries it, with ``accepted_ts``); then there is no reservation record in Redis.
        Idempotent: a second settle of the same request (a re-run after a crash) is a no-op.
        """
        keys, args = self._settle_call(
            team, request_id, actual_tokens, now=now, leased=leased, accepted_ts=accepted_ts
        )
        found, pool, reserved = await self._settle(keys=keys, args=args)
        pool_name = pool.decode() if isinstance(pool, bytes) else str(pool)
        return Settled(bool(int(found)), pool_name, int(float(reserved)))

    def queue_settle(
        self,
        pipe: Pipeline,
        team: str,
        request_id: str,
        actual_tokens: int,
        *,
        leased: int = 0,
        accepted_ts: float = 0.0,
    ) -> None:
        """``settle`` as one command of a pipeline (the worker sends it with its reply).

        Queued as a bare EVALSHA: a pipeline that holds a registered script first asks Redis
        ``SCRIPT EXISTS``, a round trip per reply. When Redis answers NOSCRIPT (it restarted
        and lost its script cache), the caller runs ``settle``, which loads the script.
        """
        keys, args = self._settle_call(
            team, request_id, actual_tokens, now=None, leased=leased, accepted_ts=accepted_ts
        )
        pipe.evalsha(self._settle.sha, len(keys), *keys, *args)

    def _settle_call(
        self,
        team: str,
        request_id: str,
        actual_tokens: int,
        *,
        now: float | None,
        leased: int,
        accepted_ts: float,
    ) -> tuple[list[str], list[float | int | str]]:
        now = time.time() if now is None else now
        hour = int(now // 3600)
        keys = [
            self.keys.quota_reservations(team),
            self.keys.quota_bucket(team, "interactive"),
            self.keys.quota_bucket(team, "batch"),
            self.keys.quota_used(team, "interactive", hour),
            self.keys.quota_used(team, "batch", hour),
            self.keys.quota_settled(team, int(accepted_ts // _SETTLED_SLOT_S)),
        ]
        return keys, [request_id, actual_tokens, now, _USED_TTL_S, leased, _SETTLED_MARK_S]

    async def lease(self, team: Team, need: int, want: int, *, now: float | None = None) -> Lease:
        """Take between ``need`` and ``want`` tokens of the team's interactive pool for an
        ingress to admit from, or raise ``QuotaExceeded`` when not even ``need`` is left."""
        now = time.time() if now is None else now
        result = await self._lease(
            keys=[
                self.keys.quota_bucket(team.name, "interactive"),
                self.keys.quota_factor(team.name),
            ],
            args=[
                self.policy.base_tokens(team, "interactive"),
                now,
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

    async def give_back(self, team: str, tokens: int, *, now: float | None = None) -> None:
        """Return the unused part of a lease to the team's interactive pool."""
        now = time.time() if now is None else now
        await self._give_back(
            keys=[self.keys.quota_bucket(team, "interactive")], args=[tokens, now]
        )

    async def snapshot(self, team: Team) -> dict[str, object]:
        """Budget, remaining, reservations, usage this hour and the factor (admin API)."""
        now = time.time()
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
