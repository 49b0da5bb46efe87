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

import httpx

from bench._stack import BenchStack, bench_stack, machine, percentile


async def drive(
    base_url: str, key: str, rate: float, seconds: float
) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=10
    ) as http:

        async def one(i: int) -> None:
            nonlocal errors
            started = time.perf_counter()
            try:
                response = await http.post(
                    "/v1/completions",
                    json={
                        "model": "laneway-code",
                        "prompt": f"def f{i}(x):\n    return",
                        "max_tokens": 16,
                    },
                    headers={"X-Laneway-Session": f"s{i % 64}"},
                )
            except httpx.HTTPError:
                errors += 1
                return
            if response.status_code != 200:
                errors += 1
                return
            latencies.append((time.perf_counter() - started) * 1000)

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
    return latencies, errors, achieved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="50,100,200,300,400")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
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
        asyncio.run(drive(stack.base_url, key, 50, args.warmup))
        print(f"# laneway added latency (instant sim engine) — {machine()}")
        header = ("rate/s", "sent", "achieved/s", "errors", "P50 ms", "P99 ms", "max ms")
        print(" ".join(f"{h:>10}" for h in header))
        best = 0.0
        for rate in rates:
            latencies, errors, achieved = asyncio.run(
                drive(stack.base_url, key, rate, args.seconds)
            )
            p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
            row = (
                rate,
                len(latencies) + errors,
                achieved,
                errors,
                p50,
                p99,
                max(latencies, default=0),
            )
            print(" ".join(f"{v:>10.1f}" for v in row), flush=True)
            if p99 < 50 and errors == 0:
                best = max(best, rate)
        print(f"highest rate with P99 < 50 ms and no errors: {best:.0f}/s")


if __name__ == "__main__":
    main()
