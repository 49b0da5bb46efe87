"""The scaling signal's rule, in memory: lag, its growth and engine saturation → replicas."""

from __future__ import annotations

import pytest

from laneway.errors import ConfigError
from laneway.settings import load_settings
from ops.settings import StackSettings
from workers.scaling import PoolLoad, ScalingPolicy, ScalingRule, desired_replicas, pool_load
from workers.settings import WorkerSettings

POLICY = ScalingPolicy(min_replicas=1, max_replicas=4, target_utilisation=0.5)


def test_a_quiet_pool_keeps_its_minimum() -> None:
    load = PoolLoad(replicas=1, running=1, capacity=4)
    assert desired_replicas(load, 0.0, POLICY)[0] == 1


def test_work_beyond_the_target_share_of_capacity_asks_for_replicas() -> None:
    # 4 slots per replica at 50 %: 2 requests each; 4 running + 3 queued + 2 in lag = 9.
    load = PoolLoad(replicas=1, running=4, queued=3, lag=2, capacity=4, kv_cache_usage=0.3)
    desired, reason = desired_replicas(load, 0.0, POLICY)
    assert desired == 4  # ⌈9 / 2⌉ = 5, clamped to the maximum
    assert "clamped to 1..4" in reason


def test_lag_growth_is_projected_over_the_horizon() -> None:
    load = PoolLoad(replicas=2, running=2, capacity=8)
    policy = ScalingPolicy(max_replicas=8, target_utilisation=0.5, growth_horizon_s=10.0)
    assert desired_replicas(load, 0.0, policy)[0] == 1
    # 0.4 records/s more lag each second: 4 more within the horizon → 6 / 2 per replica.
    assert desired_replicas(load, 0.4, policy)[0] == 3
    assert desired_replicas(load, -5.0, policy)[0] == 1  # a shrinking lag is no demand


def test_kv_cache_pressure_asks_for_replicas_whatever_the_queue() -> None:
    load = PoolLoad(replicas=2, running=1, capacity=8, kv_cache_usage=0.99)
    desired, reason = desired_replicas(load, 0.0, POLICY)
    assert desired == 3  # ⌈2 × 0.99 / 0.9⌉
    assert reason.startswith("KV cache at 99%")


def test_a_pool_with_no_live_worker_asks_for_its_minimum() -> None:
    assert desired_replicas(PoolLoad(replicas=0), 5.0, POLICY) == (1, "no live worker to measure")


def test_up_is_at_once_and_down_waits_for_the_window() -> None:
    policy = ScalingPolicy(max_replicas=4, target_utilisation=0.5, scale_down_window_s=30)
    rule = ScalingRule(policy)
    busy = PoolLoad(replicas=1, running=4, queued=4, capacity=4)
    quiet = PoolLoad(replicas=3, running=1, capacity=12)
    assert rule.decide(0.0, busy)[0] == 4
    desired, raw, _, reason = rule.decide(10.0, quiet)
    assert (desired, raw) == (4, 1)
    assert "holding 4" in reason
    assert rule.decide(29.0, quiet)[0] == 4
    assert rule.decide(31.0, quiet)[0] == 1


def test_growth_is_measured_over_the_recent_window() -> None:
    rule = ScalingRule(POLICY)
    assert rule.growth(0.0, 0) == 0.0
    assert rule.growth(2.0, 20) == pytest.approx(10.0)
    assert rule.growth(4.0, 40) == pytest.approx(10.0)
    # Older samples leave the window: the lag held still for the last 10 s.
    for t in range(6, 30, 2):
        rule.growth(float(t), 40)
    assert rule.growth(30.0, 40) == pytest.approx(0.0)


def test_pool_load_sums_the_pools_heartbeats() -> None:
    beats = [
        {"pool": "completion", "backlog": 10, "dispatch_queue": 3, "waiting": 1,
         "engine_inflight": 4, "capacity": 4, "kv_cache_usage": 0.2},
        {"pool": "completion", "backlog": 2, "dispatch_queue": 0, "waiting": 0,
         "engine_inflight": 1, "capacity": 4, "kv_cache_usage": None},
        {"pool": "chat", "backlog": 99, "capacity": 8},
    ]  # fmt: skip
    load = pool_load("completion", beats)
    assert load == PoolLoad(replicas=2, lag=8, queued=4, running=5, capacity=8, kv_cache_usage=0.2)


def test_a_maximum_below_the_minimum_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEWAY_SCALE_MIN_REPLICAS", "3")
    monkeypatch.setenv("LANEWAY_SCALE_MAX_REPLICAS", "2")
    with pytest.raises(ConfigError, match=r"LANEWAY_SCALE_MAX_REPLICAS='2'.*at least"):
        load_settings(WorkerSettings)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ('{"completion": [3, 1]}', r"completion: \[3, 1\] needs 1 <= min <= max"),
        ('{"completion": [8, 9]}', r"min <= LANEWAY_PARTITIONS \(6\)"),
        ('{"gpu": [1, 2]}', "LANEWAY_LOCAL_REPLICAS.GPU.*should be 'completion', 'chat'"),
    ],
)
def test_bad_local_replicas_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, value: str, problem: str
) -> None:
    monkeypatch.setenv("LANEWAY_LOCAL_REPLICAS", value)
    with pytest.raises(ConfigError, match=problem):
        load_settings(StackSettings)


def test_the_local_maximum_is_cut_to_the_partitions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEWAY_LOCAL_REPLICAS", '{"chat": [1, 9]}')
    monkeypatch.setenv("LANEWAY_PARTITIONS", "4")
    settings = load_settings(StackSettings)
    assert settings.replicas_of("chat") == (1, 4)
    assert settings.replicas_of("batch") == (1, 1)  # left out: one worker
