"""The Batches API: a batch is a job on the batch lane, submitted by the ingress for the
team of the key that created it.

Creating one reads its input file (``ingress.files``) and writes the job's header and every
line to Kafka in one transaction: the batch workers read ``read_committed``, so a submission
cut short runs no line at all. Progress is counted off ``laneway.results.batch`` (the
exactly-once results) when someone asks: each read goes on from where the last stopped, and
a compare-and-set in Redis keeps replicas that read at once from counting a result twice.
Once every line has its result the batch's output and error files are ranges of that topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from ingress.batch_records import BatchRecord, BatchRecords, CreateBatch, Status
from ingress.files import FileRecord, FileStore
from ingress.settings import IngressSettings
from laneway.batch import claimed_ids, output_line_bytes, parse_input, results_record
from laneway.clients import make_consumer, make_producer
from laneway.constants import FILE_RETENTION_S
from laneway.errors import BadRequest, LanewayError, NotFound, RateLimited
from laneway.schema import BatchJob, BatchRequest, BatchResult
from laneway.tasks import stop_task

__all__ = ["BatchBook"]

log = logging.getLogger(__name__)

_COUNTING: tuple[Status, ...] = ("in_progress", "cancelling")
# A batch still validating this long after its creation, with no line written, lost the
# replica that was submitting it (a submission takes seconds).
_VALIDATING_GIVE_UP_S = 600
# Others leave a batch this young to the replica submitting it.
_VALIDATING_OWNED_S = 30
# Submissions a replica runs at once (each holds its file's text, up to LANEWAY_MAX_FILE_BYTES);
# the others wait in validating, well within the time others leave a batch to its replica.
# One at a time a team: a team that creates hundreds at once waits behind its own, not
# every other team behind it, and a team has this many waiting on a replica at most (429).
_SUBMITTING_AT_ONCE = 2
_TEAM_WAITING_MAX = 8
# Lines parsed and queued between two looks at the event loop: a file of 50,000 lines is
# seconds of work, which the replica's interactive requests must not wait behind.
_LINES_A_TURN = 200


class BatchBook:
    """Creates, follows and cancels the batches of this replica's callers."""

    def __init__(
        self,
        settings: IngressSettings,
        redis: aioredis.Redis,
        files: FileStore,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.files = files
        self.topics = settings.topics
        self.keys = settings.keys
        # One reader of the results topic, for the short counting reads (file downloads
        # have consumers of their own).
        self.records = BatchRecords(redis, settings.keys)
        self._reader = make_consumer(settings, isolation_level="read_committed")
        self._reading = asyncio.Lock()
        self._submitting: dict[str, asyncio.Task[None]] = {}
        self._submit_turns = asyncio.Semaphore(_SUBMITTING_AT_ONCE)
        self._team_turns: dict[str, asyncio.Lock] = {}
        self._team_waiting: dict[str, int] = {}

    async def start(self) -> None:
        await self._reader.start()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Submissions under way get ``grace_s`` to finish; one cut short writes nothing."""
        pending = list(self._submitting.values())
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
        for task in list(self._submitting.values()):
            await stop_task(task)
        await self._reader.stop()

    # --- the API ------------------------------------------------------------------------

    async def create(self, team: str, body: CreateBatch, batch_id: str) -> BatchRecord:
        waiting = self._team_waiting.get(team, 0)
        if waiting >= _TEAM_WAITING_MAX:
            raise RateLimited(
                f"team {team!r} has {waiting} batches being queued on this ingress already; "
                "create this one once they are in progress",
                team=team,
                limit=_TEAM_WAITING_MAX,
                retry_after=5.0,
            )
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
        now = int(time.time())
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
            await asyncio.shield(self._uncount(record, file))
            raise
        task = asyncio.create_task(self._submit(record, file), name=f"submit-{batch_id}")
        self._submitting[batch_id] = task
        # Counted now, not from before the awaits: two of one team's creates at once would
        # both count from the same number.
        self._team_waiting[team] = self._team_waiting.get(team, 0) + 1
        task.add_done_callback(lambda _: self._submitted(team, batch_id))
        return record

    async def _uncount(self, record: BatchRecord, file: FileRecord) -> None:
        """The batch's lines were not stored: its team's allowance gets them back."""
        with contextlib.suppress(RedisError, OSError):
            await self.files.stored.give_back(record.team, f"batch:{record.id}", file.bytes)

    def _submitted(self, team: str, batch_id: str) -> None:
        self._submitting.pop(batch_id, None)
        left = self._team_waiting.get(team, 1) - 1
        if left > 0:
            self._team_waiting[team] = left
        else:
            self._team_waiting.pop(team, None)
            self._team_turns.pop(team, None)

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
        await self.redis.set(self.keys.batch_cancelled(batch_id), b"1", ex=FILE_RETENTION_S)
        now = int(time.time())

        def cancelling(current: BatchRecord) -> BatchRecord | None:
            if current.status not in ("validating", "in_progress"):
                return None
            return current.model_copy(update={"status": "cancelling", "cancelling_at": now})

        return await self._refresh(await self.records.update(batch_id, cancelling))

    # --- submission ---------------------------------------------------------------------

    async def _submit(self, record: BatchRecord, file: FileRecord) -> None:
        """Queue the lines of ``file``, or fail the batch saying why."""
        async with self._team_turns.setdefault(record.team, asyncio.Lock()), self._submit_turns:
            try:
                current = await self.records.load(record.id)
            except (RedisError, OSError):
                current = None  # as if still validating: the submission says what fails
            if current is not None and current.status not in ("validating", "cancelling"):
                # Given up on while it waited its turn (another replica took it for lost):
                # its lines must not run now, uncounted.
                log.warning("batch %s is %s: not queued", record.id, current.status)
                return
            await self._submit_now(record, file)

    async def _submit_now(self, record: BatchRecord, file: FileRecord) -> None:
        try:
            lines = await self.files.lines(file)
            claimed = await _claimed_ids_in_turns(lines)
            # Parsed one at a time as they are sent: a large file is never held as objects.
            requests = parse_input(
                lines,
                job_id=record.id,
                team=record.team,
                endpoint=record.endpoint,
                claimed=claimed,
            )
            producer = make_producer(
                self.settings,
                transactional_id=f"{self.topics.prefix}.batches.{record.id}",
                linger_ms=20,
            )
            await producer.start()
            try:
                await self._write(producer, record, file.id, requests)
            finally:
                await producer.stop()
        except LanewayError as exc:
            await self._fail(record.id, "invalid_file", str(exc))
            await self._uncount(record, file)  # its transaction wrote nothing
        except Exception as exc:
            if isinstance(exc, (KafkaError, RedisError, OSError)):
                log.warning("batch %s not queued: %r", record.id, exc)
                why = "the batch's lines could not be queued; create it again"
            else:  # a fault of laneway's own
                log.exception("batch %s not queued", record.id)
                why = "laneway could not queue the batch's lines"
            # Before the lines were committed the batch fails at once, rather than waiting in
            # validating until it is given up on. After (its header's offset stored: a Redis
            # error just after the commit, a commit whose outcome is unknown), recovery reads
            # what the transaction did: failed, the batch's lines would run all the same, and
            # a client told to create it again would have each run twice.
            with contextlib.suppress(RedisError, OSError):
                stored = await self.records.load(record.id)
                if stored is not None and stored.header_offset is None:
                    await self._fail(record.id, "not_queued", why)
                    # Nothing of it stays on Kafka: created again, it is not counted twice.
                    await self._uncount(record, file)

    async def _write(
        self,
        producer: AIOKafkaProducer,
        batch: BatchRecord,
        source: str,
        requests: Iterable[BatchRequest],
    ) -> None:
        """The lines, then the job's header, in one transaction. The header's offset is
        stored before the commit: whoever finds the batch still validating later can tell
        from it whether the transaction committed."""
        batch_id = batch.id
        key = batch_id.encode()
        async with producer.transaction():
            topic = self.topics.request("batch")
            lines = 0
            for request in requests:
                line_key = f"{batch_id}:{request.line_id}".encode()
                await producer.send(topic, request.to_json(), key=line_key)
                lines += 1
                if lines % _LINES_A_TURN == 0:
                    await asyncio.sleep(0)  # a send with room in its buffer never yields
            if not lines:
                raise BadRequest("the input file has no request lines", param="input_file_id")
            header = BatchJob(job_id=batch_id, team=batch.team, lines=lines, source=source)
            meta = await (await producer.send(self.topics.results_batch, header.to_json(), key=key))
            await self.records.update(
                batch_id,
                lambda current: current.model_copy(
                    update={
                        "partition": meta.partition,
                        "header_offset": meta.offset,
                        "scanned_to": meta.offset + 1,
                        "total": lines,
                    }
                ),
            )
        now = int(time.time())
        await self.records.update(batch_id, lambda current: _started(current, now))

    async def _fail(self, batch_id: str, code: str, message: str) -> None:
        now = int(time.time())

        def failed(current: BatchRecord) -> BatchRecord | None:
            if current.status not in ("validating", "cancelling"):
                return None
            error = {"code": code, "message": message, "param": "input_file_id", "line": None}
            if current.status == "cancelling":
                return current.model_copy(update={"status": "cancelled", "cancelled_at": now})
            return current.model_copy(
                update={"status": "failed", "failed_at": now, "errors": [error]}
            )

        with contextlib.suppress(RedisError, OSError):
            await self.records.update(batch_id, failed)

    # --- progress -----------------------------------------------------------------------

    async def _refresh(self, record: BatchRecord) -> BatchRecord:
        if _unsettled(record) and record.id not in self._submitting:
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
        tp = TopicPartition(self.topics.results_batch, record.partition)
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
        now = int(time.time())

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
                created_at=record.finalizing_at or int(time.time()),
                expires_at=record.created_at + FILE_RETENTION_S,
                partition=record.partition,
                first_offset=record.header_offset,
                last_offset=record.scanned_to - 1,
                job_id=record.id,
                results_ok=ok,
            )
            await self.files.put(file)
            made[kind] = file.id
        now = int(time.time())

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
        age = time.time() - record.created_at
        if age < _VALIDATING_OWNED_S:
            return record
        if record.header_offset is None or record.partition is None:
            if age > _VALIDATING_GIVE_UP_S:
                await self._fail(
                    record.id,
                    "not_queued",
                    "the ingress submitting this batch stopped before "
                    "it queued a line; create the batch again",
                )
                return await self.records.load(record.id) or record
            return record
        tp = TopicPartition(self.topics.results_batch, record.partition)
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
            await self._fail(
                record.id,
                "not_queued",
                "the batch's submission was cut short; create the batch again",
            )
            return await self.records.load(record.id) or record
        now = int(time.time())
        return await self.records.update(record.id, lambda current: _started(current, now))


def _unsettled(record: BatchRecord) -> bool:
    """Whether it is not known yet if the batch's lines were queued: validating, or
    cancelled while it was (``in_progress_at`` is set once they are)."""
    return record.status == "validating" or (
        record.status == "cancelling" and record.in_progress_at is None
    )


async def _claimed_ids_in_turns(lines: list[str]) -> set[str]:
    """``claimed_ids`` of ``lines``, letting the event loop run between slices."""
    claimed: set[str] = set()
    for start in range(0, len(lines), _LINES_A_TURN):
        claimed |= claimed_ids(lines[start : start + _LINES_A_TURN])
        await asyncio.sleep(0)
    return claimed


def _started(current: BatchRecord, now: int) -> BatchRecord | None:
    """Its lines are queued: in progress, or, cancelled meanwhile, cancelling on (its lines
    are answered "cancelled"); None when that is known already."""
    if not _unsettled(current):
        return None
    if current.status == "cancelling":
        return current.model_copy(update={"in_progress_at": now})
    return current.model_copy(update={"status": "in_progress", "in_progress_at": now})
