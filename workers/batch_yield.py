"""How the batch lane gives way to interactive work.

The whole lane pauses while the interactive pools report a backlog beyond
``batch_yield_backlog``, and on an engine shared with them (``workers.fleet``) its newest
running lines are preempted when interactive work needs their slots.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError

from laneway.constants import HEARTBEAT_TTL_S
from workers import metrics

if TYPE_CHECKING:
    from workers.batch_lane import BatchLane
    from workers.pool import PoolWorker

__all__ = ["preempt", "yield_to_interactive"]

log = logging.getLogger(__name__)

_INTERACTIVE_POOLS = ("completion", "chat")


async def yield_to_interactive(lane: BatchLane) -> None:
    """Pause the lane while the interactive pools have a backlog; resume it once gone."""
    backlog = await _interactive_backlog(lane.worker)
    should_yield = backlog > lane.worker.settings.batch_yield_backlog
    if should_yield == lane.yielding:
        return
    lane.yielding = should_yield
    assigned = list(lane.worker.consumer.assignment())
    if should_yield:
        log.info("interactive backlog %d: batch lane pauses", backlog)
        lane.worker.consumer.pause(*assigned)
    else:
        log.info("interactive backlog gone: batch lane resumes")
        # Not a partition still starting (its producer may be open already, its seek
        # not made), or fenced.
        lane.worker.consumer.resume(
            *[tp for tp in assigned if tp in lane.started and tp not in lane.fenced]
        )
    metrics.BATCH_YIELDING.set(1 if should_yield else 0)


async def _interactive_backlog(worker: PoolWorker) -> int:
    now = worker.clock.now()  # Redis's, as the beats are scored on
    try:
        ids: list[Any] = []
        for pool in _INTERACTIVE_POOLS:
            ids += await worker.redis.zrangebyscore(
                worker.keys.workers(pool), now - HEARTBEAT_TTL_S, "+inf"
            )
        if not ids:
            return 0
        infos = await worker.redis.mget([worker.keys.worker_info(i.decode()) for i in ids])
    except (RedisError, OSError):
        return 0
    return sum(int(orjson.loads(raw).get("backlog", 0)) for raw in infos if raw)


def preempt(lane: BatchLane, count: int) -> None:
    """Abort the ``count`` newest running lines: interactive work needs their slots."""
    if count <= 0:
        return
    worker = lane.worker
    # Only lines still on the engine: one already reporting its outcome has nothing to
    # give back, and an abort of it would outlive it.
    victims = [
        work
        for work in reversed(worker.runs.running.values())
        if work.env.id in worker.executor.live and work.env.id not in worker.executor.preempted
    ][:count]
    for work in victims:
        worker.executor.preempted.add(work.env.id)
        metrics.FLEET_PREEMPTIONS.labels(worker.settings.engine_id).inc()
        task = asyncio.get_running_loop().create_task(worker.executor.abort(work.env.id))
        lane.aborting.add(task)
        task.add_done_callback(lane.aborting.discard)
    if victims:
        log.info("shared engine: %d batch lines preempted for interactive work", len(victims))
