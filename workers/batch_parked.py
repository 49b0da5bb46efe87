"""The batch lane's side of the lines waiting for their budget (``workers.batch_budget``).

A parked line its pool covers now queues; one parked without its body is read back from
Kafka (``workers.reread``) and made its envelope again; one that must not run after all (its
job cancelled, its budget never enough, its record gone) is answered with why.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.errors import Expired, LanewayError
from laneway.logs import described
from laneway.schema import BatchRequest, RequestEnvelope
from workers.batch_budget import BudgetWait, NotReadBack
from workers.batch_lines import answer, id_of, line_of, release, stored_at
from workers.dispatch import Work
from workers.reread import RecordGone

if TYPE_CHECKING:
    from workers.batch_lane import BatchLane

__all__ = ["budget_wait", "job_cancelled", "read_back"]

log = logging.getLogger(__name__)

# Lines waiting for their team's budget beside the lane, at most: a team's, a whole job of
# the most lines a batch may have (LANEWAY_BATCH_MAX_LINES), and the worker's, two such
# jobs. Beyond them a line is answered with a 429 (never a wait: the lane's intake would
# hold up every team). Those past LANEWAY_BATCH_PARKED_BODIES hold no body (about 2 kB
# each, tests/test_batch_budget.py measures it): about 200 MB at the most.
_MAX_PARKED_A_TEAM = 50_000
_MAX_PARKED = 2 * _MAX_PARKED_A_TEAM


def budget_wait(lane: BatchLane) -> BudgetWait | None:
    """Where ``lane``'s lines wait for their team's budget; None without a quota."""
    worker = lane.worker
    if worker.quota is None:
        return None
    return BudgetWait(
        worker.quota,
        lane.team_of,
        queue=lambda work: _queue(lane, work),
        refuse=lambda work, exc: _refuse(lane, work, exc),
        release=lambda work: release(lane, work.env.team, work.env.id, work.env.accepted_ts),
        room=lambda: worker.held < worker.settings.max_inflight,
        freed=worker.room,
        current=lambda work: worker.offsets.current(work.tp, work.epoch),
        cancelled=lambda env: job_cancelled(lane, env),
        restore=lambda work: _restore(lane, work),
        max_lines=_MAX_PARKED,
        max_team_lines=_MAX_PARKED_A_TEAM,
        bodies=worker.settings.batch_parked_bodies,
        team_changed=lane.teams.expire,
    )


async def job_cancelled(lane: BatchLane, env: RequestEnvelope) -> bool:
    """Whether ``env``'s job was cancelled (the shield then drops its lines not started
    yet); False while Redis cannot say."""
    if env.job_id is None:
        return False
    try:
        cancelled = await lane.lines.job_cancelled(env.team, env.job_id)
    except (RedisError, OSError):
        return False
    if cancelled:
        lane.worker.shield.cancel_job(env.job_id, env.team)
    return cancelled


async def read_back(lane: BatchLane, work: Work) -> tuple[BatchRequest, float]:
    """``work``'s line read again from its partition, and when it was stored."""
    for fresh in (False, True):
        if fresh:
            # Another record at its offset: the topic was deleted and made anew, before
            # or after the reader fetched it. What it kept may be the old topic's: asked
            # of the broker once more before the line is answered as gone.
            lane.reread.forget({work.tp})
        record = await lane.reread.read(work.tp, work.offset)
        line = line_of(lane, work.tp, record, read_back=True)
        if line is not None and id_of(lane, work.tp, line) == work.env.id:
            return line, stored_at(lane, record)
    raise RecordGone(f"{work.tp.topic}:{work.tp.partition}@{work.offset} is another line")


async def _restore(lane: BatchLane, work: Work) -> Work | None:
    """A line parked without its body (``workers.batch_budget``), admitted by its budget:
    read back from Kafka and made its envelope again, as at intake (its reservation is
    made). None when its partition went away meanwhile, or when it is answered here
    instead: its job was cancelled, or the topic no longer holds it. ``NotReadBack``
    when Kafka or Redis did not answer: it is tried again."""
    try:
        line, _ = await read_back(lane, work)
        # Accepted when it was parked (the record's time then): its reservation is known
        # by it, and a time read again may differ.
        env = await lane.lines.envelope(line, work.env.id, work.env.accepted_ts)
    except RecordGone as exc:
        log.warning("parked batch line %s answered: %s", work.env.id, exc)
        gone = Expired(f"the line was deleted from Kafka before it could run: {exc}")
        await _answer_parked(lane, work, gone)
        return None
    except LanewayError as exc:  # its job cancelled since, most likely
        await _answer_parked(lane, work, exc)
        return None
    except (KafkaError, TimeoutError, RedisError, OSError) as exc:
        log.warning("parked batch line %s not read back yet: %s", work.env.id, described(exc))
        raise NotReadBack(str(exc)) from exc
    if not lane.worker.offsets.current(work.tp, work.epoch):
        return None
    return replace(work, env=env)


async def _answer_parked(lane: BatchLane, work: Work, exc: LanewayError) -> None:
    """An admitted line that cannot run after all (its job was cancelled, it cannot be
    read back): answered with ``exc``, the reservation it was admitted with given back."""
    if lane.worker.offsets.current(work.tp, work.epoch):
        _refuse(lane, work, exc)
        await release(lane, work.env.team, work.env.id, work.env.accepted_ts)


def _refuse(lane: BatchLane, work: Work, exc: LanewayError) -> None:
    """A parked line that must not run (its team's budget can no longer ever cover it,
    its job was cancelled): answered with ``exc``. Not once its partition went away:
    its next owner answers it."""
    if not lane.worker.offsets.current(work.tp, work.epoch):
        return
    env = work.env
    line = BatchRequest(job_id=str(env.job_id), line_id=str(env.line_id), team=env.team)
    answer(lane, work.tp, work.offset, line, exc)
    lane.worker.offsets.finish(work.tp, work.offset, work.epoch)


def _queue(lane: BatchLane, work: Work) -> None:
    """A parked line its pool covers now (or whose job was cancelled): it queues."""
    lane.worker.queue.push(work)
    lane.worker.dispatcher.wake()
