"""Submitting a batch: its input file's lines and the job's header, written to Kafka in one
transaction, so a submission cut short runs no line at all.

Submissions run in the background, a few at a time and one at a time a team: each holds
its file's text, and a team that creates many at once must wait behind its own batches,
never another team's behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from ingress.batch_records import BatchRecord, BatchRecords, started, unsettled
from ingress.files import FileRecord, FileStore
from ingress.settings import IngressSettings
from laneway.batch import claimed_ids, parse_input
from laneway.clients import make_producer
from laneway.errors import BadRequest, LanewayError, RateLimited
from laneway.schema import BatchJob, BatchRequest
from laneway.tasks import stop_task

__all__ = ["BatchSubmissions"]

log = logging.getLogger(__name__)

# Submissions a replica runs at once (each holds its file's text, up to LANEWAY_MAX_FILE_BYTES);
# the others wait in validating, well within the time others leave a batch to its replica.
# One at a time a team: a team that creates hundreds at once waits behind its own, not
# every other team behind it, and a team has this many waiting on a replica at most (429).
_SUBMITTING_AT_ONCE = 2
_TEAM_WAITING_MAX = 8
# Lines parsed and queued between two looks at the event loop: a file of 50,000 lines is
# seconds of work, which the replica's interactive requests must not wait behind.
_LINES_A_TURN = 200


class BatchSubmissions:
    """The batches this replica is submitting, each a task that queues its lines."""

    def __init__(self, settings: IngressSettings, records: BatchRecords, files: FileStore) -> None:
        self.settings = settings
        self.records = records
        self.files = files
        self.topics = settings.topics
        self._submitting: dict[str, asyncio.Task[None]] = {}
        self._submit_turns = asyncio.Semaphore(_SUBMITTING_AT_ONCE)
        self._team_turns: dict[str, asyncio.Lock] = {}
        self._team_waiting: dict[str, int] = {}

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self._submitting

    def hold_room(self, team: str) -> None:
        """A place among the team's batches waiting on this replica (a 429 when none is
        left), held from here through the create's awaits until its submission ends or
        ``let_go_room``: creates at once cannot all take the last place."""
        waiting = self._team_waiting.get(team, 0)
        if waiting >= _TEAM_WAITING_MAX:
            raise RateLimited(
                f"team {team!r} has {waiting} batches being queued on this ingress already; "
                "create this one once they are in progress",
                team=team,
                limit=_TEAM_WAITING_MAX,
                retry_after=5.0,
            )
        self._team_waiting[team] = waiting + 1

    def let_go_room(self, team: str) -> None:
        """Give back a place ``hold_room`` held: its submission ended, or its create failed
        before the submission began."""
        left = self._team_waiting.get(team, 1) - 1
        if left > 0:
            self._team_waiting[team] = left
        else:
            self._team_waiting.pop(team, None)
            self._team_turns.pop(team, None)

    def submit(self, record: BatchRecord, file: FileRecord) -> None:
        """Queue the lines of ``file`` in the background, in the team's turn, in the place
        ``hold_room`` held (given back when the submission ends)."""
        team, batch_id = record.team, record.id
        task = asyncio.create_task(self._submit(record, file), name=f"submit-{batch_id}")
        self._submitting[batch_id] = task
        task.add_done_callback(lambda _: self._submitted(team, batch_id))

    async def stop(self, grace_s: float) -> None:
        """Submissions under way get ``grace_s`` to finish; one cut short writes nothing."""
        pending = list(self._submitting.values())
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
        for task in list(self._submitting.values()):
            await stop_task(task)

    async def uncount(self, record: BatchRecord, file: FileRecord) -> None:
        """The batch's lines were not stored: its team's allowance gets them back."""
        with contextlib.suppress(RedisError, OSError):
            await self.files.stored.give_back(record.team, f"batch:{record.id}", file.bytes)

    def _submitted(self, team: str, batch_id: str) -> None:
        self._submitting.pop(batch_id, None)
        self.let_go_room(team)

    async def _submit(self, record: BatchRecord, file: FileRecord) -> None:
        """Queue the lines of ``file``, or fail the batch saying why."""
        async with self._team_turns.setdefault(record.team, asyncio.Lock()), self._submit_turns:
            try:
                current = await self.records.load(record.id)
            except (RedisError, OSError):
                current = None  # as if still validating: the submission says what fails
            if current is not None and current.status not in ("validating", "cancelling"):
                # Given up on while it waited its turn (another replica took it for lost):
                # its lines must not run now, uncounted; what it took of its team's stored
                # bytes is given back (nothing of it is written).
                log.warning("batch %s is %s: not queued", record.id, current.status)
                await self.uncount(record, file)
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
        except _GivenUp as exc:
            log.warning("%s", exc)
            await self.uncount(record, file)  # its transaction was aborted
        except LanewayError as exc:
            await self.records.fail(record.id, "invalid_file", str(exc))
            await self.uncount(record, file)  # its transaction wrote nothing
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
                    await self.records.fail(record.id, "not_queued", why)
                    # Nothing of it stays on Kafka: created again, it is not counted twice.
                    await self.uncount(record, file)

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
            topic = self.topics.batch_http
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
            results = self.topics.results_batch_http
            meta = await (await producer.send(results, header.to_json(), key=key))

            def queued(current: BatchRecord) -> BatchRecord | None:
                if not unsettled(current):
                    return None  # given up on meanwhile (taken for lost): not committed
                return current.model_copy(
                    update={
                        "results_topic": results,
                        "partition": meta.partition,
                        "header_offset": meta.offset,
                        "scanned_to": meta.offset + 1,
                        "total": lines,
                    }
                )

            stored = await self.records.update(batch_id, queued)
            if stored.header_offset != meta.offset:
                # Raised inside the transaction, which is aborted: none of its lines runs
                # under a batch its client was told had failed.
                raise _GivenUp(f"batch {batch_id} is {stored.status}: its lines are not queued")
        now = int(self.records.clock())
        await self.records.update(batch_id, lambda current: started(current, now))


class _GivenUp(Exception):
    """The batch was given up on while its lines were being written (another replica took
    its submission for lost): the transaction is aborted."""


async def _claimed_ids_in_turns(lines: list[str]) -> set[str]:
    """``claimed_ids`` of ``lines``, letting the event loop run between slices."""
    claimed: set[str] = set()
    for start in range(0, len(lines), _LINES_A_TURN):
        claimed |= claimed_ids(lines[start : start + _LINES_A_TURN])
        await asyncio.sleep(0)
    return claimed
