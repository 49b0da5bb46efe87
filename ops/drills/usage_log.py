"""What a drill learns after the fact from ``laneway.usage``: the usage events of its own
requests (which route served each, how often it was shed), which a client cannot see."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from laneway.clients import kafka_auth, topic_partitions
from laneway.errors import LanewayError
from laneway.settings import CommonSettings

__all__ = ["usage_events"]

# Events are read from this long before the drill began: a worker's clock may be behind.
_SLACK_S = 60.0


async def usage_events(
    settings: CommonSettings,
    since_wall: float,
    keep: Callable[[dict[str, Any]], bool],
    *,
    complete: Callable[[list[dict[str, Any]]], bool] = lambda _found: True,
    within_s: float = 60.0,
) -> list[dict[str, Any]]:
    """The events ``keep`` wants, written since ``since_wall`` (epoch seconds): read up to the
    end offsets at the start, and on until ``complete`` says all are there (events written
    a moment after their answers), for ``within_s`` at most. Committed records only: batch
    events are written in transactions, and an aborted one's events never counted."""
    topic = settings.topics.usage
    partitions = [TopicPartition(topic, p) for p in await topic_partitions(settings, topic)]
    if not partitions:
        raise LanewayError(f"topic {topic} not found on {settings.kafka_bootstrap}")
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        **kafka_auth(settings),
    )
    found: list[dict[str, Any]] = []
    await consumer.start()
    try:
        consumer.assign(partitions)
        starts = await consumer.offsets_for_times(
            {tp: int((since_wall - _SLACK_S) * 1000) for tp in partitions}
        )
        ends = await consumer.end_offsets(partitions)
        for tp in partitions:
            hit = starts.get(tp)
            consumer.seek(tp, hit.offset if hit is not None else ends[tp])
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            caught_up = all([await consumer.position(tp) >= ends[tp] for tp in partitions])
            if caught_up and complete(found):
                break
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    event = orjson.loads(record.value)
                    if isinstance(event, dict) and keep(event):
                        found.append(event)
    finally:
        await consumer.stop()
    return found
