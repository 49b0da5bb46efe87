"""A batch partition's transaction that cannot go on (``BatchLane.commit``).

Fenced: another instance started a producer of the partition (``workers.batch_txn``), and
this worker lets the partition go and asks the group for it again. Stuck: a transaction that
never ends has its producer replaced, and what it committed is learnt from the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from workers import metrics
from workers.lanes import read_commits

if TYPE_CHECKING:
    from workers.batch_lane import BatchLane

__all__ = ["lose", "replace_stuck", "settle_cut_off"]

log = logging.getLogger(__name__)

# Bounds the stop of a stuck producer.
_PRODUCER_STOP_S = 10.0


async def replace_stuck(lane: BatchLane, tp: TopicPartition, after_s: float) -> None:
    """Drop the producer of a transaction not ended after ``after_s``. The next commit starts
    a new one, which ends the old transaction (committed or aborted) before it begins; but
    only if the group still counts this worker in (a heartbeat answered, no rebalance under
    way). A worker cut off from the brokers that long may have lost the partition to
    another, whose producer a new one here would fence; it asks the group instead."""
    log.warning(
        "batch transaction of %s:%d not ended after %.0fs: its producer is replaced",
        tp.topic,
        tp.partition,
        after_s,
    )
    lane.cut_off.add(tp)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_PRODUCER_STOP_S):
            await lane.txns.close([tp])
    if not await _still_a_member(lane):
        log.warning(
            "%s:%d: the group may have given it to another worker meanwhile: asking for it again",
            tp.topic,
            tp.partition,
        )
        await _ask_again(lane, tp)


async def _still_a_member(lane: BatchLane) -> bool:
    """Whether the group's coordinator answers this worker's heartbeat as a member of the
    current generation, with no rebalance under way (aiokafka has no public call for it)."""
    coordinator = lane.worker.consumer._coordinator
    try:
        async with asyncio.timeout(_PRODUCER_STOP_S):
            answered = bool(await coordinator._do_heartbeat())
    except (TimeoutError, KafkaError):
        return False
    return answered and not coordinator._rejoin_needed_fut.done()


async def settle_cut_off(lane: BatchLane, tp: TopicPartition) -> None:
    """After a cut-off transaction (its producer replaced, so it has ended): what it
    committed is out already and leaves the ledger."""
    answered = (await read_commits(lane.worker.consumer, {tp})).get(tp)
    lane.cut_off.discard(tp)
    if answered is None:
        return
    offset = answered.low
    lane.ledger.drop(tp, lane.ledger.ready(tp, answered))
    lane.committed[tp] = (offset, answered.top())


async def lose(lane: BatchLane, tp: TopicPartition) -> None:
    """Another instance started a producer of ``tp`` (the group gave it the partition
    while this worker was expelled, or a start that came too late): what this worker
    holds of the partition is dropped, and it reads no more of it until the group assigns
    it here again. It asks the group at once: an expelled worker rejoins anyway, and one
    the group still gives ``tp`` gets it back through a rebalance (its producer started
    again, fencing the other; its reading from the committed offset) rather than wait,
    the partition stalled, for the next rebalance someone else causes."""
    log.warning(
        "partition %s:%d fenced by another producer: asking the group for it again",
        tp.topic,
        tp.partition,
    )
    lane.fences += 1
    metrics.BATCH_FENCES.labels(lane.worker.pool).inc()
    await _ask_again(lane, tp)


async def _ask_again(lane: BatchLane, tp: TopicPartition) -> None:
    """Nothing more of ``tp`` is committed or read here until the group assigns it again."""
    lane.fenced.add(tp)
    lane.started.discard(tp)
    lane.cut_off.discard(tp)
    if not lane.worker.stopping:
        # Before anything below can fail or wait. aiokafka has no public call for it: the
        # next round of its coordinator rejoins, through the revoke and assignment
        # callbacks as any rebalance. Not while the worker stops: its last commit would
        # make it wait out a rejoin, and start producers after it closed them.
        lane.worker.consumer._coordinator.request_rejoin()
    lane.worker.runs.forget({tp})
    await lane.txns.close([tp])
    if tp in lane.worker.consumer.assignment():
        lane.worker.consumer.pause(tp)
