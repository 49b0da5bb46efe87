"""What the console reads off Kafka: the hourly rollups (provisional and final) of the last
day, and the recent decisions on ``laneway.control`` (breaker changes, probes).

One consumer outside any group, started with the console's first page: it seeks a day (and
an hour) back by time and follows both topics from there. Per (team, class, model, hour) the
record with the highest revision is kept, as docs/streams.md tells every reader to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from laneway.clients import make_consumer, start_client, topic_partitions
from laneway.loops import keep_running
from laneway.settings import CommonSettings
from laneway.tasks import stop_task

__all__ = ["ConsoleFeed", "ControlRecord", "Rollup"]

log = logging.getLogger(__name__)

HOUR_S = 3600
# The plots cover the last 24 hours, plus the open one.
_KEPT_HOURS = 25
_RECENT_CHANGES = 200
# How long the first page waits for the feed to reach the topics' ends before it renders.
_CATCH_UP_S = 3.0
# A replica's probe is shown this long after it was made: 12 of the default intervals, and
# a replica gone (scaled in) leaves the table within the hour.
_PROBE_KEPT_S = 3600.0

RollupKey = tuple[str, str, str, int]  # team, class, model, hour start
# A record of laneway.usage.hourly as docs/streams.md describes it (the JSON object).
Rollup = dict[str, Any]
_KEY_FIELDS = (("team", str), ("class", str), ("model", str), ("hour_start", int))


@dataclass(frozen=True, slots=True)
class ControlRecord:
    kind: str
    subject: str
    ts: float
    data: dict[str, Any]


class ConsoleFeed:
    def __init__(self, settings: CommonSettings) -> None:
        self.settings = settings
        self.topics = (settings.topics.usage_hourly, settings.topics.control)
        self.rollups: dict[RollupKey, Rollup] = {}
        self.changes: deque[ControlRecord] = deque(maxlen=_RECENT_CHANGES)
        # (pool, replica) → that replica's latest probe of the pool
        self.probes: dict[tuple[str, str], ControlRecord] = {}
        self.caught_up = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start following the topics (once; later calls do nothing)."""
        if self._task is None:
            self._task = asyncio.create_task(
                keep_running("the console's feed", self._follow), name="console-feed"
            )

    async def ready(self) -> None:
        """Start if need be, and wait (briefly) until what the topics held is read."""
        self.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.caught_up.wait(), _CATCH_UP_S)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def _follow(self) -> None:
        # Read again from the start of what is kept (a restart after a failure): the lists
        # fill again, the keyed records are replaced.
        self.changes.clear()
        consumer: AIOKafkaConsumer = make_consumer(self.settings, isolation_level="read_committed")
        await start_client(consumer)  # the feed's stop may come while it starts
        try:
            tps = await self._assign(consumer)
            ends = await consumer.end_offsets(tps)
            while True:
                batches = await consumer.getmany(timeout_ms=500)
                for tp, records in batches.items():
                    for record in records:
                        self._fold(tp.topic, record.value)
                if not self.caught_up.is_set() and all(
                    [await consumer.position(tp) >= end for tp, end in ends.items()]
                ):
                    self.caught_up.set()
                self._forget_old()
        finally:
            await consumer.stop()

    async def _assign(self, consumer: AIOKafkaConsumer) -> list[TopicPartition]:
        tps: list[TopicPartition] = []
        for topic in self.topics:
            partitions = await topic_partitions(self.settings, topic)
            if not partitions:
                raise LookupError(f"topic {topic} does not exist yet (is the stack set up?)")
            tps += [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        since_ms = int((time.time() - _KEPT_HOURS * HOUR_S) * 1000)
        found = await consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            hit = found.get(tp)
            consumer.seek(tp, ends[tp] if hit is None else hit.offset)
        return tps

    def _fold(self, topic: str, raw: bytes | None) -> None:
        try:
            data = orjson.loads(raw or b"")
        except orjson.JSONDecodeError:
            return
        if not isinstance(data, dict):
            return
        if topic == self.topics[0]:
            if not all(isinstance(data.get(f), t) for f, t in _KEY_FIELDS) or not isinstance(
                data.get("revision"), int
            ):
                return
            key = (data["team"], data["class"], data["model"], data["hour_start"])
            kept = self.rollups.get(key)
            if kept is None or data["revision"] >= kept["revision"]:
                self.rollups[key] = data
            return
        kind, subject = data.get("kind"), data.get("subject")
        if not isinstance(kind, str) or not isinstance(subject, str):
            return
        ts = data.get("ts")
        record = ControlRecord(
            kind, subject, float(ts) if isinstance(ts, int | float) else 0.0, data
        )
        if kind == "probe" and isinstance(data.get("pool"), str):
            # Per replica: one replica's failing probe stays shown beside another's success.
            self.probes[(data["pool"], str(data.get("ingress", "")))] = record
        elif kind == "breaker":
            self.changes.append(record)

    def _forget_old(self) -> None:
        now = time.time()
        if any(r.ts < now - _PROBE_KEPT_S for r in self.probes.values()):
            # A replica that stopped probing (gone, scaled in) leaves the table.
            self.probes = {k: r for k, r in self.probes.items() if r.ts >= now - _PROBE_KEPT_S}
        oldest = (int(now) // HOUR_S - _KEPT_HOURS) * HOUR_S
        if any(key[3] < oldest for key in self.rollups):
            self.rollups = {k: v for k, v in self.rollups.items() if k[3] >= oldest}

    def hour(self, hour_start: int) -> list[Rollup]:
        """The records of one hour, by team, class and model."""
        return [r for k, r in sorted(self.rollups.items()) if k[3] == hour_start]

    def team_hours(self, team: str) -> list[Rollup]:
        """A team's records of the last day, oldest hour first."""
        return [r for k, r in sorted(self.rollups.items(), key=lambda kv: kv[0][3]) if k[0] == team]
