"""A typing storm's engine time, as the workers' usage events tell it: how much went to stale
work, to abandoned requests, and to each class (``bench.cancel_storm`` and ``laneway drill
storm`` both read it here)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from laneway.clients import kafka_auth, topic_partitions
from laneway.errors import LanewayError
from laneway.settings import CommonSettings

__all__ = ["Completion", "EngineTime", "engine_time"]

# The longest the usage topic may take to be read to its end offsets.
_READ_WITHIN_S = 60.0


@dataclass(frozen=True, slots=True)
class Completion:
    """One completion's usage event, as a timeline needs it."""

    ts: float  # when the worker ended it (epoch s)
    id: str
    status: str
    engine_ms: float
    stale_engine_ms: float


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
    completions: list[Completion] = field(default_factory=list)

    def add(self, event: dict[str, Any], abandoned: bool) -> None:
        self.total += event["engine_ms"]
        if event["class"] == "completion":
            self.by_id[event["id"]] = event["engine_ms"]
            self.times[event["id"]] = (event["queue_ms"], event["total_ms"], event["ts"])
            self.completions.append(
                Completion(
                    event["ts"],
                    event["id"],
                    event["status"],
                    event["engine_ms"],
                    event["stale_engine_ms"],
                )
            )
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
        self.completions += other.completions


async def engine_time(
    settings: CommonSettings,
    since_ms: int,
    until_ms: int,
    abandoned: set[str],
    *,
    team: str | None = None,
) -> EngineTime:
    """Engine time of the usage events stamped inside [since_ms, until_ms] (of ``team``'s
    requests only, when named): the topic is read from ``since_ms`` to its end offsets."""
    topic = settings.topics.usage
    partitions = [TopicPartition(topic, p) for p in await topic_partitions(settings, topic)]
    if not partitions:
        raise LanewayError(f"topic {topic} not found on {settings.kafka_bootstrap}")
    # read_committed: a batch transaction that aborted (and ran again) is counted once.
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        **kafka_auth(settings),
    )
    await consumer.start()
    seen = EngineTime()
    try:
        consumer.assign(partitions)
        starts = await consumer.offsets_for_times(dict.fromkeys(partitions, since_ms))
        ends = await consumer.end_offsets(partitions)
        for tp in partitions:
            found = starts.get(tp)
            consumer.seek(tp, found.offset if found is not None else ends[tp])
        give_up = time.monotonic() + _READ_WITHIN_S
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            if time.monotonic() > give_up:
                raise LanewayError(
                    f"the usage topic could not be read to its end within {_READ_WITHIN_S:g} s"
                )
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    if not since_ms <= record.timestamp <= until_ms:
                        continue
                    event = orjson.loads(record.value)
                    if team is None or event.get("team") == team:
                        seen.add(event, event["id"] in abandoned)
    finally:
        await consumer.stop()
    return seen
