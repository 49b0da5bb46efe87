"""Canary routes in-process: steps, sticky buckets, and the judge of a step."""

from __future__ import annotations

import bisect
import math
import random

import pytest

from laneway.canary import CanaryState, bucket, canary_route, parse_steps
from laneway.errors import BadRequest
from streams.canary import StepTraffic, Verdict, judge, judge_abandoned
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


SETTINGS = StreamsSettings()  # 60 s windows, 50 requests


def _abandoned(canary: StepTraffic, stable: StepTraffic | None) -> Verdict:
    return judge_abandoned(canary, stable, SETTINGS)


def test_the_judge_rolls_back_a_canary_that_answers_far_fewer_of_its_runs() -> None:
    # Few runs abandoned on the stable route: twice as many, and 10 points more, is too many
    # once the counts say it is no chance (12 of 100 is within what 5 % gives).
    assert _abandoned(_runs(88, 12), _runs(9500, 500)).passed
    failed = _abandoned(_runs(75, 25), _runs(9500, 500))
    assert not failed.passed
    assert "25.0% of 100 runs abandoned after they started or expired" in failed.reason
    # Most abandoned on the stable route (fast typing): answering under half its share is,
    # once it is past chance.
    assert _abandoned(_runs(20, 80), _runs(300, 700)).passed  # 20 % of 30 %
    assert not _abandoned(_runs(10, 190), _runs(3000, 7000)).passed  # 5 % of 30 %
    # 2 answered of 50 where the stable route answers 10 %: 5 are expected, and 2 or fewer
    # come one step in nine on identical routes. Checked each second, that was a rollback.
    assert _abandoned(_runs(2, 48), _runs(1000, 9000)).passed
    # A hung engine answers nothing: at 90 % superseded on the stable route, 0 of 100 is
    # past chance (0.9^100 ≈ 3e-5), 0 of 80 not yet (2e-4).
    hung = _abandoned(_runs(0, 100), _runs(1000, 9000))
    assert not hung.passed
    assert "0 answered" in hung.reason
    assert _abandoned(_runs(0, 80), _runs(1000, 9000)).passed


def test_without_stable_runs_to_compare_with_abandoned_runs_are_not_judged() -> None:
    """A 100 % step (or a stable route gone quiet) has no share of abandoned runs to hold
    the canary to: completion traffic abandons most runs on any route."""
    assert _abandoned(_runs(30, 70), None).passed
    assert _abandoned(_runs(30, 70), _runs(5, 2)).passed  # 7 stable runs: too few
    assert _abandoned(_runs(0, 200), _runs(20, 29)).passed  # 49 < 50
    assert not _abandoned(_runs(0, 200), _runs(20, 30)).passed


_SIM_WINDOW_S = SETTINGS.canary_window_s


def _binomial_tables(most: int, p: float) -> list[list[float]]:
    """Cumulative Binomial(n, p) for n up to ``most``: a draw is one bisection."""
    tables = []
    for n in range(most + 1):
        cdf, acc = [], 0.0
        for k in range(n + 1):
            acc += math.comb(n, k) * p**k * (1 - p) ** (n - k)
            cdf.append(acc)
        cdf[-1] = 1.0
        tables.append(cdf)
    return tables


def _steps(
    seed: int,
    count: int,
    stable_answers: float,
    canary_answers: float,
    weights: tuple[int, ...] = (1, 5, 10, 50),
) -> list[tuple[bool, int]]:
    """Simulated steps, judged each second as the streams app does until the canary has its
    answered requests (or 2 h pass): per step (rolled back?, canary runs by then). The
    canary takes 0.3-1 runs a second at a step of one of ``weights`` %, each run answered or
    abandoned independently; the stable route, the rest of the model's runs."""
    rng = random.Random(seed)
    tables = _binomial_tables(99, stable_answers)
    enough = SETTINGS.canary_min_requests
    outcomes = []
    for _ in range(count):
        rate = rng.uniform(0.3, 1.0)
        weight = rng.choice(weights)
        stable_rate = rate * (100 - weight) / weight
        c_runs = c_answered = s_runs = s_answered = 0
        rolled_back = False
        for second in range(7200):
            if rng.random() < rate:
                c_runs += 1
                c_answered += rng.random() < canary_answers
            n = int(stable_rate) + (rng.random() < stable_rate % 1)
            s_runs += n
            s_answered += bisect.bisect_left(tables[n], rng.random())
            if second < _SIM_WINDOW_S or c_runs < enough:
                continue
            canary = _runs(c_answered, c_runs - c_answered)
            if not _abandoned(canary, _runs(s_answered, s_runs - s_answered)).passed:
                rolled_back = True
                break
            if c_answered >= enough:
                break  # judged on its answers: the step is over
        outcomes.append((rolled_back, c_runs))
    return outcomes


@pytest.mark.parametrize(("seed", "abandoned"), [(7, 0.9), (8, 0.6)])
def test_identical_routes_are_seldom_rolled_back_for_abandoned_runs(
    seed: int, abandoned: float
) -> None:
    """Completion traffic: 90 % (or 60 %) of runs superseded after they started on both
    routes alike. Looked at every second over a whole step, a noisy share of a few hundred
    runs must not roll a healthy canary back (a bound of 1 % of steps)."""
    steps = _steps(seed, 400, 1 - abandoned, 1 - abandoned)
    rolled = sum(1 for rolled_back, _ in steps if rolled_back)
    assert rolled < len(steps) / 100, f"{rolled} of {len(steps)} healthy steps rolled back"


@pytest.mark.parametrize(
    ("seed", "abandoned", "weights", "within"),
    [(9, 0.9, (1,), 120), (10, 0.9, (5, 10, 50), 320), (11, 0.6, (1, 5, 10, 50), 80)],
)
def test_a_hung_canary_is_rolled_back_within_a_bounded_number_of_runs(
    seed: int, abandoned: float, weights: tuple[int, ...], within: int
) -> None:
    """Its runs start and none answers: rolled back once the count is past chance. At 90 %
    superseded on the stable route, after about 90 runs at a 1 % step, up to ~270 at 50 %
    (a stable side no larger than the canary's says less of what to expect); at 60 %, at its
    first look (after its first window: up to 70 runs at 1 a second)."""
    steps = _steps(seed, 100, 1 - abandoned, 0.0, weights)
    assert all(rolled_back for rolled_back, _ in steps)
    assert max(runs for _, runs in steps) <= within, sorted(runs for _, runs in steps)[-5:]
