"""Latency laneway adds: ingress → Kafka → worker → reply → client, with an instant sim engine.

Drives non-streamed completions open-loop at fixed rates and prints P50/P99 per rate, then
the highest rate whose P99 stays under 50 ms. The sim engine costs nothing, so every
millisecond measured is laneway's own (HTTP, Kafka, Redis, Python).

    .venv/bin/python bench/overhead.py [--rates 50,100,200,300] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench._http import HttpPool
from bench._stack import BenchStack, bench_stack, machine, percentile


async def drive(
    stack: BenchStack, key: str, rate: float, seconds: float
) -> tuple[list[float], list[float], int, float]:
    """Open-loop load: request i is sent at start + i/rate whatever the earlier ones do."""
    latencies: list[float] = []
    inside: list[float] = []
    errors = 0
    http = HttpPool("127.0.0.1", stack.ingress_port, {"Authorization": f"Bearer {key}"})

    async def one(i: int) -> None:
        nonlocal errors
        started = time.perf_counter()
        body = {"model": "laneway-code", "prompt": f"def f{i}(x):\n    return", "max_tokens": 16}
        try:
            status, headers, _ = await http.post(
                "/v1/completions", body, {"X-Laneway-Session": f"s{i % 64}"}
            )
        except (OSError, asyncio.IncompleteReadError, ValueError):
            errors += 1
            return
        if status != 200:
            errors += 1
            return
        latencies.append((time.perf_counter() - started) * 1000)
        inside.append(float(headers["server-timing"].split("dur=")[1]))

    total = int(rate * seconds)
    start = time.perf_counter()
    tasks = []
    for i in range(total):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    achieved = total / (time.perf_counter() - start)
    await http.close()
    return latencies, inside, errors, achieved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="50,100,200,300,400")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--warmup",
        type=float,
        default=40.0,
        help="seconds at 100/s first: the broker JVM compiles its hot paths",
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    stack = BenchStack(
        workers=[
            {
                "LANEWAY_POOL": "completion",
                "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0",
                "LANEWAY_SIM_DECODE_MS_PER_STEP": "0",
                "LANEWAY_MAX_INFLIGHT": "256",
            }
        ],
    )
    with bench_stack(stack):
        key = stack.api_key("bench")
        asyncio.run(drive(stack, key, 100, args.warmup))
        print(f"# laneway added latency (instant sim engine) — {machine()}")
        header = ("rate/s", "sent", "achieved/s", "errors", "P50 ms", "P99 ms", "max ms")
        header += ("inside P50", "inside P99")
        print(" ".join(f"{h:>10}" for h in header))
        best = 0.0
        for rate in rates:
            latencies, inside, errors, achieved = asyncio.run(drive(stack, key, rate, args.seconds))
            p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
            row = (
                rate,
                len(latencies) + errors,
                achieved,
                errors,
                p50,
                p99,
                max(latencies, default=0),
                percentile(inside, 50),
                percentile(inside, 99),
            )
            print(" ".join(f"{v:>10.1f}" for v in row), flush=True)
            if p99 < 50 and errors == 0:
                best = max(best, rate)
        print(f"highest rate with P99 < 50 ms and no errors: {best:.0f}/s")


if __name__ == "__main__":
    main()
