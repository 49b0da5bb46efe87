"""Latency laneway adds: ingress → Kafka → worker → reply → client, with an instant sim engine.

Drives non-streamed completions open-loop at fixed rates and prints P50/P99 per rate, then
the highest rate whose P99 stays under 50 ms. The sim engine costs nothing, so every
millisecond measured is laneway's own (HTTP, Kafka, Redis, Python). Each row also gives the
P99 of the parts of the ingress's Server-Timing header (admit, enqueue, worker) and the CPU
steal of the row, on average and in its worst 200 ms: on a shared virtual machine, rows under
steal are not comparable. Under each row: the CPU of every process, the requests over the
15 ms target in the bunches they came in (a large bunch is a stall that slowed every request
crossing it), and the CPU the broker's collector and C2 compiler threads took in the row.

    .venv/bin/python -m bench.overhead [--rates 50,100,200,300] [--seconds 10] [--warmup 150]
        [--ingress-env LANEWAY_QUOTA_LEASE_SHARE=0 ...] [--jvm-option=-XX:+ZProactive ...]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import uvloop

from bench._open_loop import open_loop
from bench._proc import CpuWatch, StealWatch, machine, thread_seconds
from bench._stack import BenchStack, add_ingress_env_option, bench_stack, ingress_env
from bench._stats import bunches, group_seconds, percentile
from ops.drills.http_pool import HttpPool, server_timing

# The target for the P99 laneway adds at 200/s; slower requests are shown in bunches.
SLOW_MS = 15.0


@dataclass
class Load:
    """What one ``drive`` saw: each answered request's latency (ms) and when it was sent (s
    after the start), the Server-Timing parts, errors by kind, and the rate achieved."""

    latencies: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    achieved: float = 0.0


async def drive(stack: BenchStack, key: str, rate: float, seconds: float) -> Load:
    """Open-loop load: request i is sent at start + i/rate whatever the earlier ones do.

    Errors are counted by kind: an HTTP status with the start of its error message, or the
    exception the connection ended in."""
    load = Load()
    http = HttpPool("127.0.0.1", stack.ingress_port, {"Authorization": f"Bearer {key}"})

    async def one(i: int) -> None:
        started = time.perf_counter()
        body = {"model": "laneway-code", "prompt": f"def f{i}(x):\n    return", "max_tokens": 16}
        try:
            status, headers, data = await http.post(
                "/v1/completions", body, {"X-Laneway-Session": f"s{i % 64}"}
            )
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            load.errors[type(exc).__name__] += 1
            return
        if status != 200:
            load.errors[f"{status} {data[:120].decode(errors='replace')}"] += 1
            return
        load.latencies.append((time.perf_counter() - started) * 1000)
        load.sent.append(started - start)
        for name, dur in server_timing(headers["server-timing"]).items():
            load.stages.setdefault(name, []).append(dur)

    total = int(rate * seconds)
    start = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) async for i in open_loop(rate, total)]
    await asyncio.gather(*tasks)
    load.achieved = total / (time.perf_counter() - start)
    await http.close()
    return load


def instant_stack(
    jvm_options: list[str] | None = None, settings: dict[str, str] | None = None
) -> BenchStack:
    """Ingress and one completion worker whose sim engine takes no time at all."""
    worker = {
        "LANEWAY_POOL": "completion",
        "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0",
        "LANEWAY_SIM_DECODE_MS_PER_STEP": "0",
        "LANEWAY_MAX_INFLIGHT": "256",
    }
    return BenchStack(workers=[worker], jvm_options=jvm_options or [], ingress_env=settings or {})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="50,100,200,300,400")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--warmup",
        type=float,
        default=150.0,
        help="seconds of load first (at 200/s, or the highest rate if lower): the broker JVM's "
        "C2 compiler takes a whole core in bursts for about two minutes, which is start-up, "
        "not steady state",
    )
    add_ingress_env_option(parser)
    parser.add_argument(
        "--jvm-option",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra JVM flag for the broker (repeatable), e.g. -XX:+ZProactive",
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    settings = ingress_env(parser, args.ingress_env)

    stack = instant_stack(args.jvm_option, settings)
    with bench_stack(stack):
        key = stack.api_key("bench")
        # uvloop: the load generator shares the cores it measures, so keep it light.
        uvloop.run(drive(stack, key, min(200.0, max(rates)), args.warmup))
        print(f"# laneway added latency (instant sim engine) — {machine()}")
        if args.jvm_option:
            print(f"# extra JVM flags for the broker: {' '.join(args.jvm_option)}")
        if settings:
            print(f"# ingress settings: {' '.join(f'{k}={v}' for k, v in settings.items())}")
        header = ["rate/s", "sent", "achieved/s", "errors", "P50 ms", "P99 ms", "max ms"]
        # P99 of each part of the time inside laneway (the Server-Timing header)
        parts = ("laneway", "admit", "enqueue", "worker")
        header += ["inside P50", *(f"{p[:7]} P99" for p in parts), "steal %", "steal max"]
        print(" ".join(f"{h:>10}" for h in header))
        best = 0.0
        met: dict[float, list[bool]] = {}
        for rate in rates:
            broker_before = thread_seconds(stack.pids["broker"])
            with CpuWatch(stack) as cpu, StealWatch() as steal:
                load = uvloop.run(drive(stack, key, rate, args.seconds))
            broker = group_seconds(broker_before, thread_seconds(stack.pids["broker"]))
            errors = sum(load.errors.values())
            p50, p99 = percentile(load.latencies, 50), percentile(load.latencies, 99)
            row = (
                rate,
                len(load.latencies) + errors,
                load.achieved,
                errors,
                p50,
                p99,
                max(load.latencies, default=0),
                percentile(load.stages.get("laneway", []), 50),
                *(percentile(load.stages.get(p, []), 99) for p in parts),
                steal.average,
                steal.peak,
            )
            print(" ".join(f"{v:>10.1f}" for v in row), flush=True)
            print(f"#   cpu, % of one core: {cpu.shares}", flush=True)
            slow = bunches(load.sent, load.latencies, SLOW_MS)
            print(
                f"#   over {SLOW_MS:.0f} ms: {sum(slow)} requests in {len(slow)} bunches"
                f" (largest {', '.join(map(str, slow[:3])) or '-'});"
                f" broker CPU, ms: ZGC {1000 * broker['ZGC']:.0f}"
                f"  C2 JIT {1000 * broker['C2 JIT']:.0f}",
                flush=True,
            )
            for kind, count in load.errors.most_common():
                print(f"#   error x{count}: {kind}", flush=True)
            if p99 < 50 and errors == 0:
                best = max(best, rate)
            met.setdefault(rate, []).append(p99 <= SLOW_MS and errors == 0)
        print(f"highest rate with P99 < 50 ms and no errors: {best:.0f}/s")
        for rate, rows in met.items():
            print(
                f"target (P99 ≤ {SLOW_MS:.0f} ms, no errors) at {rate:.0f}/s: "
                f"{sum(rows)} of {len(rows)} rows"
            )


if __name__ == "__main__":
    main()
