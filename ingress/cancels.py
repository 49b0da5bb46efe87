"""Tombstones out of the ingress: sent together, and left out where a newer keystroke
already does their work.

In a cancel storm nearly every tombstone is for a keystroke that the next keystroke of the
same session supersedes: the worker that runs the session (one session lives on one
partition of one lane) drops the older request as soon as it fetches the newer one, so the
tombstone would only cost a Kafka produce, a Redis publish and a wake-up of every worker.
A tombstone for a disconnect that a newer keystroke may still supersede (the request has a
session and a seq, and its team drops superseded work at once) is therefore held for
``LANEWAY_CANCEL_HOLD_MS``; if this ingress accepts a newer seq of the session on the same
lane in that time, the tombstone is left out. Any other tombstone goes out at once.
Tombstones that go out together share one Redis round trip and one Kafka produce request.

Leaving one out is safe only because the newer request is already stored in Kafka when it
counts: a newer seq is noted only once the broker has acknowledged it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from ingress import metrics
from laneway.constants import RedisKeys, Topics
from laneway.schema import CancelRecord, RequestEnvelope

__all__ = ["CancelOutbox"]

log = logging.getLogger(__name__)

# A newer keystroke is remembered this long (and at most this many sessions): forgetting one
# early only means a tombstone that could have been left out is sent.
_NEWEST_TTL_S = 60.0
_NEWEST_MAX = 50_000

Lane = tuple[str, str]  # (request topic, session)


@dataclass(slots=True)
class _Held:
    record: CancelRecord
    lane: Lane | None  # set when a newer seq on this lane makes the tombstone needless
    seq: int
    due: float  # monotonic time it goes out at the latest


class CancelOutbox:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        redis: aioredis.Redis,
        topics: Topics,
        keys: RedisKeys,
        *,
        hold_s: float,
    ) -> None:
        self._producer = producer
        self._redis = redis
        self._topics = topics
        self._keys = keys
        self._hold_s = hold_s
        self._held: list[_Held] = []
        self._newest: OrderedDict[Lane, tuple[int, float]] = OrderedDict()
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    @property
    def held(self) -> int:
        return len(self._held)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cancel-outbox")

    async def stop(self) -> None:
        """Sends everything still held (a stopping ingress accepts no newer keystroke); a
        flush under way finishes first, so no tombstone is dropped half sent."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        else:
            await self._flush(everything=True)

    def accepted(self, env: RequestEnvelope) -> None:
        """The broker stored ``env``: it supersedes older seqs of its session on its lane."""
        if env.session is None or env.seq is None:
            return
        lane = (self._topics.request(env.cls, env.band), env.session)
        known = self._newest.get(lane)
        if known is not None and known[0] >= env.seq:
            return
        self._newest[lane] = (env.seq, time.monotonic())
        self._newest.move_to_end(lane)
        while len(self._newest) > _NEWEST_MAX:
            self._newest.popitem(last=False)

    def add(self, env: RequestEnvelope) -> None:
        """The client of ``env`` went away: its tombstone goes out within the hold, or not at
        all when a newer keystroke of its session on its lane was accepted by then."""
        record = CancelRecord(id=env.id, team=env.team, reason="disconnect")
        now = time.monotonic()
        # Only a newer seq with no grace makes the worker drop it at once.
        if (
            self._hold_s > 0
            and env.session is not None
            and env.seq is not None
            and env.supersede_grace_tokens == 0
        ):
            lane = (self._topics.request(env.cls, env.band), env.session)
            self._held.append(_Held(record, lane, env.seq, now + self._hold_s))
        else:
            self._held.append(_Held(record, None, 0, now))
        self._wake.set()

    async def send_now(self, record: CancelRecord) -> None:
        """Send one tombstone and wait until the broker stored it (``DELETE``); raises the
        broker's error."""
        early = asyncio.ensure_future(self._publish_early([record]))
        try:
            await self._producer.send_and_wait(
                self._topics.cancel, record.to_json(), key=record.id.encode()
            )
        finally:
            await early

    def _superseded(self, held: _Held) -> bool:
        if held.lane is None:
            return False
        newest = self._newest.get(held.lane)
        return newest is not None and newest[0] > held.seq

    async def _run(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while self._held and not self._stopping:
                wait = min(h.due for h in self._held) - time.monotonic()
                if wait > 0:
                    # A tombstone that may not wait (due now) wakes this early.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait)
                    self._wake.clear()
                try:
                    await self._flush()
                except Exception:  # keep sending the next ones
                    log.exception("cancels not published")
        await self._flush(everything=True)

    async def _flush(self, *, everything: bool = False) -> None:
        now = time.monotonic()
        going: list[CancelRecord] = []
        kept: list[_Held] = []
        for held in self._held:
            if self._superseded(held):
                metrics.TOMBSTONES.labels("superseded").inc()
            elif everything or held.due <= now:
                going.append(held.record)
            else:
                kept.append(held)
        self._held = kept
        self._forget(now)
        if not going:
            return
        metrics.TOMBSTONES.labels("sent").inc(len(going))
        early = asyncio.ensure_future(self._publish_early(going))
        try:
            outcomes = await self._store(going)
        finally:
            await early
        for record, outcome in zip(going, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.warning(
                    "cancel of %s not published: %s",
                    record.id,
                    outcome,
                    extra={"request_id": record.id},
                )

    async def _store(self, records: list[CancelRecord]) -> list[object]:
        """Produce them all (one request, as the producer batches what is queued together);
        each record's outcome, an exception where the broker did not store it."""
        stored: list[asyncio.Future[object]] = []
        for record in records:
            try:
                stored.append(
                    await self._producer.send(
                        self._topics.cancel, record.to_json(), key=record.id.encode()
                    )
                )
            except KafkaError as exc:
                failed: asyncio.Future[object] = asyncio.get_running_loop().create_future()
                failed.set_exception(exc)
                stored.append(failed)
        return list(await asyncio.gather(*stored, return_exceptions=True))

    async def _publish_early(self, records: list[CancelRecord]) -> None:
        """On a Redis channel too, which reaches running workers a Kafka hop sooner; never
        waits on a Redis outage (the topic still carries the tombstones)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for record in records:
                    pipe.publish(self._keys.cancels(), record.to_json())
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.debug("cancels not published on Redis (the topic still carries them): %s", exc)

    def _forget(self, now: float) -> None:
        while self._newest:
            _, (_, at) = next(iter(self._newest.items()))
            if now - at < _NEWEST_TTL_S:
                break
            self._newest.popitem(last=False)
