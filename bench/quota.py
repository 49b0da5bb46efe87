"""Quota admission: what one decision costs, and how far the limit drifts across replicas.

Part 1 times the Lua scripts against a real Redis: reserve and settle, one at a time and 32
at once. Part 2 runs 4 ingress processes against one team budget (no workers, so every
admission stays reserved) and fires requests at all of them at once: the admitted tokens
minus the budget is the drift (the design bound: one reservation). Admitted means answered
504 (reserved, then no worker answered in time); 429 is refused; any other answer is counted
apart, as neither, and its first body printed.

    .venv/bin/python -m bench.quota [--decisions 3000] [--requests 600] [--ingress-env LANEWAY_X=V]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import redis.asyncio as aioredis

from bench._proc import machine
from bench._stack import (
    BenchStack,
    add_ingress_env_option,
    bench_stack,
    ingress_env,
    sigterm_unwinds,
)
from bench._stats import percentile
from laneway.apikeys import create_key
from laneway.constants import RedisKeys
from ops.drills.http_pool import HttpPool
from ops.redis_server import RedisServer
from quota import QuotaEnforcer, QuotaPolicy, Team, set_team

RESERVATION = 10 + 16  # "y" * 40 → 10 prompt tokens, plus max_tokens 16


async def _decision_costs(url: str, decisions: int) -> None:
    redis = aioredis.Redis.from_url(url)
    keys = RedisKeys(f"bench{uuid.uuid4().hex[:6]}")
    quota = QuotaEnforcer(redis, keys, QuotaPolicy())
    team = Team("bench", size=100_000)
    reserve: list[float] = []
    settle: list[float] = []
    for i in range(decisions):
        started = time.perf_counter()
        await quota.reserve(team, "interactive", f"r{i}", 100)
        reserve.append((time.perf_counter() - started) * 1e6)
        started = time.perf_counter()
        await quota.settle("bench", f"r{i}", 60)
        settle.append((time.perf_counter() - started) * 1e6)

    async def worker(n: int) -> None:
        for i in range(decisions // 32):
            await quota.reserve(team, "interactive", f"c{n}-{i}", 100)

    started = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(32)))
    rate = (decisions // 32 * 32) / (time.perf_counter() - started)
    await redis.aclose()
    print(f"{'decision':>12} {'P50 µs':>10} {'P99 µs':>10}")
    for name, values in (("reserve", reserve), ("settle", settle)):
        print(f"{name:>12} {percentile(values, 50):>10.0f} {percentile(values, 99):>10.0f}")
    print(f"32 concurrent reservers: {rate:,.0f} decisions/s")


async def _drift_round(
    stack: BenchStack, ports: list[int], requests: int, budget: int
) -> tuple[int, int, int]:
    """Admitted (504), refused (429) and other answers of one round."""
    redis = aioredis.Redis.from_url(stack.redis_url)
    team = f"drift-{uuid.uuid4().hex[:6]}"
    complexity = budget / 50_000  # size 1 × 50 units × 1,000 tokens × complexity
    await set_team(redis, RedisKeys(stack.prefix), Team(team, size=1, complexity=complexity))
    key = await create_key(redis, RedisKeys(stack.prefix), team)
    await redis.aclose()
    pools = [HttpPool("127.0.0.1", port, {"Authorization": f"Bearer {key}"}) for port in ports]
    body = {"model": "laneway-code", "prompt": "y" * 40, "max_tokens": 16}
    results = await asyncio.gather(
        *(pools[i % len(pools)].post("/v1/completions", body) for i in range(requests))
    )
    for pool in pools:
        await pool.close()
    codes: dict[int, int] = {}
    for status, _, _ in results:
        codes[status] = codes.get(status, 0) + 1
    print(f"#   responses by status: {codes}")
    for status, _, data in results:
        if status not in (429, 504):
            print(f"#   {status}: {data[:300]!r}")
            break
    return (
        codes.get(504, 0),
        codes.get(429, 0),
        sum(n for status, n in codes.items() if status not in (429, 504)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decisions", type=int, default=3000)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--budget", type=int, default=5000, help="team budget, tokens per hour")
    parser.add_argument("--rounds", type=int, default=3)
    add_ingress_env_option(parser)
    args = parser.parse_args()
    settings = {"LANEWAY_REPLY_TIMEOUT_S": "2", **ingress_env(parser, args.ingress_env)}
    print(f"# quota admission — {machine()}")

    data = Path(tempfile.mkdtemp(prefix="laneway-bench-"))
    redis = RedisServer(port=31479, data_dir=data)  # beside bench._stack's ports
    with sigterm_unwinds():
        redis.start()
        try:
            asyncio.run(_decision_costs(redis.url, args.decisions))
        finally:
            redis.stop()
            shutil.rmtree(data, ignore_errors=True)

    stack = BenchStack(ingress_env=settings)
    with bench_stack(stack):
        ports = [stack.ingress_port] + [stack.ingress_port + i for i in (1, 2, 3)]
        for port in ports[1:]:
            stack.spawn(
                "ingress",
                {"LANEWAY_PORT": str(port), "LANEWAY_PROBE_INTERVAL_S": "0", **settings},
            )
        time.sleep(5)
        print(
            f"# 4 ingress processes, {args.requests} requests at once, budget {args.budget} tokens, {RESERVATION} reserved each"
        )
        print(f"# ingress settings: {' '.join(f'{k}={v}' for k, v in settings.items())}")
        print(
            f"{'round':>6} {'admitted':>9} {'429':>6} {'admitted tokens':>16} {'drift tokens':>13} {'drift reservations':>19} {'other':>6}"
        )
        for n in range(1, args.rounds + 1):
            admitted, refused, other = asyncio.run(
                _drift_round(stack, ports, args.requests, args.budget)
            )
            drift = admitted * RESERVATION - args.budget
            print(
                f"{n:>6} {admitted:>9} {refused:>6} {admitted * RESERVATION:>16} {drift:>13} {drift / RESERVATION:>19.2f} {other:>6}"
            )


if __name__ == "__main__":
    main()
