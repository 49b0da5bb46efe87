"""A synthetic 24 h usage history on the real broker gives the expected σ and quota factor,
written where the quota code reads it and announced on ``laneway.control``."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from laneway.constants import RedisKeys
from quota.teams import Team, set_team
from streams.variance import HOUR_S, hour_of
from tests.stack import LiveStack, eventually
from tests.test_streams_process import StreamsProcess, produce_usage, usage_event


async def test_24h_history_gives_the_expected_factor(stack: LiveStack, tmp_path: Path) -> None:
    keys = RedisKeys(stack.prefix)
    # Budgets: steady 2 × 50 × 1.0 × 1000 = 100k tokens/h; bursty 1 × 50 × 2.0 × 1000 = 100k.
    await set_team(stack.redis, keys, Team("steady", size=2, complexity=1.0))
    await set_team(stack.redis, keys, Team("bursty", size=1, complexity=2.0))
    current = hour_of(time.time())
    events = []
    for i in range(24):
        ts = (current - 24 + i) * HOUR_S + 60
        steady = 40_000 if i % 2 else 60_000  # utilisation 0.4 / 0.6: σ 0.1 → 1.05
        events.append(
            usage_event(team="steady", prompt_tokens=steady - 1000, completion_tokens=1000, ts=ts)
        )
        if i % 6 == 0:  # 4 busy hours at 3.0, 20 idle: σ = √1.25 → capped at 1.3
            events.append(
                usage_event(team="bursty", prompt_tokens=300_000, completion_tokens=0, ts=ts)
            )
    producer = await stack.producer()
    await produce_usage(producer, stack.topics.usage, events)

    streams = StreamsProcess(stack, tmp_path)
    await streams.start()
    seen = _Seen(stack, keys.quota_factor("steady"), keys.quota_factor("bursty"))
    try:
        await seen.until((1.05, 1.3))
    finally:
        assert await streams.stop() == 0, streams.log()
    if hour_of(time.time()) != current:
        pytest.skip("the hour turned during the test: the 24 h window moved")
    assert seen.last == pytest.approx((1.05, 1.3), abs=1e-6)
    # Announced with the whole history's σ and mean. When the first tick saw part of the
    # backlog, bursty's factor may already sit at its cap (1.3) with another σ; the
    # capped-factor test in test_streams_logic.py pins that case down.
    sigmas = {"steady": 0.1, "bursty": round(1.25**0.5, 6)}
    updates = await stack.read_topic(
        stack.topics.control,
        count=2,
        where=lambda r: r["kind"] == "quota_factor" and sigmas.get(r["team"]) == r["sigma"],
    )
    by_team = {u["team"]: u for u in updates}
    assert (by_team["steady"]["factor"], by_team["steady"]["mean"]) == (1.05, 0.5)
    assert by_team["bursty"]["factor"] == 1.3


async def test_factor_is_measured_against_the_configured_budget(
    stack: LiveStack, tmp_path: Path
) -> None:
    """With 100 units a member the ingress budget doubles; so must the budget the streams app
    measures utilisation against (it was 50 units, hard-coded, whatever the setting)."""
    keys = RedisKeys(stack.prefix)
    team = f"wide-{stack.prefix[-6:]}"
    # Budget 1 × 100 × 1.0 × 1000 = 100k tokens/h: alternate 0.2 / 0.6 → σ 0.2 → factor 1.1.
    # Measured against 50 units it would be 0.4 / 1.2 → σ 0.4 → 1.2.
    await set_team(stack.redis, keys, Team(team, size=1, complexity=1.0))
    current = hour_of(time.time())
    events = [
        usage_event(
            team=team,
            prompt_tokens=(60_000 if i % 2 else 20_000) - 1000,
            completion_tokens=1000,
            ts=(current - 24 + i) * HOUR_S + 60,
        )
        for i in range(24)
    ]
    producer = await stack.producer()
    await produce_usage(producer, stack.topics.usage, events)

    streams = StreamsProcess(stack, tmp_path, quota_units_per_member=100)
    await streams.start()
    seen = _Seen(stack, keys.quota_factor(team))
    try:
        await seen.until((1.1,))
    finally:
        assert await streams.stop() == 0, streams.log()
    if hour_of(time.time()) != current:
        pytest.skip("the hour turned during the test: the 24 h window moved")
    assert seen.last == pytest.approx((1.1,), abs=1e-6)


class _Seen:
    """The factors in Redis, polled until they are the whole history's. The factor timer
    works on what the agent has folded so far, so on a slow machine its first ticks give the
    factor of part of the history; the last value seen is what a failure shows."""

    def __init__(self, stack: LiveStack, *keys: str) -> None:
        self.stack = stack
        self.keys = list(keys)
        self.last: tuple[float, ...] | None = None

    async def until(self, expected: tuple[float, ...], within_s: float = 40.0) -> None:
        async def settled() -> bool:
            values = await self.stack.redis.mget(self.keys)
            if all(values):
                self.last = tuple(float(v) for v in values)
            return self.last == pytest.approx(expected, abs=1e-6)

        with contextlib.suppress(TimeoutError):  # the caller's assert shows what came
            await eventually(settled, within_s, f"quota factors {expected} in Redis")
