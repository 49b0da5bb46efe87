"""The Batches API: a batch is a job on the batch lane, submitted by the ingress for the
team of the key that created it.

Creating one reads its input file (``ingress.files``) and queues its lines in the background
(``ingress.batch_submission``); asking for one brings its counts up to date from its results
(``ingress.batch_progress``), a compare-and-set in Redis keeping replicas that read at once
from counting a result twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from ingress.batch_progress import BatchProgress
from ingress.batch_records import BatchRecord, BatchRecords, CreateBatch
from ingress.batch_submission import BatchSubmissions
from ingress.files import FileRecord, FileStore
from ingress.settings import IngressSettings
from laneway.constants import FILE_RETENTION_S
from laneway.errors import BadRequest, NotFound, RateLimited

__all__ = ["BatchBook"]


class BatchBook:
    """Creates, follows and cancels the batches of this replica's callers."""

    def __init__(
        self,
        settings: IngressSettings,
        redis: aioredis.Redis,
        files: FileStore,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.files = files
        self.keys = settings.keys
        self.records = BatchRecords(redis, settings.keys, clock)
        self.submissions = BatchSubmissions(settings, self.records, files)
        self.progress = BatchProgress(settings, self.records, files)

    async def start(self) -> None:
        await self.progress.start()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Submissions under way get ``grace_s`` to finish; one cut short writes nothing."""
        await self.submissions.stop(grace_s)
        await self.progress.stop()

    async def create(self, team: str, body: CreateBatch, batch_id: str) -> BatchRecord:
        self.submissions.hold_room(team)
        try:
            record, file = await self._stored(team, body, batch_id)
        except BaseException:
            self.submissions.let_go_room(team)
            raise
        self.submissions.submit(record, file)
        return record

    async def _stored(
        self, team: str, body: CreateBatch, batch_id: str
    ) -> tuple[BatchRecord, FileRecord]:
        """The batch's record, stored with its file counted against the team's allowance."""
        stored = await self.records.count(team)
        if stored >= self.settings.batch_max_batches:
            raise RateLimited(
                f"team {team!r} has {stored} batches within the last 7 days, as many as it "
                "may keep (LANEWAY_BATCH_MAX_BATCHES); put more lines in one batch",
                team=team,
                limit=self.settings.batch_max_batches,
                retry_after=3600.0,
            )
        file = await self.files.get(body.input_file_id, team, param="input_file_id")
        if file.purpose != "batch":
            raise BadRequest(
                f"file {file.id} has purpose {file.purpose!r}; a batch reads a file uploaded "
                "with purpose 'batch'",
                param="input_file_id",
            )
        # Its lines are the file's bytes written once more (a file may be used again and
        # again): counted again.
        await self.files.stored.take(team, f"batch:{batch_id}", file.bytes)
        now = int(self.records.clock())
        record = BatchRecord(
            id=batch_id,
            team=team,
            endpoint=body.endpoint,
            input_file_id=file.id,
            metadata=body.metadata,
            created_at=now,
            expires_at=now + 24 * 3600,
        )
        try:
            await self.records.insert(record)
        except BaseException:
            await asyncio.shield(self.submissions.uncount(record, file))
            raise
        return record, file

    async def get(self, batch_id: str, team: str) -> BatchRecord:
        """The team's batch, its counts brought up to date; another team's is "not found"."""
        record = await self.records.load(batch_id)
        if record is None or record.team != team:
            raise NotFound(f"no batch {batch_id[:200]!r} of team {team!r}", param="batch_id")
        return await self._refresh(record)

    async def page(self, team: str, after: str | None, limit: int) -> dict[str, Any]:
        ids = await self.records.team_ids(team)
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page: list[BatchRecord] = []
        for batch_id in ids:
            if len(page) > limit:
                break
            record = await self.records.load(batch_id)
            if record is None:
                await self.records.forget(team, batch_id)  # expired with its results
                continue
            page.append(await self._refresh(record) if len(page) < limit else record)
        data = [r.public() for r in page[:limit]]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(page) > limit,
        }

    async def cancel(self, batch_id: str, team: str) -> BatchRecord:
        record = await self.get(batch_id, team)
        if record.status in ("cancelling", "cancelled"):
            return record
        if record.status not in ("validating", "in_progress"):
            raise BadRequest(
                f"batch {batch_id} is {record.status}: only a validating or in-progress batch "
                "can be cancelled",
                param="batch_id",
            )
        # Workers answer the lines they have not started yet with a "cancelled" result.
        await self.redis.set(self.keys.batch_cancelled(team, batch_id), b"1", ex=FILE_RETENTION_S)
        now = int(self.records.clock())

        def cancelling(current: BatchRecord) -> BatchRecord | None:
            if current.status not in ("validating", "in_progress"):
                return None
            return current.model_copy(update={"status": "cancelling", "cancelling_at": now})

        return await self._refresh(await self.records.update(batch_id, cancelling))

    async def _refresh(self, record: BatchRecord) -> BatchRecord:
        return await self.progress.refresh(record, submitting=record.id in self.submissions)
