"""Batch lines waiting for their team's budget, out of the other teams' way.

A batch line reserves its tokens from its team's batch pool as it comes in. One the pool
cannot cover yet is parked here, holding no engine slot, while the lane goes on fetching:
the lines of every other team on the same partitions run meanwhile, and their results are
committed as they finish (``workers.answered``). Each team's parked lines are admitted in
the order they came as its pool refills. A line bigger than the team's whole budget is
answered with a 429 at once instead: it would never leave.

Up to ``bodies`` parked lines hold their bodies at a time: a line parked while fewer do
keeps its own (one whose body left with an admitted line frees the place for the next).
The others keep only what waiting needs (team, job, size, place) and are read back from
Kafka (``workers.reread``) when admitted, so a job of tens of thousands of lines waits in about
2 kB a line, whatever its prompts. A team parks up to ``max_team_lines`` (a whole batch of
the most lines one may have), and the worker up to ``max_lines`` in all: a line past either
is answered at once with a 429 that says so. Never a wait for room: the lane's intake
waiting would hold up every team's lines behind one team's spent budget.

A team's pool is tried again when its refill could cover the next line, at least every
``RETRY_MAX_S``, and at once when the team's record changes (an admin raised its budget:
``quota.set_team`` announces it on a Redis channel, which this worker follows from its first
parked line on). A change made while the channel was not followed (before its subscription,
or while Redis was away) is not announced to it: each new subscription counts as a change
of every team.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace

from aiokafka import TopicPartition
from redis.exceptions import RedisError

from laneway.errors import Cancelled, LanewayError, QuotaExceeded
from laneway.metrics import team_label
from laneway.retry import Backoff
from laneway.schema import RequestEnvelope
from laneway.tasks import cancel_all, kept
from quota import Team
from quota.enforcer import QuotaEnforcer
from quota.teams import follow_team_changes
from workers import metrics
from workers.dispatch import Work

__all__ = ["RETRY_MAX_S", "BudgetWait", "NotReadBack"]

log = logging.getLogger(__name__)

# A parked team's pool is tried again at least this often.
RETRY_MAX_S = 5.0
# With no room in the dispatch queue, admission waits for a slot to free (the worker's event)
# at most this long before it looks again.
_NO_ROOM_WAIT_S = RETRY_MAX_S
# A line that could not be read back is tried again after this (the other teams' meanwhile).
_READ_BACK_RETRY_S = 1.0


class NotReadBack(Exception):
    """A line parked without its body could not be read back just now (Kafka did not
    answer); it waits at the head of its team's lines and is tried again."""


def line_tokens(env: RequestEnvelope) -> int:
    """What a line reserves: its prompt's estimate and its max_tokens."""
    return env.prompt_tokens + env.max_tokens


def without_body(env: RequestEnvelope) -> RequestEnvelope:
    """``env`` as a parked line beyond the bodies kept holds it: no prompt, no messages."""
    return env.model_copy(update={"prompt": "", "suffix": None, "messages": None})


class BudgetWait:
    """The lines whose team's batch pool could not cover them at intake, per team, oldest
    first; up to ``max_team_lines`` a team and ``max_lines`` in all, the bodies of
    ``bodies`` (see the module)."""

    def __init__(
        self,
        quota: QuotaEnforcer,
        team: Callable[[str], Awaitable[Team]],
        *,
        queue: Callable[[Work], None],
        refuse: Callable[[Work, LanewayError], None],
        release: Callable[[Work], Awaitable[None]],
        room: Callable[[], bool],
        freed: asyncio.Event,
        current: Callable[[Work], bool],
        cancelled: Callable[[RequestEnvelope], Awaitable[bool]],
        restore: Callable[[Work], Awaitable[Work | None]],
        max_lines: int,
        bodies: int,
        max_team_lines: int | None = None,
        team_changed: Callable[[str | None], None] = lambda name: None,
    ) -> None:
        self.quota = quota
        self._team = team
        # A team's record changed (None: any team's may have): any copy of it held for
        # ``team`` is let go.
        self._team_changed = team_changed
        self._queue = queue  # a line admitted (or cancelled): to the dispatch queue
        self._refuse = refuse  # a line that must not run (never fits, cancelled): its error
        self._release = release  # a line's reservation, given back
        # The dispatch queue can take more: admitted lines wait while it cannot (a line read
        # back brings its body back into memory).
        self._room = room
        self._freed = freed  # set when a line leaves the dispatch queue or the engine
        self._current = current  # its partition is still this worker's, in the same tenure
        self._cancelled = cancelled
        # A line parked without its body, admitted: the line read back, or None when it was
        # answered there (it could not be) or its partition went away meanwhile;
        # ``NotReadBack`` when Kafka did not answer.
        self._restore = restore
        self.max_lines = max_lines
        self.max_team_lines = max_team_lines or max_lines
        self.bodies = bodies
        # The lines parked without their bodies, by place (two lines may share an id: a job
        # sent twice, or two teams' jobs of the same id on their own topics).
        self._light: set[tuple[TopicPartition, int]] = set()
        # Found short at intake, not parked yet. An id left here by a line whose partition
        # went away before it queued goes when the line comes back (or with the worker).
        self._short: set[str] = set()
        self._lines: dict[str, deque[Work]] = {}
        self._parked = asyncio.Event()
        self._woken = asyncio.Event()  # a parked team's record changed: look again at once
        self._task: asyncio.Task[None] | None = None
        self._changes: asyncio.Task[None] | None = None
        self._closing = False

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
            await self.quota.reserve(
                team, "batch", env.id, line_tokens(env), record=env.accepted_ts
            )
        except QuotaExceeded as exc:
            if exc.never:
                raise
            self._short.add(env.id)
        else:
            self._short.discard(env.id)

    async def park(self, work: Work) -> bool:
        """Whether ``work`` is parked (its reservation at intake found the pool short);
        False: it reserved already and may queue. Past the bounds it is answered instead
        (``True`` too: the lane is done with it)."""
        if work.env.id not in self._short:
            return False
        self._short.discard(work.env.id)
        if not self._current(work):
            return True  # its partition went away meanwhile: its next owner's
        if (full := self._full(work.env.team)) is not None:
            self._refuse(work, full)
            return True
        if len(self) - len(self._light) >= self.bodies:
            work = replace(work, env=without_body(work.env))
            self._light.add(_place(work))
        self._lines.setdefault(work.env.team, deque()).append(work)
        metrics.QUOTA_WAITS.labels(team_label(work.env.team)).inc()
        self._changed()
        self._parked.set()
        if self._task is None:
            self._task = kept("batch budget", self._admit)
            self._changes = kept("batch budget: team changes", self._follow_changes)
        return True

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Lines of partitions taken away: their next owner runs them."""
        for team, lines in list(self._lines.items()):
            staying = deque(work for work in lines if work.tp not in partitions)
            if staying:
                self._lines[team] = staying
            else:
                del self._lines[team]
        self._light.intersection_update(_place(work) for work in self)
        self._changed()

    async def release_cancelled(self) -> None:
        """Lines of a job cancelled since they were parked go to the queue, where the
        shield drops them as cancelled: the job's cancel answers them at once."""
        firsts = {(work.env.team, work.env.job_id): work for work in self if work.env.job_id}
        for (team, job_id), work in firsts.items():
            if await self._cancelled(work.env):
                self._take_job(team, job_id)

    async def close(self) -> None:
        self._closing = True
        await cancel_all([task for task in (self._task, self._changes) if task is not None])

    async def _follow_changes(self) -> None:
        """A parked team's lines are looked at again as soon as its record changes, every
        parked team's when any may have (``follow_team_changes``)."""
        await follow_team_changes(
            self.quota.redis, self.quota.keys, self._changed_team, closing=lambda: self._closing
        )

    def _changed_team(self, name: str | None) -> None:
        """A team's record changed (None: any team's may have)."""
        self._team_changed(name)
        if name in self._lines or (name is None and self._lines):
            self._woken.set()

    async def _admit(self) -> None:
        """Each parked team's oldest lines, as its pool refills; every team in turn."""
        backoff = Backoff(0.5, RETRY_MAX_S)
        while True:
            if not self._lines:
                self._parked.clear()
                await self._parked.wait()
            wait = RETRY_MAX_S
            # Cleared before the round: a change announced during it wakes the next at once.
            self._woken.clear()
            try:
                for team in list(self._lines):
                    wait = min(wait, await self._admit_team(team))
            except (RedisError, OSError) as exc:
                log.warning("parked batch lines wait, Redis unreachable: %s", exc)
                await backoff.wait()
                continue
            backoff.reset()
            if self._lines:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), wait)

    async def _admit_team(self, name: str) -> float:
        """Admit ``name``'s parked lines while its pool covers them; the seconds until its
        pool is worth trying again."""
        while (lines := self._lines.get(name)) is not None:
            if not self._room():
                # The next line is admitted as soon as a slot frees (a poll here capped a
                # drain at a slot's worth of lines per poll); the wait is bounded all the
                # same, should room come some other way.
                self._freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), _NO_ROOM_WAIT_S)
                continue
            work = lines[0]
            # Before the awaits: a cancel answering it meanwhile takes it out of ``_light``.
            light = _place(work) in self._light
            try:
                team = await self._team(name)
                await self.quota.reserve(
                    team, "batch", work.env.id, line_tokens(work.env), record=work.env.accepted_ts
                )
            except QuotaExceeded as exc:
                if work.env.job_id is not None and await self._cancelled(work.env):
                    self._take_job(name, work.env.job_id)
                    continue
                if exc.never:  # the team's budget shrank below it since it came in
                    if self._leave(name, work):
                        self._refuse(work, exc)
                    continue
                return min(max(exc.retry_after, 0.05), RETRY_MAX_S)
            if not self._leave(name, work):
                # It left while it reserved. Answered meanwhile (its job cancelled, and it
                # waited without its body), its partition still here: the reservation is
                # given back. Queued meanwhile (cancelled, with its body): it keeps it, for
                # the shield drops it, or, shield off, it runs. Its partition taken away: the
                # reservation stays for the line's next run, wherever it is (a reserve of
                # the same line finds it), and expires with it otherwise; given back here, it
                # could be the one that next run holds.
                if light and self._current(work):
                    await self._release(work)
                continue
            if light:
                try:
                    restored = await self._restore(work)
                except NotReadBack:
                    # First in its team's line again, its reservation held; the other teams'
                    # lines go on meanwhile.
                    if self._current(work):
                        self._lines.setdefault(name, deque()).appendleft(work)
                        self._light.add(_place(work))
                        self._changed()
                    return _READ_BACK_RETRY_S
                if restored is None:
                    continue
                work = restored
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
        self._light.discard(_place(work))
        self._changed()
        return True

    def _take_job(self, team: str, job_id: str) -> None:
        """A cancelled job's parked lines go to the queue now, unreserved: the shield drops
        them as cancelled when they would start. One parked without its body is answered as
        cancelled here instead (it must never start). Only the job's own team's: another
        team's lines naming the same job id are not cancelled by it. One pass, whatever the
        number of lines (tens of thousands may wait)."""
        lines = self._lines.get(team)
        if not lines:
            return
        taken = [work for work in lines if work.env.job_id == job_id]
        if not taken:
            return
        staying = deque(work for work in lines if work.env.job_id != job_id)
        if staying:
            self._lines[team] = staying
        else:
            del self._lines[team]
        cancelled = Cancelled(f"batch {job_id} was cancelled before it ran")
        for work in taken:
            if _place(work) in self._light:
                self._light.discard(_place(work))
                self._refuse(work, cancelled)
            else:
                self._queue(work)
        self._changed()

    def _changed(self) -> None:
        metrics.BATCH_PARKED.set(len(self))

    def _full(self, team: str) -> QuotaExceeded | None:
        """Why a line of ``team`` cannot be parked (None: it can)."""
        held, parked = len(self._lines.get(team, ())), len(self)
        if held >= self.max_team_lines:
            why = f"team {team} has {held:,} batch lines waiting for its budget here already"
        elif parked >= self.max_lines:
            why = f"this worker holds {parked:,} batch lines waiting for their teams' budgets"
        else:
            return None
        return QuotaExceeded(
            f"{why}, as many as it keeps: this line was not queued. Send it again once they "
            "have run, or raise the team's budget",
            team=team,
            limit=0,
            retry_after=RETRY_MAX_S,
        )


def _place(work: Work) -> tuple[TopicPartition, int]:
    return work.tp, work.offset
