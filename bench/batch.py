"""Batch lane: lines per second, and interactive latency with and without batch work running.

Sim engine (a simulated GPU: prefill 0.05 ms/token, decode 15 ms/step, 32 slots) in each
pool: the completion and batch pools have an engine each, so what they share is the host's
CPU, Kafka and Redis (one engine for both is bench.shared_fleet). Each round measures the
interactive load alone and while batch jobs run, in alternating order (alone first in odd
rounds, with batch first in even ones), then a job alone. While the interactive load runs
"with batch", jobs of ``--lines`` are submitted back to back, so batch work flows for the
whole window however fast a job finishes (the row says how many jobs that took).

    .venv/bin/python -m bench.batch [--lines 2000] [--rate 20] [--seconds 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
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


async def _interactive(
    stack: BenchStack, key: str, rate: float, seconds: float
) -> tuple[list[float], int]:
    """Latencies of the completions answered 200, and how many were not."""
    http = HttpPool("127.0.0.1", stack.ingress_port, {"Authorization": f"Bearer {key}"})
    latencies: list[float] = []
    failed = 0

    async def one(i: int) -> None:
        nonlocal failed
        started = time.perf_counter()
        body = {"model": "laneway-code", "prompt": f"def handler_{i}(event):", "max_tokens": 16}
        status, _, _ = await http.post("/v1/completions", body)
        if status == 200:
            latencies.append((time.perf_counter() - started) * 1000)
        else:
            failed += 1

    tasks = [asyncio.create_task(one(i)) async for i in open_loop(rate, int(rate * seconds))]
    await asyncio.gather(*tasks)
    await http.close()
    return latencies, failed


async def _job(client: BatchClient, lines: int) -> float:
    """Submit a job and wait for all its results; the seconds that took."""
    started = time.perf_counter()
    job = await client.submit(_lines(lines), team="bench")
    while not (await client.status(job)).complete:
        await asyncio.sleep(0.25)
    return time.perf_counter() - started


async def _jobs_until(client: BatchClient, lines: int, stop: asyncio.Event) -> list[float]:
    """Jobs back to back until ``stop`` is set (the one running then finishes)."""
    took: list[float] = []
    while not stop.is_set():
        took.append(await _job(client, lines))
    return took


class _Row:
    def __init__(self, name: str, latencies: list[float], failed: int) -> None:
        self.name, self.latencies, self.failed = name, latencies, failed
        self.p99 = percentile(latencies, 99)

    def line(self, extra: str = "") -> str:
        lat = self.latencies
        return (
            f"{self.name:>14} {percentile(lat, 50):>12.0f} {self.p99:>12.0f} "
            f"{len(lat):>7} {self.failed:>7}   {extra}"
        )


async def _round(
    n: int, stack: BenchStack, settings: CommonSettings, key: str, args: argparse.Namespace
) -> float:
    """One round's rows; its P99 with batch over alone."""
    rows: dict[str, _Row] = {}

    async def alone() -> None:
        rows["alone"] = _Row("alone", *await _interactive(stack, key, args.rate, args.seconds))
        print(f"{n:>5} {rows['alone'].line()}", flush=True)

    async def beside(client: BatchClient) -> None:
        stop = asyncio.Event()
        pump = asyncio.create_task(_jobs_until(client, args.lines, stop))
        await asyncio.sleep(2)  # the first job's lines are flowing
        measured = await _interactive(stack, key, args.rate, args.seconds)
        busy = not pump.done()  # batch still running when the window closed
        stop.set()
        took = await pump
        rows["batch"] = _Row("with batch", *measured)
        rate = args.lines * len(took) / sum(took)
        extra = (
            f"{rate:.1f} lines/s, {len(took)} job(s), busy to the end: {'yes' if busy else 'NO'}"
        )
        print(f"{n:>5} {rows['batch'].line(extra)}", flush=True)

    async with BatchClient(settings) as client:
        if n % 2:
            await alone()
            await beside(client)
        else:
            await beside(client)
            await alone()
        took = await _job(client, args.lines)
        print(f"{n:>5} {'job alone':>14} {'':>44}{args.lines / took:.1f} lines/s", flush=True)
    return rows["batch"].p99 / rows["alone"].p99


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=2000, help="lines per job")
    parser.add_argument("--rate", type=float, default=20.0, help="interactive completions/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="per interactive window")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for name in ("lines", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.rate <= 0 or args.seconds <= 0:
        parser.error("--rate and --seconds must be positive")
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
                "# sim engine (a simulated GPU) in each pool: prefill 0.05 ms/token, "
                "decode 15 ms/step, 32 slots"
            )
            print(
                f"{'round':>5} {'interactive':>14} {'P50 ms':>12} {'P99 ms':>12} "
                f"{'n':>7} {'failed':>7}   batch"
            )
            ratios = [
                await _round(n, stack, settings, key, args) for n in range(1, args.rounds + 1)
            ]
            shown = ", ".join(f"{r:.2f}" for r in ratios)
            print(
                f"# interactive P99 with batch / alone, per round: {shown}; median "
                f"{statistics.median(ratios):.2f} (target ≤ 1.10)"
            )

        asyncio.run(run())


if __name__ == "__main__":
    main()
