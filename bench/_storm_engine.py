"""The cancel storm's engine time, as the workers' usage events tell it: how much went to
stale work, to abandoned requests, and to each class."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench._stack import BenchStack


@dataclass
class EngineTime:
    """What the usage events of a run say about engine time (ms)."""

    total: float = 0.0
    stale: float = 0.0  # used after the news reached the worker
    on_abandoned: float = 0.0  # all of it, on requests the typists abandoned
    in_flight: float = 0.0  # used while the news travelled from the ingress to the worker
    news_ms: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    by_class: dict[str, float] = field(default_factory=dict)
    by_id: dict[str, float] = field(default_factory=dict)  # completions only
    # completions only: (queue_ms, total_ms) as the worker measured them from acceptance, and
    # the wall clock time the worker ended it
    times: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def add(self, event: dict[str, Any], abandoned: bool) -> None:
        self.total += event["engine_ms"]
        if event["class"] == "completion":
            self.by_id[event["id"]] = event["engine_ms"]
            self.times[event["id"]] = (event["queue_ms"], event["total_ms"], event["ts"])
        self.by_class[event["class"]] = self.by_class.get(event["class"], 0.0) + event["engine_ms"]
        self.stale += event["stale_engine_ms"]
        if event["stale_engine_ms"]:
            self._count("turned stale while running")
            self.news_ms.append(event["stale_news_ms"])
            # The engine ran all along before the news arrived, so while it travelled too.
            before_news = event["engine_ms"] - event["stale_engine_ms"]
            self.in_flight += min(event["stale_news_ms"], before_news)
        if abandoned or event["status"] in ("cancelled", "superseded"):
            self.on_abandoned += event["engine_ms"]
        if event["class"] == "completion":
            self._count(event["status"])

    def _count(self, status: str, n: int = 1) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + n

    def merge(self, other: EngineTime) -> None:
        self.total += other.total
        self.stale += other.stale
        self.on_abandoned += other.on_abandoned
        self.in_flight += other.in_flight
        self.news_ms += other.news_ms
        for status, n in other.statuses.items():
            self._count(status, n)
        for cls, ms in other.by_class.items():
            self.by_class[cls] = self.by_class.get(cls, 0.0) + ms
        self.by_id.update(other.by_id)
        self.times.update(other.times)


async def engine_time(
    stack: BenchStack, since_ms: int, until_ms: int, abandoned: set[str]
) -> EngineTime:
    """Engine time of the usage events stamped inside [since_ms, until_ms]: everything on
    the topic up to now is read, to its end offsets."""
    # read_committed: a batch transaction that aborted (and ran again) is counted once.
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap, isolation_level="read_committed")
    await consumer.start()
    seen = EngineTime()
    try:
        partitions = [TopicPartition(stack.topics.usage, p) for p in range(stack.partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        give_up = time.monotonic() + 60
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            if time.monotonic() > give_up:
                raise TimeoutError("the usage topic could not be read to its end within 60 s")
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    if since_ms <= record.timestamp <= until_ms:
                        event = orjson.loads(record.value)
                        seen.add(event, event["id"] in abandoned)
    finally:
        await consumer.stop()
    return seen
