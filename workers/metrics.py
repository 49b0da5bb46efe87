"""Worker counters (exported on the worker's /metrics when LANEWAY_METRICS_PORT is set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "ABORT_SECONDS",
    "DISPATCH_QUEUE",
    "ENGINE_CAPACITY",
    "ENGINE_INFLIGHT",
    "ENGINE_MS",
    "FLEET_BATCH_SHARE",
    "FLEET_PREEMPTIONS",
    "FLEET_RESERVE",
    "FLEET_SLOTS",
    "INFLIGHT",
    "KV_CACHE_USAGE",
    "LATE_STARTS",
    "MALFORMED",
    "MEMORY_PRESSURE",
    "MEMORY_SHED",
    "ORPHANS",
    "OUTCOMES",
    "REUSED",
    "REUSE_SAVED_MS",
    "STALE_ENGINE_MS",
    "USAGE_RESENT",
]

MALFORMED = Counter(
    "laneway_worker_malformed_records_total",
    "Kafka records (and Redis cancel messages) skipped because they did not decode",
    ["pool", "topic"],
)
USAGE_RESENT = Counter(
    "laneway_worker_usage_resent_total",
    "Requests answered by a worker that stopped before the broker stored their usage "
    "events: the events Redis held, sent again by the partition's next owner (not run again)",
    ["pool"],
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
INFLIGHT = Gauge(
    "laneway_worker_inflight",
    "Requests held by this worker: waiting in its dispatch queue or on the engine",
    ["pool"],
)
DISPATCH_QUEUE = Gauge(
    "laneway_dispatch_queue", "Requests waiting in the worker's queue for the engine", ["pool"]
)
ENGINE_INFLIGHT = Gauge(
    "laneway_engine_inflight", "Requests this worker has on its engine now", ["pool"]
)
ENGINE_CAPACITY = Gauge(
    "laneway_engine_capacity",
    "Requests the engine can start at once: configured, its own limit, or learned (upstream)",
    ["pool"],
)
LATE_STARTS = Counter(
    "laneway_late_starts_total",
    "Requests whose engine work began after they had turned stale (work the shield missed)",
    ["pool"],
)
ORPHANS = Counter(
    "laneway_orphaned_requests_total",
    "Requests stopped because their ingress replica was gone (their clients with it)",
    ["pool"],
)
ABORT_SECONDS = Histogram(
    "laneway_abort_seconds",
    "From the news that a running request turned stale to its engine work stopping",
    ["pool"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
)
REDIS_FALLBACK = Counter(
    "laneway_worker_redis_fallback_total",
    "Replies a worker sent through Kafka because Redis was not reached",
)
QUOTA_WAITS = Counter(
    "laneway_quota_waits_total",
    "Times a batch request waited for its team's batch budget to refill",
    ["team"],
)
BATCH_PARKED = Gauge(
    "laneway_batch_parked",
    "Batch lines waiting for their team's batch budget beside the lane (workers.batch_budget)",
)
BATCH_READ_BACK_FETCHES = Counter(
    "laneway_batch_read_back_fetches_total",
    "Fetches that read back batch lines parked without their bodies (workers.reread); one "
    "brings the lines after it on its partition too",
)
BATCH_COPIES = Counter(
    "laneway_batch_copies_total",
    "Batch lines fetched while the same line (same id, same record content) was still on "
    "the worker: answered by that one's run",
    ["pool"],
)
BATCH_FENCES = Counter(
    "laneway_batch_fences_total",
    "Batch partitions whose transactional producer another instance fenced while this "
    "worker held them; each time it asks the group for them again",
    ["pool"],
)
BATCH_YIELDING = Gauge(
    "laneway_batch_yielding", "1 while the batch lane is paused for interactive backlog"
)
KV_CACHE_USAGE = Gauge(
    "laneway_engine_kv_cache_usage", "The worker's engine KV-cache usage (0..1)", ["pool"]
)
MEMORY_PRESSURE = Gauge(
    "laneway_memory_pressure",
    "1 while the worker's engine is under memory pressure (shedding batch and lo-band work)",
    ["pool"],
)
MEMORY_SHED = Counter(
    "laneway_memory_shed_total",
    "Requests aborted under engine memory pressure and queued again (they run later)",
    ["pool", "band"],
)
FLEET_SLOTS = Gauge(
    "laneway_fleet_slots",
    "A shared engine's slots in use by class, as this worker sees them",
    ["engine", "cls"],
)
FLEET_RESERVE = Gauge(
    "laneway_fleet_reserve", "Slots of a shared engine that batch may not take", ["engine"]
)
FLEET_BATCH_SHARE = Gauge(
    "laneway_fleet_batch_share", "Share of a shared engine's running work that is batch", ["engine"]
)
FLEET_PREEMPTIONS = Counter(
    "laneway_fleet_preemptions_total",
    "Batch lines aborted on a shared engine for interactive work, and queued again",
    ["engine"],
)
PREEMPTED_ENGINE_MS = Counter(
    "laneway_preempted_engine_ms_total",
    "Engine milliseconds spent on attempts that were preempted (run again, not billed)",
    ["pool"],
)
REUSED = Counter(
    "laneway_reused_requests_total",
    "Requests served from another request's generation (type-through, recent, coalesced)",
    ["pool", "kind"],
)
REUSE_SAVED_MS = Counter(
    "laneway_reuse_engine_ms_saved_total",
    "Engine milliseconds reused requests would have cost at their generation's per-token time",
    ["pool"],
)
