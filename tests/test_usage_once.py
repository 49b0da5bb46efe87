"""Each request's usage is counted once: a worker's re-run repeats an event, an aborted batch
transaction leaves one behind; the streams app's hourly rollup counts neither twice."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaProducer

from tests.stack import LiveStack
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
