"""Batch lines waiting for their team's budget (``workers.batch_budget``), on the real Redis
and the real quota scripts: a team's lines are admitted oldest first, and one its budget can
no longer ever cover is answered instead of waited for."""

from __future__ import annotations

from aiokafka import TopicPartition

from laneway.constants import RedisKeys
from laneway.errors import QuotaExceeded
from quota import QuotaEnforcer, QuotaPolicy, Team
from tests.stack import LiveStack, envelope, eventually
from workers.batch_budget import BudgetWait
from workers.dispatch import Work

TP = TopicPartition("lines", 0)


def _line(tokens: int, offset: int) -> Work:
    env = envelope(
        id=f"batch-j-{offset}",
        team="thrifty",
        cls="batch",
        job_id="j",
        line_id=str(offset),
        prompt="",
        max_tokens=tokens,
        deadline_ts=None,
    )
    return Work(TP, offset, env)


async def test_a_teams_lines_wait_oldest_first_and_one_that_can_never_fit_is_answered(
    stack: LiveStack,
) -> None:
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10)  # 1,000 tokens an hour
    quota = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), policy)
    team = {"now": Team("thrifty", size=1)}
    queued: list[Work] = []
    refused: list[tuple[Work, QuotaExceeded]] = []

    async def lookup(name: str) -> Team:
        return team["now"]

    async def cancelled(env: object) -> bool:
        return False

    wait = BudgetWait(
        quota,
        lookup,
        queue=queued.append,
        refuse=lambda work, exc: refused.append((work, exc)),
        current=lambda work: True,
        cancelled=cancelled,
        max_lines=10,
    )
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
        assert [(w.offset, exc.never) for w, exc in refused] == [(1, True)]
        assert len(wait) == 0
    finally:
        await wait.close()
