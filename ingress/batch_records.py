"""Batch objects in Redis: what the Batches API answers, and how far each batch's results
were counted. Changes are compare-and-set, so replicas that change a batch at once (two
counting the same results, a cancel during a count) never lose or double an update. The
changes that submitting and following a batch both make (started, failed) are here too."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from laneway.constants import FILE_RETENTION_S, RedisKeys, object_id_keyable
from laneway.errors import NotFound

__all__ = ["BatchRecord", "BatchRecords", "CreateBatch", "Status", "started", "unsettled"]

Status = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
# Compare and set: the record changes only if it is still what the change was decided on.
_SWAP = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
  return 1
end
return 0
"""


class CreateBatch(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    # OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512.
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = Field(None, max_length=16)


class BatchRecord(BaseModel):
    """A batch's object and its progress, as Redis keeps it."""

    model_config = ConfigDict(extra="ignore")

    id: str
    team: str
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    status: Status = "validating"
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    errors: list[dict[str, Any]] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    # Where its results are: the topic (None: laneway.results.batch, where a batch made
    # before laneway.results.batch.http existed has them), the partition, its header's
    # offset, and how far that partition was counted.
    results_topic: str | None = None
    partition: int | None = None
    header_offset: int | None = None
    scanned_to: int | None = None
    output_bytes: int = 0
    error_bytes: int = 0

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": None,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }


class BatchRecords:
    """The batch records of one Redis, with each team's index of them."""

    def __init__(
        self, redis: aioredis.Redis, keys: RedisKeys, clock: Callable[[], float] = time.time
    ) -> None:
        self.redis = redis
        self.keys = keys
        # Redis's clock (``laneway.clock``): every replica stamps and ages batches on it, so
        # one whose own clock is off neither gives up on another's batch early nor late.
        self.clock = clock

    async def insert(self, record: BatchRecord) -> None:
        index = self.keys.team_batches(record.team)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.batch(record.id), record.model_dump_json(), ex=FILE_RETENTION_S)
            pipe.zadd(index, {record.id: self.clock()})
            pipe.zremrangebyscore(index, "-inf", record.created_at - FILE_RETENTION_S)
            pipe.expire(index, FILE_RETENTION_S)
            await pipe.execute()

    async def count(self, team: str) -> int:
        """How many batches the team has within their life (``FILE_RETENTION_S``)."""
        index = self.keys.team_batches(team)
        await self.redis.zremrangebyscore(index, "-inf", self.clock() - FILE_RETENTION_S)
        return int(await self.redis.zcard(index))

    async def team_ids(self, team: str) -> list[str]:
        """The team's batch ids, newest first."""
        ids = await self.redis.zrevrange(self.keys.team_batches(team), 0, -1)
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    async def forget(self, team: str, batch_id: str) -> None:
        """Drop an expired batch from its team's index."""
        await self.redis.zrem(self.keys.team_batches(team), batch_id)

    async def load(self, batch_id: str) -> BatchRecord | None:
        if not object_id_keyable(batch_id):
            return None
        raw = await self.redis.get(self.keys.batch(batch_id))
        return BatchRecord.model_validate_json(raw) if raw is not None else None

    async def update(
        self, batch_id: str, change: Callable[[BatchRecord], BatchRecord | None]
    ) -> BatchRecord:
        """Apply ``change`` to the stored record atomically (None: leave it); the record
        as stored afterwards."""
        key = self.keys.batch(batch_id)
        while True:
            raw = await self.redis.get(key)
            if raw is None:
                raise NotFound(f"no batch {batch_id!r}", param="batch_id")
            current = BatchRecord.model_validate_json(raw)
            changed = change(current)
            if changed is None:
                return current
            if await self.redis.eval(_SWAP, 1, key, raw, changed.model_dump_json()):
                return changed
            # Another replica changed it since: decide again on what it stored.

    async def fail(
        self, batch_id: str, code: str, message: str, *, aborted_header: int | None = None
    ) -> None:
        """The batch's lines were not queued: failed, saying why (cancelled, if it was being
        cancelled); a batch that moved on already is left as it is, and so is one whose
        header's offset is stored unless ``aborted_header`` is that offset (recovery read
        from Kafka that its transaction was aborted). Whether a stored header's lines run is
        read, never guessed: its submitter may have got as far as the commit."""
        now = int(self.clock())

        def failed(current: BatchRecord) -> BatchRecord | None:
            if current.status not in ("validating", "cancelling"):
                return None
            if current.header_offset not in (None, aborted_header):
                return None
            error = {"code": code, "message": message, "param": "input_file_id", "line": None}
            if current.status == "cancelling":
                return current.model_copy(update={"status": "cancelled", "cancelled_at": now})
            return current.model_copy(
                update={"status": "failed", "failed_at": now, "errors": [error]}
            )

        with contextlib.suppress(RedisError, OSError):
            await self.update(batch_id, failed)


def unsettled(record: BatchRecord) -> bool:
    """Whether it is not known yet if the batch's lines were queued: validating, or
    cancelled while it was (``in_progress_at`` is set once they are)."""
    return record.status == "validating" or (
        record.status == "cancelling" and record.in_progress_at is None
    )


def started(current: BatchRecord, now: int) -> BatchRecord | None:
    """Its lines are queued: in progress, or, cancelled meanwhile, cancelling on (its lines
    are answered "cancelled"); None when that is known already."""
    if not unsettled(current):
        return None
    if current.status == "cancelling":
        return current.model_copy(update={"in_progress_at": now})
    return current.model_copy(update={"status": "in_progress", "in_progress_at": now})
