"""Stopping and restarting the streams app mid-stream yields the same hourly totals as one
uninterrupted run: nothing is lost and nothing is counted twice (SIGTERM and SIGKILL)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from laneway.schema import UsageEvent
from streams.rollups import add_event, new_rollup, to_record
from streams.settings import StreamsSettings
from streams.variance import HOUR_S, hour_of
from tests.stack import LiveStack
from tests.test_streams_process import StreamsProcess, produce_usage, usage_event

TEAMS = ("team-a", "team-b", "team-c")
HOURS = 3
PER_HOUR = 120


def _history() -> list[UsageEvent]:
    """Three past hours of mixed outcomes for three teams, in time order."""
    first = (hour_of(time.time()) - HOURS - 1) * HOUR_S
    statuses = ("ok", "ok", "ok", "error", "cancelled", "ok", "superseded", "ok")
    events = []
    for i in range(HOURS * PER_HOUR):
        ts = first + i * (HOUR_S / PER_HOUR)
        for t, team in enumerate(TEAMS):
            events.append(
                usage_event(
                    team=team,
                    cls="chat" if i % 5 == 0 else "completion",
                    route="laneway-code-fp8" if i % 7 == 0 else "laneway-code",
                    status=statuses[(i + t) % len(statuses)],
                    prompt_tokens=100 + i % 50,
                    cached_tokens=i % 30,
                    completion_tokens=10 + (i * 7 + t) % 90,
                    total_ms=5.0 + (i * 13 + t) % 400,
                    ts=ts + t,
                )
            )
    return events


def _expected(events: list[UsageEvent]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """What one uninterrupted pass folds: the same code, in process, once per event."""
    settings = StreamsSettings()
    rollups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        key = (e.team, e.cls, e.model, hour_of(e.ts))
        value = rollups.setdefault(key, new_rollup(*key, partition=0))
        add_event(value, e, settings.price_of(e.route))
    return {
        k: _comparable(to_record(v, now=0).model_dump(by_alias=True)) for k, v in rollups.items()
    }


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "ts"}


def _key(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record["team"], record["class"], record["model"], record["hour_start"] // HOUR_S)


def _latest(records: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    latest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in records:
        key = _key(r)
        if key not in latest or r["revision"] > latest[key]["revision"]:
            latest[key] = r
    return {k: _comparable(v) for k, v in latest.items()}


async def _complete(stack: LiveStack, expected: dict[tuple[Any, ...], Any]) -> list[dict[str, Any]]:
    """Hourly records until every key has its full revision (or the wait runs out: long,
    since a lost event never arrives however long one waits, while a slow machine catches
    up; the suite's neighbours once held a restarted app a revision short at 60 s)."""
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        records = await stack.read_all(stack.topics.usage_hourly)
        latest = _latest(records)
        if all(k in latest and latest[k]["revision"] >= v["revision"] for k, v in expected.items()):
            break
        await asyncio.sleep(0.5)
    return records


async def _left_at(stack: LiveStack) -> dict[str, Any]:
    """What the stopped first run left: its group's committed offsets and the rollups'
    changelog (each key's changes: requests folded, input offsets applied)."""
    app_id = StreamsSettings(**stack.common).app_id
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.services.bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(app_id)
    finally:
        await admin.close()
    changes = await stack.read_all(f"{app_id}-rollups-changelog")
    return {
        "committed": {tp.partition: meta.offset for tp, meta in offsets.items()},
        "changes": [
            (c["team"], c["class"], c["model"], c["hour"], c["requests"], c.get("o"))
            for c in changes
            if isinstance(c, dict) and "hour" in c
        ],
    }


def _where(
    left_at: dict[str, Any], after: dict[str, Any], keys: set[tuple[Any, ...]]
) -> dict[str, Any]:
    """The first run's committed offsets and last changes of ``keys``, then the second run's
    first changes of them (what it restored shows in the requests it went on from)."""
    first = [c for c in left_at["changes"] if c[:4] in keys]
    both = [c for c in after["changes"] if c[:4] in keys]
    return {
        "committed": left_at["committed"],
        "first run's last changes": first[-3:],
        "second run's first changes": both[len(first) : len(first) + 3],
    }


@pytest.mark.slow
@pytest.mark.timeout(300)  # past _complete's 180 s wait: that wait, not the suite's, decides
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_restart_mid_stream_gives_the_same_hourly_totals(
    stack: LiveStack, tmp_path: Path, sig: int
) -> None:
    events = _history()
    expected = _expected(events)
    half = len(events) // 2
    producer = await stack.producer()
    await produce_usage(producer, stack.topics.usage, events[:half])

    settings = {"rollup_idle_s": 1.0, "rollup_grace_s": 0}
    first = StreamsProcess(stack, tmp_path / "run1", **settings)
    await first.start()
    try:
        # Mid-stream: at least one hour is out, the second half is not even produced yet.
        await stack.read_topic(stack.topics.usage_hourly, count=1, within_s=30)
    finally:
        code = await first.stop(sig)
    assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), first.log()
    left_at = await _left_at(stack)  # to say where an event went missing, if one does

    await produce_usage(producer, stack.topics.usage, events[half:])
    # A fresh data dir: the tables come back from their changelog topics alone.
    second = StreamsProcess(stack, tmp_path / "run2", **settings)
    await second.start()
    try:
        records = await _complete(stack, expected)
    finally:
        assert await second.stop() == 0, second.log()

    latest = _latest(records)
    missing = sorted(set(expected) - set(latest))
    assert not missing, (
        f"hours never published: {missing}; where the first run left them: "
        f"{_where(left_at, await _left_at(stack), set(missing))}; the second run's last lines:\n"
        + "\n".join(second.log().splitlines()[-60:])
    )
    assert set(latest) == set(expected)
    after = await _left_at(stack) if any(latest[k] != w for k, w in expected.items()) else {}
    wrong = {
        k: {"got": (v.get("requests"), v.get("revision")), "want": (w["requests"], w["revision"])}
        for k, w in expected.items()
        if (v := latest[k]) != w
    }
    published = {k: [r["revision"] for r in records if _key(r) == k] for k in wrong}
    assert not wrong, (
        f"hours that differ: {wrong}; revisions published: {published}; "
        f"where the first run left them: {_where(left_at, after, set(wrong))}; partitions moved: "
        f"{[line for line in (first.log() + second.log()).splitlines() if 'partitions' in line]}"
    )
    # Re-publication after the restart repeats identical totals; never more events.
    for r in records:
        assert r["revision"] <= expected[_key(r)]["revision"]
