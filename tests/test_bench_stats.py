"""The benches' statistics (bench/_stats.py), on which docs/benchmarks.md's numbers rest."""

from __future__ import annotations

import math
import random
from itertools import chain

import pytest

from bench._stats import (
    bootstrap_interval,
    bunches,
    cpu_share,
    group_seconds,
    percentile,
    steal_percent,
)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _windows(
    rng: random.Random, mean: float, n_windows: int = 4, per_window: int = 100, window_sd: float = 0
) -> list[list[float]]:
    """A run's values, window by window: each window shifted by its own luck (``window_sd``)."""
    windows = []
    for _ in range(n_windows):
        shift = rng.gauss(0, window_sd)
        windows.append([rng.gauss(mean + shift, 10) for _ in range(per_window)])
    return windows


# percentile


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))


def test_percentile_of_one_value_is_that_value_at_every_rank() -> None:
    assert [percentile([7.0], q) for q in (0, 50, 99, 100)] == [7.0, 7.0, 7.0, 7.0]


def test_percentile_ends_are_the_minimum_and_the_maximum() -> None:
    values = [5.0, 1.0, 9.0, 3.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 9.0


def test_percentile_is_the_nearest_rank_without_interpolation() -> None:
    values = [float(v) for v in range(1, 102)]  # 1 .. 101: rank q is the value q + 1
    random.Random(3).shuffle(values)
    assert percentile(values, 50) == 51.0
    assert percentile(values, 99) == 100.0
    # Between two ranks it picks one of the values, never a mean of them.
    assert percentile([1.0, 2.0], 50) in (1.0, 2.0)


def test_percentile_leaves_its_input_as_it_was() -> None:
    values = [3.0, 1.0, 2.0]
    percentile(values, 50)
    assert values == [3.0, 1.0, 2.0]


# bootstrap_interval


def test_interval_holds_the_true_difference() -> None:
    rng = random.Random(11)
    a, b = _windows(rng, mean=100), _windows(rng, mean=105)
    low, high = bootstrap_interval(a, b, _mean)
    assert low <= 5 <= high
    assert low > 0  # 5 against a noise of 10 over 400 values a run is told apart


def test_interval_leaves_out_zero_when_the_effect_is_large() -> None:
    rng = random.Random(12)
    a, b = _windows(rng, mean=740), _windows(rng, mean=800)
    low, high = bootstrap_interval(a, b, lambda v: percentile(v, 99))
    assert 0 < low <= high


def test_interval_holds_zero_in_the_null_case() -> None:
    rng = random.Random(13)
    a, b = _windows(rng, mean=740), _windows(rng, mean=740)
    low, high = bootstrap_interval(a, b, lambda v: percentile(v, 99))
    assert low <= 0 <= high


def test_a_shorter_run_gives_the_negative_difference() -> None:
    rng = random.Random(14)
    a, b = _windows(rng, mean=120), _windows(rng, mean=100)
    low, high = bootstrap_interval(a, b, _mean)
    assert low <= high < 0


def test_window_luck_widens_the_interval_instead_of_posing_as_a_difference() -> None:
    # Two runs of the same load whose windows each had their own host (steal, the collector):
    # resampling completions alone (one window a run) reads that luck as a difference.
    rng = random.Random(5)
    a = _windows(rng, mean=740, window_sd=15)
    b = _windows(rng, mean=740, window_sd=15)
    two_stage = bootstrap_interval(a, b, _mean)
    completions_alone = bootstrap_interval([[*chain(*a)]], [[*chain(*b)]], _mean)
    assert two_stage[1] - two_stage[0] > 3 * (completions_alone[1] - completions_alone[0])
    assert two_stage[0] <= 0 <= two_stage[1]


def test_interval_is_the_same_for_the_same_seed() -> None:
    # The bench prints it with the default seed: a re-run of the same numbers prints the same.
    rng = random.Random(6)
    a, b = _windows(rng, mean=100), _windows(rng, mean=101)
    assert bootstrap_interval(a, b, _mean) == bootstrap_interval(a, b, _mean)
    assert bootstrap_interval(a, b, _mean, seed=2) != bootstrap_interval(a, b, _mean, seed=3)


# bunches


def test_no_slow_request_makes_no_bunch() -> None:
    assert bunches([0.0, 0.1, 0.2], [5.0, 15.0, 9.0], over_ms=15) == []


def test_slow_requests_close_together_make_one_bunch_largest_first() -> None:
    sent = [0.00, 0.01, 0.02, 1.00, 2.00, 2.04, 2.08, 2.12]
    latencies = [30.0, 40.0, 20.0, 3.0, 16.0, 17.0, 18.0, 19.0]
    assert bunches(sent, latencies, over_ms=15) == [4, 3]


def test_a_gap_of_gap_s_or_more_starts_a_new_bunch() -> None:
    assert bunches([0.0, 0.05, 0.2], [20.0, 20.0, 20.0], over_ms=15, gap_s=0.05) == [1, 1, 1]


def test_bunches_follow_the_send_time_not_the_order_given() -> None:
    assert bunches([0.02, 5.0, 0.0, 0.01], [20.0, 20.0, 20.0, 20.0], over_ms=15) == [3, 1]


# steal_percent, cpu_share, group_seconds


def test_steal_is_the_eighth_counter_over_all_time_spent() -> None:
    before = [100, 0, 50, 800, 0, 0, 0, 10]
    after = [160, 0, 70, 900, 0, 0, 0, 30]  # 200 ticks in all, 20 of them stolen
    assert steal_percent(before, after) == pytest.approx(10.0)


def test_steal_is_zero_when_no_time_passed() -> None:
    assert steal_percent([1] * 8, [1] * 8) == 0.0


def test_cpu_share_is_each_role_as_a_share_of_one_core() -> None:
    before = {"broker": 10.0, "ingress": 5.0}
    after = {"broker": 12.0, "ingress": 5.5, "worker": 1.0}  # the worker started meanwhile
    assert cpu_share(before, after, seconds=4) == "broker 50%  ingress 12%  worker 25%"


def test_cpu_share_of_no_time_does_not_divide_by_zero() -> None:
    assert cpu_share({"a": 0.0}, {"a": 0.0}, seconds=0) == "a 0%"


def test_group_seconds_adds_each_group_s_threads() -> None:
    before = {("1", "ZGC"): 1.0, ("2", "ZGC"): 2.0, ("3", "other"): 5.0, ("4", "C2 JIT"): 9.0}
    after = {("1", "ZGC"): 1.5, ("2", "ZGC"): 2.25, ("3", "other"): 5.0, ("5", "C2 JIT"): 0.5}
    spent = group_seconds(before, after)
    # Thread 4 ended in between: its last part is lost; thread 5 is new and counts from 0.
    assert spent == {"ZGC": 0.75, "other": 0.0, "C2 JIT": 0.5}
    assert spent["data plane"] == 0.0
