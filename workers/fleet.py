"""One engine shared by several pools: its slots go by priority, completion before chat before
batch.

Pools that point at the same engine (one vLLM fleet for everything is the cheapest way to run
laneway) declare it with the same ``LANEWAY_ENGINE_ID``. Every worker of such an engine, on
any machine, publishes what it runs and what waits in its queue, on a Redis hash and a pub/sub
channel of the engine's (``RedisKeys.fleet``), and keeps a view of everyone's. From the view:

- **Allocation by class.** Completions take what they need, then chats, then batch; batch
  never takes the *reserve*, slots kept for interactive work: the most the interactive
  classes asked for at once over the last ``peak_window_s`` (at least ``reserve_min``).
- **Nothing waits in the engine.** A worker starts work only into slots that are free now
  (the engine's capacity less everyone's running work) and within its class's share; the
  rest waits in its own queue, where the shield can still drop it.
- **Preemption.** Batch running beyond its share (interactive work arrived) is aborted and
  queued again at the front of its worker's queue, within a Redis round trip of the news.

Redis unreachable, or hanging (the process's Redis circuit is open): interactive workers run
on their engine as if alone; batch starts nothing. No dispatch ever waits on Redis: the view
is fed in the background, and a publish gives up after the circuit's hot timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from laneway.constants import HEARTBEAT_TTL_S, RedisKeys
from laneway.redis_circuit import circuit_of
from laneway.retry import Backoff
from workers import metrics
from workers.settings import WorkerSettings

__all__ = ["CLASSES", "FleetShare", "Member", "allocate", "fleet_share"]

log = logging.getLogger(__name__)

CLASSES = ("completion", "chat", "batch")
_INTERACTIVE = ("completion", "chat")
# How often a member's state is written again even when it did not change (and the view
# read whole), so members that died without a word drop out.
_REFRESH_S = 2.0
# Reading the whole view is background work; a read slower than this says Redis hangs.
_READ_TIMEOUT_S = 1.0
# The subscription is read in waits this long, so a circuit that opened is noticed.
_LISTEN_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class Member:
    """One worker's part of a shared engine, as it last said."""

    worker: str
    cls: str
    running: int
    queued: int
    capacity: int  # what its engine says it can run at once
    ts: float

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))


def allocate(capacity: int, reserve: int, demand: Mapping[str, int]) -> dict[str, int]:
    """Slots per class: completions, then chats, take what they ask of what is left; batch
    takes what is left beyond the reserve (or beyond what interactive work asks, if more)."""
    left = capacity
    shares: dict[str, int] = {}
    for cls in _INTERACTIVE:
        shares[cls] = min(demand.get(cls, 0), left)
        left -= shares[cls]
    kept = max(reserve, shares["completion"] + shares["chat"])
    shares["batch"] = min(demand.get("batch", 0), max(0, capacity - kept))
    return shares


class _Peak:
    """The highest value seen over a sliding window, in one-second buckets."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._window_s = window_s
        self._clock = clock
        self._buckets: deque[tuple[int, int]] = deque()  # (second, highest in it)

    def add(self, value: int) -> None:
        second = int(self._clock())
        if self._buckets and self._buckets[-1][0] == second:
            if value > self._buckets[-1][1]:
                self._buckets[-1] = (second, value)
        else:
            self._buckets.append((second, value))

    def value(self) -> int:
        horizon = self._clock() - self._window_s
        while self._buckets and self._buckets[0][0] < horizon:
            self._buckets.popleft()
        return max((v for _, v in self._buckets), default=0)


class FleetShare:
    """This worker's view of a shared engine, and its share of it (module docstring)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        engine_id: str,
        worker_id: str,
        cls: str,
        *,
        reserve_min: int = 1,
        peak_window_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.redis = redis
        self.circuit = circuit_of(redis)
        self.circuit.listen(self._on_circuit)
        self.key = keys.fleet(engine_id)
        self.engine_id = engine_id
        self.worker = worker_id
        self.cls = cls
        self.reserve_min = reserve_min
        self.on_change = on_change  # the others' room changed: the dispatcher looks again
        self._clock = clock
        self._peak = _Peak(peak_window_s, clock)
        self.members: dict[str, Member] = {}
        self._mine = Member(worker_id, cls, 0, 0, 0, clock())
        self._published: tuple[int, int, int] | None = None
        self._publishing: asyncio.Task[None] | None = None
        self._dirty = False
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.connected = False  # the view was fed (read from Redis) since Redis last failed

    def _fed(self) -> bool:
        """Whether the view is current: fed, and Redis answering now."""
        return self.connected and not self.circuit.open

    def _on_circuit(self, opened: bool) -> None:
        if opened:
            self._lost(RuntimeError("Redis does not answer (circuit open)"))

    # --- the view ---------------------------------------------------------------------------

    def _live(self) -> list[Member]:
        horizon = self._clock() - HEARTBEAT_TTL_S
        others = [m for m in self.members.values() if m.worker != self.worker and m.ts >= horizon]
        return [self._mine, *others]

    def capacity(self) -> int:
        """The engine's slots: the most any member's engine says (mine included)."""
        return max(m.capacity for m in self._live())

    def demand(self) -> dict[str, int]:
        out = dict.fromkeys(CLASSES, 0)
        for member in self._live():
            out[member.cls] = out.get(member.cls, 0) + member.running + member.queued
        return out

    def running(self) -> dict[str, int]:
        out = dict.fromkeys(CLASSES, 0)
        for member in self._live():
            out[member.cls] = out.get(member.cls, 0) + member.running
        return out

    @property
    def reserve(self) -> int:
        """The interactive peak of the window, at least ``reserve_min``; never the whole
        engine (one burst larger than the engine must not keep batch out for the window)."""
        return max(self.reserve_min, min(self._peak.value(), self.capacity() - 1))

    def shares(self) -> dict[str, int]:
        return allocate(self.capacity(), self.reserve, self.demand())

    def room(self, running: int, queued: int) -> int:
        """How many more this worker, running ``running`` with ``queued`` waiting now, may
        start: free slots, within its class's share."""
        if (running, queued) != (self._mine.running, self._mine.queued):
            self._mine = replace(self._mine, running=running, queued=queued)
        fed = self._fed()
        if not fed and self.cls == "batch":
            return 0  # without the view, batch could take what interactive work needs
        if not fed:
            return max(0, self._mine.capacity - self._mine.running)
        busy = self.running()
        free = self.capacity() - sum(busy.values())
        share = self.shares()[self.cls] - busy[self.cls]
        return max(0, min(free, share))

    def excess(self) -> int:
        """Batch: how many of this worker's running lines are beyond batch's share now.

        Without a view (Redis away) none: batch starts nothing then, but what runs finishes.
        """
        if self.cls != "batch" or not self._fed() or not self._mine.running:
            return 0
        running = self.running()["batch"]
        over = running - self.shares()["batch"]
        if over <= 0:
            return 0
        # Each batch worker gives up its part, rounded down; the remainder goes to the first
        # of them by id, so the batch workers together give up exactly the excess.
        members = sorted(
            (m for m in self._live() if m.cls == "batch" and m.running), key=lambda m: m.worker
        )
        parts = {m.worker: over * m.running // running for m in members}
        parts[members[0].worker] += over - sum(parts.values())
        return min(self._mine.running, parts.get(self.worker, 0))

    # --- this worker's state --------------------------------------------------------------------

    def local(self, running: int, queued: int, capacity: int) -> None:
        """What this worker runs and holds waiting now; published when it changed."""
        self._mine = Member(self.worker, self.cls, running, queued, capacity, self._clock())
        self._note_peak()
        if (running, queued, capacity) != self._published:
            self._publish_soon()

    def _note_peak(self) -> None:
        demand = self.demand()
        self._peak.add(sum(demand[c] for c in _INTERACTIVE))
        self._export(demand)

    def _export(self, demand: Mapping[str, int]) -> None:
        running = self.running()
        for cls in CLASSES:
            metrics.FLEET_SLOTS.labels(self.engine_id, cls).set(running[cls])
        metrics.FLEET_RESERVE.labels(self.engine_id).set(self.reserve)
        total = sum(running.values())
        metrics.FLEET_BATCH_SHARE.labels(self.engine_id).set(
            running["batch"] / total if total else 0.0
        )

    def _publish_soon(self) -> None:
        if self._publishing is not None and not self._publishing.done():
            self._dirty = True
            return
        self._publishing = asyncio.create_task(self._publish(), name="fleet-publish")

    async def _publish(self) -> None:
        while True:
            self._dirty = False
            mine = self._mine
            try:
                await self.circuit.hot(partial(self._write, mine))
                self._published = (mine.running, mine.queued, mine.capacity)
            except (RedisError, OSError) as exc:
                self._lost(exc)
                return
            if not self._dirty:
                return

    async def _write(self, mine: Member) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, self.worker, mine.to_json())
            pipe.publish(self.key, mine.to_json())
            await pipe.execute()

    # --- feeding the view -----------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._listen(), name="fleet-listen"),
            asyncio.create_task(self._refresh(), name="fleet-refresh"),
        ]

    async def stop(self) -> None:
        self._stopping = True  # redis-py's timed read swallows a cancellation now and then
        for task in [*self._tasks, self._publishing]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                    await task
        gone = Member(self.worker, self.cls, 0, 0, 0, 0.0)
        with contextlib.suppress(RedisError, OSError):
            await self.circuit.background(partial(self._leave, gone), timeout_s=_READ_TIMEOUT_S)

    async def _leave(self, gone: Member) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hdel(self.key, self.worker)
            pipe.publish(self.key, gone.to_json())
            await pipe.execute()

    def _heard(self, raw: bytes) -> None:
        try:
            member = Member(**orjson.loads(raw))
        except (orjson.JSONDecodeError, TypeError) as exc:
            log.warning("skipped a fleet message on %s: %s", self.key, exc)
            return
        if member.worker != self.worker:
            self.members[member.worker] = member
            self._note_peak()
            self.on_change()

    async def _listen(self) -> None:
        backoff = Backoff(0.2, 5.0)
        while not self._stopping:
            # While Redis does not answer, wait; then subscribe anew (a subscription that
            # lived through a partition may be dead without a word).
            await self.circuit.wait_closed()
            closings = self.circuit.closings
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.key)
                    await self._read_all()
                    backoff.reset()
                    while self.circuit.closings == closings and not self.circuit.open:
                        if self._stopping:
                            return
                        message = await pubsub.get_message(timeout=_LISTEN_POLL_S)
                        if message is not None:
                            self._heard(message["data"])
            except (RedisError, OSError) as exc:
                self._lost(exc)
                await backoff.wait()

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(_REFRESH_S)
            if self.circuit.open:
                continue  # the view is not fed meanwhile; no read waits on Redis
            try:
                await self._read_all()
            except (RedisError, OSError) as exc:
                self._lost(exc)
                continue
            self._published = None  # written again: the hash entry stays fresh
            self.local(self._mine.running, self._mine.queued, self._mine.capacity)

    async def _read_all(self) -> None:
        entries = await self.circuit.background(
            partial(self.redis.hgetall, self.key), timeout_s=_READ_TIMEOUT_S
        )
        members: dict[str, Member] = {}
        for raw in entries.values():
            with contextlib.suppress(orjson.JSONDecodeError, TypeError):
                member = Member(**orjson.loads(raw))
                members[member.worker] = member
        self.members = members
        if not self.connected:
            log.info("shared engine %s: %d members in view", self.engine_id, len(members))
        self.connected = True
        self._note_peak()
        self.on_change()

    def _lost(self, exc: BaseException) -> None:
        if self.connected:
            log.warning(
                "shared engine %s: Redis unreachable (%s); %s",
                self.engine_id,
                exc,
                "batch starts nothing" if self.cls == "batch" else "running as if alone",
            )
        self.connected = False
        self.on_change()


def fleet_share(
    settings: WorkerSettings,
    redis: aioredis.Redis,
    keys: RedisKeys,
    clock: Callable[[], float],
    on_change: Callable[[], None],
) -> FleetShare | None:
    """A worker's share of the engine its pool shares with others (``LANEWAY_ENGINE_ID``);
    None when its engine is its own. ``clock``: Redis's, as members' beats are compared
    across machines."""
    if not settings.engine_id:
        return None
    return FleetShare(
        redis,
        keys,
        settings.engine_id,
        settings.worker_id,
        settings.pool,
        reserve_min=settings.fleet_reserve_min,
        peak_window_s=settings.fleet_peak_window_s,
        clock=clock,
        on_change=on_change,
    )
