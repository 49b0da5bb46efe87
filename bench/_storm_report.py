"""What the cancel storm prints: its header, a row and its comment lines per run, and the
storm's P99 against its baseline's with a bootstrap interval."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from itertools import chain

from bench._proc import machine
from bench._stats import bootstrap_interval, percentile
from bench._storm_load import (
    CHAT_CONTEXT_CHARS,
    CHAT_MAX_TOKENS,
    CHAT_USERS,
    DOCUMENT_CHARS,
    DOCUMENT_MAX_TOKENS,
    RunStats,
)
from bench._storm_session import BATCH_LINES_AT_ONCE, Scenario
from ops.drills.engine_time import EngineTime
from ops.drills.typists import MAX_TOKENS

# Windows at or under this average steal (%) are compared on their own as well: on a shared
# host, a window the hypervisor slowed says more about the host than about the storm.
QUIET_STEAL = 1.0
# The fewest kept completions, and windows, on each side for that comparison.
QUIET_MIN = 300
QUIET_MIN_WINDOWS = 2

HEADER = (
    "scenario",
    "run",
    "requests",
    "abandoned",
    "stale eng %",
    "abandoned eng %",
    "kept",
    "P50 ms",
    "P99 ms",
    "P99 wait ms",
    "err %",
    "open max",
    "open end",
    "steal %",
)


def print_header(args: argparse.Namespace) -> None:
    """The machine, the load and the column names."""
    print(f"# cancel storm — {machine()}")
    print("# sim engine (a simulated GPU) in each pool: prefill 0.05 ms/token, decode 15 ms/step,")
    print(
        f"# 32 slots; {args.typists} typists, prompts ~1k tokens, max_tokens {MAX_TOKENS}; "
        f"each run is {args.rounds} windows of {args.seconds:.0f} s, after {args.warmup:.0f} s "
        f"of warm-up; {'the two runs' if args.null_test else 'no storm and shield on'} "
        "alternate (ABBA) on one stack; stream interval "
        f"{args.stream_interval} token(s)"
    )
    if args.null_test:
        print("# null test: the second run is no storm as well; any difference is chance")
    if args.scenario != "storm":
        print(
            f"# fleet: + {CHAT_USERS} chat users (~{CHAT_CONTEXT_CHARS // 4000}k-token "
            f"conversations, max_tokens {CHAT_MAX_TOKENS}, streamed) + a batch job "
            f"(~{DOCUMENT_CHARS // 4000}k-token documents, max_tokens {DOCUMENT_MAX_TOKENS}, "
            f"{BATCH_LINES_AT_ONCE} at once)"
        )
    print(" ".join(f"{h:>15}" for h in HEADER))


def report_run(scenario: Scenario, name: str, stats: RunStats, seen: EngineTime) -> None:
    """One run's row, then its comment lines (windows, outcomes, CPU, wait parts, lag)."""
    total = seen.total or 1.0
    share, abandoned_share = 100 * seen.stale / total, 100 * seen.on_abandoned / total
    errors = 100 * stats.errors / max(1, stats.sent - stats.abandoned_requests)
    # A kept completion's latency beyond its own engine time: what the rest of the traffic
    # made it wait, without the luck of how many tokens it happened to generate.
    kept = list(stats.kept.values())
    waits = [ms - seen.by_id[rid] for rid, ms in stats.kept.items() if rid in seen.by_id]
    row = (
        scenario.name,
        name,
        stats.sent,
        stats.abandoned_requests,
        f"{share:.1f}",
        f"{abandoned_share:.1f}",
        len(kept),
        f"{percentile(kept, 50):.0f}",
        f"{percentile(kept, 99):.0f}",
        f"{percentile(waits, 99):.0f}",
        f"{errors:.2f}",
        f"{stats.open_max:.0f}",
        f"{stats.open_end:.0f}",
        f"{sum(stats.steal) / len(stats.steal):.1f}",
    )
    print(" ".join(f"{v:>15}" for v in row), flush=True)
    windows = ", ".join(
        f"{percentile([stats.kept[rid] for rid in ids], 99):.0f} ({steal:.1f} %)"
        for ids, steal in zip(stats.windows, stats.steal, strict=True)
    )
    print(f"#   kept P99 ms (steal) by window: {windows}")
    print(f"#   completion outcomes: {seen.statuses}", flush=True)
    for cpu in stats.cpu:
        print(f"#   cpu, % of one core: {cpu}", flush=True)
    by_class = ", ".join(f"{cls} {ms / 1000:.0f}" for cls, ms in sorted(seen.by_class.items()))
    print(f"#   engine seconds by class: {by_class}", flush=True)
    if parts := _wait_parts(stats, seen):
        print(f"#   kept wait, P50/P99 ms: {parts}", flush=True)
    print(
        f"#   load generator's loop lag, P50/P99/max ms: {percentile(stats.lag, 50):.1f}/"
        f"{percentile(stats.lag, 99):.1f}/{max(stats.lag, default=0.0):.1f}",
        flush=True,
    )
    if scenario.fleet:
        print(f"#   chat turns {stats.chat_turns}, chat errors {stats.chat_errors}", flush=True)
    if news := seen.news_ms:
        print(
            f"#   stale ms per request that turned stale while running: {seen.stale / len(news):.1f}"
        )
        print(
            f"#   its news took P50 {percentile(news, 50):.1f} / P99 {percentile(news, 99):.1f} ms "
            "from the ingress to the worker; with the engine time in that gap, stale eng % "
            f"would be {100 * (seen.stale + seen.in_flight) / total:.1f}",
            flush=True,
        )


def compare(
    base: tuple[RunStats, EngineTime], storm: tuple[RunStats, EngineTime], label: str
) -> None:
    """The storm's P99 against its baseline's, with how sure the difference is.

    A P99 of a few hundred completions rests on its few largest, so two runs of the same
    load differ by tens of milliseconds by chance. A bootstrap over windows, then the
    completions within them, gives the 95 % interval of the difference: when it holds 0,
    the storm is not told apart from no storm at this sample size. The same comparison over
    the quiet windows alone (average steal at most QUIET_STEAL) follows, when both runs have
    enough of them.
    """

    def kept(stats: RunStats, seen: EngineTime, rid: str) -> float | None:
        return stats.kept[rid]

    def wait(stats: RunStats, seen: EngineTime, rid: str) -> float | None:
        return stats.kept[rid] - seen.by_id[rid] if rid in seen.by_id else None

    def windows(
        run: tuple[RunStats, EngineTime],
        value: Callable[[RunStats, EngineTime, str], float | None],
        quiet: bool,
    ) -> list[list[float]]:
        stats, seen = run
        chosen = []
        for ids, steal in zip(stats.windows, stats.steal, strict=True):
            if quiet and steal > QUIET_STEAL:
                continue
            values = [v for rid in ids if (v := value(stats, seen, rid)) is not None]
            if values:
                chosen.append(values)
        return chosen

    for quiet in (False, True):
        where = f", windows under {QUIET_STEAL:.0f} % steal" if quiet else ""
        for what, value in (("kept P99", kept), ("P99 wait", wait)):
            a, b = windows(base, value, quiet), windows(storm, value, quiet)
            n_a, n_b = sum(map(len, a)), sum(map(len, b))
            if quiet and (min(n_a, n_b) < QUIET_MIN or min(len(a), len(b)) < QUIET_MIN_WINDOWS):
                print(
                    f"#   {what}{where}: too few ({n_a} and {n_b} completions, "
                    f"{len(a)} and {len(b)} windows)"
                )
                continue
            if not a or not b:
                continue
            low, high = bootstrap_interval(a, b, lambda v: percentile(v, 99))
            diff = percentile([*chain(*b)], 99) - percentile([*chain(*a)], 99)
            verdict = "worse" if low > 0 else "better" if high < 0 else "not told apart"
            print(
                f"#   {label}, {what}{where}: {diff:+.0f} ms, 95 % interval "
                f"{low:+.0f} .. {high:+.0f} ({n_a} and {n_b} completions in {len(a)} and "
                f"{len(b)} windows): {verdict}",
                flush=True,
            )


def _wait_parts(stats: RunStats, seen: EngineTime) -> str:
    """Where a kept completion's wait went: the client opening a connection (when none of
    its pool was free: in a storm, the previous keystroke's is still streaming), its
    request until the ingress accepted it, before its engine started (ingress, Kafka, worker
    fetch), at the worker beside the engine's own time, and after the worker's last word
    (reply to the ingress, HTTP to the client). The two parts outside the stack compare the
    client's wall clock with the worker's, on the same machine."""
    parts: dict[str, list[float]] = {
        "connect": [],
        "to ingress": [],
        "admit": [],
        "enqueue": [],
        "to worker": [],
        "worker": [],
        "back": [],
    }
    for rid in stats.kept:
        if rid not in seen.times:
            continue
        queue, total, ended_at = seen.times[rid]
        timing = stats.timing.get(rid, {})
        admit, enqueue = timing.get("admit", 0.0), timing.get("enqueue", 0.0)
        parts["connect"].append(timing.get("connect", 0.0))
        if "sent_at" in timing and "done_at" in timing:
            accepted_at = ended_at - total / 1000
            parts["to ingress"].append((accepted_at - timing["sent_at"]) * 1000)
            parts["back"].append((timing["done_at"] - ended_at) * 1000)
        parts["admit"].append(admit)
        parts["enqueue"].append(enqueue)
        parts["to worker"].append(queue - admit - enqueue)
        parts["worker"].append(total - queue - seen.by_id[rid])
    return ", ".join(
        f"{name} {percentile(v, 50):.0f}/{percentile(v, 99):.0f}" for name, v in parts.items() if v
    )
