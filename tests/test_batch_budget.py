"""Batch lines waiting for their team's budget (``workers.batch_budget``), on the real Redis
and the real quota scripts: a team's lines are admitted oldest first, and one its budget can
no longer ever cover is answered instead of waited for."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from aiokafka import TopicPartition

from laneway.batch import batch_request_id
from laneway.constants import RedisKeys
from laneway.errors import LanewayError, QuotaExceeded
from laneway.schema import BatchRequest, RequestEnvelope
from quota import QuotaEnforcer, QuotaPolicy, Team, get_team, set_team
from tests.stack import LiveStack, envelope, eventually
from workers import batch_budget, batch_lane
from workers.batch_budget import BudgetWait, NotReadBack
from workers.batch_lane import BatchLane
from workers.dispatch import Work

TP = TopicPartition("lines", 0)


class _Lane:
    """What the lane is handed by the waiting lines: queued, answered with an error, and the
    reservations given back."""

    def __init__(self) -> None:
        self.queued: list[Work] = []
        self.refused: list[tuple[Work, LanewayError]] = []
        self.released: list[int] = []
        self.changed: list[str | None] = []  # teams whose record the lane was told changed
        self._room = 100  # lines the dispatch queue takes
        self.freed = asyncio.Event()  # as the worker's: set when a line leaves the queue

    @property
    def room(self) -> int:
        return self._room

    @room.setter
    def room(self, lines: int) -> None:
        self._room = lines
        self.freed.set()

    def waiting(
        self,
        quota: QuotaEnforcer,
        lookup: Callable[[str], Awaitable[Team]],
        *,
        cancelled: Callable[[RequestEnvelope], Awaitable[bool]],
        restore: Callable[[Work], Awaitable[Work | None]],
        bodies: int,
    ) -> BudgetWait:
        return BudgetWait(
            quota,
            lookup,
            queue=self.queued.append,
            refuse=self.refuse,
            release=self.release,
            room=lambda: len(self.queued) < self.room,
            freed=self.freed,
            current=lambda work: True,
            cancelled=cancelled,
            restore=restore,
            max_lines=10,
            bodies=bodies,
            team_changed=self.changed.append,
        )

    def refuse(self, work: Work, exc: LanewayError) -> None:
        self.refused.append((work, exc))

    async def release(self, work: Work) -> None:
        self.released.append(work.offset)


async def _never_restored(work: Work) -> Work | None:
    raise AssertionError(f"line {work.offset} kept its body: nothing to read back")


def _line(tokens: int, offset: int, prompt: str = "") -> Work:
    env = envelope(
        id=f"batch-j-{offset}",
        team="thrifty",
        cls="batch",
        job_id="j",
        line_id=str(offset),
        prompt=prompt,
        max_tokens=tokens,
        deadline_ts=None,
    )
    return Work(TP, offset, env)


async def test_a_teams_lines_wait_oldest_first_and_one_that_can_never_fit_is_answered(
    stack: LiveStack,
) -> None:
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")  # 1,000 tokens an hour
    quota = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), policy)
    team = {"now": Team("thrifty", size=1)}
    lane = _Lane()
    queued, refused = lane.queued, lane.refused

    async def lookup(name: str) -> Team:
        return team["now"]

    async def cancelled(env: RequestEnvelope) -> bool:
        return False

    wait = lane.waiting(quota, lookup, cancelled=cancelled, restore=_never_restored, bodies=10)
    try:
        await quota.reserve(team["now"], "batch", "earlier-work", 900)  # 100 tokens left
        big, small = _line(600, 1), _line(10, 2)
        await wait.reserve(team["now"], big.env)
        assert await wait.park(big)  # short: it waits
        # The small one would fit the 100 tokens left, but the big one came first: it waits
        # behind it rather than take the refill the big one waits for.
        await wait.reserve(team["now"], small.env)
        assert await wait.park(small)
        assert [w.offset for w in wait] == [1, 2]
        assert queued == []
        # The team's budget is lowered below the big line: it can never run, so it is
        # answered (with the 429 that says so) and the small one is admitted.
        team["now"] = Team("thrifty", size=1, complexity=0.5)  # 500 tokens an hour
        await quota.settle("thrifty", "earlier-work", 0, min_charge=0)  # and room again
        await eventually(lambda: queued, 15, "the small line admitted")
        assert [w.offset for w in queued] == [2]
        assert [(w.offset, getattr(exc, "never", None)) for w, exc in refused] == [(1, True)]
        assert len(wait) == 0
    finally:
        await wait.close()


async def test_a_raised_budget_admits_the_parked_lines_at_once(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admin raises a team's budget (``set_team``, as the admin API and the CLI do): its
    parked lines are admitted as soon as the new budget covers them, not at the pool's next
    look (here a minute away), and the lane is told to let go of the team's old record."""
    monkeypatch.setattr(batch_budget, "RETRY_MAX_S", 60.0)
    keys = RedisKeys(stack.prefix)
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")  # 1,000 tokens an hour
    quota = QuotaEnforcer(stack.redis, keys, policy)
    await set_team(stack.redis, keys, Team("thrifty", size=1))
    await set_team(stack.redis, keys, Team("other", size=1))
    lane = _Lane()

    async def lookup(name: str) -> Team:  # the lane's cache let go: the stored record
        return await get_team(stack.redis, keys, name)

    async def cancelled(env: RequestEnvelope) -> bool:
        return False

    wait = lane.waiting(quota, lookup, cancelled=cancelled, restore=_never_restored, bodies=10)
    try:
        await quota.reserve(await lookup("thrifty"), "batch", "earlier-work", 1000)  # empty
        lines = [_line(100, 1), _line(100, 2)]
        for work in lines:
            await wait.reserve(await lookup("thrifty"), work.env)
            assert await wait.park(work)
        await asyncio.sleep(1.5)  # the first look done: the next one a minute away
        assert lane.queued == []
        await set_team(stack.redis, keys, Team("other", size=5))  # not the parked team
        await asyncio.sleep(1.0)
        assert lane.queued == []
        # A million tokens an hour: the pool refills at the new rate (a raise adds no
        # tokens at once), the two lines' 200 in under a second.
        await set_team(stack.redis, keys, Team("thrifty", size=1000))
        await eventually(lambda: len(lane.queued) == 2, 10, "the parked lines admitted")
        assert [w.offset for w in lane.queued] == [1, 2]
        # Its subscription counts as a change of any team (None), then the two announced.
        assert lane.changed == [None, "other", "thrifty"]
    finally:
        await wait.close()


async def test_off_peak_a_line_borrows_the_idle_interactive_budget_instead_of_waiting(
    stack: LiveStack,
) -> None:
    """The off-peak window (``LANEWAY_QUOTA_OFFPEAK``, 22:00-06:00 by default) read on the
    quota's clock: the same line, its batch pool empty, waits at noon and runs at 23:00 on
    what the team's interactive pool can spare. (The other tests here set the window off:
    run inside it, they would see their lines borrow rather than wait.)"""
    noon = datetime(2026, 1, 1, 12, 0, tzinfo=UTC).timestamp()
    night = datetime(2026, 1, 1, 23, 0, tzinfo=UTC).timestamp()
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10)  # 1,000 tokens an hour each
    team = Team("nightly", size=1)

    async def lookup(name: str) -> Team:
        return team

    async def cancelled(env: RequestEnvelope) -> bool:
        return False

    for name, when, parks in [("noon", noon, True), ("night", night, False)]:
        keys = RedisKeys(f"{stack.prefix}-{name}")
        quota = QuotaEnforcer(stack.redis, keys, policy, clock=lambda when=when: when)
        wait = _Lane().waiting(
            quota, lookup, cancelled=cancelled, restore=_never_restored, bodies=10
        )
        try:
            await quota.reserve(team, "batch", "earlier-work", 1000)  # the batch pool is empty
            work = _line(200, 1)
            await wait.reserve(team, work.env)
            assert await wait.park(work) is parks, name
            held = await stack.redis.hkeys(keys.quota_reservations(team.name))
            borrowed = [k for k in held if k.decode().startswith(f"{work.env.id}@")]
            assert bool(borrowed) is not parks, name
        finally:
            await wait.close()


async def test_lines_parked_past_the_bodies_kept_are_read_back_when_admitted(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``bodies`` parked lines, a line waits without its body (a team's whole job can
    wait in little memory); admitted, it is read back in full before it queues, and one
    Kafka cannot give back yet waits first in line while it is tried again. One of a job
    cancelled meanwhile is answered as cancelled, never queued without its body; a line
    sent twice (one id, two places) is read back at each place. With the dispatch queue
    full, admission goes on as soon as a slot frees, not at its next look."""
    # Its next look only after the test's bound: the queue's room must wake it.
    monkeypatch.setattr(batch_budget, "_NO_ROOM_WAIT_S", 60.0)
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")  # 1,000 tokens an hour
    quota = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), policy)
    team = Team("thrifty", size=1)
    lane = _Lane()
    queued = lane.queued
    restored: list[int] = []
    originals = {offset: _line(50, offset, prompt=f"document {offset}") for offset in range(1, 6)}
    originals[4].env = originals[4].env.model_copy(update={"job_id": "other-job"})
    # Offset 5 is line 1 sent again: the same id as offset 1, which keeps its body.
    originals[5].env = originals[1].env.model_copy(update={"prompt": "document 1 again"})
    cancelled_jobs: set[str] = set()
    failures = {3: 1}  # offset 3's first read back finds Kafka unreachable

    async def lookup(name: str) -> Team:
        return team

    async def cancelled(env: RequestEnvelope) -> bool:
        return env.job_id in cancelled_jobs

    async def restore(work: Work) -> Work | None:
        assert work.env.prompt == ""  # it waited without its body
        if failures.get(work.offset):
            failures[work.offset] -= 1
            raise NotReadBack("no answer")
        restored.append(work.offset)
        return originals[work.offset]  # as the lane reads it back from Kafka

    wait = lane.waiting(quota, lookup, cancelled=cancelled, restore=restore, bodies=1)
    try:
        await quota.reserve(team, "batch", "earlier-work", 1000)  # the pool is empty
        for work in originals.values():
            await wait.reserve(team, work.env)
            assert await wait.park(work)
        kept = [work.env.prompt for work in wait]
        assert kept == ["document 1", "", "", "", ""]  # one body kept, the rest let go
        cancelled_jobs.add("other-job")
        await wait.release_cancelled()  # as the lane does every beat
        assert [(w.offset, type(exc).__name__) for w, exc in lane.refused] == [(4, "Cancelled")]
        assert queued == []  # never queued without its body
        lane.room = 2  # the dispatch queue takes two more: no more bodies come back
        await quota.settle("thrifty", "earlier-work", 0, min_charge=0)  # budget for all
        await eventually(lambda: len(queued) == 2, 15, "two admitted")
        await asyncio.sleep(0.5)
        assert len(queued) == 2
        assert restored == [2]
        lane.room = 100  # as a line leaves the worker's queue: its event wakes admission
        await eventually(lambda: len(queued) == 4, 15, "the rest admitted")
        assert [w.offset for w in queued] == [1, 2, 3, 5]  # in order, the retried one too
        assert [w.env.prompt for w in queued] == [
            "document 1",
            "document 2",
            "document 3",
            "document 1 again",
        ]
        assert restored == [2, 3, 5]  # the first kept its body
        assert len(wait) == 0
    finally:
        await wait.close()


async def _drain(quota: QuotaEnforcer, team: Team, rid: str) -> None:
    """Whatever ``team``'s batch pool has left, reserved by other work."""
    left = (await quota.reserve(team, "batch", rid, 1)).remaining
    if left:
        await quota.reserve(team, "batch", f"{rid}-rest", left)


async def test_a_body_that_left_with_its_line_is_kept_by_the_next_line_parked(
    stack: LiveStack,
) -> None:
    """``bodies`` bounds the bodies held, not the lines parked before one: with the first
    two lines' bodies kept and the first admitted, the next line parked keeps its body
    (a lane that parked all of a job at once had kept none of the lines left waiting, so
    each was read back from Kafka, and one deleted by retention meanwhile lost)."""
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")  # 1,000 tokens an hour
    quota = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), policy)
    team = Team("thrifty", size=1)
    lane = _Lane()

    async def lookup(name: str) -> Team:
        return team

    async def cancelled(env: RequestEnvelope) -> bool:
        return False

    wait = lane.waiting(quota, lookup, cancelled=cancelled, restore=_never_restored, bodies=2)
    lines = {offset: _line(50, offset, prompt=f"document {offset}") for offset in range(1, 5)}
    try:
        await _drain(quota, team, "earlier-work")
        for offset in (1, 2, 3):
            await wait.reserve(team, lines[offset].env)
            assert await wait.park(lines[offset])
        assert [work.env.prompt for work in wait] == ["document 1", "document 2", ""]
        lane.room = 1  # the dispatch queue takes one line
        await quota.settle("thrifty", "earlier-work-rest", 0, min_charge=0)
        await eventually(lambda: len(lane.queued) == 1, 15, "the first line admitted")
        await _drain(quota, team, "later-work")
        await wait.reserve(team, lines[4].env)
        assert await wait.park(lines[4])
        assert [work.env.prompt for work in wait] == ["document 2", "", "document 4"]
    finally:
        await wait.close()


async def test_a_line_answered_as_cancelled_while_it_reserved_gives_its_reservation_back(
    stack: LiveStack,
) -> None:
    """A line waiting without its body is answered at once when its job is cancelled. If
    that happens while its admission reserves its tokens, the reservation it then holds is
    given back: nothing runs or settles it (the team's pool was short of it for good)."""
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")  # 1,000 tokens an hour
    quota = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), policy)
    team = Team("thrifty", size=1)
    lane = _Lane()
    cancelled_jobs: set[str] = set()
    wait: BudgetWait | None = None

    async def lookup(name: str) -> Team:
        # The job's cancel comes while admission is under way (as from the lane's beat).
        if not cancelled_jobs and wait is not None:
            cancelled_jobs.add("j")
            await wait.release_cancelled()
        return team

    async def cancelled(env: RequestEnvelope) -> bool:
        return env.job_id in cancelled_jobs

    wait = lane.waiting(quota, lookup, cancelled=cancelled, restore=_never_restored, bodies=0)
    line = _line(50, 1, prompt="document 1")
    try:
        await _drain(quota, team, "earlier-work")
        await wait.reserve(team, line.env)
        assert await wait.park(line)
        await quota.settle("thrifty", "earlier-work-rest", 0, min_charge=0)  # room again
        await eventually(lambda: lane.refused, 15, "the line answered as cancelled")
        await eventually(lambda: lane.released, 15, "its reservation given back")
        assert [(w.offset, type(exc).__name__) for w, exc in lane.refused] == [(1, "Cancelled")]
        assert lane.released == [1]
        assert lane.queued == []
    finally:
        await wait.close()


async def test_a_cancel_takes_only_its_own_teams_lines_of_that_job(stack: LiveStack) -> None:
    """Job ids are the submitter's: two teams can both have a job "nightly". One team's cancel
    answers its own waiting lines, never the other's (which wait on, and run when their
    budget allows)."""
    policy = QuotaPolicy(
        unit_tokens=100, units_per_member=10, offpeak=""
    )  # 1,000 tokens an hour each
    quota = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), policy)
    teams = {name: Team(name, size=1) for name in ("alpha", "beta")}
    lane = _Lane()
    cancelled_teams: set[str] = set()

    async def lookup(name: str) -> Team:
        return teams[name]

    async def cancelled(env: RequestEnvelope) -> bool:
        return env.team in cancelled_teams and env.job_id == "nightly"

    def line(team: str, offset: int) -> Work:
        work = _line(50, offset)
        work.env = work.env.model_copy(
            update={"team": team, "job_id": "nightly", "id": f"batch-{team}-{offset}"}
        )
        return work

    wait = lane.waiting(quota, lookup, cancelled=cancelled, restore=_never_restored, bodies=10)
    try:
        for name, team in teams.items():
            await quota.reserve(team, "batch", f"earlier-{name}", 1000)  # both pools empty
        for work in [line("alpha", 1), line("beta", 2), line("alpha", 3), line("beta", 4)]:
            await wait.reserve(teams[work.env.team], work.env)
            assert await wait.park(work)
        cancelled_teams.add("alpha")
        await wait.release_cancelled()
        # alpha's lines go to the queue, where the shield drops them as cancelled; beta's wait.
        assert [(w.env.team, w.offset) for w in lane.queued] == [("alpha", 1), ("alpha", 3)]
        assert [(w.env.team, w.offset) for w in wait] == [("beta", 2), ("beta", 4)]
        await quota.settle("beta", "earlier-beta", 0, min_charge=0)
        await eventually(lambda: len(lane.queued) == 4, 15, "beta's lines admitted")
        assert [w.offset for w in lane.queued[2:]] == [2, 4]
    finally:
        await wait.close()


async def test_a_line_waiting_without_its_body_holds_a_small_fixed_size(stack: LiveStack) -> None:
    """What lets 50,000 lines wait on one worker (``batch_parked._MAX_PARKED``): past the bodies
    kept, a line holds about 2 kB, however long its prompt (here 20 kB)."""
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")
    quota = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), policy)
    team = Team("thrifty", size=1)

    async def lookup(name: str) -> Team:
        return team

    async def cancelled(env: RequestEnvelope) -> bool:
        return False

    wait = _Lane().waiting(quota, lookup, cancelled=cancelled, restore=_never_restored, bodies=0)
    wait.max_lines = wait.max_team_lines = 5000
    try:
        await quota.reserve(team, "batch", "earlier-work", 1000)  # the pool is empty
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for offset in range(2000):
                work = _line(50, offset, prompt="x" * 20_000)
                await wait.reserve(team, work.env)
                assert await wait.park(work)
                del work  # only what the waiting line keeps stays
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert len(wait) == 2000
        assert held / 2000 < 4000, f"{held / 2000:.0f} bytes a line"
    finally:
        await wait.close()


async def test_a_team_record_read_while_it_changed_is_not_kept(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane caches team records; one read from Redis while its change was announced may
    be the old record, so it answers that lookup and is not cached: the next reads again."""
    lane = (await stack.start_worker("batch")).lane
    assert isinstance(lane, BatchLane)
    read = batch_lane.get_team
    reads = 0

    async def get_team(redis: Any, keys: RedisKeys, name: str) -> Team:
        nonlocal reads
        reads += 1
        team = await read(redis, keys, name)
        if reads == 1:
            lane.teams.expire(name)  # announced while this read was under way
        return team

    monkeypatch.setattr(batch_lane, "get_team", get_team)
    await lane.team_of("thrifty")
    await lane.team_of("thrifty")
    assert reads == 2  # the first read was not kept
    await lane.team_of("thrifty")
    assert reads == 2  # the second was


async def test_past_its_share_a_teams_line_is_answered_and_no_one_waits(stack: LiveStack) -> None:
    """One team's spent budget never stops the lane: its lines past its share of the parked
    lines, and any line past the worker's, are answered at once (a 429 that says why);
    before, the lane's intake waited for room, and every team's lines with it."""
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")  # 1,000 tokens an hour
    quota = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), policy)
    lane = _Lane()

    async def lookup(name: str) -> Team:
        return Team(name, size=1)

    async def cancelled(env: RequestEnvelope) -> bool:
        return False

    wait = lane.waiting(quota, lookup, cancelled=cancelled, restore=_never_restored, bodies=10)
    wait.max_lines, wait.max_team_lines = 5, 3
    try:
        # Each team's budget covers its first line (600 of 1,000 tokens): the rest are short.
        for offset, name in enumerate(["spent"] * 5 + ["other"] * 4):
            line = _line(600, offset)
            line = Work(TP, offset, line.env.model_copy(update={"team": name}))
            await wait.reserve(Team(name, size=1), line.env)
            await asyncio.wait_for(wait.park(line), 5)  # never a wait
        answered = {w.offset: exc for w, exc in lane.refused}
        # "spent": 1-3 parked, 4 past its share; "other": 6-7 parked, 8 past the worker's.
        assert sorted(answered) == [4, 8]
        assert all(isinstance(exc, QuotaExceeded) for exc in answered.values())
        assert "team spent has 3 batch lines waiting for its budget" in str(answered[4])
        assert "this worker holds 5 batch lines waiting" in str(answered[8])
        assert sorted(w.offset for w in wait) == [1, 2, 3, 6, 7]
    finally:
        await wait.close()


async def test_a_rerun_line_of_a_cancelled_job_gives_back_its_earlier_runs_reservation(
    stack: LiveStack,
) -> None:
    """A batch line reserved at its first run, then its worker died before the commit; the
    job is cancelled meanwhile. The re-run answers the line 'cancelled' and the reservation
    of the first run goes back (not held for a day against the team's batch pool)."""
    keys = RedisKeys(stack.prefix)
    await stack.api_key("docs", size=1)
    line = BatchRequest(
        job_id="job-x",
        line_id="l-0",
        team="docs",
        url="/v1/completions",
        body={"model": "laneway-code", "prompt": "def f():", "max_tokens": 8},
    )
    producer = await stack.producer()
    meta = await producer.send_and_wait(stack.topics.request("batch"), line.to_json())
    quota = QuotaEnforcer(stack.redis, keys, QuotaPolicy())
    rid = batch_request_id("job-x", "l-0")
    await quota.reserve(Team("docs", size=1), "batch", rid, 50, record=meta.timestamp / 1000)
    assert await stack.redis.hlen(keys.quota_reservations("docs")) == 1
    await stack.redis.set(keys.batch_cancelled("docs", "job-x"), b"1")
    await stack.start_worker("batch")
    (result,) = await stack.read_topic(stack.topics.results_batch, count=1)
    assert result["status"] == "cancelled"

    async def none_held() -> bool:
        return await stack.redis.hlen(keys.quota_reservations("docs")) == 0

    await eventually(none_held, 10, "the first run's reservation given back")
