"""Workers whose clocks are off, as real processes beside the real stack. One 5 s ahead
serves completions within their (4 s) deadlines and settles quota without stretching the
budget; one 2 h behind or ahead reports its usage at the time it happened and counts it in
the hour everyone else does. Deadlines, buckets, acceptances and usage all go by Redis's
clock, and record times by the broker's (a broker refuses records its producer stamped more
than an hour ahead of it)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from laneway.clock import RedisClock
from laneway.constants import RedisKeys
from laneway.schema import MAX_USAGE_MS
from quota.enforcer import QuotaEnforcer
from quota.model import QuotaPolicy
from quota.teams import get_team
from tests.stack import ROOT, LiveStack, clear_of_the_hour_turn, envelope, eventually

SKEW_S = 5.0
# The worker's process: every time.time() in it reads ``skew_s`` off (asyncio and the sim's
# step timing use the monotonic clock, as a machine whose wall clock is wrong would).
_SKEWED_WORKER = (
    "import sys, time\n"
    "real = time.time\n"
    "time.time = lambda: real() + float(sys.argv[1])\n"
    "from workers.__main__ import main\n"
    "sys.exit(main([]))\n"
)
BUDGET = 3600  # tokens an hour: the bucket refills one token a second
CONCURRENCY = 4
RESERVATION = 20  # a 40-character prompt (10 tokens) and max_tokens 10


def _spawn_skewed_worker(stack: LiveStack, skew_s: float = SKEW_S) -> subprocess.Popen[bytes]:
    env = stack.process_env(
        LANEWAY_POOL="completion",
        LANEWAY_ENGINE="sim",
        LANEWAY_WORKER_ID=f"{stack.prefix}-skewed",
        LANEWAY_SIM_PREFILL_MS_PER_TOKEN="0",
        LANEWAY_SIM_DECODE_MS_PER_STEP="0",
        LANEWAY_HEARTBEAT_INTERVAL_S="0.5",
        LANEWAY_COMMIT_INTERVAL_MS="50",
        LANEWAY_LOG_LEVEL="WARNING",
    )
    command = [sys.executable, "-c", _SKEWED_WORKER, str(skew_s)]
    return subprocess.Popen(command, env=env, cwd=ROOT)


async def _served(http: httpx.AsyncClient, within_s: float) -> None:
    """Until the worker has its partitions and answers (a team of its own pays for this)."""
    deadline = time.monotonic() + within_s
    while True:
        body = {"model": "laneway-code", "prompt": "warm up", "max_tokens": 2}
        if (await http.post("/v1/completions", json=body)).status_code == 200:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the skewed worker never answered")
        await asyncio.sleep(0.2)


async def test_a_worker_5_s_ahead_serves_in_time_and_admits_no_more_than_the_budget(
    stack: LiveStack,
) -> None:
    # One reservation in Redis per request: every admission and settlement runs a script.
    # Deadlines of 4 s: short of the skew, so a worker that judged them by its own clock
    # would find every one passed; long enough that a slow broker does not pass one.
    ingress = await stack.start_ingress(
        quota_lease_share=0, quota_units_per_member=3.6, completion_deadline_ms=4000
    )
    worker = _spawn_skewed_worker(stack)
    try:
        await _served(stack.http(ingress, await stack.api_key("warm-up", size=50)), 60)
        http = stack.http(ingress, await stack.api_key("team-a", size=1))
        statuses: list[int] = []
        started = time.time()
        for round_ in range(200):  # ends at the first round refused whole
            bodies = [
                {
                    "model": "laneway-code",
                    "prompt": f"{round_ * CONCURRENCY + i:040d}",
                    "max_tokens": 10,
                }
                for i in range(CONCURRENCY)
            ]
            answers = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
            statuses += [a.status_code for a in answers]
            if all(a.status_code == 429 for a in answers):
                break
        elapsed = time.time() - started
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    # Deadlines held: the worker judged them on Redis's clock, not its own 5 s ahead.
    assert set(statuses) == {200, 429}, sorted(set(statuses))
    ok = statuses.count(200)
    events = await stack.read_topic(
        stack.topics.usage, count=ok, where=lambda e: e["team"] == "team-a"
    )
    assert [e["status"] for e in events] == ["ok"] * ok
    spent = sum(e["prompt_tokens"] + e["completion_tokens"] for e in events)
    # The budget, what refilled meanwhile, and what the last requests in flight held.
    allowed = BUDGET + elapsed * BUDGET / 3600 + CONCURRENCY * RESERVATION
    assert spent <= allowed, (spent, allowed, ok)
    assert spent > BUDGET - CONCURRENCY * RESERVATION  # and the budget was really used


async def test_the_clock_reads_redis_time_whatever_the_local_clock_says(stack: LiveStack) -> None:
    skewed = RedisClock(local=lambda: time.time() + SKEW_S)
    await skewed.sync(stack.redis)
    seconds, micros = await stack.redis.time()
    redis_now = seconds + micros / 1e6
    assert abs(skewed.now() - redis_now) < 1.0
    assert abs(skewed.offset + SKEW_S) < 1.0
    assert skewed.material
    assert abs(skewed.to_local(redis_now) - (time.time() + SKEW_S)) < 1.0


@pytest.mark.parametrize("skew_h", [-2, 2])
async def test_a_worker_2_h_off_reports_usage_at_redis_time_in_the_hour_of_everyone(
    stack: LiveStack, skew_h: int
) -> None:
    await clear_of_the_hour_turn(90)  # the hour's counter is what this test reads
    ingress = await stack.start_ingress(quota_lease_share=0)
    worker = _spawn_skewed_worker(stack, skew_h * 3600.0)
    try:
        await _served(stack.http(ingress, await stack.api_key("warm-up", size=50)), 60)
        http = stack.http(ingress, await stack.api_key("team-b", size=5))
        began = await _redis_now(stack)
        tokens = 0
        for i in range(6):
            body = {"model": "laneway-code", "prompt": f"def f{i}():", "max_tokens": 8}
            answer = await http.post("/v1/completions", json=body, headers=_session(i))
            assert answer.status_code == 200, answer.text
            tokens += answer.json()["usage"]["total_tokens"]
        ended = await _redis_now(stack)
        enforcer = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), QuotaPolicy())
        team = await get_team(stack.redis, RedisKeys(stack.prefix), "team-b")

        async def used() -> int:
            pools: Any = (await enforcer.snapshot(team))["pools"]
            return int(pools["interactive"]["used_tokens_this_hour"])

        # Settled in this hour's counter, the one the admin API reads (its own clock's
        # hour, two hours off, would leave this one at nothing).
        await eventually(lambda: _at_least(used, tokens), 20, f"{tokens} tokens this hour")
        assert await used() == tokens
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    events = await stack.read_topic(
        stack.topics.usage, count=6, where=lambda e: e["team"] == "team-b"
    )
    assert sum(e["prompt_tokens"] + e["completion_tokens"] for e in events) == tokens
    span_ms = (ended - began) * 1000
    for event in events:
        # When it ended, on Redis's clock (the streams app rolls usage up by this hour),
        # and waits that fit inside the time the client waited.
        assert began - 1 <= event["ts"] <= ended + 1, (event["ts"], began, ended)
        assert 0 <= event["queue_ms"] <= event["total_ms"] <= span_ms + 1000, event


def _session(i: int) -> dict[str, str]:
    # Every keystroke one session, each newer than the last: the skewed worker compares
    # their acceptances (for the news of a supersede) on Redis's clock too.
    return {"X-Laneway-Session": "skewed", "X-Laneway-Seq": str(i)}


async def _redis_now(stack: LiveStack) -> float:
    seconds, micros = await stack.redis.time()
    return float(seconds + micros / 1e6)


async def _at_least(read: Callable[[], Awaitable[int]], tokens: int) -> bool:
    return await read() >= tokens


async def test_a_request_stamped_by_no_plausible_clock_still_gets_its_outcome(
    stack: LiveStack,
) -> None:
    """A batch line's acceptance time is its record's timestamp; on a topic an older laneway
    made, its producer sets it, to 1970 if it likes. The run's durations then exceed what a
    usage event holds: they are clamped, and the request still ends with its usage event
    (and so its reply and settlement), not in an error after its engine time was spent."""
    worker = await stack.start_worker("completion")
    env = envelope(accepted_ts=0.001, reply_to=None)
    usage = await worker.executor.run(env)
    assert usage is not None
    assert usage.status == "ok"
    assert usage.total_ms == MAX_USAGE_MS
    (stored,) = (await stack.usage_of(env.id)).values()
    assert stored["status"] == "ok"
