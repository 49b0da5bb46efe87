"""Each request's usage is counted once: a worker's re-run repeats an event, an aborted batch
transaction leaves one behind; the streams app's hourly rollup counts neither twice."""

from __future__ import annotations

import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from laneway.batch import BatchClient
from laneway.constants import RedisKeys
from laneway.settings import CommonSettings
from tests.stack import LiveStack, clear_of_the_hour_turn, eventually
from tests.test_streams_process import StreamsProcess, produce_usage, usage_event

CLOSED_HOUR = {"rollup_idle_s": 0.5, "rollup_grace_s": 0}


async def test_a_repeated_usage_event_is_counted_once(stack: LiveStack, tmp_path: Path) -> None:
    streams = StreamsProcess(stack, tmp_path, **CLOSED_HOUR)
    await streams.start()
    try:
        producer = await stack.producer()
        ts = time.time() - 7200  # an hour that is over: its rollup is published at once
        first = usage_event(ts=ts, completion_tokens=20)
        rerun = usage_event(id=first.id, ts=ts + 1, completion_tokens=20)  # the same request
        other = usage_event(ts=ts, completion_tokens=5)
        await produce_usage(producer, stack.topics.usage, [first, rerun, other])
        # The closed hour goes out as soon as it changes, so a record may come after the first
        # event alone; the one that counts two requests says what the rerun did.
        records = await stack.read_topic(
            stack.topics.usage_hourly, count=1, within_s=30, where=lambda r: r["requests"] >= 2
        )
    finally:
        assert await streams.stop() == 0, streams.log()
    assert records[0]["requests"] == 2
    assert records[0]["completion_tokens"] == 25  # first and other: the rerun's 20 not added


async def test_usage_of_an_aborted_batch_transaction_is_not_counted(
    stack: LiveStack, tmp_path: Path
) -> None:
    streams = StreamsProcess(stack, tmp_path, **CLOSED_HOUR)
    await streams.start()
    txn = AIOKafkaProducer(
        bootstrap_servers=stack.services.bootstrap,
        transactional_id=f"{stack.prefix}-test-{uuid.uuid4().hex[:6]}",
    )
    await txn.start()
    try:
        ts = time.time() - 7200
        aborted = usage_event(ts=ts, cls="batch", completion_tokens=64)
        await txn.begin_transaction()
        await txn.send_and_wait(stack.topics.usage, aborted.to_json(), key=aborted.team.encode())
        await txn.abort_transaction()  # as a batch worker's transaction, fenced or failed
        kept = usage_event(ts=ts, cls="batch", completion_tokens=3)
        async with txn.transaction():
            await txn.send(stack.topics.usage, kept.to_json(), key=kept.team.encode())
        records = await stack.read_topic(stack.topics.usage_hourly, count=1, within_s=30)
    finally:
        await txn.stop()
        assert await streams.stop() == 0, streams.log()
    assert (records[0]["requests"], records[0]["completion_tokens"]) == (1, 3)


@pytest.mark.timeout(120 + 41)  # the hang guard plus the wait for the next hour, at most 41 s
async def test_a_batch_job_sent_twice_is_counted_twice_as_the_quota_charged_it(
    stack: LiveStack, tmp_path: Path
) -> None:
    """Batch ids are chosen by whoever writes the lines: the same job sent again (its ids
    again) runs again and its team's budget pays again. The hourly rollup counts it again
    too, to the token of what Redis charged: it is not a worker's re-run (the same record),
    whose repeat it skips."""
    streams = StreamsProcess(stack, tmp_path, rollup_provisional_s=2, rollup_grace_s=60)
    await streams.start()
    try:
        await stack.api_key("docs", size=1000)
        await stack.start_worker("batch", quota_offpeak="")
        await clear_of_the_hour_turn(40)  # one open hour holds all of it
        hour = int(time.time()) // 3600
        lines = [
            orjson.dumps(
                {
                    "custom_id": f"doc-{i}",
                    "url": "/v1/completions",
                    "body": {"model": "laneway-code", "prompt": f"summarise {i}", "max_tokens": 8},
                }
            ).decode()
            for i in range(3)
        ]

        async def nightly_events(count: int) -> list[dict[str, Any]]:
            usage = await stack.read_all(stack.topics.usage)
            nightly = [e for e in usage if e.get("job_id") == "nightly"]
            return nightly if len(nightly) == count else []

        async with BatchClient(CommonSettings(**stack.common)) as client:
            await client.submit(lines, team="docs", job_id="nightly")
            await eventually(partial(nightly_events, 3), 60, "the first run's usage events")
            # Sent again once answered (sent while its first copy runs, a copy is refused:
            # tests/test_batch.py).
            await client.submit(lines, team="docs", job_id="nightly")
            events = await eventually(partial(nightly_events, 6), 60, "both runs' usage events")
        assert len({e["id"] for e in events}) == 3  # three ids, each run twice
        assert len({(e["id"], e["accepted_ts"]) for e in events}) == 6
        spent = sum(e["prompt_tokens"] + e["completion_tokens"] for e in events)
        keys = RedisKeys(stack.prefix)

        async def charged() -> bool:
            used = await stack.redis.get(keys.quota_used("docs", "batch", hour))
            return int(used or 0) == spent

        await eventually(charged, 30, f"Redis charging docs {spent} tokens")

        async def rolled_up() -> list[dict[str, Any]]:
            records = await stack.read_all(stack.topics.usage_hourly)
            return [r for r in records if r["team"] == "docs" and r["requests"] == 6]

        (record, *_) = await eventually(rolled_up, 30, "the hour's rollup of six requests")
        assert record["prompt_tokens"] + record["completion_tokens"] == spent
    finally:
        assert await streams.stop() == 0, streams.log()
