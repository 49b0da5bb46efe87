"""What a worker says of itself each heartbeat: its record in Redis (the ingress, the console
and the scaling signal read it) and its gauges."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from laneway.metrics import CONSUMER_LAG
from workers import metrics

if TYPE_CHECKING:
    from workers.pool import PoolWorker

__all__ = ["heartbeat_record", "set_gauges"]


async def heartbeat_record(worker: PoolWorker, now: float) -> dict[str, Any]:
    stats = worker.engine.stats()
    dispatcher = worker.dispatcher
    return {
        "pool": worker.pool,
        "engine": worker.engine.name,
        "simulation": worker.engine.is_simulation,
        "inflight": worker.held,
        "dispatch_queue": len(worker.queue),
        "engine_inflight": dispatcher.running,
        "capacity": dispatcher.capacity_seen,
        "backlog": await record_lag(worker) + len(worker.queue) + stats.waiting,
        "cancels_held": len(worker.shield),
        "running": stats.running,
        "waiting": stats.waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefix_cache_hit_rate": (
            stats.prefix_cache_hits / stats.prefix_cache_queries
            if stats.prefix_cache_queries
            else None
        ),
        "memory_free_bytes": stats.memory_free_bytes,
        "memory_pressure": worker.memory.pressed,
        "memory_shed": worker.memory.shed_total,
        "model_digest": worker.digest,
        "ts": now,
    }


async def record_lag(worker: PoolWorker) -> int:
    """Records not fetched yet on the worker's partitions, exported per topic; the total."""
    total = 0
    assigned = worker.consumer.assignment()
    topics = {tp.topic for tp in assigned} | set(worker.topics.pool_topics(worker.settings.pool))
    for topic in sorted(topics):
        lag = await worker.intake.lag([tp for tp in assigned if tp.topic == topic])
        CONSUMER_LAG.labels(worker.pool, topic).set(lag)
        total += lag
    return total


def set_gauges(worker: PoolWorker) -> None:
    metrics.DISPATCH_QUEUE.labels(worker.pool).set(len(worker.queue))
    metrics.ENGINE_INFLIGHT.labels(worker.pool).set(worker.dispatcher.running)
    metrics.ENGINE_CAPACITY.labels(worker.pool).set(worker.dispatcher.capacity_seen)
    metrics.INFLIGHT.labels(worker.pool).set(worker.held)
