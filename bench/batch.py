"""Batch lane: lines per second, and interactive latency with and without a job running.

Sim engine (a simulated GPU: prefill 0.05 ms/token, decode 15 ms/step, 32 slots) in both
pools. Runs: interactive completions alone; the same load while a job runs; the job alone.

    .venv/bin/python -m bench.batch [--lines 2000] [--rate 20] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench._open_loop import open_loop
from bench._proc import machine
from bench._stack import BenchStack, bench_stack, document_lines
from bench._stats import percentile
from laneway.batch import BatchClient
from laneway.settings import CommonSettings
from ops.drills.http_pool import HttpPool

COSTS = {
    "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0.05",
    "LANEWAY_SIM_DECODE_MS_PER_STEP": "15",
    "LANEWAY_SIM_BATCH_SLOTS": "32",
}


def _lines(n: int) -> list[str]:
    return document_lines((f"summarise document {i} " * 20 for i in range(n)), max_tokens=16)


async def _interactive(stack: BenchStack, key: str, rate: float, seconds: float) -> list[float]:
    http = HttpPool("127.0.0.1", stack.ingress_port, {"Authorization": f"Bearer {key}"})
    latencies: list[float] = []

    async def one(i: int) -> None:
        started = time.perf_counter()
        body = {"model": "laneway-code", "prompt": f"def handler_{i}(event):", "max_tokens": 16}
        status, _, _ = await http.post("/v1/completions", body)
        if status == 200:
            latencies.append((time.perf_counter() - started) * 1000)

    tasks = [asyncio.create_task(one(i)) async for i in open_loop(rate, int(rate * seconds))]
    await asyncio.gather(*tasks)
    await http.close()
    return latencies


async def _job(settings: CommonSettings, key: str, lines: int) -> tuple[str, float, float]:
    """Submit a job; returns its id and the times it was queued and finished."""
    async with BatchClient(settings) as client:
        started = time.perf_counter()
        job = await client.submit(_lines(lines), team="bench")
        while not (await client.status(job)).complete:
            await asyncio.sleep(0.5)
        return job, started, time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=20.0, help="interactive completions/s")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    workers = [
        {"LANEWAY_POOL": "completion", **COSTS},
        {"LANEWAY_POOL": "batch", "LANEWAY_MAX_INFLIGHT": "64", **COSTS},
    ]
    stack = BenchStack(workers=workers)
    with bench_stack(stack):
        key = stack.api_key("bench")
        settings = stack.settings()

        async def run() -> None:
            print(f"# batch lane — {machine()}")
            print(
                "# sim engine (a simulated GPU): prefill 0.05 ms/token, decode 15 ms/step, 32 slots"
            )
            print(
                f"{'run':>26} {'lines/s':>9} {'int. P50 ms':>12} {'int. P99 ms':>12} {'int. n':>7}"
            )
            alone = await _interactive(stack, key, args.rate, args.seconds)
            print(
                f"{'interactive alone':>26} {'':>9} {percentile(alone, 50):>12.0f} {percentile(alone, 99):>12.0f} {len(alone):>7}",
                flush=True,
            )
            job = asyncio.create_task(_job(settings, key, args.lines))
            await asyncio.sleep(2)  # the job is flowing
            mixed = await _interactive(stack, key, args.rate, args.seconds)
            _, started, finished = await job
            rate = args.lines / (finished - started)
            print(
                f"{'interactive + batch job':>26} {rate:>9.1f} {percentile(mixed, 50):>12.0f} {percentile(mixed, 99):>12.0f} {len(mixed):>7}",
                flush=True,
            )
            _, started, finished = await _job(settings, key, args.lines)
            print(f"{'batch job alone':>26} {args.lines / (finished - started):>9.1f}", flush=True)

        asyncio.run(run())


if __name__ == "__main__":
    main()
