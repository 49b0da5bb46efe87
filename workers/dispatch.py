"""Dispatch at the last responsible moment: fetched work waits here, not in the engine.

A worker fetches more than its engine can start, so that news (a tombstone, a newer
keystroke, a passing deadline) reaches work while it still waits, where dropping it costs
nothing. The engine is handed only what it can start now; the shield is asked at that
moment, whichever engine sits behind the worker. An engine that queues on its own (an
upstream server, vLLM's waiting queue) would hide waiting work from the shield.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from laneway.errors import Dropped, Expired
from laneway.schema import RequestEnvelope

__all__ = ["DispatchQueue", "Dispatcher", "Work"]

log = logging.getLogger(__name__)

# Bands in the order they are served.
_BAND_RANK = {"hi": 0, "lo": 1}
# While work waits and the engine is full, the dispatcher looks again this often. Engines
# and the shared fleet wake it when room appears; this only bounds a missed wake-up.
_RECHECK_S = 0.1


@dataclass(slots=True)
class Work:
    """A fetched request and the record it came in."""

    tp: TopicPartition
    offset: int
    env: RequestEnvelope
    epoch: int = 0  # its partition's tenure on this worker when fetched (OffsetTracker)
    fetched: float = field(default_factory=time.monotonic)


class DispatchQueue:
    """Waiting work: ``hi`` band before ``lo``, earliest deadline first within a band.

    Entries leave by ``pop`` (to the engine), by id (a tombstone), by session (a newer
    keystroke) or by deadline; removals are lazy in the heaps, so each costs O(log n).
    """

    def __init__(self) -> None:
        self._order: list[tuple[int, float, int, str]] = []  # band, deadline, arrival, id
        self._deadlines: list[tuple[float, int, str]] = []
        self._work: dict[str, Work] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._work)

    def __iter__(self) -> Iterator[Work]:
        return iter(list(self._work.values()))

    def push(self, work: Work, *, front: bool = False) -> None:
        """Queue ``work``; ``front``: ahead of all its band's waiting work (a preempted
        request, queued again: it had started in time, and it keeps no start deadline, which
        placed it after every request of its band that has one, for as long as they came)."""
        env = work.env
        deadline = env.deadline_ts if env.deadline_ts is not None else math.inf
        arrival = -next(self._arrivals) if front else next(self._arrivals)
        self._work[env.id] = work
        rank = (_BAND_RANK.get(env.band, 1), -math.inf if front else deadline, arrival, env.id)
        heapq.heappush(self._order, rank)
        if env.deadline_ts is not None:
            heapq.heappush(self._deadlines, (deadline, arrival, env.id))

    def pop(self) -> Work | None:
        """The next work to start, or None."""
        while self._order:
            *_, rid = heapq.heappop(self._order)
            work = self._work.pop(rid, None)
            if work is not None:
                return work
        return None

    def first(self) -> Work | None:
        """The next work to start, left in the queue; None when empty."""
        while self._order:
            rid = self._order[0][-1]
            work = self._work.get(rid)
            if work is not None:
                return work
            heapq.heappop(self._order)
        return None

    def get(self, request_id: str) -> Work | None:
        return self._work.get(request_id)

    def remove(self, request_id: str) -> Work | None:
        return self._work.pop(request_id, None)

    def superseded(self, env: RequestEnvelope) -> list[Work]:
        """Remove and return the waiting keystrokes of ``env``'s session older than it."""
        if env.session is None or env.seq is None:
            return []
        stale = [
            w
            for w in self._work.values()
            if w.env.session == env.session
            and w.env.team == env.team
            and w.env.seq is not None
            and w.env.seq < env.seq
        ]
        for work in stale:
            del self._work[work.env.id]
        return stale

    def expired(self, now: float) -> list[Work]:
        """Remove and return the work whose deadline passed by ``now`` (epoch seconds)."""
        out: list[Work] = []
        while self._deadlines and self._deadlines[0][0] < now:
            entry = heapq.heappop(self._deadlines)
            if self._holds(entry):
                out.append(self._work.pop(entry[2]))
        return out

    def next_deadline(self) -> float | None:
        while self._deadlines and not self._holds(self._deadlines[0]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _holds(self, entry: tuple[float, int, str]) -> bool:
        """Whether a deadline entry is still that of the work queued under its id: a request
        queued again (preempted) is the same id without its start deadline, and the entry of
        its first wait must not expire it."""
        deadline, _, rid = entry
        work = self._work.get(rid)
        return work is not None and work.env.deadline_ts == deadline

    def forget(self, partitions: set[TopicPartition]) -> list[Work]:
        """Remove and return the work of partitions taken away (their next owner runs it)."""
        gone = [w for w in self._work.values() if w.tp in partitions]
        for work in gone:
            del self._work[work.env.id]
        return gone


class Dispatcher:
    """Hands waiting work to the engine as it has room, asking ``verdict`` at that moment.

    ``capacity`` is how many requests the engine can run at once now; ``start`` runs a work
    (the worker calls ``done`` when the engine is through with it); ``drop`` finishes a work
    that must not run, with the reason; ``held`` says a work may not start yet (memory
    pressure holds the lo band and batch). The queue serves hi first, so what waits behind a
    held work is held too.
    """

    def __init__(
        self,
        queue: DispatchQueue,
        *,
        capacity: Callable[[], int],
        verdict: Callable[[RequestEnvelope, float], Dropped | None],
        start: Callable[[Work], None],
        drop: Callable[[Work, Dropped], None],
        after: Callable[[], None] = lambda: None,
        held: Callable[[RequestEnvelope], bool] = lambda _env: False,
    ) -> None:
        self.queue = queue
        self.held = held
        self.capacity = capacity
        self.verdict = verdict
        self.start = start
        self.drop = drop
        self.after = after  # after each pass: what runs and waits may have changed
        self.running = 0
        self.capacity_seen = 0  # the engine's capacity when last asked (for heartbeats)
        self._wake = asyncio.Event()

    def _capacity(self) -> int:
        self.capacity_seen = self.capacity()
        return self.capacity_seen

    def wake(self) -> None:
        """Something changed: new work, a finished request, or more room on the engine."""
        self._wake.set()

    def done(self) -> None:
        """A started work left the engine."""
        self.running -= 1
        self._wake.set()

    def dispatch(self) -> None:
        """Start what the engine has room for now; drop what turned stale while it waited."""
        now = time.time()
        for work in self.queue.expired(now):
            late_ms = (now - (work.env.deadline_ts or now)) * 1000
            self.drop(work, Expired(f"deadline passed {late_ms:.0f} ms before it could start"))
        while len(self.queue) and self.running < self._capacity():
            upcoming = self.queue.first()
            if upcoming is None:
                break
            work = upcoming
            reason = self.verdict(work.env, now)
            if reason is None and self.held(work.env):
                break  # it waits first in line, and all behind it with it
            self.queue.remove(work.env.id)
            if reason is not None:
                self.drop(work, reason)
                continue
            self.running += 1
            self.start(work)
        self.after()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            self.dispatch()
            timeout: float | None = None
            if len(self.queue):
                deadline = self.queue.next_deadline()
                if deadline is not None:
                    timeout = max(0.0, deadline - time.time())
                if self.running >= self._capacity():
                    timeout = _RECHECK_S if timeout is None else min(timeout, _RECHECK_S)
            if timeout is None:
                await self._wake.wait()
            else:
                try:
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
                except TimeoutError:
                    pass
