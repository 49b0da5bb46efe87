"""The streams app's rules without a broker: σ → factor, breaker hysteresis, rollup maths,
and replays after a crash that must not count twice."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from laneway.constants import RedisKeys
from laneway.metrics import OTHER_TEAM, team_label
from laneway.schema import UsageEvent
from quota.model import QuotaPolicy
from quota.teams import Team, set_team
from streams.announce import Announcer
from streams.breaker import (
    BreakerPolicy,
    BreakerState,
    add_outcome,
    next_state,
    route_counts,
    window_counts,
)
from streams.dedupe import UsageIds
from streams.oncall import OnCallWebhook
from streams.processor import UsageProcessor
from streams.rollups import add_event, new_rollup, percentile, to_record
from streams.settings import Price, StreamsSettings
from streams.variance import utilisation_stats
from tests.stack import Services
from tests.test_streams_process import usage_event

POLICY = BreakerPolicy(
    enter=(0.05, 0.10, 0.20),
    exit=(0.03, 0.07, 0.15),
    cooldown_s=10.0,
    min_requests=100,
    window_s=60.0,
    bucket_s=1.0,
)


def test_sigma_of_24_complete_hours_with_idle_hours_as_zero() -> None:
    budget = QuotaPolicy(unit_tokens=1000).base_tokens(
        Team("t", size=2, complexity=1.5), "interactive"
    )
    assert budget == 150_000
    now = 1000
    alternating = {now - 24 + i: (0.2 if i % 2 else 0.6) * budget for i in range(24)}
    alternating[now] = 10 * budget  # the current, incomplete hour is not part of it
    stats = utilisation_stats(alternating, budget, now)
    assert (stats.mean, stats.sigma, stats.hours) == (pytest.approx(0.4), pytest.approx(0.2), 24)
    assert stats.factor == pytest.approx(1.1)
    one_burst = utilisation_stats({now - 1: 24 * budget}, budget, now)
    assert one_burst.mean == pytest.approx(1.0)
    assert one_burst.factor == pytest.approx(1.3)


def test_breaker_enters_at_once_and_leaves_one_level_per_cooldown() -> None:
    state = BreakerState()
    state = next_state(state, 99, 50, 0.0, POLICY)
    assert state.level == 0, "below the minimum request count there is no rate"
    state = next_state(state, 200, 50, 1.0, POLICY)
    assert (state.level, state.since) == (3, 1.0)
    # Below level 3's exit threshold but not for a whole cool-down: no change.
    state = next_state(state, 200, 20, 2.0, POLICY)
    state = next_state(state, 200, 20, 11.0, POLICY)
    assert state.level == 3
    state = next_state(state, 200, 20, 12.0, POLICY)
    assert (state.level, state.since) == (2, 12.0)
    # 10 % is above level 2's exit (7 %): the cool-down restarts, no flapping.
    state = next_state(state, 200, 20, 30.0, POLICY)
    assert state.level == 2
    assert state.calm_since is None
    # Calm from 31 s on: one level per whole cool-down, each step starting the next one.
    levels = []
    for t in (31.0, 40.0, 41.0, 42.0, 50.0, 51.0):
        state = next_state(state, 200, 2, t, POLICY)
        levels.append(state.level)
    assert levels == [2, 2, 1, 1, 1, 0]
    state = next_state(state, 0, 0, 70.0, POLICY)  # no traffic: calm
    state = next_state(state, 0, 0, 80.0, POLICY)
    assert state.level == 0


def test_breaker_window_slides() -> None:
    buckets: MutableMapping[str, list[int]] = {}
    for second in range(100):
        add_outcome(buckets, float(second), error=second % 2 == 0, now=float(second), policy=POLICY)
    # The bucket the window's start falls in still counts: 60 s plus up to one bucket.
    assert window_counts(buckets, 99.5, POLICY) == (61, 30, 0)
    assert not add_outcome(buckets, 10.0, error=True, now=99.5, policy=POLICY)
    assert window_counts(buckets, 200.0, POLICY) == (0, 0, 0)


def test_rollup_counts_costs_and_percentiles() -> None:
    price = Price(prompt=1.0, cached=0.5, completion=2.0)
    rollup = new_rollup("t", "completion", "laneway-code", 500_000, 0)
    for ms in range(1, 1001):
        add_event(
            rollup,
            usage_event(
                total_ms=float(ms), prompt_tokens=1000, cached_tokens=400, completion_tokens=100
            ),
            price,
        )
    add_event(rollup, usage_event(status="error", total_ms=5000.0), price)
    add_event(rollup, usage_event(status="cancelled", prompt_tokens=0, completion_tokens=0), price)
    record = to_record(rollup, now=0)
    assert (record.requests, record.ok, record.errors, record.dropped) == (1002, 1000, 1, 1)
    assert record.hour == "2027-01-15T08:00:00Z"
    # 1000 × (600·1 + 400·0.5 + 100·2)/1000 + (100·1 + 20·2)/1000
    assert record.cost == pytest.approx(1000 * 1.0 + 0.14)
    assert record.latency_ms.p50 == pytest.approx(500, rel=0.02)
    assert record.latency_ms.p99 == pytest.approx(990, rel=0.02)
    assert record.latency_ms.p999 == pytest.approx(999, rel=0.02)
    assert percentile({}, 0.5) is None


class _Table(dict[str, Any]):
    @property
    def data(self) -> MutableMapping[str, Any]:
        return self

    def send_changelog(
        self, partition: int | None, key: Any, value: Any, *args: Any, **kwargs: Any
    ) -> None:
        pass


def offline_processor(settings: StreamsSettings | None = None, **parts: Any) -> UsageProcessor:
    """A processor with no Redis, announcer or producer unless ``parts`` give them: its fold
    and its timers alone, on tables of its own unless given."""
    given: dict[str, Any] = {
        "rollups": _Table(),
        "outcomes": _Table(),
        "announcer": None,
        "redis": None,
        "keys": None,
        "send": None,
        **parts,
    }
    return UsageProcessor(StreamsSettings() if settings is None else settings, **given)


async def test_replayed_offsets_are_not_counted_twice() -> None:
    rollups, outcomes = _Table(), _Table()
    processor = offline_processor(
        rollups=rollups,
        outcomes=outcomes,
    )
    events = [usage_event(status="error" if i % 3 == 0 else "ok") for i in range(10)]
    for offset, event in enumerate(events):
        processor.handle(event.to_json(), 0, offset)
    # A crash after the changelog was flushed but before offsets were committed: 4..9 again.
    for offset, event in enumerate(events[4:], start=4):
        processor.handle(event.to_json(), 0, offset)
    processor.handle(b'{"id": 1}', 0, 10)
    (rollup,) = rollups.values()
    assert rollup["requests"] == 10
    (outcome,) = outcomes.values()
    assert sum(n for n, *_ in outcome["b"].values()) == 10
    assert processor.counters.replayed == 6
    assert processor.counters.malformed == 1


def _publishing(
    rollups: _Table,
    send: Callable[[str, bytes, bytes], Awaitable[None]],
    clock: Callable[[], float],
) -> UsageProcessor:
    """A processor whose hours close once their partition is idle a second (no grace)."""
    return offline_processor(
        StreamsSettings(rollup_idle_s=1.0, rollup_grace_s=0),
        rollups=rollups,
        send=send,
        clock=clock,
    )


async def test_events_folded_while_an_hour_is_on_its_way_out_are_published_next() -> None:
    """The agent runs while a timer awaits the hourly record's delivery: what it folds then
    is in no record yet, so the hour stays pending and goes out again with it."""
    hour_start = (int(time.time()) // 3600 - 3) * 3600
    now = [float(hour_start + 7200)]
    rollups = _Table()
    sent: list[dict[str, Any]] = []
    late = [usage_event(ts=hour_start + 60.0 + i) for i in range(3)]

    async def send(topic: str, key: bytes, value: bytes) -> None:
        sent.append(orjson.loads(value))
        for offset, event in enumerate(late, start=5):
            processor.handle(event.to_json(), 0, offset)  # the agent, mid-delivery
        late.clear()
        await asyncio.sleep(0)

    processor = _publishing(rollups, send, lambda: now[0])
    for offset in range(5):
        processor.handle(usage_event(ts=hour_start + offset).to_json(), 0, offset)
    now[0] += 2  # the partition went quiet: the idle rule closes the hour
    assert await processor.publish_rollups() == 1
    now[0] += 2
    assert await processor.publish_rollups() == 1
    assert await processor.publish_rollups() == 0
    # Both final (the hour had closed): a revision is twice the events, plus one for the close.
    assert [(r["requests"], r["revision"], r["final"]) for r in sent] == [
        (5, 11, True),
        (8, 17, True),
    ]
    (rollup,) = rollups.values()
    assert rollup["emitted"] == rollup["rev"] == 8


async def test_hours_a_rebalance_hands_over_are_published_though_no_event_comes() -> None:
    """A process indexes the hours still to publish at its first publish; after that only
    the hours it folds itself were. Hours that partitions assigned later bring with their
    changelogs (folded by the previous owner, not yet final) were never published if no
    event of theirs came: the cost report, which counts final hours, lost them."""
    hour_start = (int(time.time()) // 3600 - 3) * 3600
    now = [float(hour_start + 7200)]
    sent: list[dict[str, Any]] = []

    async def send(topic: str, key: bytes, value: bytes) -> None:
        sent.append(orjson.loads(value))

    previous_owner = _Table()  # what partition 1's changelog holds
    previous = _publishing(previous_owner, send, lambda: now[0])
    previous.handle(usage_event(ts=hour_start + 5.0).to_json(), 1, 0)
    rollups = _Table()
    processor = _publishing(rollups, send, lambda: now[0])
    assert await processor.publish_rollups() == 0  # its first publish: nothing yet
    rollups.update(previous_owner)  # partition 1 assigned here, its changelog recovered
    processor.reindex()  # as the app does on every assignment
    now[0] += 2  # its partition idle past LANEWAY_ROLLUP_IDLE_S: the hour closes
    assert await processor.publish_rollups() == 1
    assert [(r["requests"], r["final"]) for r in sent] == [(1, True)]


async def test_the_open_hour_goes_out_provisional_while_it_changes_then_final() -> None:
    hour_start = (int(time.time()) // 3600 + 5) * 3600  # the processor's clock is set here
    now = [float(hour_start + 100)]
    sent: list[dict[str, Any]] = []

    async def send(topic: str, key: bytes, value: bytes) -> None:
        sent.append(orjson.loads(value))

    processor = offline_processor(
        StreamsSettings(rollup_provisional_s=10, rollup_grace_s=30, rollup_idle_s=5),
        send=send,
        clock=lambda: now[0],
    )
    offsets = iter(range(100))

    def fold(count: int, ts: float) -> None:
        for _ in range(count):
            processor.handle(usage_event(ts=ts).to_json(), 0, next(offsets))

    fold(3, now[0])
    assert await processor.publish_rollups() == 1, "the first events go out at once"
    assert await processor.publish_rollups() == 0, "nothing changed"
    fold(2, now[0])
    now[0] += 9
    assert await processor.publish_rollups() == 0, "not before LANEWAY_ROLLUP_PROVISIONAL_S"
    now[0] += 1
    assert await processor.publish_rollups() == 1
    now[0] += 60
    assert await processor.publish_rollups() == 0, "an unchanged open hour is not repeated"
    # An event past the hour's end plus the grace closes it on its partition (at once: the
    # partition is not idle, and the wall clock alone would wait LANEWAY_ROLLUP_IDLE_S).
    now[0] = hour_start + 3600 + 30
    fold(1, now[0])
    assert await processor.publish_rollups() == 2  # the closed hour, final; the next, open
    fold(1, hour_start + 1000)  # late
    assert await processor.publish_rollups() == 1
    this_hour = [r for r in sent if r["hour_start"] == hour_start]
    assert [(r["requests"], r["revision"], r["final"]) for r in this_hour] == [
        (3, 6, False),
        (5, 10, False),
        (5, 11, True),
        (6, 13, True),
    ]
    (following,) = [r for r in sent if r["hour_start"] != hour_start]
    assert (following["requests"], following["final"]) == (1, False)


def test_a_routes_rate_is_one_that_several_teams_see() -> None:
    # One team failing everything, another served: the route's rate is the other's (0 %).
    assert route_counts([(100, 100), (300, 0)], 50) == (300, 0)
    # The engine fails everyone: without any one team, the rest still fail.
    assert route_counts([(100, 30), (100, 25), (100, 35)], 50) == (200, 55)
    # A big team with some errors and a small one failing everything: the small one is left
    # out, and the route is judged on the big one's own 10 %.
    assert route_counts([(1000, 100), (60, 60)], 50) == (1000, 100)
    # One team alone on a route: its level judges it; the route has no rate of its own.
    assert route_counts([(500, 500)], 50) == (0, 0)
    assert route_counts([], 50) == (0, 0)


async def test_a_teams_failures_raise_its_own_level_and_the_route_needs_several_teams(
    services: Services, prefix: str
) -> None:
    """Rejected requests (the engine refused what they asked) count for their team only;
    engine errors count for the route too, once they are not one team's alone."""
    redis = aioredis.Redis.from_url(services.redis_url)
    settings = StreamsSettings(breaker_min_requests=20, breaker_window_s=60.0)
    now = time.time()
    processor, sent = _announcing(redis, RedisKeys(prefix), lambda: now, settings)
    try:
        offsets = iter(range(10_000))

        def fold(team: str, status: str, count: int) -> None:
            for _ in range(count):
                event = usage_event(team=team, status=status, ts=now - 1)
                processor.handle(event.to_json(), 0, next(offsets))

        fold("bad", "rejected", 40)  # over-long prompts, all refused by the engine
        fold("good", "ok", 40)
        fold("noisy", "error", 30)  # one team's engine errors, whatever their cause
        fold("noisy", "ok", 10)
        await processor.evaluate_breakers()
        levels = {(t["route"], t["team"]): t["level"] for t in sent}
        assert levels == {("laneway-code", "bad"): 3, ("laneway-code", "noisy"): 3}
        # Seen on /metrics, where an alert pages for a team shut out on a route that is fine
        # (under the team's label: "other" once the process has seen 500 teams, as a whole
        # suite's process may have).
        for team, level in (("bad", 3), ("noisy", 3), ("good", None)):
            labels = {"route": "laneway-code", "team": team_label(team)}
            if level is None and labels["team"] == OTHER_TEAM:
                continue  # shared with the raised teams past the bound
            assert REGISTRY.get_sample_value("laneway_breaker_team_level", labels) == level

        fold("good", "error", 20)  # now a second team sees engine errors: the route's
        fold("bad", "error", 20)
        await processor.evaluate_breakers()
        levels = {(t["route"], t["team"]): t["level"] for t in sent}
        assert levels[("laneway-code", None)] == 3
    finally:
        await redis.aclose()


def _announcing(
    redis: aioredis.Redis,
    keys: RedisKeys,
    clock: Callable[[], float],
    settings: StreamsSettings | None = None,
) -> tuple[UsageProcessor, list[dict[str, Any]]]:
    """A processor that writes quota factors and breaker levels to ``redis`` on ``clock``,
    and the control records it sent."""
    sent: list[dict[str, Any]] = []

    async def send(topic: str, key: bytes, value: bytes) -> None:
        sent.append(orjson.loads(value))

    processor = UsageProcessor(
        settings or StreamsSettings(),
        rollups=_Table(),
        outcomes=_Table(),
        announcer=Announcer(redis, keys, "control", send, OnCallWebhook(""), cooldown_s=30.0),
        redis=redis,
        keys=keys,
        send=send,
        clock=clock,
    )
    return processor, sent


def _fold_busy_hours(processor: UsageProcessor, current: int, *hours: int) -> None:
    """Three budgets of team "bursty" in each of ``hours`` of the 24 before ``current``."""
    for i in hours:
        ts = (current - 24 + i) * 3600 + 60
        event = usage_event(team="bursty", prompt_tokens=300_000, completion_tokens=0)
        processor.handle(event.model_copy(update={"ts": ts}).to_json(), 0, i)


async def test_a_capped_factor_is_announced_again_when_its_sigma_moves(
    services: Services, prefix: str
) -> None:
    """The first tick after a start can see only part of a backlog; the factor may already be
    at its cap (1.3), but the announcement must not keep the partial history's σ."""
    redis = aioredis.Redis.from_url(services.redis_url)
    keys = RedisKeys(prefix)
    now = time.time()
    current = int(now) // 3600
    processor, sent = _announcing(redis, keys, lambda: now)
    try:
        # Budget 1 × 50 × 2.0 × 1000 = 100k tokens an hour; a busy hour is 3.0 of it.
        await set_team(redis, keys, Team("bursty", size=1, complexity=2.0))
        # The part of the backlog folded by the first tick: two busy hours in 24, σ 0.83,
        # already past the cap's 0.6.
        _fold_busy_hours(processor, current, 0, 6)
        assert await processor.update_quota_factors() == 1
        _fold_busy_hours(processor, current, 12, 18)  # the rest: four busy hours, σ = √1.25
        assert await processor.update_quota_factors() == 1
        assert await processor.update_quota_factors() == 0  # nothing moved: not repeated
        assert [(u["factor"], u["sigma"]) for u in sent] == [
            (1.3, round(statistics.pstdev([3.0] * 2 + [0.0] * 22), 6)),
            (1.3, round(statistics.pstdev([3.0] * 4 + [0.0] * 20), 6)),
        ]
        assert await redis.get(keys.quota_factor("bursty")) == b"1.300000"
    finally:
        await redis.aclose()


async def test_a_factor_redis_lost_is_written_again_on_the_next_tick(
    services: Services, prefix: str
) -> None:
    """A factor is announced once and kept in Redis with no expiry; one lost there (a
    failover to a replica the write had not reached) read as 1 until the factor moved."""
    redis = aioredis.Redis.from_url(services.redis_url)
    keys = RedisKeys(prefix)
    now = time.time()
    current = int(now) // 3600
    processor, sent = _announcing(redis, keys, lambda: now)
    try:
        await set_team(redis, keys, Team("bursty", size=1, complexity=2.0))
        _fold_busy_hours(processor, current, 0, 6, 12, 18)
        assert await processor.update_quota_factors() == 1
        await redis.delete(keys.quota_factor("bursty"))
        assert await processor.update_quota_factors() == 0  # nothing moved: no announcement
        assert await redis.get(keys.quota_factor("bursty")) == b"1.300000"
        await redis.set(keys.quota_factor("bursty"), b"1.000000")  # or a stale value
        await processor.update_quota_factors()
        assert await redis.get(keys.quota_factor("bursty")) == b"1.300000"
        assert len(sent) == 1
    finally:
        await redis.aclose()


async def test_raised_levels_are_rewritten_when_the_clock_steps_back_to_redis(
    services: Services, prefix: str
) -> None:
    """The app's clock is this machine's until its first sync with Redis. A machine an hour
    ahead stepped back an hour at the sync, and the refresh of raised levels (every 150 s,
    their TTL 600 s) then waited that hour: the ingress read level 0 from 600 s on."""
    redis = aioredis.Redis.from_url(services.redis_url)
    keys = RedisKeys(prefix)
    redis_now = time.time()
    now = [redis_now + 3600.0]  # this machine's clock, before the first sync
    settings = StreamsSettings(breaker_min_requests=20, breaker_window_s=60.0)
    processor, _ = _announcing(redis, keys, lambda: now[0], settings)
    try:
        await processor.evaluate_breakers()  # a first tick, before the sync
        now[0] = redis_now  # synced: an hour back
        offsets = iter(range(10_000))
        for _ in range(40):
            event = usage_event(team="noisy", status="error", ts=redis_now - 1)
            processor.handle(event.to_json(), 0, next(offsets))
        await processor.evaluate_breakers()
        level_key = keys.breaker("laneway-code", "noisy")
        assert orjson.loads(await redis.get(level_key))["level"] == 3
        for _ in range(4):  # errors go on; the level holds, and nothing new is announced
            await redis.delete(level_key)  # as if its TTL had run out
            now[0] += 160.0
            for _ in range(40):
                event = usage_event(team="noisy", status="error", ts=now[0] - 1)
                processor.handle(event.to_json(), 0, next(offsets))
            await processor.evaluate_breakers()
            stored = await redis.get(level_key)
            assert stored is not None, f"level not rewritten {now[0] - redis_now:.0f} s on"
            assert orjson.loads(stored)["level"] == 3
    finally:
        await redis.aclose()


async def test_batch_usage_leaves_the_interactive_quota_factor_alone(
    services: Services, prefix: str
) -> None:
    """The factor is measured against the interactive budget: a nightly batch (its own pool)
    must not make a team's steady typing look bursty."""
    redis = aioredis.Redis.from_url(services.redis_url)
    keys = RedisKeys(prefix)
    now = time.time()
    current = int(now) // 3600
    processor, sent = _announcing(redis, keys, lambda: now)
    try:
        await set_team(redis, keys, Team("steady", size=1))  # 50k tokens an hour
        offsets = iter(range(100))
        for i in range(24):  # half the budget every hour, chats and completions
            for cls in ("completion", "chat"):
                event = usage_event(team="steady", cls=cls, prompt_tokens=12_500)
                event = event.model_copy(update={"ts": (current - 24 + i) * 3600 + 60})
                processor.handle(event.to_json(), 0, next(offsets))
        for i in (2, 3):  # the nightly job: six budgets in two hours, on the batch pool
            event = usage_event(team="steady", cls="batch", prompt_tokens=300_000)
            event = event.model_copy(update={"ts": (current - 24 + i) * 3600 + 120})
            processor.handle(event.to_json(), 0, next(offsets))
        assert await processor.update_quota_factors() == 1
        assert [(u["factor"], u["sigma"]) for u in sent] == [(1.0, 0.0)]
        assert await redis.get(keys.quota_factor("steady")) == b"1.000000"
    finally:
        await redis.aclose()


async def test_usage_ids_tell_a_repeat_from_a_replay_and_forget_old_ones() -> None:
    ids = UsageIds(_Table(), window_s=60)

    def event(request_id: str, ts: float, **fields: Any) -> UsageEvent:
        values: dict[str, Any] = {"team": "team-a", "accepted_ts": 990.0, **fields}
        return UsageEvent(
            id=request_id, cls="batch", model="m", route="m", status="ok", ts=ts, **values
        )

    def repeat(request: UsageEvent, partition: int, offset: int) -> bool:
        return ids.repeat(request, partition, offset, now=request.ts)  # folded as it came

    assert not repeat(event("r-1", 1000.0), partition=0, offset=5)  # first: remembered
    assert not repeat(event("r-1", 1000.0), partition=0, offset=5)  # the record read again
    assert repeat(event("r-1", 1001.0), partition=0, offset=9)  # a re-run's second event
    assert not repeat(event("r-2", 1050.0), partition=1, offset=1)
    assert await ids.expire(now=1070.0) == 1  # r-1 is past the window, r-2 is not
    assert not repeat(event("r-1", 1080.0), partition=0, offset=12)
    # The same id is another request when it was accepted at another time (a batch line sent
    # again: run and charged again) or is another team's (ids a tenant chose on its topic).
    assert not repeat(event("r-2", 1051.0, accepted_ts=1049.0), partition=1, offset=2)
    assert not repeat(event("r-2", 1052.0, team="team-b"), partition=1, offset=3)
    assert repeat(event("r-2", 1053.0, team="team-b"), partition=1, offset=4)
    # An event of a worker from before ``accepted_ts`` is known by its id alone.
    assert not repeat(event("r-3", 1060.0, accepted_ts=None), partition=0, offset=20)
    assert repeat(event("r-3", 1061.0, accepted_ts=None), partition=0, offset=21)
    # Caught up on an hour-old backlog: the window runs from the fold, not from the run, so
    # the timer between a request's first event and its re-run's does not forget it.
    assert not ids.repeat(event("r-4", 500.0), partition=0, offset=30, now=2000.0)
    assert await ids.expire(now=2001.0) == 5  # all the others; r-4 was folded just now
    assert ids.repeat(event("r-4", 560.0), partition=0, offset=31, now=2002.0)


async def test_a_usage_record_no_clock_or_request_could_make_is_not_folded_as_it_is() -> None:
    """A time far ahead is counted when it came (it would move the stream's clock on and
    close open hours early); a time no clock shows, or a token count no request reaches, is
    a bad record (before: a crashed agent, a bill of 10^18 tokens)."""
    now = float(int(time.time()) // 3600 * 3600 + 600)
    rollups = _Table()
    processor = offline_processor(
        rollups=rollups,
        clock=lambda: now,
    )
    processor.handle(usage_event(ts=now + 5 * 365 * 86400).to_json(), 0, 0)
    (rollup,) = rollups.values()
    assert (rollup["hour"], rollup["requests"]) == (int(now // 3600), 1)
    assert processor.times.stream_clock[0] == now
    # With the broker's time of the record, that is its time: the same however late it is
    # read (read again after a restart in the next hour, it was counted in that hour too).
    ahead = usage_event(ts=now + 5 * 365 * 86400).to_json()
    processor.handle(ahead, 1, 0, stored_at=now - 3600)
    processor.handle(ahead, 1, 0, stored_at=now - 3600)  # read again: one hour, once
    stored_hour = [r["requests"] for r in rollups.values() if r["hour"] == int(now // 3600) - 1]
    assert stored_hour == [1]
    fields = orjson.loads(usage_event().to_json())
    for offset, bad in enumerate(
        [{"ts": 1e308}, {"ts": -5.0}, {"prompt_tokens": -(10**9)}, {"completion_tokens": 10**18}],
        start=1,
    ):
        processor.handle(orjson.dumps({**fields, "id": f"bad-{offset}", **bad}), 0, offset)
    assert processor.counters.malformed == 4
    assert rollup["requests"] == 1


async def test_a_count_without_its_time_or_of_the_wrong_type_is_not_billed() -> None:
    """A record without ``ts`` would count in the hour it is read, and in another when read
    again after a restart; ``"100"`` or ``true`` for a count, or more cached tokens than the
    prompt has, is not what any worker writes. Each is a bad record, counted and skipped."""
    now = float(int(time.time()) // 3600 * 3600 + 600)
    rollups = _Table()
    processor = offline_processor(rollups=rollups, clock=lambda: now)
    fields = orjson.loads(usage_event(ts=now).to_json())
    processor.handle(orjson.dumps(fields), 0, 0)
    without_ts = {k: v for k, v in fields.items() if k != "ts"}
    for offset, bad in enumerate(
        [
            without_ts,
            {**fields, "prompt_tokens": "100"},
            {**fields, "prompt_tokens": True},
            {**fields, "ts": str(now)},
            {**fields, "prompt_tokens": 10, "cached_tokens": 11},
        ],
        start=1,
    ):
        processor.handle(orjson.dumps({**bad, "id": f"bad-{offset}"}), 0, offset)
    assert processor.counters.malformed == 5
    (rollup,) = rollups.values()
    assert rollup["requests"] == 1


def test_a_final_record_never_ties_with_a_provisional_one_that_says_otherwise() -> None:
    """Killed before its changelog kept that it had closed an hour, the app publishes that
    hour again as open when a late event comes: that record (one event more) must outrank
    the final one, not share its revision."""
    rollup = new_rollup("t", "completion", "m", 500_000, 0)
    add_event(rollup, usage_event(ts=500_000 * 3600.0 + 1), Price())
    final_one = to_record(rollup, now=0.0, final=True)
    add_event(rollup, usage_event(ts=500_000 * 3600.0 + 2), Price())
    open_two = to_record(rollup, now=0.0, final=False)
    final_two = to_record(rollup, now=0.0, final=True)
    assert final_one.revision < open_two.revision < final_two.revision


async def test_teams_past_the_label_bound_share_a_series_at_the_highest_of_their_levels(
    services: Services, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the bound on team labels (500 a process), teams share the series ``other``: it
    shows the highest of their levels, not whichever team's changed last, and goes once
    none is raised."""
    monkeypatch.setattr(
        "streams.announce.team_label", lambda team: "other" if team.startswith("many-") else team
    )
    redis = aioredis.Redis.from_url(services.redis_url)

    async def send(topic: str, key: bytes, value: bytes) -> None:
        pass

    announcer = Announcer(
        redis, RedisKeys(prefix), "control", send, OnCallWebhook(""), cooldown_s=30
    )
    route = f"route-{prefix}"

    def shown() -> float | None:
        labels = {"route": route, "team": "other"}
        return REGISTRY.get_sample_value("laneway_breaker_team_level", labels)

    try:
        seen = []
        for team, level in (("many-a", 3), ("many-b", 1), ("many-a", 0), ("many-b", 0)):
            await announcer.store_level((route, team), BreakerState(level=level))
            seen.append(shown())
        assert seen == [3, 3, 1, None]
    finally:
        await redis.aclose()
