"""Following a batch: its progress is counted off ``laneway.results.batch`` (the exactly-once
results) when someone asks, each read going on from where the last stopped. Once every line
has its result the batch's output and error files are ranges of that topic. A batch left
validating by a replica that stopped is recovered from what its transaction did.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import TopicPartition

from ingress.batch_records import BatchRecord, BatchRecords, Status, started, unsettled
from ingress.files import FileRecord, FileStore
from ingress.settings import IngressSettings
from laneway.batch import output_line_bytes, results_record
from laneway.clients import make_consumer
from laneway.constants import FILE_RETENTION_S
from laneway.schema import BatchResult

__all__ = ["BatchProgress"]

_COUNTING: tuple[Status, ...] = ("in_progress", "cancelling")
# A batch still validating this long after its creation, with no line written, lost the
# replica that was submitting it (a submission takes seconds).
_VALIDATING_GIVE_UP_S = 600
# Others leave a batch this young to the replica submitting it.
_VALIDATING_OWNED_S = 30


class BatchProgress:
    """Brings batches up to date from their results: counts, final files, recovery."""

    def __init__(self, settings: IngressSettings, records: BatchRecords, files: FileStore) -> None:
        # One reader of the results topic, for the short counting reads (file downloads
        # have consumers of their own).
        self._reader = make_consumer(settings, isolation_level="read_committed")
        self._reading = asyncio.Lock()
        self.topics = settings.topics
        self.records = records
        self.files = files

    async def start(self) -> None:
        await self._reader.start()

    async def stop(self) -> None:
        await self._reader.stop()

    async def refresh(self, record: BatchRecord, *, submitting: bool) -> BatchRecord:
        """The batch as its results say it is now; ``submitting``: this replica is still
        queuing its lines, so it is not recovered."""
        if unsettled(record) and not submitting:
            record = await self._recover(record)
        if record.status in _COUNTING and record.scanned_to is not None:
            record = await self._count(record)
        if record.status == "finalizing":
            record = await self._finalize(record)
        return record

    async def _count(self, record: BatchRecord) -> BatchRecord:
        """Count the results written since the last count."""
        assert record.partition is not None
        assert record.scanned_to is not None
        tp = TopicPartition(record.results_topic or self.topics.results_batch, record.partition)
        job = record.id.encode()
        completed = failed = output_bytes = error_bytes = 0
        async with self._reading:
            self._reader.assign([tp])
            self._reader.seek(tp, record.scanned_to)
            end = (await self._reader.end_offsets([tp]))[tp]
            while await self._reader.position(tp) < end:
                batches = await self._reader.getmany(tp, timeout_ms=1000)
                for kafka_record in batches.get(tp, []):
                    if kafka_record.offset >= end or kafka_record.key != job:
                        continue
                    result = results_record(kafka_record.value)
                    # Only the batch's team's results count: whoever else may write the
                    # topic (an operator's batch service) cannot finish another's batch.
                    if not isinstance(result, BatchResult) or result.team != record.team:
                        continue
                    size = len(output_line_bytes(result))
                    if result.status_code == 200:
                        completed, output_bytes = completed + 1, output_bytes + size
                    else:
                        failed, error_bytes = failed + 1, error_bytes + size
        if end <= record.scanned_to:
            return record
        now = int(self.records.clock())

        def counted(current: BatchRecord) -> BatchRecord | None:
            if current.scanned_to != record.scanned_to or current.status not in _COUNTING:
                return None  # another replica counted these already
            update: dict[str, Any] = {
                "scanned_to": end,
                "completed": current.completed + completed,
                "failed": current.failed + failed,
                "output_bytes": current.output_bytes + output_bytes,
                "error_bytes": current.error_bytes + error_bytes,
            }
            if update["completed"] + update["failed"] >= current.total > 0:
                update.update(status="finalizing", finalizing_at=now)
            return current.model_copy(update=update)

        return await self.records.update(record.id, counted)

    async def _finalize(self, record: BatchRecord) -> BatchRecord:
        """Every line has its result: the output and error files, then the final status."""
        assert record.partition is not None
        assert record.header_offset is not None
        assert record.scanned_to is not None
        made: dict[str, str] = {}
        for kind, ok, count, size in (
            ("output", True, record.completed, record.output_bytes),
            ("errors", False, record.failed, record.error_bytes),
        ):
            if not count:
                continue
            # Named after the batch: replicas finalizing at once write the same object.
            file = FileRecord(
                id=f"file-{record.id}-{kind}",
                team=record.team,
                purpose="batch_output",
                filename=f"{record.id}_{kind}.jsonl",
                bytes=size,
                created_at=record.finalizing_at or int(self.records.clock()),
                expires_at=record.created_at + FILE_RETENTION_S,
                partition=record.partition,
                first_offset=record.header_offset,
                last_offset=record.scanned_to - 1,
                job_id=record.id,
                results_topic=record.results_topic,
                results_ok=ok,
            )
            await self.files.put(file)
            made[kind] = file.id
        now = int(self.records.clock())

        def finished(current: BatchRecord) -> BatchRecord | None:
            if current.status != "finalizing":
                return None
            update: dict[str, Any] = {
                "output_file_id": made.get("output"),
                "error_file_id": made.get("errors"),
            }
            if current.cancelling_at is not None:
                update.update(status="cancelled", cancelled_at=now)
            else:
                update.update(status="completed", completed_at=now)
            return current.model_copy(update=update)

        return await self.records.update(record.id, finished)

    async def _recover(self, record: BatchRecord) -> BatchRecord:
        """A batch left validating by a replica that stopped: its transaction either
        committed (the lines run: in progress) or not (nothing runs: failed)."""
        age = self.records.clock() - record.created_at
        if age < _VALIDATING_OWNED_S:
            return record
        if record.header_offset is None or record.partition is None:
            if age > _VALIDATING_GIVE_UP_S:
                await self.records.fail(
                    record.id,
                    "not_queued",
                    "the ingress submitting this batch stopped before "
                    "it queued a line; create the batch again",
                )
                return await self.records.load(record.id) or record
            return record
        tp = TopicPartition(record.results_topic or self.topics.results_batch, record.partition)
        committed: bool | None = None
        async with self._reading:
            self._reader.assign([tp])
            end = (await self._reader.end_offsets([tp]))[tp]
            if end <= record.header_offset:
                return record  # its transaction is still open
            self._reader.seek(tp, record.header_offset)
            while committed is None and await self._reader.position(tp) < end:
                batches = await self._reader.getmany(tp, timeout_ms=1000)
                for kafka_record in batches.get(tp, []):
                    committed = kafka_record.offset == record.header_offset
                    break
            committed = bool(committed)
        if not committed:
            await self.records.fail(
                record.id,
                "not_queued",
                "the batch's submission was cut short; create the batch again",
                aborted_header=record.header_offset,
            )
            return await self.records.load(record.id) or record
        now = int(self.records.clock())
        return await self.records.update(record.id, lambda current: started(current, now))
