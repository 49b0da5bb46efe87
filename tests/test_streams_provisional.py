"""Provisional rollups on the real broker: traffic through the ingress and a worker shows up on
``laneway.usage.hourly`` while its hour is open (``final: false``), and the hour's closing
record follows (``final: true``, a higher revision)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.stack import LiveStack, clear_of_the_hour_turn, eventually
from tests.test_streams_process import StreamsProcess, produce_usage, usage_event


async def _hourly(stack: LiveStack, team: str) -> list[dict[str, Any]]:
    return [r for r in await stack.read_all(stack.topics.usage_hourly) if r["team"] == team]


# The hang guard plus the wait for the next hour, at most 40 + 1 s.
@pytest.mark.timeout(120 + 41)
async def test_traffic_is_on_the_hourly_topic_within_30s_then_its_hour_closes(
    stack: LiveStack, tmp_path: Path
) -> None:
    # The three requests are one open hour's record.
    await clear_of_the_hour_turn(40)
    # The app takes an event as at most a few seconds ahead of its clock (so a worker whose
    # clock runs fast cannot close the hour for everyone), and the event that closes the hour
    # is an hour and the grace after its start: the app's clock is set past that, as if the
    # hour had gone by. Its hours close by their events alone (no idle partition closes one).
    ahead = (int(time.time()) // 3600 + 1) * 3600 + 61 - time.time()
    # The production period of provisional records (10 s) and grace: only timers are fast.
    streams = StreamsProcess(
        stack,
        tmp_path,
        module="tests.streams_fault",
        rollup_provisional_s=10,
        rollup_grace_s=60,
        rollup_idle_s=7200,
    )
    streams.env["STREAMS_FAULT"] = f"clock-ahead:{ahead}"
    streams.env["STREAMS_FAULT_MARKER"] = str(tmp_path / "fault-met")
    await streams.start()
    try:
        ingress = await stack.start_ingress()
        await stack.start_worker("completion")
        key = await stack.api_key("team-live")
        http = stack.http(ingress, key)
        sent_at = time.monotonic()
        for i in range(3):
            response = await http.post(
                "/v1/completions",
                json={"model": "laneway-code", "prompt": f"def f{i}():", "max_tokens": 8},
            )
            assert response.status_code == 200, response.text

        async def open_hour() -> list[dict[str, Any]]:
            return [r for r in await _hourly(stack, "team-live") if r["requests"] == 3]

        (provisional, *_) = await eventually(open_hour, 30, "the open hour's record")
        assert time.monotonic() - sent_at < 30
        assert provisional["final"] is False
        assert provisional["class"] == "completion"
        assert provisional["ok"] == 3
        assert provisional["completion_tokens"] > 0
        assert provisional["cost"] > 0
        hour_start = provisional["hour_start"]
        assert hour_start <= time.time() < hour_start + 3600

        # An event of the same team (same partition) past the hour's end plus the grace: the
        # partition's event time has moved on, so the hour closes.
        producer = await stack.producer()
        later = usage_event(team="team-live", ts=hour_start + 3600 + 61)
        await produce_usage(producer, stack.topics.usage, [later])

        async def closed() -> list[dict[str, Any]]:
            return [
                r
                for r in await _hourly(stack, "team-live")
                if r["hour_start"] == hour_start and r["final"]
            ]

        (final,) = await eventually(closed, 30, "the hour's final record")
        assert final["requests"] == 3
        assert final["revision"] > provisional["revision"]
        assert final["completion_tokens"] == provisional["completion_tokens"]
        # Nothing provisional of that hour after its final record, up to a marker: a later
        # provisional record of the next hour (a flush at least one period after the final).
        again = usage_event(team="team-live", ts=hour_start + 3600 + 62)
        await produce_usage(producer, stack.topics.usage, [again])

        async def next_hour_of_two() -> bool:
            return any(
                r["hour_start"] == hour_start + 3600 and r["requests"] == 2
                for r in await _hourly(stack, "team-live")
            )

        await eventually(next_hour_of_two, 60, "the next hour's record of two events")
        records = [r for r in await _hourly(stack, "team-live") if r["hour_start"] == hour_start]
        assert records[-1]["final"] is True
        assert sum(r["final"] for r in records) == 1
    finally:
        code = await streams.stop()
    assert code == 0, streams.log()
