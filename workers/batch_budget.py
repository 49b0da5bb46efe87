"""Batch lines waiting for their team's budget, out of the other teams' way.

A batch line reserves its tokens from its team's batch pool as it comes in. One the pool
cannot cover yet is parked here, holding no engine slot, while the lane goes on fetching:
the lines of every other team on the same partitions run meanwhile, and their results are
committed as they finish (``workers.answered``). Each team's parked lines are admitted in
the order they came as its pool refills. A line bigger than the team's whole budget is
answered with a 429 at once instead: it would never leave.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator

from aiokafka import TopicPartition
from redis.exceptions import RedisError

from laneway.errors import QuotaExceeded
from laneway.retry import Backoff
from laneway.schema import RequestEnvelope
from laneway.tasks import cancel_all, kept
from quota import Team
from quota.enforcer import QuotaEnforcer
from workers import metrics
from workers.dispatch import Work

__all__ = ["RETRY_MAX_S", "BudgetWait"]

log = logging.getLogger(__name__)

# A parked team's pool is tried again at least this often.
RETRY_MAX_S = 5.0


def line_tokens(env: RequestEnvelope) -> int:
    """What a line reserves: its prompt's estimate and its max_tokens."""
    return env.prompt_tokens + env.max_tokens


class BudgetWait:
    """The lines whose team's batch pool could not cover them at intake, per team, oldest
    first; up to ``max_lines`` of them (then the lane waits for room, as it did before
    lines were parked)."""

    def __init__(
        self,
        quota: QuotaEnforcer,
        team: Callable[[str], Awaitable[Team]],
        *,
        queue: Callable[[Work], None],
        refuse: Callable[[Work, QuotaExceeded], None],
        current: Callable[[Work], bool],
        cancelled: Callable[[RequestEnvelope], Awaitable[bool]],
        max_lines: int,
    ) -> None:
        self.quota = quota
        self._team = team
        self._queue = queue  # a line admitted (or cancelled): to the dispatch queue
        self._refuse = refuse  # a line that can never fit: answered with its error
        self._current = current  # its partition is still this worker's, in the same tenure
        self._cancelled = cancelled
        self.max_lines = max_lines
        # Found short at intake, not parked yet. An id left here by a line whose partition
        # went away before it queued goes when the line comes back (or with the worker).
        self._short: set[str] = set()
        self._lines: dict[str, deque[Work]] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._parked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return sum(len(lines) for lines in self._lines.values())

    def __iter__(self) -> Iterator[Work]:
        for lines in list(self._lines.values()):
            yield from lines

    async def reserve(self, team: Team, env: RequestEnvelope) -> None:
        """Reserve ``env``'s tokens as it comes in. ``QuotaExceeded`` (``never``) for a line
        bigger than its team's whole budget; a line the pool cannot cover yet is marked to
        be parked when it would queue."""
        if env.team in self._lines:
            # Behind the team's parked lines: a newer (smaller) line would take each refill
            # before the oldest, which could wait for good.
            self._short.add(env.id)
            return
        try:
            await self.quota.reserve(team, "batch", env.id, line_tokens(env))
        except QuotaExceeded as exc:
            if exc.never:
                raise
            self._short.add(env.id)
        else:
            self._short.discard(env.id)

    async def park(self, work: Work) -> bool:
        """Whether ``work`` is parked (its reservation at intake found the pool short);
        False: it reserved already and may queue. Waits while ``max_lines`` are parked."""
        if work.env.id not in self._short:
            return False
        self._short.discard(work.env.id)
        while len(self) >= self.max_lines and self._current(work):
            self._room.clear()
            await self._room.wait()
        if not self._current(work):
            return True  # its partition went away meanwhile: its next owner's
        self._lines.setdefault(work.env.team, deque()).append(work)
        metrics.QUOTA_WAITS.labels(work.env.team).inc()
        self._changed()
        self._parked.set()
        if self._task is None:
            self._task = kept("batch budget", self._admit)
        return True

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Lines of partitions taken away: their next owner runs them."""
        for team, lines in list(self._lines.items()):
            staying = deque(work for work in lines if work.tp not in partitions)
            if staying:
                self._lines[team] = staying
            else:
                del self._lines[team]
        self._changed()

    async def release_cancelled(self) -> None:
        """Lines of a job cancelled since they were parked go to the queue, where the
        shield drops them as cancelled: the job's cancel answers them at once."""
        firsts = {(work.env.team, work.env.job_id): work for work in self if work.env.job_id}
        for (team, job_id), work in firsts.items():
            if await self._cancelled(work.env):
                self._take_job(team, job_id)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])

    async def _admit(self) -> None:
        """Each parked team's oldest lines, as its pool refills; every team in turn."""
        backoff = Backoff(0.5, RETRY_MAX_S)
        while True:
            if not self._lines:
                self._parked.clear()
                await self._parked.wait()
            wait = RETRY_MAX_S
            try:
                for team in list(self._lines):
                    wait = min(wait, await self._admit_team(team))
            except (RedisError, OSError) as exc:
                log.warning("parked batch lines wait, Redis unreachable: %s", exc)
                await backoff.wait()
                continue
            backoff.reset()
            if self._lines:
                await asyncio.sleep(wait)

    async def _admit_team(self, name: str) -> float:
        """Admit ``name``'s parked lines while its pool covers them; the seconds until its
        pool is worth trying again."""
        while (lines := self._lines.get(name)) is not None:
            work = lines[0]
            try:
                team = await self._team(name)
                await self.quota.reserve(team, "batch", work.env.id, line_tokens(work.env))
            except QuotaExceeded as exc:
                if work.env.job_id is not None and await self._cancelled(work.env):
                    self._take_job(name, work.env.job_id)
                    continue
                if exc.never:  # the team's budget shrank below it since it came in
                    self._leave(name, work)
                    self._refuse(work, exc)
                    continue
                return min(max(exc.retry_after, 0.05), RETRY_MAX_S)
            # Its partition may have been taken away while it reserved: then the reservation
            # stays for the line's next run, wherever it is (a reserve of the same line finds
            # it), and expires with it otherwise; given back here, it could be the one that
            # next run holds.
            if self._leave(name, work):
                self._queue(work)
        return RETRY_MAX_S

    def _leave(self, team: str, work: Work) -> bool:
        """``work`` leaves ``team``'s parked lines; False if it was no longer among them."""
        lines = self._lines.get(team)
        if not lines or work not in lines:
            return False
        lines.remove(work)
        if not lines:
            del self._lines[team]
        self._changed()
        return True

    def _take_job(self, team: str, job_id: str) -> None:
        """A cancelled job's parked lines go to the queue now, unreserved: the shield drops
        them as cancelled when they would start. Only the job's own team's: another team's
        lines naming the same job id are not cancelled by it."""
        lines = self._lines.get(team, deque())
        for work in [w for w in lines if w.env.job_id == job_id]:
            self._leave(team, work)
            self._queue(work)

    def _changed(self) -> None:
        metrics.BATCH_PARKED.set(len(self))
        if len(self) < self.max_lines:
            self._room.set()
