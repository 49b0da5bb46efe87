"""The broker's JIT: where its CPU goes, window by window, from start-up to steady state.

Drives the same load as bench/overhead.py (non-streamed completions, instant sim engine) at a
fixed rate from the moment the stack is ready, and prints for every window the latency P50/P99,
the CPU steal, and the broker's CPU by thread group (the C2 and C1 compiler threads, the
request-handling data plane, the ZGC collector's threads, the rest), as a share of one core.
Extra JVM flags for the broker show what a flag changes:

    .venv/bin/python -m bench.broker_jit [--rate 200] [--window 15] [--windows 12]
    .venv/bin/python -m bench.broker_jit --jvm-option=-XX:TieredStopAtLevel=1
    .venv/bin/python -m bench.broker_jit --jvm-option=-XX:+ZProactive
"""

from __future__ import annotations

import argparse
import time

import uvloop

from bench._proc import BROKER_THREADS, StealWatch, machine, thread_seconds
from bench._stack import bench_stack
from bench._stats import group_seconds, percentile
from bench.overhead import drive, instant_stack


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--window", type=float, default=15.0, help="seconds per row")
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument(
        "--jvm-option", action="append", default=[], help="an extra JVM flag for the broker"
    )
    args = parser.parse_args()

    stack = instant_stack(args.jvm_option)
    with bench_stack(stack):
        key = stack.api_key("bench")
        broker = stack.pids["broker"]
        flags = " ".join(args.jvm_option) or "none"
        print(f"# broker JIT at {args.rate:.0f}/s — {machine()}; extra JVM flags: {flags}")
        labels = [label for _, label in BROKER_THREADS] + ["other"]
        header = ["after s", "P50 ms", "P99 ms", "steal %"] + [f"{g} %" for g in labels]
        print(" ".join(f"{h:>12}" for h in header))
        started = time.monotonic()
        for _ in range(args.windows):
            threads_before, t0 = thread_seconds(broker), time.monotonic()
            with StealWatch() as steal:
                load = uvloop.run(drive(stack, key, args.rate, args.window))
            seconds = time.monotonic() - t0
            spent = group_seconds(threads_before, thread_seconds(broker))
            shares = [100 * spent[g] / seconds for g in labels]
            row = [
                time.monotonic() - started,
                percentile(load.latencies, 50),
                percentile(load.latencies, 99),
                steal.average,
                *shares,
            ]
            print(" ".join(f"{v:>12.1f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
