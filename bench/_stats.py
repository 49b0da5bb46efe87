"""The benches' statistics: pure functions of numbers already measured (tested in
tests/test_bench_stats.py). Reading the numbers from /proc is bench._proc's job."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable


def percentile(values: list[float], q: float) -> float:
    """The value at rank ``q`` % of ``values`` (nearest rank, no interpolation); NaN if empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def bootstrap_interval(
    a: list[list[float]],
    b: list[list[float]],
    statistic: Callable[[list[float]], float],
    rounds: int = 2000,
    seed: int = 1,
) -> tuple[float, float]:
    """95 % interval of ``statistic(b) - statistic(a)``, each given as its windows' values.

    Two stages: each round draws a run's windows with replacement, then the values within
    each drawn window. The completions of one window share its host's speed (its steal, the
    broker's collector), so resampling completions alone would read one window's luck as a
    difference between the runs: a null test (``--null-test``) of two identical runs came
    out "better" at -6 ms (-11 .. -0) that way. With four windows a run it is still
    approximate, and a little narrow (a run offers few distinct draws of its windows); with
    one window a run it amounts to resampling completions alone.
    """
    rng = random.Random(seed)

    def draw(windows: list[list[float]]) -> list[float]:
        picked = rng.choices(windows, k=len(windows))
        return [v for window in picked for v in rng.choices(window, k=len(window))]

    diffs = sorted(statistic(draw(b)) - statistic(draw(a)) for _ in range(rounds))
    return diffs[int(0.025 * rounds)], diffs[int(0.975 * rounds) - 1]


def bunches(
    sent_s: list[float], latencies: list[float], over_ms: float, gap_s: float = 0.05
) -> list[int]:
    """Sizes of the bunches in which requests slower than ``over_ms`` came, largest first: a
    slow request sent within ``gap_s`` of the previous slow one joins its bunch. Many small
    bunches are requests slowed one by one; a few large ones are stalls (a collector cycle,
    a compiler burst, the hypervisor), each slowing every request that crossed it."""
    sizes: list[int] = []
    last = -1.0
    for sent, latency in sorted(zip(sent_s, latencies, strict=True)):
        if latency <= over_ms:
            continue
        if sizes and sent - last < gap_s:
            sizes[-1] += 1
        else:
            sizes.append(1)
        last = sent
    return sorted(sizes, reverse=True)


def steal_percent(before: list[int], after: list[int]) -> float:
    """Share of CPU time the hypervisor gave to other guests between two ``cpu_times()``.

    On a shared virtual machine this swings from 0 to 30 % from one minute to the next, and
    every latency tail with it: a row measured under steal is not comparable to one without.
    """
    spent = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(spent)
    return 100 * spent[7] / total if total else 0.0


def cpu_share(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """'role N%' per process: its share of one core between two ``cpu_seconds()``."""
    seconds = max(seconds, 1e-9)
    return "  ".join(
        f"{role} {100 * (after[role] - before.get(role, 0.0)) / seconds:.0f}%" for role in after
    )


def group_seconds(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> defaultdict[str, float]:
    """CPU seconds per group between two ``thread_seconds``. The JVM starts and ends threads
    as it needs them; a thread that ended in between loses its last part (an undercount)."""
    spent: defaultdict[str, float] = defaultdict(float)
    for (tid, group), seconds in after.items():
        spent[group] += seconds - before.get((tid, group), 0.0)
    return spent
