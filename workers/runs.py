"""The work a worker holds past its dispatch queue, until each offset may be finished.

Work is here while it runs on the engine, while it is served from another request's
generation (type-through), or while its drop is reported. Each ends by reporting its
outcome once, the lane told (``workers.lanes``), and then its offset is finished; only a
stop past the grace period leaves an offset pending, so that the request runs again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import TopicPartition

from laneway.errors import Cancelled, Dropped
from laneway.schema import CancelRecord, RequestEnvelope, UsageEvent
from laneway.shadow import shadow_id
from workers.dispatch import DispatchQueue, Work
from workers.execution import RequestExecutor
from workers.lanes import Lane
from workers.offsets import OffsetTracker
from workers.reuse import Follower
from workers.shield import CancelShield

__all__ = ["Runs"]

log = logging.getLogger(__name__)


class Runs:
    def __init__(
        self,
        executor: RequestExecutor,
        shield: CancelShield,
        queue: DispatchQueue,
        offsets: OffsetTracker,
        lane: Lane,
        *,
        engine_done: Callable[[], None],
        wake: Callable[[], None],
        room: asyncio.Event,
    ) -> None:
        self.executor = executor
        self.shield = shield
        self.queue = queue
        self.offsets = offsets
        self.lane = lane
        self.engine_done = engine_done  # the dispatcher's: an engine slot is free again
        self.wake = wake  # the dispatcher's: look at the queue again
        self.room = room  # set when the worker may fetch again
        self.running: dict[str, Work] = {}  # on the engine, oldest first
        # The engine had no room (an upstream's 429 or 503): nothing more starts until then
        # (monotonic), whatever its capacity says.
        self.no_room_until = float("-inf")
        self.following: dict[str, Work] = {}  # served from another request's generation
        # Everything started, followed or dropped, from then until its offset is finished
        # (its usage event stored): a record of it fetched again is adopted, not run again.
        self.unfinished: dict[str, Work] = {}
        # Started or dropped work until its offset may be finished; with the queue, what
        # the worker holds (max_inflight bounds it).
        self.tasks: dict[asyncio.Task[None], RequestEnvelope] = {}

    def __len__(self) -> int:
        return len(self.tasks)

    def start(self, work: Work) -> None:
        """The dispatcher hands ``work`` to the engine."""
        env = work.env
        if env.reuse:
            # An identical request started a moment ago (in this pass, say) is followed, not
            # run again; else this one's output becomes reusable from now on.
            follower = self.reusable(env)
            if follower is not None:
                self.engine_done()
                self.follow(work, follower)
                return
            self.executor.reuse.begin(env)
        self.running[env.id] = work
        self._track(self._run(work), work, f"req-{env.id}")

    def drop(self, work: Work, reason: Dropped) -> None:
        """``work`` must not run: its outcome is reported with the reason."""
        self._track(self._report_drop(work, reason), work, f"drop-{work.env.id}")
        self.room.set()

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Partitions taken away by a rebalance: their next owner re-runs what is pending
        (waiting work included: it leaves the queue unstarted)."""
        gone = self.queue.forget(partitions)
        self.offsets.forget(partitions)
        self.lane.forgot(partitions, gone)
        # What was queued left: room to fetch again (nothing running may set it).
        self.room.set()
        self.wake()

    async def withdraw_moved(self, assigned: set[TopicPartition]) -> None:
        """A rebalance ended with ``assigned``: work whose partition went to another worker
        stops, with no outcome here (the new owner runs it again, and this run's answer
        would be thrown away). Runs before followers: a generation still followed is
        marked withdrawn and runs on for its followers (its own client's text no longer
        passed on) until the last leaves, then stops as withdrawn; withdrawing a follower
        first would stop a stale owner as stale, which an engine that yields on abort (vLLM)
        lets report before its own withdrawal. Work whose partition came back runs on: the
        record fetched again is adopted, or skipped if the run answered first."""
        self.offsets.kept(assigned)
        for work in [*self.running.values(), *self.following.values()]:
            if work.tp in assigned or self.offsets.current(work.tp, work.epoch):
                continue
            if await self.executor.withdraw(work.env.id):
                log.info(
                    "request %s withdrawn: %s:%d went to another worker",
                    work.env.id,
                    work.tp.topic,
                    work.tp.partition,
                    extra={"request_id": work.env.id, "team": work.env.team},
                )

    async def cancel(self, cancel: CancelRecord) -> None:
        """A tombstone: work still queued leaves the queue; work running is aborted. It ends
        the request's shadow copy too (``laneway.shadow``), whose id no client is given.
        Every tombstone so takes two places in the shield's bounded cancel set while neither
        request is here (the copy's, with or without a copy): it halves how many are kept,
        which still outlasts any request's start deadline by far."""
        await self._cancel(cancel, hold=True)
        mirror = shadow_id(cancel.id)
        if mirror is not None:
            await self._cancel(cancel.model_copy(update={"id": mirror}), hold=False)

    async def _cancel(self, cancel: CancelRecord, *, hold: bool) -> None:
        waiting = self.queue.get(cancel.id) if self.shield.enabled else None
        if waiting is not None and waiting.env.team == cancel.team:
            self.queue.remove(cancel.id)
            self.drop(waiting, Cancelled(f"cancelled ({cancel.reason}) before it started"))
            return
        rid = self.shield.cancel(cancel)
        if rid is not None:
            # A gone keystroke's client usually sent the next keystroke a moment before: it
            # may type through this generation, so the abort waits for it, briefly (a
            # shadow copy serves no type-through: it stops at once).
            await self.executor.abort(rid, hold=hold)

    def adopt(self, work: Work) -> bool:
        """A record of a request already in hand (its partition went away and came back
        while it ran, or while its outcome was reported, so it was fetched again): the run
        under way finishes it, as of this tenure, instead of a second run of the same id."""
        known = self.unfinished.get(work.env.id)
        if known is None:
            return False
        known.tp, known.offset, known.epoch = work.tp, work.offset, work.epoch
        return True

    def reusable(self, env: RequestEnvelope) -> Follower | None:
        """The generation ``env`` may be served from (type-through), if any."""
        if not env.reuse or self.shield.verdict(env) is not None:
            return None
        return self.executor.reuse.match(env)

    def follow(self, work: Work, follower: Follower) -> None:
        # Known to the shield at once: a newer keystroke or a tombstone ends it like any other;
        # a tombstone that came since it was matched (the cancel feed runs beside the fetch
        # loop) ends it at once.
        self.shield.started(work.env)
        if self.shield.stale_reason(work.env.id) is not None:
            follower.left = True
        self.following[work.env.id] = work
        self._track(self._serve(work, follower), work, f"reuse-{work.env.id}")

    def _track(self, coro: Coroutine[Any, Any, None], work: Work, name: str) -> None:
        self.unfinished[work.env.id] = work
        task = asyncio.create_task(self._until_finished(coro, work), name=name)
        self.tasks[task] = work.env
        task.add_done_callback(self._untrack)

    async def _until_finished(self, coro: Coroutine[Any, Any, None], work: Work) -> None:
        try:
            await coro
        finally:
            # Right after its offset is finished (no await between): adopted any later, the
            # offset of its new tenure would never be.
            if self.unfinished.get(work.env.id) is work:
                del self.unfinished[work.env.id]

    def _untrack(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)
        self.room.set()

    async def _run(self, work: Work) -> None:
        env = work.env
        try:
            try:
                usage = await self.executor.run(env)
            finally:
                # The engine is done with it: its slot takes the next work while the usage
                # event is still on its way to the broker.
                self.running.pop(env.id, None)
                self.engine_done()
                self.room.set()
            if usage is None:
                wait = self.executor.no_room.pop(env.id, None)
                if wait is not None:  # it never started: it keeps its start deadline
                    self.no_room_until = max(self.no_room_until, time.monotonic() + wait)
                self._again(work, started=wait is None)
                return  # its offset stays pending
            self.lane.finished(work, usage)
            await self.executor.reports.delivered(env.id)
        except asyncio.CancelledError:
            # Shutdown past the grace period: leave the offset pending so it is re-run.
            raise
        except Exception:
            # A reply or usage write failed after retries; the offset must still move on or
            # the partition would stall. The ingress times the client out with a 504.
            log.exception(
                "request %s failed outside the engine",
                env.id,
                extra={"request_id": env.id, "team": env.team},
            )
            self.lane.ended(work)
        self.offsets.finish(work.tp, work.offset, work.epoch)

    def _again(self, work: Work, *, started: bool) -> None:
        """``work`` left the engine to run again later (preempted: memory pressure, or a
        shared engine's interactive work), the engine had no room for it (an upstream's 429
        or 503: it never started), or its generation left a follower nothing: first in line
        again with its offset pending. A run that ``started`` waits with no start
        deadline (it started in time; that it waits again is the engine's doing, not its
        client's); a follower keeps its own: nothing of it started, and its client still
        waits for a start by then."""
        if self.unfinished.get(work.env.id) is work:
            del self.unfinished[work.env.id]  # in the queue, or gone: no run to adopt
        if self.offsets.current(work.tp, work.epoch):
            if started:
                work.env = work.env.model_copy(update={"deadline_ts": None})
            self.queue.push(work, front=True)
        else:  # its partition went away meanwhile: the next owner runs it
            self.lane.ended(work)

    async def _report_drop(self, work: Work, reason: Dropped) -> None:
        try:
            usage: UsageEvent = await self.executor.drop(work.env, reason)
            self.lane.finished(work, usage)
            await self.executor.reports.delivered(work.env.id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "dropped request %s could not be reported",
                work.env.id,
                extra={"request_id": work.env.id, "team": work.env.team},
            )
            self.lane.ended(work)
        self.offsets.finish(work.tp, work.offset, work.epoch)

    async def _serve(self, work: Work, follower: Follower) -> None:
        try:
            try:
                usage = await self.executor.follow(follower)
            finally:
                self.following.pop(work.env.id, None)
            if usage is None:
                # Withdrawn (its partition's next owner runs it), or to run on its own.
                self._again(work, started=False)
                self.wake()
                return  # its offset stays pending
            await self.executor.reports.delivered(work.env.id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "reused request %s failed",
                work.env.id,
                extra={"request_id": work.env.id, "team": work.env.team},
            )
        self.offsets.finish(work.tp, work.offset, work.epoch)
