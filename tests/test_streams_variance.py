"""A synthetic 24 h usage history on the real broker gives the expected σ and quota factor,
written where the quota code reads it and announced on ``laneway.control``."""

from __future__ import annotations

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
    try:

        async def factors() -> tuple[bytes, bytes] | None:
            steady, bursty = await stack.redis.mget(
                [keys.quota_factor("steady"), keys.quota_factor("bursty")]
            )
            return (steady, bursty) if steady and bursty else None

        steady, bursty = await eventually(factors, 40, "quota factors in Redis")
    finally:
        assert await streams.stop() == 0, streams.log()
    if hour_of(time.time()) != current:
        pytest.skip("the hour turned during the test: the 24 h window moved")
    assert float(steady) == pytest.approx(1.05, abs=1e-6)
    assert float(bursty) == pytest.approx(1.3, abs=1e-6)
    updates = await stack.read_topic(
        stack.topics.control, count=2, where=lambda r: r["kind"] == "quota_factor"
    )
    by_team = {u["team"]: u for u in updates}
    assert by_team["steady"]["sigma"] == pytest.approx(0.1, abs=1e-6)
    assert by_team["steady"]["mean"] == pytest.approx(0.5, abs=1e-6)
    assert by_team["bursty"]["factor"] == pytest.approx(1.3, abs=1e-6)
    assert by_team["bursty"]["sigma"] == pytest.approx(1.25**0.5, abs=1e-6)


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
    try:

        async def factor() -> bytes | None:
            value: bytes | None = await stack.redis.get(keys.quota_factor(team))
            return value

        value = await eventually(factor, 40, "the team's quota factor in Redis")
    finally:
        assert await streams.stop() == 0, streams.log()
    if hour_of(time.time()) != current:
        pytest.skip("the hour turned during the test: the 24 h window moved")
    assert float(value) == pytest.approx(1.1, abs=1e-6)
