"""Team quotas on the real Redis (and the real broker for the whole-path scenarios)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka.errors import KafkaTimeoutError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from laneway.constants import RedisKeys, Topics
from laneway.errors import BadRequest, QuotaExceeded
from laneway.schema import BatchRequest, Reply, RequestEnvelope, UsageEvent
from laneway.tokens import estimate_tokens
from ops.redis_server import RedisServer
from quota import (
    LocalLimiter,
    QuotaEnforcer,
    QuotaPolicy,
    Team,
    dynamic_factor,
    get_team,
    utilisation_sigma,
)
from quota.teams import MAX_TEAM_SIZE, set_team
from tests.stack import (
    LiveStack,
    Services,
    clear_of_the_hour_turn,
    envelope,
    eventually,
    free_port,
    frozen,
    redis_client,
)
from workers import metrics
from workers.accounting import Owed
from workers.outbox import Outbox

# --- the model --------------------------------------------------------------------------


def test_budget_formula_and_factor_cap() -> None:
    policy = QuotaPolicy(unit_tokens=1000, units_per_member=50, batch_ratio=0.5)
    team = Team("t", size=4, complexity=1.5)
    assert policy.base_tokens(team, "interactive") == 4 * 50 * 1.5 * 1000
    assert policy.base_tokens(team, "batch") == 4 * 50 * 1.5 * 1000 * 0.5
    assert dynamic_factor(0.0) == 1.0
    assert dynamic_factor(0.2) == pytest.approx(1.1)
    assert dynamic_factor(0.6) == pytest.approx(1.3)  # 0.5·σ = 0.3: exactly at the cap
    assert dynamic_factor(5.0) == pytest.approx(1.3)  # capped
    assert policy.budget_tokens(team, "interactive", dynamic_factor(5.0)) == pytest.approx(390_000)


def test_sigma_of_hourly_utilisation() -> None:
    # Half the hours at 20 % of budget, half at 60 %: mean 40 %, σ = 20 %.
    hours = [200.0, 600.0] * 12
    assert utilisation_sigma(hours, 1000.0) == pytest.approx(0.2)
    assert dynamic_factor(utilisation_sigma(hours, 1000.0)) == pytest.approx(1.1)


def test_offpeak_window_wraps_midnight() -> None:
    policy = QuotaPolicy(offpeak="22:00-06:00")
    assert policy.in_offpeak(datetime(2026, 1, 1, 23, 30, tzinfo=UTC))
    assert policy.in_offpeak(datetime(2026, 1, 1, 5, 59, tzinfo=UTC))
    assert not policy.in_offpeak(datetime(2026, 1, 1, 9, 0, tzinfo=UTC))
    assert not QuotaPolicy(offpeak="").in_offpeak()


# --- enforcement arithmetic on the real Redis --------------------------------------------


@pytest.fixture(autouse=True)
async def _within_one_hour() -> None:
    """A pool's "used this hour" counter starts again at the turn of the hour: no test here
    may straddle it (the longest takes about 10 s)."""
    await clear_of_the_hour_turn(60)


@pytest.fixture
async def enforcer(services: Services) -> Any:
    redis = redis_client(services.redis_url)
    keys = RedisKeys(f"q{uuid.uuid4().hex[:8]}")
    policy = QuotaPolicy(unit_tokens=1000, units_per_member=1, offpeak="", borrow_reserve=0.3)
    yield QuotaEnforcer(redis, keys, policy), redis, keys
    await redis.aclose()


async def test_reserve_and_settle_arithmetic(enforcer: Any) -> None:
    quota, redis, keys = enforcer
    team = Team("alpha", size=1)  # 1,000 tokens an hour per pool
    admitted = await quota.reserve(team, "interactive", "ok-1", 300)
    assert (admitted.remaining, admitted.capacity) == (700, 1000)
    await quota.reserve(team, "interactive", "err-1", 200)
    await quota.reserve(team, "interactive", "cancel-1", 100)
    await quota.reserve(team, "interactive", "exp-1", 100)
    # ok: used 120 of 300 → 180 back; error after 50 tokens: 150 back;
    # cancelled and expired before they ran: all back but the minimum charge (16 tokens).
    assert (await quota.settle("alpha", "ok-1", 120)).reserved == 300
    await quota.settle("alpha", "err-1", 50)
    assert (await quota.settle("alpha", "cancel-1", 0)).charged == 16
    await quota.settle("alpha", "exp-1", 0)
    snap = await quota.snapshot(team)
    pool = snap["pools"]["interactive"]
    assert pool["reservations"] == 0
    assert pool["used_tokens_this_hour"] == 170 + 2 * 16
    bucket = await redis.hget(keys.quota_bucket("alpha", "interactive"), "tokens")
    assert float(bucket) == pytest.approx(1000 - 202, abs=1)  # the refill meanwhile is tiny
    # Settling twice (a re-run after a crash) changes nothing.
    assert not (await quota.settle("alpha", "ok-1", 120)).found
    # Charged above the reservation: the excess is taken too, up to the reservation again
    # (QuotaPolicy.max_excess = 1): 180 of 100 → 180; 900 of 100 → 200.
    await quota.reserve(team, "interactive", "long-1", 100)
    assert (await quota.settle("alpha", "long-1", 180)).charged == 180
    assert float(
        await redis.hget(keys.quota_bucket("alpha", "interactive"), "tokens")
    ) == pytest.approx(1000 - 202 - 180, abs=1)
    await quota.reserve(team, "interactive", "long-2", 100)
    assert (await quota.settle("alpha", "long-2", 900)).charged == 200


async def test_a_debt_outlives_the_idle_expiry_of_its_bucket(enforcer: Any) -> None:
    """A request that used far more than it reserved leaves its pool in debt; the bucket
    lives until the refill has paid it back, so an expiry never forgives it."""
    quota, redis, keys = enforcer
    team = Team("epsilon", size=1)  # 1,000 tokens an hour
    await quota.reserve(team, "interactive", "all", 1000)
    # 5,000 used of 1,000 reserved: charged 2,000 (the excess is capped at the reservation).
    assert (await quota.settle("epsilon", "all", 5000)).charged == 2000
    bucket = keys.quota_bucket("epsilon", "interactive")
    assert float(await redis.hget(bucket, "tokens")) == pytest.approx(-1000, abs=1)
    # Two idle hours, plus the hour the refill needs to pay 1,000 tokens back.
    assert await redis.ttl(bucket) > 2 * 3600 + 3500
    with pytest.raises(QuotaExceeded):
        await quota.reserve(team, "interactive", "next", 10)


async def test_requests_admitted_locally_are_charged_once_when_redis_answers(
    enforcer: Any,
) -> None:
    """While Redis did not answer, an ingress admitted with its local limiter (nothing taken
    from the pool): the settlement charges what the request used, once, however often it is
    sent (a worker sends again what may not have reached Redis)."""
    quota, redis, keys = enforcer
    team = Team("zeta", size=1)  # 1,000 tokens an hour
    await quota.reserve(team, "interactive", "before", 100)  # the bucket exists: 900 left
    now = time.time()
    settled = await quota.settle("zeta", "local-1", 40, local=120, accepted_ts=now)
    assert (settled.found, settled.reserved, settled.charged) == (True, 120, 40)
    assert not (await quota.settle("zeta", "local-1", 40, local=120, accepted_ts=now)).found
    # Its reservation reached Redis after all (the call timed out, then ran): settled against
    # the reservation, once.
    await quota.reserve(team, "interactive", "late-1", 50)
    settled = await quota.settle("zeta", "late-1", 30, local=50, accepted_ts=now)
    assert (settled.found, settled.charged) == (True, 30)
    assert not (await quota.settle("zeta", "late-1", 30, local=50, accepted_ts=now)).found
    bucket = await redis.hget(keys.quota_bucket("zeta", "interactive"), "tokens")
    assert float(bucket) == pytest.approx(1000 - 100 - 40 - 30, abs=1)
    pool = (await quota.snapshot(team))["pools"]["interactive"]
    assert (pool["used_tokens_this_hour"], pool["reservations"]) == (40 + 30, 1)  # "before"


async def test_a_charge_to_a_pool_whose_bucket_is_gone_is_taken_from_a_full_one(
    enforcer: Any,
) -> None:
    """A team idle for two hours, a new team, or a bucket lost with Redis's data has no bucket:
    what an outage served (admitted locally, nothing taken) is charged to a full one made for
    it, of the team's budget times its factor. What is given back to it changes nothing."""
    quota, redis, keys = enforcer
    now = time.time()
    bucket = keys.quota_bucket("zeta", "interactive")
    settled = await quota.settle("zeta", "local-1", 40, local=120, accepted_ts=now)
    assert (settled.found, settled.charged) == (True, 40)
    assert float(await redis.hget(bucket, "tokens")) == pytest.approx(1000 - 40, abs=1)
    assert not (await quota.settle("zeta", "local-1", 40, local=120, accepted_ts=now)).found
    assert float(await redis.hget(bucket, "tokens")) == pytest.approx(1000 - 40, abs=1)
    # Through a worker's pipeline (the settle sent beside the reply, which cannot carry the
    # team's budget): the team's record and factor make the bucket, 2 × 1,000 × 1.5.
    await set_team(redis, keys, Team("eta", size=2))
    await redis.set(keys.quota_factor("eta"), "1.5")
    outbox = Outbox(redis, None, Topics(keys.prefix), quota)  # type: ignore[arg-type]
    env = envelope(id="local-2", team="eta", max_tokens=200, quota_local=300, accepted_ts=now)
    usage = UsageEvent(
        id="local-2",
        team="eta",
        cls="completion",
        model="m",
        route="m",
        status="ok",
        prompt_tokens=100,
        completion_tokens=150,
    )
    await outbox._final_writes(env, Reply(id="local-2", n=0, done=True, status="ok"), usage)
    assert not outbox.accounting.owed
    tokens, cap = await redis.hmget(keys.quota_bucket("eta", "interactive"), ["tokens", "cap"])
    assert (float(tokens), float(cap)) == (pytest.approx(3000 - 250, abs=1), 3000)
    # A charge beyond a batch reservation whose bucket expired meanwhile (its line ran long).
    await quota.reserve(Team("zeta"), "batch", "batch-j-1", 100)
    await redis.delete(keys.quota_bucket("zeta", "batch"))
    assert (await quota.settle("zeta", "batch-j-1", 150)).charged == 150
    batch = float(await redis.hget(keys.quota_bucket("zeta", "batch"), "tokens"))
    assert batch == pytest.approx(1000 - 50, abs=1)
    # Given back to a bucket that is gone: it is full anyway, and stays unmade.
    await quota.give_back("theta", 30)
    assert (await quota.settle("theta", "l-1", 40, leased=120, accepted_ts=now)).charged == 40
    assert not await redis.exists(keys.quota_bucket("theta", "interactive"))


async def test_a_leased_request_settled_after_its_mark_window_is_refunded_nothing(
    enforcer: Any,
) -> None:
    """Its mark may be gone by then (it lives 15 minutes): a replay, dropped as long expired,
    would be refunded its lease a second time. A charge beyond the lease is still taken."""
    quota, redis, keys = enforcer
    team = Team("delta", size=1)
    await quota.lease(team, need=300, want=300)  # 700 left
    bucket = keys.quota_bucket("delta", "interactive")
    long_ago = time.time() - 1000
    settled = await quota.settle("delta", "old-1", 0, leased=120, accepted_ts=long_ago)
    assert (settled.found, settled.charged) == (True, 16)
    assert float(await redis.hget(bucket, "tokens")) == pytest.approx(700, abs=1)
    settled = await quota.settle("delta", "old-2", 80, leased=50, accepted_ts=long_ago)
    assert settled.charged == 80
    assert float(await redis.hget(bucket, "tokens")) == pytest.approx(700 - 30, abs=1)
    # Within the window the unused lease goes back, as always.
    await quota.settle("delta", "new-1", 40, leased=100, accepted_ts=time.time())
    assert float(await redis.hget(bucket, "tokens")) == pytest.approx(670 + 60, abs=1)


def test_estimates_count_dense_text_denser() -> None:
    assert estimate_tokens("") == 0
    assert estimate_tokens("def fib(n): return n") == 6  # 17 plain (4 a token), 3 punctuation
    code = "def handler(request):\n    return request.json()\n" * 20
    assert len(code) / 4 <= estimate_tokens(code) <= len(code) / 2.5
    # What tokenizes a token a character or denser is no longer a quarter token each.
    assert estimate_tokens("数据库连接失败" * 10) == 105  # 3 UTF-8 bytes: 1.5 a character
    assert estimate_tokens("🙂" * 100) == 200
    assert estimate_tokens("{}[]()<>" * 50) == 200
    assert estimate_tokens("\ud800 lone") > 0  # a lone surrogate is counted, not an error


async def test_lease_arithmetic(enforcer: Any) -> None:
    quota, redis, _ = enforcer
    team = Team("delta", size=1)  # 1,000 tokens an hour per pool
    first = await quota.lease(team, need=100, want=300)
    assert (first.taken, first.capacity) == (300, 1000)
    assert first.remaining == pytest.approx(700)
    # Never more than is left, never less than asked for: the rest of the pool, or a refusal.
    second = await quota.lease(team, need=100, want=900)
    assert second.taken == 700
    assert second.remaining == pytest.approx(0, abs=0.01)
    with pytest.raises(QuotaExceeded) as info:
        await quota.lease(team, need=50, want=100)
    assert info.value.retry_after == pytest.approx(180, rel=0.01)  # 50 tokens at 1,000/h
    # Requests admitted from a lease are settled by what the envelope says they took:
    # 120 of which 40 were used, and 150 dropped before running (the minimum charge, 16).
    now = time.time()
    settled = await quota.settle("delta", "l-1", 40, leased=120, accepted_ts=now)
    assert (settled.found, settled.pool, settled.reserved) == (True, "interactive", 120)
    await quota.settle("delta", "l-2", 0, leased=150, accepted_ts=now)
    # Settling twice (a re-run after a crash) changes nothing.
    assert not (await quota.settle("delta", "l-1", 40, leased=120, accepted_ts=now)).found
    await quota.give_back("delta", 30)  # the unused rest of the first lease
    tokens = await redis.hget(quota.keys.quota_bucket("delta", "interactive"), "tokens")
    assert float(tokens) == pytest.approx(80 + 134 + 30, abs=1)
    pool = (await quota.snapshot(team))["pools"]["interactive"]
    assert (pool["used_tokens_this_hour"], pool["reservations"]) == (40 + 16, 0)


async def test_over_budget_says_when_to_retry(enforcer: Any) -> None:
    quota, _, _ = enforcer
    team = Team("beta", size=1)
    await quota.reserve(team, "interactive", "a", 900)
    with pytest.raises(QuotaExceeded) as info:
        await quota.reserve(team, "interactive", "b", 200)
    # 100 tokens are missing; the pool refills 1,000 tokens an hour: 360 s.
    assert info.value.retry_after == pytest.approx(360, rel=0.01)
    assert info.value.limit == 1000
    with pytest.raises(QuotaExceeded, match="can never fit"):
        await quota.reserve(team, "interactive", "c", 5000)


async def test_dynamic_factor_from_redis_and_batch_pool_separate(enforcer: Any) -> None:
    quota, redis, keys = enforcer
    team = Team("gamma", size=1)
    await redis.set(keys.quota_factor("gamma"), "1.3")
    admitted = await quota.reserve(team, "interactive", "x", 10)
    assert admitted.capacity == 1300
    # Draining batch leaves interactive untouched.
    await quota.reserve(team, "batch", "b1", 1300)
    with pytest.raises(QuotaExceeded):
        await quota.reserve(team, "batch", "b2", 10, borrow=False)
    assert (await quota.reserve(team, "interactive", "i2", 500)).remaining == 790


async def test_batch_borrows_only_above_the_reserve(enforcer: Any) -> None:
    quota, _, _ = enforcer
    team = Team("delta", size=1)
    await quota.reserve(team, "batch", "b0", 1000)
    # Off-peak borrowing from interactive: allowed while 30 % of it stays untouched.
    admitted = await quota.reserve(team, "batch", "b1", 600, borrow=True)
    assert admitted.pool == "interactive"
    with pytest.raises(QuotaExceeded):
        await quota.reserve(team, "batch", "b2", 200, borrow=True)
    settled = await quota.settle("delta", "b1", 600)
    assert settled.pool == "interactive"


# --- whole path ------------------------------------------------------------------------------


async def test_worker_settles_even_after_redis_lost_its_scripts(enforcer: Any) -> None:
    """The worker sends its settle as a bare EVALSHA beside the final reply; a Redis that
    restarted without its script cache answers NOSCRIPT, and the settle must still land, for
    each of the requests whose writes shared the pipeline."""
    quota, redis, keys = enforcer
    team = Team("alpha", size=1)
    ids = ("r-1", "r-2")
    for rid in ids:
        await quota.reserve(team, "interactive", rid, 300)
    await redis.script_flush()
    outbox = Outbox(redis, None, Topics(keys.prefix), quota)  # type: ignore[arg-type]
    stream = f"{keys.prefix}:reply:test"

    async def finish(rid: str, tokens: int) -> None:
        env = envelope(id=rid, team="alpha", max_tokens=200, reply_to=stream)
        final = Reply(id=rid, n=0, text="hi", done=True, status="ok")
        usage = UsageEvent(
            id=rid,
            team="alpha",
            cls="completion",
            model="m",
            route="m",
            status="ok",
            prompt_tokens=100,
            completion_tokens=tokens,
        )
        await outbox._final_writes(env, final, usage)

    await asyncio.gather(finish("r-1", 20), finish("r-2", 30))
    pool = (await quota.snapshot(team))["pools"]["interactive"]
    assert pool["reservations"] == 0
    assert pool["used_tokens_this_hour"] == 250
    assert await redis.xlen(stream) == 2  # each reply went out once, through Redis


def _spawn_ingress(stack: LiveStack, port: int, **env: str) -> subprocess.Popen[bytes]:
    return stack.spawn("ingress", LANEWAY_PORT=str(port), LANEWAY_LOG_LEVEL="WARNING", **env)


async def test_headers_and_429(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(quota_units_per_member=0.1)  # 100 tokens an hour
    await stack.start_worker("completion")
    http = stack.http(ingress, await stack.api_key("tiny", size=1))
    body = {"model": "laneway-code", "prompt": "x" * 40, "max_tokens": 30}  # reserves 40
    first = await http.post("/v1/completions", json=body)
    assert first.status_code == 200
    assert int(first.headers["x-ratelimit-limit-tokens"]) == 100
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 60
    assert first.headers["x-ratelimit-reset-tokens"].endswith("s")
    # Settled to the real count, not the reservation: the hour's counter holds what was used
    # and no reservation is left.
    used = first.json()["usage"]["total_tokens"]
    assert used < 40
    team = Team("tiny", size=1)
    snapshot = functools.partial(ingress.state.quota.enforcer.snapshot, team)
    await wait_for_budget_used(snapshot, used)
    pool = (await snapshot())["pools"]["interactive"]
    assert (pool["used_tokens_this_hour"], pool["reservations"]) == (used, 0)
    statuses = [(await http.post("/v1/completions", json=body)).status_code for _ in range(4)]
    assert 429 in statuses
    refused = await http.post("/v1/completions", json=body)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    # What is left, and when the request fits: 100 tokens an hour refill one every 36 s, so
    # minutes. Not worth a retry (openai-node 6 slept its whole Retry-After, past its own
    # timeout): the SDKs are told not to, and the wait is in the reset header.
    left = int(refused.headers["x-ratelimit-remaining-tokens"])
    assert 0 <= left < 40
    assert f"{left} of 100 tokens/hour left" in refused.json()["error"]["message"]
    wait = int(refused.headers["x-ratelimit-reset-tokens"].removesuffix("s"))
    assert wait > 60
    assert f"fits again in about {wait} s" in refused.json()["error"]["message"]
    assert refused.headers["x-should-retry"] == "false"
    assert "retry-after" not in refused.headers
    # Named by its id, as an answer would be (the OpenAI SDKs read it as request_id); one
    # larger than the whole hour's budget is never for the SDK to send again.
    assert refused.headers["x-request-id"]
    whole = await http.post("/v1/completions", json={**body, "prompt": "x" * 400})
    assert whole.status_code == 429, whole.text
    assert whole.headers["x-should-retry"] == "false"
    assert "retry-after" not in whole.headers  # no wait makes it fit: none to wait for


async def test_ingress_admits_from_a_lease_and_gives_back_the_rest(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(quota_lease_share=0.01, quota_lease_idle_s=60)
    await stack.start_worker("completion")
    team = Team("leasers", size=2)  # 100,000 tokens an hour: leases of 1,000
    http = stack.http(ingress, await stack.api_key(team.name, size=team.size))
    gate = ingress.state.quota
    leases: list[int] = []
    take = gate.enforcer.lease

    async def counted(*args: Any, **kwargs: Any) -> Any:
        got = await take(*args, **kwargs)
        leases.append(got.taken)
        return got

    gate.enforcer.lease = counted  # type: ignore[method-assign]
    spent = 0
    remaining: list[int] = []
    started = time.time()
    for i in range(20):
        body = {"model": "laneway-code", "prompt": f"def f{i}():", "max_tokens": 8}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        spent += response.json()["usage"]["total_tokens"]
        remaining.append(int(response.headers["x-ratelimit-remaining-tokens"]))
    # 20 admissions of about 12 tokens each, one Redis lease of about 1,000 for all of them.
    assert len(leases) == 1, leases
    assert 1000 <= leases[0] <= 1100
    assert remaining == sorted(remaining, reverse=True)
    assert remaining[0] - remaining[-1] > 19 * 10  # each request is counted locally
    # Settled to the real count by the worker, and the idle rest goes back to the pool:
    # then the pool lacks exactly what was used (plus a sliver of refill).
    await wait_for_budget_used(lambda: gate.enforcer.snapshot(team), spent)
    assert await gate.return_idle() == 0  # used a moment ago: not idle for 60 s yet
    held = gate._leases[team.name].tokens
    assert held > 0
    assert await gate.return_idle(idle_s=0) == held
    pool = (await gate.enforcer.snapshot(team))["pools"]["interactive"]
    refill = (time.time() - started) * 100_000 / 3600  # the pool refills all along
    assert pool["used_tokens_this_hour"] == spent
    assert 100_000 - spent <= pool["remaining_tokens"] <= 100_000 - spent + refill + 1


@pytest.mark.slow
@pytest.mark.parametrize(("lease_share", "unused"), [(0, 2), (0.1, 3)], ids=["exact", "leases"])
async def test_two_ingress_processes_never_overspend(
    stack: LiveStack, lease_share: float, unused: int
) -> None:
    key = await stack.api_key("shared", size=1, complexity=0.02)  # 1,000 tokens an hour
    # No worker: reservations stay open, so every admission spends from the bucket.
    ports = [free_port(), free_port()]
    procs = [
        _spawn_ingress(
            stack,
            port,
            LANEWAY_REPLY_TIMEOUT_S="3",
            LANEWAY_QUOTA_LEASE_SHARE=str(lease_share),
        )
        for port in ports
    ]
    try:
        async with httpx.AsyncClient(
            timeout=30, headers={"Authorization": f"Bearer {key}"}
        ) as http:
            for port in ports:
                await wait_for_http(http, f"http://127.0.0.1:{port}/healthz")
            body = {"model": "laneway-code", "prompt": "y" * 40, "max_tokens": 16}  # reserves 26
            calls = [
                http.post(f"http://127.0.0.1:{ports[i % 2]}/v1/completions", json=body)
                for i in range(100)
            ]
            responses = await asyncio.gather(*calls)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
    codes = [r.status_code for r in responses]
    admitted = codes.count(504)  # admitted, then no worker answered within the reply timeout
    assert admitted + codes.count(429) == 100, codes
    reservation = 26
    assert admitted * reservation <= 1000 + reservation  # overshoot ≤ one reservation
    # And the budget was really used: what is left is less than a reservation in the pool,
    # and with leases (100 tokens each) less than one in each replica's lease too.
    assert admitted * reservation > 1000 - unused * reservation


@pytest.mark.slow
async def test_replicas_that_lose_redis_admit_together_what_the_pool_had_left(
    services: Services, tmp_path: Path, prefix: str
) -> None:
    """While Redis is silent each replica admits on its own, and the load balancer may send
    a team's requests to any of them: together they grant no more than the pool had left
    (each its share, counted by the replicas' roll call), not that much each."""
    server = _own_redis(tmp_path)
    stack = LiveStack(Services(services.bootstrap, server.url), prefix)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await stack.create_topics()
        key = await stack.api_key("shared", size=1, complexity=0.02)  # 1,000 tokens an hour
        ports = [free_port(), free_port()]
        # Per-request reservations (the fallback starts from what each last heard exactly);
        # no worker, so each admitted request stays reserved and is answered 504.
        procs = [
            _spawn_ingress(stack, port, LANEWAY_REPLY_TIMEOUT_S="3", LANEWAY_QUOTA_LEASE_SHARE="0")
            for port in ports
        ]
        async with httpx.AsyncClient(
            timeout=30, headers={"Authorization": f"Bearer {key}"}
        ) as http:
            for port in ports:
                await wait_for_http(http, f"http://127.0.0.1:{port}/healthz")

            async def counted(port: int) -> bool:  # each has heard of the other (seconds)
                scrape = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                return "laneway_quota_fallback_replicas 2.0" in scrape

            for port in ports:
                await eventually(functools.partial(counted, port), 30, "the roll call")
            body = {"model": "laneway-code", "prompt": "y" * 40, "max_tokens": 16}  # 26 each
            url = "http://127.0.0.1:{}/v1/completions"
            # Each replica hears of the team from Redis (an exact admission).
            heard = [await http.post(url.format(port), json=body) for port in ports]
            pid = server.pid
            assert pid is not None
            with frozen(pid, at_most_s=60):
                calls = [http.post(url.format(ports[i % 2]), json=body) for i in range(100)]
                responses = heard + list(await asyncio.gather(*calls))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
        await stack.stop()
        server.stop()
    codes = [r.status_code for r in responses]
    admitted = codes.count(504)  # admitted, then no worker answered within the reply timeout
    assert admitted + codes.count(429) == 102, codes
    assert admitted * 26 <= 1000 + 26, codes  # overshoot ≤ one reservation
    assert any("local limit while Redis does not answer in time" in r.text for r in responses)


async def wait_for_http(http: httpx.AsyncClient, url: str) -> None:
    async def answers() -> bool:
        try:
            return (await http.get(url)).status_code == 200
        except httpx.HTTPError:
            return False

    await eventually(answers, 30, f"{url} to answer 200")


def _batch_line(team: str, job: str, line: int) -> BatchRequest:
    return BatchRequest(
        job_id=job,
        line_id=str(line),
        team=team,
        url="/v1/completions",
        body={"model": "laneway-code", "prompt": f"document {line} " * 5, "max_tokens": 64},
    )


@pytest.mark.slow
async def test_night_batch_never_throttles_interactive(stack: LiveStack) -> None:
    team = "night"
    ingress = await stack.start_ingress(quota_offpeak="")
    await stack.start_worker("completion")
    await stack.start_worker("batch", quota_offpeak="")
    key = await stack.api_key(team, size=1, complexity=0.1)  # 5,000 tokens/h per pool
    producer = await stack.producer()
    job = uuid.uuid4().hex[:6]
    for line in range(200):  # 200 × 84 tokens ≫ the batch pool
        await producer.send(
            stack.topics.request("batch"),
            _batch_line(team, job, line).to_json(),
            key=f"{job}:{line}".encode(),
        )
    await producer.flush()
    waits_before = metrics.QUOTA_WAITS.labels(team)._value.get()
    await eventually(
        lambda: metrics.QUOTA_WAITS.labels(team)._value.get() > waits_before, 30, "batch throttled"
    )

    http = stack.http(ingress, key)
    codes = []
    for i in range(30):
        response = await http.post(
            "/v1/completions",
            json={"model": "laneway-code", "prompt": f"fix {i}", "max_tokens": 16},
        )
        codes.append(response.status_code)
    assert codes == [200] * 30
    await stack.read_topic(stack.topics.results_batch, count=1)  # the job runs...
    results = await stack.read_all(stack.topics.results_batch)
    assert len(results) < 200  # ...but its own pool is throttled: the job waits, nothing fails
    assert all(r["status"] == "ok" for r in results)


def _own_redis(tmp_path: Path, port: int = 0) -> RedisServer:
    """A Redis server of the test's own (on ``port``: started again), to stop and start."""
    server = RedisServer(port=port or free_port(), data_dir=tmp_path / "redis")
    server.start()
    return server


@pytest.mark.slow
async def test_redis_outage_keeps_interactive_and_pauses_batch(
    services: Services, tmp_path: Path, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = _own_redis(tmp_path)
    stack = LiveStack(Services(services.bootstrap, server.url), prefix)
    try:
        await stack.create_topics()
        # Per-request reservations: a lease would admit the outage's few requests without
        # asking Redis at all, and this is about the fallback when it must be asked.
        ingress = await stack.start_ingress(quota_lease_share=0)
        await stack.start_worker("completion")
        await stack.start_worker("batch")
        key = await stack.api_key("ops", size=1)
        http = stack.http(ingress, key)
        body = {"model": "laneway-code", "prompt": "def ok():", "max_tokens": 8}
        assert (await http.post("/v1/completions", json=body)).status_code == 200

        with contextlib.suppress(RedisConnectionError):
            await stack.redis.shutdown(save=True)  # keeps its data for the restart
        await eventually(lambda: not server.running, 10, "redis to stop")
        server.stop()  # reaps the process and closes its log

        for i in range(5):
            response = await http.post(
                "/v1/completions", json={**body, "prompt": f"while down {i}"}
            )
            assert response.status_code == 200, response.text
        producer = await stack.producer()
        job = uuid.uuid4().hex[:6]
        for line in range(5):
            await producer.send_and_wait(
                stack.topics.request("batch"),
                _batch_line("ops", job, line).to_json(),
                key=f"{job}:{line}".encode(),
            )
        # The lane took the lines up and paused on Redis; nothing of the job was written.
        await eventually(
            lambda: "paused, Redis unreachable" in caplog.text, 30, "the lane to pause"
        )
        assert await stack.read_all(stack.topics.results_batch) == []

        server = _own_redis(tmp_path, server.port)
        results = await stack.read_topic(stack.topics.results_batch, count=5, within_s=30)
        assert len(results) == 5
        response = await http.post("/v1/completions", json={**body, "prompt": "after"})
        assert response.status_code == 200
        await eventually(lambda: not ingress.state.quota.degraded, 10, "exact quota again")
        response = await http.post("/v1/completions", json={**body, "prompt": "after 2"})
        assert response.status_code == 200
        # 8 completions (1 before, 5 during, 2 after the outage) and the 5 batch lines
        usage = await stack.read_topic(stack.topics.usage, count=13, within_s=10)
        assert sum(1 for e in usage if e["class"] == "completion" and e["status"] == "ok") == 8
    finally:
        await stack.stop()
        server.stop()


async def test_admin_api_sets_team_and_reads_budget(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(admin_key="root-secret-0123456")
    await stack.start_worker("completion")
    admin = stack.http(ingress, "root-secret-0123456")
    assert (await stack.http(ingress, "wrong").get("/admin/teams/docs")).status_code == 401
    created = await admin.put(
        "/admin/teams/docs",
        json={"size": 2, "complexity": 0.5, "tier": "lo", "supersede_grace_tokens": 8},
    )
    assert created.status_code == 200, created.text
    assert created.json()["pools"]["interactive"]["budget_tokens_per_hour"] == 2 * 50 * 0.5 * 1000
    bad = await admin.put("/admin/teams/docs", json={"size": 0})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "size"
    bad = await admin.put("/admin/teams/docs", json={"size": 2, "supersede_grace_tokens": -1})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "supersede_grace_tokens"
    # A size whose budget no 64-bit number holds is refused, not stored.
    bad = await admin.put("/admin/teams/docs", json={"size": 400_000_000_000_000})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "size")
    with pytest.raises(BadRequest, match="from 1 to 100,000"):
        Team("docs", size=400_000_000_000_000)
    # One stored before the bounds is read within them: the team keeps working.
    keys = RedisKeys(stack.prefix)
    await stack.redis.hset(keys.team("legacy"), mapping={"size": 400_000_000_000_000})
    await stack.redis.sadd(keys.teams(), "legacy")
    assert (await get_team(stack.redis, keys, "legacy")).size == MAX_TEAM_SIZE
    assert (await admin.get("/admin/teams/legacy")).status_code == 200
    # A new name must be one people can tell apart; a team that has one already keeps it.
    spaced = await admin.put("/admin/teams/%20docs", json={"size": 2})
    assert (spaced.status_code, spaced.json()["error"]["param"]) == (400, "team"), spaced.text
    assert "no spaces around it" in spaced.json()["error"]["message"]
    await stack.redis.sadd(keys.teams(), " old")
    kept = await admin.put("/admin/teams/%20old", json={"size": 2})
    assert kept.status_code == 200, kept.text

    user = stack.http(ingress, await stack.api_key("docs"))
    done = await user.post(
        "/v1/completions", json={"model": "laneway-code", "prompt": "x", "max_tokens": 8}
    )
    assert done.status_code == 200
    spent = done.json()["usage"]["total_tokens"]
    await wait_for_budget_used(lambda: _json(admin.get("/admin/teams/docs")), spent)
    snapshot = (await admin.get("/admin/teams/docs")).json()
    assert snapshot["tier"] == "lo"
    assert snapshot["supersede_grace_tokens"] == 8
    assert snapshot["factor"] == 1.0
    pool = snapshot["pools"]["interactive"]
    assert pool["used_tokens_this_hour"] == spent
    assert pool["reservations"] == 0
    assert (await admin.get("/admin/teams/nobody")).status_code == 404


async def wait_for_budget_used(
    snapshot: Callable[[], Awaitable[dict[str, Any]]], tokens: int, within_s: float = 10
) -> None:
    """Until the team snapshot says the workers settled ``tokens`` of its interactive pool."""

    async def settled() -> bool:
        used: int = (await snapshot())["pools"]["interactive"]["used_tokens_this_hour"]
        return used >= tokens

    await eventually(settled, within_s, f"{tokens} tokens settled")


async def _json(response: Awaitable[httpx.Response]) -> dict[str, Any]:
    body: dict[str, Any] = (await response).json()
    return body


async def test_a_batch_line_run_again_is_charged_once_and_a_new_record_of_its_ids_is_not_free(
    enforcer: Any,
) -> None:
    quota, redis, keys = enforcer
    team = Team("alpha", size=1)  # 1,000 tokens an hour per pool
    stored = 1_000_000.0  # when the line's record was stored
    await quota.reserve(team, "batch", "batch-j-1", 100)
    assert (await quota.settle("alpha", "batch-j-1", 80, accepted_ts=stored, once=True)).found
    # Its worker died before the commit: the re-run reserves again and settles again; that
    # reservation goes back whole.
    await quota.reserve(team, "batch", "batch-j-1", 100)
    again = await quota.settle("alpha", "batch-j-1", 80, accepted_ts=stored, once=True)
    assert not again.found
    pool = (await quota.snapshot(team))["pools"]["batch"]
    assert (pool["used_tokens_this_hour"], pool["reservations"]) == (80, 0)
    # The mark outlives any wait for budget a re-run may have (a batch line has no deadline),
    # an interactive request of the team settled in the same minutes too (its marks, kept
    # 15 minutes, shared the hash and its expiry: a re-run 15 minutes on was charged again).
    await quota.settle("alpha", "completion-1", 10, leased=50, accepted_ts=stored + 2)
    mark = keys.quota_settled("alpha", int(stored // 300), lines=True)
    assert await redis.ttl(mark) > 3600
    # A new record that repeats the ids (stored later) is another line: charged.
    await quota.reserve(team, "batch", "batch-j-1", 100)
    later = await quota.settle("alpha", "batch-j-1", 50, accepted_ts=stored + 1, once=True)
    assert (later.found, later.charged) == (True, 50)


async def test_two_records_of_one_batch_line_id_each_hold_their_own_reservation(
    enforcer: Any,
) -> None:
    """A tenant writes line J/1 twice, to two partitions its two workers hold: each record
    reserves, settles and releases its own reservation. Neither runs free, and neither's
    release gives back the other's."""
    quota, _, _ = enforcer
    team = Team("alpha", size=1)  # 1,000 tokens an hour per pool
    first, second = 1_000_000.0, 1_000_000.25  # when each record was stored
    await quota.reserve(team, "batch", "batch-j-1", 100, record=first)  # worker 0
    # Worker 1's copy has no body: answered with a 400, its release leaves the first alone.
    await quota.settle("alpha", "batch-j-1", 0, min_charge=0, record=second)
    pool = (await quota.snapshot(team))["pools"]["batch"]
    assert (pool["reservations"], pool["reserved_tokens"]) == (1, 100)
    settled = await quota.settle("alpha", "batch-j-1", 80, accepted_ts=first, once=True)
    assert (settled.found, settled.charged) == (True, 80)
    # Both valid: the second takes a reservation of its own, and each run is charged.
    await quota.reserve(team, "batch", "batch-j-2", 100, record=first)
    assert (await quota.reserve(team, "batch", "batch-j-2", 100, record=second)).remaining == 720
    # A re-run of the first record (its worker crashed) is admitted on what it holds.
    assert (await quota.reserve(team, "batch", "batch-j-2", 100, record=first)).remaining == 720
    assert (await quota.settle("alpha", "batch-j-2", 80, accepted_ts=first, once=True)).found
    assert (await quota.settle("alpha", "batch-j-2", 70, accepted_ts=second, once=True)).found
    pool = (await quota.snapshot(team))["pools"]["batch"]
    assert (pool["used_tokens_this_hour"], pool["reservations"]) == (80 + 80 + 70, 0)


async def test_owed_batch_lines_of_one_id_are_owed_apart_and_a_refused_one_holds_none_back(
    enforcer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two records of one batch line id are two lines with a reservation each: owed through
    a Redis outage, the second overwrote the first, whose reservation then stayed held. A
    settlement Redis refuses (it answered) is given up, not tried before every other one
    for good."""
    quota, redis, keys = enforcer
    team = Team("theta", size=1)
    for record in (1000.0, 2000.0):
        await quota.reserve(team, "batch", "job:l1", 100, record=record)
    outbox = Outbox(redis, None, Topics(keys.prefix), quota)  # type: ignore[arg-type]
    accounting = outbox.accounting
    refused = Owed("theta", "bad", 5, 0, 0, accepted_ts=1.0, once=True)
    first = Owed("theta", "job:l1", 40, 0, 0, accepted_ts=1000.0, once=True)
    second = Owed("theta", "job:l1", 60, 0, 0, accepted_ts=2000.0, once=True)
    settle = accounting._settle

    async def refusing(owed: Owed) -> None:
        if owed is refused:
            raise ResponseError("ERR refused")
        await settle(owed)

    monkeypatch.setattr(accounting, "_settle", refusing)
    accounting.owed = {o.key: o for o in (refused, first, second)}
    assert await accounting.pay_owed() == 2
    assert not accounting.owed
    assert not await redis.hlen(keys.quota_reservations("theta"))  # both settled
    used = await redis.get(keys.quota_used("theta", "batch", int(time.time() // 3600)))
    assert int(used) == 40 + 60


async def test_a_503_from_kafka_gives_the_reservation_back(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request Kafka did not confirm storing is answered 503 and costs the team nothing: a
    Kafka hiccup must not drain its budget while its clients retry."""
    ingress = await stack.start_ingress(quota_units_per_member=0.1, quota_lease_share=0)

    async def refused(env: RequestEnvelope) -> None:
        raise KafkaTimeoutError()

    monkeypatch.setattr(ingress.state.admission, "produce", refused)
    http = stack.http(ingress, await stack.api_key("tiny", size=1))
    body = {"model": "laneway-code", "prompt": "x" * 40, "max_tokens": 30}
    for _ in range(3):
        assert (await http.post("/v1/completions", json=body)).status_code == 503
    snapshot = functools.partial(ingress.state.quota.enforcer.snapshot, Team("tiny", size=1))
    pool = (await snapshot())["pools"]["interactive"]
    # No reservation left, and the bucket (100 tokens an hour) full again.
    assert pool["reservations"] == 0, pool
    assert pool["remaining_tokens"] >= 99, pool


@pytest.mark.slow
async def test_a_team_that_spent_its_budget_gets_no_new_one_when_redis_goes_silent(
    services: Services, tmp_path: Path, prefix: str
) -> None:
    """While Redis does not answer, each replica admits with its local limiter. It starts from
    what Redis last said the team had left, not from a full budget: a busy ingress that takes
    Redis for silent for a moment (a burst) must not hand every team its budget again."""
    server = _own_redis(tmp_path)
    stack = LiveStack(Services(services.bootstrap, server.url), prefix)
    try:
        await stack.create_topics()
        ingress = await stack.start_ingress(quota_lease_share=0, quota_units_per_member=0.1)
        await stack.start_worker("completion")
        http = stack.http(ingress, await stack.api_key("frugal", size=1))  # 100 tokens/h
        other = stack.http(ingress, await stack.api_key("thrifty", size=1))
        body = {"model": "laneway-code", "prompt": "x" * 40, "max_tokens": 30}  # ~40 each
        answers = []
        while 429 not in answers and len(answers) < 20:  # each settles to what it used
            answers.append((await http.post("/v1/completions", json=body)).status_code)
        assert answers[-1] == 429, answers
        assert (await other.post("/v1/completions", json=body)).status_code == 200

        with contextlib.suppress(RedisConnectionError):
            await stack.redis.shutdown(nosave=True)
        await eventually(lambda: not server.running, 10, "redis to stop")
        server.stop()
        refused = await http.post("/v1/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert "local limit while Redis does not answer in time" in refused.text
        # A team with budget left when Redis went silent is still served from it.
        assert (await other.post("/v1/completions", json=body)).status_code == 200
    finally:
        await stack.stop()
        server.stop()


def test_the_local_limiter_starts_from_what_redis_last_said_or_a_small_share() -> None:
    """While Redis seems silent each replica admits on its own: from the team's remaining as
    Redis last reported it, else from 1 % of its budget (at least the request): a moment of
    silence during a burst must not admit a whole budget per replica for each new team."""
    limiter = LocalLimiter()
    limiter.note("known", remaining=100, capacity=5000, now=0.0)
    assert limiter.reserve("known", 60, 5000, now=0.0) == 40
    with pytest.raises(QuotaExceeded):
        limiter.reserve("known", 60, 5000, now=0.0)
    assert limiter.reserve("new", 26, 5000, now=0.0) == 24  # 1 % of 5,000 is 50
    with pytest.raises(QuotaExceeded):
        limiter.reserve("new", 26, 5000, now=0.0)
    assert limiter.reserve("new", 26, 5000, now=3600.0) >= 0  # it refills at the budget's rate
    assert limiter.reserve("big", 300, 5000, now=0.0) == 0  # one request, however large
    # Two replicas run: each grants half of what the pool had left, refilling at half the
    # budget's rate (7,200 tokens an hour is 2 a second, 1 each).
    shared = LocalLimiter()
    shared.replicas = 2
    shared.note("known", remaining=100, capacity=7200, now=0.0)
    assert shared.reserve("known", 50, 7200, now=0.0) == 0
    with pytest.raises(QuotaExceeded):
        shared.reserve("known", 1, 7200, now=0.0)
    assert shared.reserve("known", 1, 7200, now=1.0) == pytest.approx(0)
    assert shared.reserve("big", 300, 5000, now=0.0) == 0  # still one request, however large
    # A request larger than a replica's share (3,000 of 10,000 among 4 replicas) is admitted
    # once the bucket has refilled to it, as its Retry-After says, not refused for good.
    quarter = LocalLimiter()
    quarter.replicas = 4
    quarter.note("wide", remaining=10_000, capacity=10_000, now=0.0)
    with pytest.raises(QuotaExceeded) as refused:
        quarter.reserve("wide", 3000, 10_000, now=0.0)
    retry = refused.value.retry_after
    assert quarter.reserve("wide", 3000, 10_000, now=retry + 1) >= 0
