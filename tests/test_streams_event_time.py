"""Usage events whose numbers or times cannot be taken as they are: non-finite or absurd
durations are refused at decode, times ahead of the app's clock neither close hours early
nor stay in the breaker, and times too old for the tables are counted when they were stored.
Unit tests on the processor with in-memory tables (no broker, no Redis)."""

from __future__ import annotations

import logging
import math
from typing import Any

import orjson
import pytest

from laneway.errors import MalformedMessage
from laneway.schema import UsageEvent, decode
from streams.event_time import RETENTION_HOURS
from streams.metrics import EVENTS
from streams.processor import UsageProcessor
from tests.test_streams_logic import _Table, offline_processor
from tests.test_streams_process import usage_event

HOUR = 500_000  # 2027-01-15T08:00Z


def _processor(
    rollups: _Table, now: list[float], sent: list[dict[str, Any]] | None = None
) -> UsageProcessor:
    async def send(topic: str, key: bytes, value: bytes) -> None:
        if sent is not None:
            sent.append(orjson.loads(value))

    return offline_processor(
        rollups=rollups,
        send=send,
        clock=lambda: now[0],
    )


def _raw(event: UsageEvent, **fields: str) -> bytes:
    """``event`` as JSON with ``fields`` written in as raw JSON text (NaN, Infinity, 1e308)."""
    raw = event.to_json()
    for name, text in fields.items():
        raw = raw.replace(b"}", f',"{name}":{text}}}'.encode(), 1)
    return raw


@pytest.mark.parametrize(
    "field", ["engine_ms", "total_ms", "queue_ms", "ttft_ms", "stale_engine_ms", "stale_news_ms"]
)
@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e308"])
def test_a_duration_no_request_can_have_is_a_bad_record(field: str, text: str) -> None:
    with pytest.raises(MalformedMessage, match=field):
        decode(UsageEvent, _raw(usage_event(), **{field: text}))


def test_durations_the_workers_write_are_still_read() -> None:
    """A worker's ``total_ms`` and ``ttft_ms`` span two clocks (acceptance, outcome): a little
    below zero is a clock's error, not a bad record. A day-long batch line is no absurd time."""
    for fields in (
        {"total_ms": -250.0, "ttft_ms": -40.0},
        {"total_ms": 86_400_000.0, "queue_ms": 86_000_000.0, "engine_ms": 400_000.0},
        {"ttft_ms": None, "engine_ms": 0.0},
    ):
        event = usage_event(**fields)
        assert decode(UsageEvent, event.to_json()) == event
    with pytest.raises(MalformedMessage, match="engine_ms"):
        decode(UsageEvent, _raw(usage_event(), engine_ms="-1.5"))  # one engine's own clock


async def test_a_non_finite_duration_neither_reaches_a_rollup_nor_stops_the_app() -> None:
    """Before, one NaN made the hour's engine time NaN: published as null (the cost report
    dropped the team's hour), recovered from the changelog as None (the fold and the publish
    raised after every restart); an infinite total_ms raised in the fold."""
    now = [HOUR * 3600.0 + 600]
    rollups = _Table()
    sent: list[dict[str, Any]] = []
    processor = _processor(rollups, now, sent)
    good = usage_event(ts=now[0], engine_ms=12.5)
    processor.handle(good.to_json(), 0, 0)
    for offset, fields in enumerate(
        [{"engine_ms": "NaN"}, {"engine_ms": "1e308"}, {"total_ms": "Infinity"}], start=1
    ):
        bad = usage_event(ts=now[0]).model_dump(by_alias=True, exclude=set(fields))
        processor.handle(_raw(UsageEvent.model_validate(bad), **fields), 0, offset)
    assert processor.counters.malformed == 3
    (rollup,) = rollups.values()
    assert (rollup["requests"], rollup["engine_ms"]) == (1, 12.5)
    # What a changelog gives back for an hour a NaN reached before: the app folds and
    # publishes on, the lost sum starting again from nothing.
    rollup["engine_ms"] = None
    processor.handle(usage_event(ts=now[0], engine_ms=7.0).to_json(), 0, 4)
    assert await processor.publish_rollups() == 1
    assert (sent[-1]["requests"], sent[-1]["engine_ms"]) == (2, 7.0)
    assert all(math.isfinite(r["engine_ms"]) for r in sent)


async def test_an_event_stamped_ahead_does_not_close_the_hour_for_everyone() -> None:
    """A worker whose clock runs 50 minutes fast: before, its one event moved the partition's
    clock into the next hour, and the hour every other team was still in went out final at
    once (and again as final with every event after)."""
    now = [HOUR * 3600.0 + 600]
    sent: list[dict[str, Any]] = []
    processor = _processor(_Table(), now, sent)
    for offset in range(5):
        processor.handle(usage_event(team="a", ts=now[0]).to_json(), 0, offset)
    processor.handle(usage_event(team="b", ts=now[0] + 3000).to_json(), 0, 5, stored_at=now[0])
    assert processor.times.stream_clock[0] <= now[0] + 5
    await processor.publish_rollups()
    assert sorted((r["team"], r["hour_start"], r["final"]) for r in sent) == [
        ("a", HOUR * 3600, False),
        ("b", HOUR * 3600, False),  # counted when it was stored
    ]
    # Seconds ahead (a clock's error): counted in its own time, the stream's clock held to
    # a few seconds ahead of the app's.
    processor.handle(usage_event(team="c", ts=now[0] + 20).to_json(), 0, 6, stored_at=now[0])
    assert processor.times.stream_clock[0] <= now[0] + 5


async def test_usage_too_old_for_the_tables_is_counted_when_it_was_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An event whose own time is days before it reached the topic (a writer's clock far
    behind) counts in the hour it was stored in; one stored that long ago too (a backlog
    older than the tables keep) is left out, said so in the log and in the metrics."""
    now = [HOUR * 3600.0 + 600]
    rollups = _Table()
    processor = _processor(rollups, now)
    days_ago = now[0] - 3 * 86400
    stale = usage_event(ts=days_ago).to_json()
    processor.handle(stale, 0, 0, stored_at=now[0] - 10)
    processor.handle(stale, 0, 0, stored_at=now[0] - 10)  # read again: counted once
    assert [(r["hour"], r["requests"]) for r in rollups.values()] == [(HOUR, 1)]
    before = EVENTS.labels("too_old")._value.get(), processor.counters.events
    with caplog.at_level(logging.WARNING, logger="streams.event_time"):
        processor.handle(usage_event(ts=days_ago).to_json(), 0, 1, stored_at=days_ago + 5)
    assert (EVENTS.labels("too_old")._value.get(), processor.counters.events) == (
        before[0] + 1,
        before[1],
    )
    assert processor.counters.too_old == 1
    assert "older than the" in caplog.text
    assert [(r["hour"], r["requests"]) for r in rollups.values()] == [(HOUR, 1)]
    # Within the hours kept, an event counts in its own hour, however late it comes.
    late = now[0] - (RETENTION_HOURS - 3) * 3600
    processor.handle(usage_event(ts=late).to_json(), 0, 2, stored_at=now[0])
    assert sorted(r["hour"] for r in rollups.values()) == [HOUR - RETENTION_HOURS + 3, HOUR]


async def test_a_record_stamped_ahead_counts_in_one_hour_however_late_it_is_read() -> None:
    """A writer 90 s ahead, its record stored 30 s before the hour turns: re-stamped when read
    at once, and re-stamped the same when read again after a restart 45 s later (then only
    45 s ahead of the app's clock): one request, in one hour."""
    stored = (HOUR + 1) * 3600.0 - 30
    rollups = _Table()
    event = usage_event(ts=stored + 90).to_json()
    _processor(rollups, [stored + 0.1]).handle(event, 0, 100, stored_at=stored)
    _processor(rollups, [stored + 45]).handle(event, 0, 100, stored_at=stored)
    assert [(r["hour"], r["requests"]) for r in rollups.values()] == [(HOUR, 1)]


async def test_an_event_a_day_behind_its_record_is_counted_though_read_in_the_next_hour() -> None:
    """Stored a second before the hour turns, 26 hours after its own time, and read two
    seconds later: counted (in the hour it was stored), not lost between the rule for events
    behind their record and the rule for a backlog too old."""
    stored = (HOUR + 1) * 3600.0 - 1
    rollups = _Table()
    processor = _processor(rollups, [stored + 2])
    processor.handle(usage_event(ts=stored - 26 * 3600).to_json(), 0, 0, stored_at=stored)
    assert processor.counters.too_old == 0
    assert [(r["hour"], r["requests"]) for r in rollups.values()] == [(HOUR, 1)]
