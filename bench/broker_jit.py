"""The broker's JIT: where its CPU goes, window by window, from start-up to steady state.

Drives the same load as bench/overhead.py (non-streamed completions, instant sim engine) at a
fixed rate from the moment the stack is ready, and prints for every window the latency P50/P99,
the CPU steal, and the broker's CPU by thread group (the C2 and C1 compiler threads, the
request-handling data plane, the rest), as a share of one core. Extra JVM flags for the broker
show what a flag changes:

    .venv/bin/python -m bench.broker_jit [--rate 200] [--window 15] [--windows 12]
    .venv/bin/python -m bench.broker_jit --jvm-option=-XX:TieredStopAtLevel=1
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import uvloop

from bench._stack import (
    StealWatch,
    bench_stack,
    machine,
    percentile,
    stat_cpu_seconds,
)
from bench.overhead import drive, instant_stack

GROUPS = (("C2 Compiler", "C2 JIT"), ("C1 Compiler", "C1 JIT"), ("data-plane", "data plane"))


def thread_seconds(pid: int) -> dict[tuple[str, str], float]:
    """CPU seconds used so far by each thread of ``pid``, keyed by (thread id, group)."""
    used: dict[tuple[str, str], float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        group = next((label for prefix, label in GROUPS if name.startswith(prefix)), "other")
        used[task.name, group] = stat_cpu_seconds(raw)
    return used


def group_seconds(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> Counter[str]:
    """CPU seconds per group between two samples. The JVM starts and ends compiler threads as
    it needs them; a thread that ended in between loses its last part (an undercount)."""
    spent: Counter[str] = Counter()
    for (tid, group), seconds in after.items():
        spent[group] += seconds - before.get((tid, group), 0.0)
    return spent


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
        labels = [label for _, label in GROUPS] + ["other"]
        header = ["after s", "P50 ms", "P99 ms", "steal %"] + [f"{g} %" for g in labels]
        print(" ".join(f"{h:>12}" for h in header))
        started = time.monotonic()
        for _ in range(args.windows):
            threads_before, t0 = thread_seconds(broker), time.monotonic()
            with StealWatch() as steal:
                latencies, _, _, _ = uvloop.run(drive(stack, key, args.rate, args.window))
            seconds = time.monotonic() - t0
            spent = group_seconds(threads_before, thread_seconds(broker))
            shares = [100 * spent[g] / seconds for g in labels]
            row = [
                time.monotonic() - started,
                percentile(latencies, 50),
                percentile(latencies, 99),
                steal.average,
                *shares,
            ]
            print(" ".join(f"{v:>12.1f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
