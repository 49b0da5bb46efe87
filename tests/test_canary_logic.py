"""Canary routes in-process: steps, sticky buckets, and the judge of a step."""

from __future__ import annotations

import pytest

from laneway.canary import CanaryState, bucket, canary_route, parse_steps
from laneway.errors import BadRequest
from streams.canary import StepTraffic, judge, judge_abandoned
from streams.records import RouteStats
from streams.settings import StreamsSettings


def test_steps_rise_to_a_full_promotion() -> None:
    assert parse_steps("1, 5,10,100") == (1.0, 5.0, 10.0, 100.0)
    for bad, says in [
        ("", "at least one"),
        ("1,x", "comma-separated"),
        ("5,1,100", "must rise"),
        ("1,5,10", "end at 100"),
        ("0,100", r"\(0, 100\]"),
    ]:
        with pytest.raises(BadRequest, match=says):
            parse_steps(bad)


def test_a_canary_walks_its_steps_then_is_promoted() -> None:
    state = CanaryState(model="m", target="m-v2", steps=(1, 5, 100))
    weights = []
    while state.status == "running":
        weights.append(state.weight)
        state = state.advanced(now=0.0)
    assert (weights, state.status, state.weight) == ([1, 5], "promoted", 100)
    rolled = CanaryState(model="m", target="m-v2").ended("rolled_back", "errors", 1.0)
    assert rolled.weight == 0
    with pytest.raises(BadRequest, match="differ"):
        CanaryState(model="m", target="m")


def test_sessions_stick_and_only_ever_move_to_the_canary() -> None:
    sessions = [f"src/file{i}.py" for i in range(20_000)]
    by_step = []
    for step in range(4):
        state = CanaryState(model="m", target="m-v2", step=step, salt="s3cret")
        routes = {s: canary_route(state, "team-a", s) for s in sessions}
        # Within a step: the same session gets the same route every time.
        assert all(canary_route(state, "team-a", s) == routes[s] for s in sessions[:500])
        by_step.append({s for s, r in routes.items() if r == "m-v2"})
    for weight, on_canary in zip((1, 5, 10, 100), by_step, strict=True):
        assert abs(len(on_canary) / len(sessions) - weight / 100) < 0.01
    # A session on the canary at one step stays on it at every later one.
    assert by_step[0] <= by_step[1] <= by_step[2] <= by_step[3]
    # Teams are hashed apart: one team's session name says nothing of another's bucket.
    assert bucket("team-a", "x") != bucket("team-b", "x")


def _stats(requests: int, errors: int, p99: float | None) -> RouteStats:
    return RouteStats(requests=requests, errors=errors, error_rate=errors / requests, p99_ms=p99)


def test_the_judge_compares_the_canary_with_the_stable_route() -> None:
    settings = StreamsSettings()  # error ratio 1.5, slack 1 point, P99 ratio 1.5
    stable = _stats(1000, 20, 100.0)  # 2 %
    assert judge(_stats(100, 3, 120.0), stable, settings).passed  # 3 % ≤ 3 %
    failed = judge(_stats(100, 5, 120.0), stable, settings)
    assert not failed.passed
    assert "error rate 5.0%" in failed.reason
    slow = judge(_stats(100, 0, 200.0), stable, settings)
    assert not slow.passed
    assert "P99 200 ms" in slow.reason
    # A stable route without errors: the slack decides (0 → at most 1 %).
    clean = _stats(1000, 0, 100.0)
    assert judge(_stats(200, 2, 100.0), clean, settings).passed
    assert not judge(_stats(200, 4, 100.0), clean, settings).passed
    # No stable traffic to compare with: the canary alone, against the slack.
    assert judge(_stats(100, 0, 50.0), None, settings).passed


def _runs(answered: int, abandoned: int) -> StepTraffic:
    return StepTraffic(_stats(answered, 0, 50.0) if answered else None, abandoned)


def test_the_judge_rolls_back_a_canary_that_leaves_far_more_runs_unanswered() -> None:
    # Few runs abandoned on the stable route: twice as many, and 10 points more, is too many.
    assert judge_abandoned(_runs(88, 12), _runs(95, 5)).passed  # 12 % ≤ 15 %
    failed = judge_abandoned(_runs(80, 20), _runs(95, 5))
    assert not failed.passed
    assert "20.0% of 100 runs abandoned after they started or expired" in failed.reason
    # Most abandoned on the stable route (fast typing): answering under half its share is.
    assert judge_abandoned(_runs(20, 80), _runs(30, 70)).passed  # 80 % ≤ 85 %
    assert not judge_abandoned(_runs(10, 90), _runs(30, 70)).passed
    # A hung engine answers nothing, whatever the stable route does short of the same.
    assert not judge_abandoned(_runs(0, 50), _runs(2, 98)).passed
    assert not judge_abandoned(_runs(0, 50), None).passed
