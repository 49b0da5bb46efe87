"""Tombstones out of the ingress: on Redis at once, and on Kafka unless a newer keystroke
already stands in for them.

A tombstone travels two ways. The Redis channel reaches the running workers at once, so it
aborts a request wherever it runs, whatever the worker's backlog. The record on the
compacted ``laneway.cancel`` topic is for the workers that were not listening: one that
starts, or takes a partition over, replays it. Every tombstone is published on Redis at once.

In a cancel storm nearly every tombstone is for a keystroke that the next keystroke of the
same session supersedes. The newer request is stored after the older one on the same
partition of the same request topic (the same *lane*), so any worker that later reads the
older one from Kafka reads the newer one right behind it and drops the older. For such a
keystroke the Kafka record is needless: a gone client's tombstone whose request has a
session and a seq (and a team that drops superseded work at once) waits up to
``LANEWAY_CANCEL_HOLD_MS`` for this ingress to store a newer seq of the session on the same
lane, and its Kafka record is left out if one is (``laneway_ingress_tombstones_total``). It
goes out after all when the Redis publish failed: then the record is the only way.

Tombstones due together share one Redis pipeline and are queued on the producer together,
which batches them. Sends run in tasks of their own, so a slow broker or Redis delays no
later tombstone. The Redis publish goes through the process's Redis circuit: a Redis that
hangs holds a Kafka record back by the hot timeout at most, and not at all once the circuit
is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from ingress import metrics
from laneway.constants import SESSION_RESTART_S, RedisKeys, Topics
from laneway.redis_circuit import circuit_of
from laneway.schema import CancelRecord, RequestEnvelope, cancel_key

__all__ = ["CancelOutbox"]

log = logging.getLogger(__name__)

# A newer keystroke is remembered this long (and at most this many sessions): forgetting one
# early only means a Kafka record that could have been left out is sent.
_NEWEST_TTL_S = 60.0
_NEWEST_MAX = 50_000
# How long a stopping ingress waits for tombstones still being sent.
_STOP_WAIT_S = 5.0

# (request topic, team, session): a session is its team's name, so only a newer keystroke of
# the same team's session stands in for a tombstone.
Lane = tuple[str, str, str]


@dataclass(slots=True)
class _Held:
    record: CancelRecord
    lane: Lane | None  # set when a newer seq on this lane makes the Kafka record needless
    seq: int
    due: float  # monotonic time its Kafka record goes out at the latest
    on_redis: asyncio.Future[bool]  # whether the Redis publish went out


class CancelOutbox:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        redis: aioredis.Redis,
        topics: Topics,
        keys: RedisKeys,
        *,
        hold_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._producer = producer
        self._clock = clock  # Redis's, which tombstones are stamped on (``laneway.clock``)
        self._redis = redis
        self._circuit = circuit_of(redis)
        self._topics = topics
        self._keys = keys
        self._hold_s = hold_s
        self._early: list[tuple[CancelRecord, asyncio.Future[bool]]] = []
        self._held: list[_Held] = []
        self._newest: OrderedDict[Lane, tuple[int, float]] = OrderedDict()
        self._sending: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    @property
    def held(self) -> int:
        """Tombstones whose Kafka record waits (for a newer keystroke, or to go out)."""
        return len(self._held)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cancel-outbox")

    async def stop(self) -> None:
        """Sends everything still held (a stopping ingress accepts no newer keystroke) and
        waits up to 5 s for the sends under way."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._flush(everything=True)
        if self._sending:
            _, late = await asyncio.wait(self._sending, timeout=_STOP_WAIT_S)
            if late:
                log.warning("%d tombstone sends still under way at stop", len(late))

    def accepted(self, env: RequestEnvelope) -> None:
        """The broker stored ``env``: it supersedes older seqs of its session on its lane."""
        lane = self._lane(env)
        if lane is None or env.seq is None:
            return
        known = self._newest.get(lane)
        now = time.monotonic()
        # A lower seq long after the newest: the session's count started again (as the
        # workers' shield reads it), so it is the newest now.
        if (
            known is not None
            and known[0] >= env.seq
            and (known[0] == env.seq or now - known[1] < SESSION_RESTART_S)
        ):
            return
        self._newest[lane] = (env.seq, now)
        self._newest.move_to_end(lane)
        while len(self._newest) > _NEWEST_MAX:
            self._newest.popitem(last=False)

    def add(self, env: RequestEnvelope) -> None:
        """The client of ``env`` went away: its tombstone goes on Redis at once, and on Kafka
        within the hold unless a newer keystroke of its session on its lane was stored."""
        record = CancelRecord(id=env.id, team=env.team, reason="disconnect", ts=self._clock())
        on_redis: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._early.append((record, on_redis))
        now = time.monotonic()
        lane = self._lane(env)
        # Only a newer seq with no grace makes a worker drop the request at once.
        if (
            self._hold_s > 0
            and lane is not None
            and env.seq is not None
            and env.supersede_grace_tokens == 0
        ):
            self._held.append(_Held(record, lane, env.seq, now + self._hold_s, on_redis))
        else:
            self._held.append(_Held(record, None, 0, now, on_redis))
        if self._stopping:  # the loop is gone: only a stop() still under way sends it
            log.warning("tombstone of %s added while stopping", env.id)
        self._wake.set()

    async def send_now(self, record: CancelRecord) -> None:
        """Send one tombstone and wait until the broker stored it (``DELETE``); raises the
        broker's error. The Redis publish does not hold it up."""
        self._in_background(self._publish_early([record], []))
        await self._producer.send_and_wait(
            self._topics.cancel, record.to_json(), key=cancel_key(record)
        )

    def _lane(self, env: RequestEnvelope) -> Lane | None:
        """The (request topic, team, session) whose later keystrokes supersede ``env``."""
        if env.session is None:
            return None
        return (self._topics.request(env.cls, env.band), env.team, env.session)

    def _needless(self, held: _Held) -> bool:
        """A newer keystroke stands in for its Kafka record, and Redis carried it."""
        if held.lane is None:
            return False
        if not held.on_redis.done() or not held.on_redis.result():
            return False
        newest = self._newest.get(held.lane)
        return newest is not None and newest[0] > held.seq

    async def _run(self) -> None:
        """Flush whenever something may have come due: a new tombstone, a Redis publish that
        ended, or the end of a hold."""
        while not self._stopping:
            try:
                self._flush()
            except Exception:  # never let the loop die: later tombstones still need it
                log.exception("cancel outbox flush failed")
            now = time.monotonic()
            holds = [h.due - now for h in self._held if h.due > now]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(holds) if holds else None)
            self._wake.clear()

    def _flush(self, *, everything: bool = False) -> None:
        """Start the sends that are due, each batch in a task of its own."""
        if self._early:
            early, self._early = self._early, []
            self._in_background(self._publish_early([r for r, _ in early], [f for _, f in early]))
        now = time.monotonic()
        going: list[CancelRecord] = []
        kept: list[_Held] = []
        for held in self._held:
            if everything:
                going.append(held.record)
            elif held.due > now:
                kept.append(held)
            elif held.lane is not None and not held.on_redis.done():
                kept.append(held)  # whether Redis carried it decides, in a moment
            elif self._needless(held):
                metrics.TOMBSTONES.labels("superseded").inc()
            else:
                going.append(held.record)
        self._held = kept
        self._forget(now)
        if going:
            self._in_background(self._store(going))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _store(self, records: list[CancelRecord]) -> None:
        """Queue them all on the producer (which batches what is queued together), then wait
        for the broker; a record it did not store is logged."""
        stored: list[asyncio.Future[Any]] = []
        for record in records:
            try:
                stored.append(
                    await self._producer.send(
                        self._topics.cancel, record.to_json(), key=cancel_key(record)
                    )
                )
            except KafkaError as exc:
                failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                failed.set_exception(exc)
                stored.append(failed)
        outcomes = await asyncio.gather(*stored, return_exceptions=True)
        for record, outcome in zip(records, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                metrics.TOMBSTONES.labels("failed").inc()
                log.warning(
                    "cancel of %s not published: %s",
                    record.id,
                    outcome,
                    extra={"request_id": record.id},
                )
            else:
                metrics.TOMBSTONES.labels("sent").inc()

    async def _publish_early(
        self, records: list[CancelRecord], done: list[asyncio.Future[bool]]
    ) -> None:
        """Publish on the Redis channel; never raises (the topic still carries them)."""
        ok = True

        async def publish() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                for record in records:
                    pipe.publish(self._keys.cancels(), record.to_json())
                await pipe.execute()

        try:
            await self._circuit.hot(publish)
        except (RedisError, OSError) as exc:
            ok = False
            log.debug("cancels not published on Redis (the topic still carries them): %s", exc)
        finally:
            for future in done:
                if not future.done():
                    future.set_result(ok)
            if done:
                self._wake.set()

    def _forget(self, now: float) -> None:
        while self._newest:
            _, (_, at) = next(iter(self._newest.items()))
            if now - at < _NEWEST_TTL_S:
                break
            self._newest.popitem(last=False)
