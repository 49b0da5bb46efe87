"""A worker whose clock runs 5 s ahead, as a real process beside the real stack: it serves
completions within their (4 s) deadlines and settles quota without stretching the budget,
because deadlines and buckets both go by Redis's clock."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx

from laneway.clock import RedisClock
from tests.stack import ROOT, LiveStack

SKEW_S = 5.0
# The worker's process: every time.time() in it reads 5 s ahead (asyncio and the sim's step
# timing use the monotonic clock, as a machine whose wall clock is wrong would).
_SKEWED_WORKER = (
    "import sys, time\n"
    "real = time.time\n"
    f"time.time = lambda: real() + {SKEW_S}\n"
    "from workers.__main__ import main\n"
    "sys.exit(main())\n"
)
BUDGET = 3600  # tokens an hour: the bucket refills one token a second
CONCURRENCY = 4
RESERVATION = 20  # a 40-character prompt (10 tokens) and max_tokens 10


def _spawn_skewed_worker(stack: LiveStack) -> subprocess.Popen[bytes]:
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
    return subprocess.Popen([sys.executable, "-c", _SKEWED_WORKER], env=env, cwd=ROOT)


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
