"""Worker counters (exported on the worker's /metrics when LANEWAY_METRICS_PORT is set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

__all__ = [
    "ENGINE_MS",
    "INFLIGHT",
    "MALFORMED",
    "OUTCOMES",
    "STALE_ENGINE_MS",
]

MALFORMED = Counter(
    "laneway_worker_malformed_records_total",
    "Kafka records (and Redis cancel messages) skipped because they did not decode",
    ["pool", "topic"],
)
OUTCOMES = Counter(
    "laneway_requests_total",
    "Terminal outcomes of requests by status (ok, error, cancelled, superseded, expired...)",
    ["team", "cls", "status"],
)
ENGINE_MS = Counter(
    "laneway_engine_ms_total",
    "Engine milliseconds spent (modelled for the sim engine)",
    ["team", "cls"],
)
STALE_ENGINE_MS = Counter(
    "laneway_stale_engine_ms_total",
    "Engine milliseconds spent on requests after they turned stale (cancelled or superseded)",
    ["team", "cls", "status"],
)
INFLIGHT = Gauge("laneway_worker_inflight", "Requests running on this worker", ["pool"])
REDIS_FALLBACK = Counter(
    "laneway_worker_redis_fallback_total",
    "Times a worker found Redis unreachable and sent replies through Kafka",
)
QUOTA_WAITS = Counter(
    "laneway_quota_waits_total",
    "Times a batch request waited for its team's batch budget to refill",
    ["team"],
)
BATCH_YIELDING = Gauge(
    "laneway_batch_yielding", "1 while the batch lane is paused for interactive backlog"
)
BATCH_REQUEUED = Counter(
    "laneway_batch_requeued_total", "Batch lines aborted under engine memory pressure and re-queued"
)
