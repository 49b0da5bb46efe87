"""Topic names, Redis key layout and TTLs: every name laneway puts on the wire, in one place."""

from __future__ import annotations

import re
from typing import Final, Literal

__all__ = [
    "API_KEY_CACHE_S",
    "BANDS",
    "BROKER_TIME",
    "CLASSES",
    "DECOMPRESSED_BATCH_BYTES",
    "FILE_RETENTION_S",
    "HEARTBEAT_TTL_S",
    "INTERACTIVE_CLASSES",
    "POOLS",
    "REPLY_STREAM_MAXLEN",
    "REPLY_STREAM_TTL_S",
    "SCALING_DECISION_TTL_S",
    "SHADOW_COMPARISON_TTL_S",
    "UNKNOWN_KEY_CACHE_S",
    "Band",
    "RedisKeys",
    "RequestClass",
    "Topics",
    "object_id_keyable",
]

RequestClass = Literal["completion", "chat", "batch"]
Band = Literal["hi", "lo"]

CLASSES: Final[tuple[RequestClass, ...]] = ("completion", "chat", "batch")
INTERACTIVE_CLASSES: Final[tuple[RequestClass, ...]] = ("completion", "chat")
POOLS: Final = CLASSES
BANDS: Final[tuple[Band, ...]] = ("hi", "lo")

# A worker is live while its heartbeat is younger than this: three missed beats at the
# default two-second interval, so one slow beat never flips /readyz.
HEARTBEAT_TTL_S: Final = 6.0
# Each ingress replica says it runs this often (``RedisKeys.ingresses``); one that has not
# for INGRESS_GONE_S (3 roll calls missed) is not counted among the replicas.
INGRESS_ROLL_CALL_S: Final = 2.0
INGRESS_GONE_S: Final = 7.0
# A pool's scaling decision outlives its last heartbeat by this much: the local autoscaler
# keeps what it runs while no decision is fresh, and a dead pool's decision is not obeyed.
SCALING_DECISION_TTL_S: Final = 3 * HEARTBEAT_TTL_S
# A reply stream outlives its ingress instance by this much, then Redis reclaims it; the
# ingress refreshes it on every read loop, so a live instance never loses its stream.
REPLY_STREAM_TTL_S: Final = 300
# Replies are read within milliseconds; the cap only bounds memory if an ingress dies.
REPLY_STREAM_MAXLEN: Final = 20_000
# A direct-Kafka tenant's topics keep at most this much a partition (Kafka deletes whole
# segments, oldest first, so a partition holds up to one segment more): a tenant principal
# may write its batch topic as fast as the broker takes it, and nothing else bounds its disk.
TEAM_TOPIC_PARTITION_BYTES: Final = 1 << 30
TEAM_TOPIC_SEGMENT_BYTES: Final = 64 << 20
# A keystroke whose seq is below its session's newest, accepted this long after that newest
# one, starts the session's count again (an editor restarted, a document reopened) instead of
# being superseded by the old count. An older keystroke racing a newer one (two connections,
# two replicas) is accepted within milliseconds of it, not seconds.
SESSION_RESTART_S: Final = 2.0
# ... unless it is one of the session's last few keystrokes, sent again within this while:
# a client's retry of a keystroke that was superseded (the Vercel AI SDK retries a 409 after
# a fixed 2 s, past SESSION_RESTART_S) is superseded again, not run as the session's newest.
SESSION_RESEND_S: Final = 60.0
# Key records change rarely (create/revoke). A replica re-reads a key it knows this often, so
# a revoked key is refused within 5 s even when the revocation topic does not reach it (the
# topic brings it in milliseconds, and is what refuses it while Redis is away).
API_KEY_CACHE_S: Final = 4.0
# An unknown key is refused from memory this long: a client retrying a wrong key costs Redis
# one read per replica per 30 s. Keys are random, so none is looked up before it exists.
UNKNOWN_KEY_CACHE_S: Final = 30.0

# A fetched Kafka record batch decompresses into at most this (``laneway.kafka_bounds``): a
# producer batch of request lines is 1 MiB compressed by default, which text rarely expands
# past ten times; this is far past that, and still nothing a worker holding one batch per
# partition cannot afford.
DECOMPRESSED_BATCH_BYTES: Final = 64 * 1024 * 1024

# Files (uploads and a batch's output) and batch objects live this long: the retention of
# laneway.results.batch and laneway.files, so no object outlives its bytes.
FILE_RETENTION_S: Final = 7 * 24 * 3600
# A shadow's comparison stays readable this long after the streams app last wrote it: a day,
# so the numbers of a shadow stopped in the evening are still there the next morning.
SHADOW_COMPARISON_TTL_S: Final = 24 * 3600


class Topics:
    """Kafka topic names under one prefix (``LANEWAY_TOPIC_PREFIX``)."""

    def __init__(self, prefix: str = "laneway") -> None:
        self.prefix = prefix
        self.cancel = f"{prefix}.cancel"
        self.usage = f"{prefix}.usage"
        self.results_batch = f"{prefix}.results.batch"
        self.control = f"{prefix}.control"
        self.usage_hourly = f"{prefix}.usage.hourly"
        # Reply chunks go here, keyed by reply stream, only while Redis is unreachable.
        self.replies = f"{prefix}.replies"
        # Revoked API keys (by hash), read by every ingress: refused even while Redis is away.
        self.keys = f"{prefix}.keys"
        # Bytes of files uploaded through the Files API, in chunks keyed by file id.
        self.files = f"{prefix}.files"
        # The HTTP Batches API's lines and results: topics the ingress and the batch workers
        # alone write, so no other principal (an operator's batch service writes req.batch
        # and results.batch) can finish, or read, a team's HTTP batch.
        self.batch_http = f"{prefix}.req.batch.http"
        self.results_batch_http = f"{prefix}.results.batch.http"

    def request(self, cls: RequestClass, band: Band = "hi") -> str:
        """The request topic of a class; batch has a single band."""
        if cls == "batch":
            return f"{self.prefix}.req.batch"
        return f"{self.prefix}.req.{cls}.{band}"

    def pool_topics(self, pool: RequestClass) -> list[str]:
        """Request topics a pool consumes, highest band first."""
        if pool == "batch":
            return [self.request("batch")]
        return [self.request(pool, band) for band in BANDS]

    # Direct-Kafka tenants (docs/security.md): a team's batch input and results each have a
    # topic of their own, so an ACL on the name decides who writes and reads them (Kafka
    # ACLs cannot filter the records of a shared topic). The worker takes a line's team from
    # the name of the topic it came from, never from the line.
    def batch_team(self, team: str) -> str:
        """Batch input that ``team``'s principal alone may write."""
        return f"{self.prefix}.req.batch.team.{team}"

    def results_batch_team(self, team: str) -> str:
        """Results of the lines of ``batch_team(team)``, readable by that team alone."""
        return f"{self.prefix}.results.batch.team.{team}"

    def team_of_batch_topic(self, topic: str) -> str | None:
        """The team of a tenant's batch topic; None for the ingress's ``req.batch``."""
        head = f"{self.prefix}.req.batch.team."
        if not topic.startswith(head):
            return None
        return topic[len(head) :] or None

    def batch_results_for(self, input_topic: str) -> str:
        """Where the results of lines read from ``input_topic`` go."""
        if input_topic == self.batch_http:
            return self.results_batch_http
        team = self.team_of_batch_topic(input_topic)
        return self.results_batch if team is None else self.results_batch_team(team)

    def batch_pattern(self) -> str:
        """Regex of every topic the batch pool consumes: the lane, the HTTP Batches API's
        and each tenant's topic."""
        return rf"^{re.escape(self.prefix)}\.req\.batch(\.http|\.team\.[A-Za-z0-9_-]+)?$"

    def team_specs(self, team: str, partitions: int) -> list[tuple[str, int, dict[str, str]]]:
        """(name, partitions, config) of a direct-Kafka tenant's two topics: a week, and at
        most ``TEAM_TOPIC_PARTITION_BYTES`` a partition, so a tenant writing without end
        fills none of the broker's disk but its own share (its oldest lines go first)."""
        config = {
            "retention.ms": str(7 * 24 * 3600 * 1000),
            "retention.bytes": str(TEAM_TOPIC_PARTITION_BYTES),
            "segment.bytes": str(TEAM_TOPIC_SEGMENT_BYTES),
            **BROKER_TIME,
        }
        return [
            (self.batch_team(team), partitions, dict(config)),
            (self.results_batch_team(team), partitions, dict(config)),
        ]

    def consumer_group(self, pool: RequestClass) -> str:
        return f"{self.prefix}.workers.{pool}"

    def specs(self, partitions: int) -> list[tuple[str, int, dict[str, str]]]:
        """(name, partitions, config) of every topic laneway uses."""
        day_ms = str(24 * 3600 * 1000)
        out: list[tuple[str, int, dict[str, str]]] = []
        for pool in POOLS:
            out.extend((topic, partitions, {}) for topic in self.pool_topics(pool))
        out += [
            # Compacted with short retention: a tombstone only matters while its request
            # could still run; the cleaner keeps one record per request id.
            (
                self.cancel,
                partitions,
                {
                    "cleanup.policy": "compact,delete",
                    "retention.ms": str(15 * 60 * 1000),
                    "segment.ms": str(60 * 1000),
                },
            ),
            (self.usage, partitions, {"retention.ms": str(7 * 24 * 3600 * 1000)}),
            (self.results_batch, partitions, {"retention.ms": str(FILE_RETENTION_S * 1000)}),
            (self.batch_http, partitions, {}),
            (self.results_batch_http, partitions, {"retention.ms": str(FILE_RETENTION_S * 1000)}),
            (self.control, 1, {"retention.ms": day_ms}),
            (self.replies, partitions, {"retention.ms": str(10 * 60 * 1000)}),
            (self.usage_hourly, partitions, {"retention.ms": str(90 * 24 * 3600 * 1000)}),
            # As long as the results: a batch's input is readable while its output is.
            (self.files, partitions, {"retention.ms": str(FILE_RETENTION_S * 1000)}),
            # Compacted and kept for good: a revocation must outlive every copy of its key.
            (self.keys, 1, {"cleanup.policy": "compact", "retention.ms": "-1"}),
        ]
        return [(name, count, {**config, **BROKER_TIME}) for name, count, config in out]


# Every topic's records carry the time the broker stored them, not the producer's: a
# producer whose clock runs more than an hour ahead would otherwise have each record refused
# (Kafka 4's ``message.timestamp.after.max.ms``), and one far behind would have its records
# age out of a short retention (tombstones, replies) before they were read. Retention, time
# lookups (``offsets_for_times``) and record times then follow the broker's clock alone.
BROKER_TIME = {"message.timestamp.type": "LogAppendTime"}


_OBJECT_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")


def object_id_keyable(object_id: str) -> bool:
    """Whether a client's id of a file or batch can name its record's key: the ids laneway
    makes (``file-…``, ``batch_…``) are letters, digits, ``_`` and ``-``. Any other (one
    with ``:``) is no record's, and under ``<prefix>:batch:`` could name another kind of
    key (``batch:cancelled:<id>``): read as a batch, that was a 500 for any team, and told
    it which batch ids had been cancelled."""
    return _OBJECT_ID.fullmatch(object_id) is not None


class RedisKeys:
    """Redis key layout under one prefix (``LANEWAY_REDIS_PREFIX``)."""

    def __init__(self, prefix: str = "laneway") -> None:
        self.prefix = prefix

    def api_key(self, key_hash: str) -> str:
        return f"{self.prefix}:apikey:{key_hash}"

    def team(self, team: str) -> str:
        return f"{self.prefix}:team:{team}"

    def teams(self) -> str:
        return f"{self.prefix}:teams"

    def team_changes(self) -> str:
        """Pub/sub channel that carries the name of each team whose record was just set
        (``quota.teams.follow_team_changes``: the ingresses and the batch workers with parked
        lines use the new record at once)."""
        return f"{self.prefix}:team-changes"

    def console_ended(self, nonce: str) -> str:
        """A console session logged out (by its nonce), kept until its cookie expires."""
        return f"{self.prefix}:console-ended:{nonce}"

    def reply_stream(self, instance: str) -> str:
        return f"{self.prefix}:reply:{instance}"

    def reply_instance(self, stream: str | None) -> str | None:
        """The ingress replica whose reply stream ``stream`` is (None: not one)."""
        head = self.reply_stream("")
        return stream[len(head) :] if stream and stream.startswith(head) else None

    def workers(self, pool: str) -> str:
        """Sorted set of worker ids scored by the time of their last heartbeat."""
        return f"{self.prefix}:workers:{pool}"

    def ingresses(self) -> str:
        """Sorted set of ingress replica ids scored by when each last said it runs
        (``ingress.quota_gate.QuotaGate.roll_call``)."""
        return f"{self.prefix}:ingresses"

    def worker_info(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def cache_salt_secret(self) -> str:
        """The secret every worker salts a team's prefix cache with (``workers.cache_salt``)."""
        return f"{self.prefix}:cache_salt_secret"

    def sim_kv_hold(self) -> str:
        """Simulation only: the share of every simulated engine's KV memory held by something
        other than its requests (a float; ``laneway drill memory`` sets it, with a TTL)."""
        return f"{self.prefix}:sim:kv_hold"

    def scaling(self, pool: str) -> str:
        """A pool's latest ``ScalingDecision`` (JSON), written by the pool's lead worker."""
        return f"{self.prefix}:scaling:{pool}"

    def usage_held(self, request_id: str) -> str:
        """A finished interactive request's usage event, until the broker stores it
        (``workers.outbox``)."""
        return f"{self.prefix}:usage-held:{request_id}"

    def cancels(self) -> str:
        """Pub/sub channel that carries each cancel tombstone ahead of ``laneway.cancel``."""
        return f"{self.prefix}:cancels"

    def fleet(self, engine_id: str) -> str:
        """A shared engine's members: worker id → its share state (a hash), and the pub/sub
        channel of the same name that carries each change as it happens."""
        return f"{self.prefix}:fleet:{engine_id}"

    def legacy_probe_key(self) -> str:
        """Where versions before key hashing kept the prober's API key in plain text (the
        prober deletes it, and the key's record, when it starts)."""
        return f"{self.prefix}:probe:key"

    def file(self, file_id: str) -> str:
        """An uploaded or result file of the Files API: its object and where its bytes are."""
        return f"{self.prefix}:file:{file_id}"

    def batch(self, batch_id: str) -> str:
        """A batch of the Batches API: its object and how far its results were counted."""
        return f"{self.prefix}:batch:{batch_id}"

    def team_stored(self, team: str) -> str:
        """What a team stored on Kafka through the Files and Batches API within their life:
        ``<kind>:<id>:<bytes>`` scored by when (``LANEWAY_TEAM_STORED_BYTES``)."""
        return f"{self.prefix}:stored:{team}"

    def team_batches(self, team: str) -> str:
        """A team's batch ids scored by creation time (``GET /v1/batches``)."""
        return f"{self.prefix}:batches:{team}"

    def batch_cancelled(self, team: str, job_id: str) -> str:
        """Set while a team's batch job is cancelled: workers answer its remaining lines at
        once. Per team: another team's job of the same id (on its own topic) runs on."""
        return f"{self.prefix}:batch:cancelled:{job_id}:{team}"

    def cancel_rate(self, team: str) -> str:
        """``DELETE /v1/requests/{id}`` calls of a team in the current second (a counter)."""
        return f"{self.prefix}:ratelimit:cancel:{team}"

    def quota_factor(self, team: str) -> str:
        """Dynamic quota factor of a team (a float as text), written by the streams app."""
        return f"{self.prefix}:quota:factor:{team}"

    def quota_bucket(self, team: str, pool: str) -> str:
        """Token bucket of a team's pool (interactive or batch): a hash."""
        return f"{self.prefix}:quota:bucket:{team}:{pool}"

    def quota_reservations(self, team: str) -> str:
        """Open reservations of a team: request id → "<pool> <tokens>"."""
        return f"{self.prefix}:quota:resv:{team}"

    def quota_settled(self, team: str, slot: int, *, lines: bool = False) -> str:
        """Requests settled already: a hash per time slot. Batch lines' (``lines``: kept a
        day) apart from interactive requests' (kept minutes, and many more): in one hash,
        either's expiry would be the other's."""
        if lines:
            return f"{self.prefix}:quota:settled:{team}:{slot}"
        return f"{self.prefix}:quota:settled-now:{team}:{slot}"

    def quota_used(self, team: str, pool: str, hour: int) -> str:
        """Tokens settled by a team's pool in one hour (epoch hour)."""
        return f"{self.prefix}:quota:used:{team}:{pool}:{hour}"

    def canary(self, model: str) -> str:
        """A model's canary (``laneway.canary.CanaryState`` as JSON)."""
        return f"{self.prefix}:canary:{model}"

    def canaries(self) -> str:
        """The set of models that have a canary record."""
        return f"{self.prefix}:canaries"

    def shadow(self, model: str) -> str:
        """A model's shadow route (``laneway.shadow.ShadowState`` as JSON)."""
        return f"{self.prefix}:shadow:{model}"

    def shadows(self) -> str:
        """The set of models that have a shadow record."""
        return f"{self.prefix}:shadows"

    def shadow_comparison(self, model: str) -> str:
        """The streams app's shadow-against-primary figures of a model (JSON)."""
        return f"{self.prefix}:shadow-comparison:{model}"

    def breaker(self, route: str, team: str | None = None) -> str:
        """Breaker state of a model route (or of one team on it): JSON with ``level``."""
        if team is None:
            return f"{self.prefix}:breaker:route:{route}"
        return f"{self.prefix}:breaker:team:{route}:{team}"
