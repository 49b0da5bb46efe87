"""The Files API's storage: bytes on Kafka, objects in Redis.

An uploaded file goes to ``laneway.files`` in chunks keyed by its id (one partition, in
order); Redis keeps its object and where the chunks are. A batch's output and error files
are not copies: they are ranges of ``laneway.results.batch``, the exactly-once results
themselves, filtered to the batch and to ok (output) or not (errors). Redis holds only small
objects, so a large upload can never fill the memory that quota buckets and keys live in.
"""

from __future__ import annotations

import asyncio
import codecs
import secrets
import time
from collections.abc import AsyncIterator
from typing import IO, Any, Literal

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from pydantic import BaseModel, ConfigDict

from ingress.settings import IngressSettings
from laneway.batch import output_line_bytes, results_record
from laneway.clients import make_consumer, start_client
from laneway.constants import FILE_RETENTION_S, RedisKeys, Topics, object_id_keyable
from laneway.errors import BadRequest, BodyTooLarge, NotFound, RateLimited
from laneway.schema import BatchResult

__all__ = ["FileRecord", "FileStore", "StoredBytes", "TeamTransfers", "read_range"]

# A chunk is one Kafka record: well below the 1 MiB a record may have by default.
_CHUNK_BYTES = 512 * 1024


class FileRecord(BaseModel):
    """A file's object and where its bytes are, as Redis keeps it."""

    model_config = ConfigDict(extra="ignore")

    id: str
    team: str
    purpose: Literal["batch", "batch_output"]
    filename: str
    bytes: int
    created_at: int
    expires_at: int
    partition: int
    # upload: the offsets of its first and last chunk on laneway.files
    first_offset: int = 0
    last_offset: int = -1
    # a batch's output or errors: the range of its results topic that holds them (None:
    # laneway.results.batch, a batch made before laneway.results.batch.http existed)
    job_id: str | None = None
    results_topic: str | None = None
    results_ok: bool = True

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


# File uploads and downloads one team may have under way on one replica at once.
_TEAM_TRANSFERS_MAX = 8

# Each stored thing counts at least this much: a team's ledger (and the file records beside
# it) stays within allowance / 1 MiB entries, however small its files.
_LEAST_COUNTED = 1024 * 1024

# KEYS: 1 the team's entries (``<kind>:<id>:<bytes>`` scored by when), 2 their running total.
# Drops the entries older than ARGV[2] from both, then adds ARGV[3] (ARGV[5] bytes) at
# ARGV[1] if the total stays within ARGV[4]; returns -1 when added, else the total stored.
# The total is kept beside the entries: summed on every call, a full team's ten thousand
# entries would hold Redis (every team's quota scripts) for each of its uploads.
_TAKE = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
local total = tonumber(redis.call('GET', KEYS[2]) or '0')
for _, entry in ipairs(expired) do
  total = total - tonumber(string.match(entry, ':(%d+)$'))
end
if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2]) end
if total < 0 or redis.call('EXISTS', KEYS[1]) == 0 then total = 0 end
if total + tonumber(ARGV[5]) > tonumber(ARGV[4]) then
  redis.call('SET', KEYS[2], total, 'EX', ARGV[6])
  return total
end
if redis.call('ZADD', KEYS[1], ARGV[1], ARGV[3]) == 1 then total = total + tonumber(ARGV[5]) end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('SET', KEYS[2], total, 'EX', ARGV[6])
return -1
"""

# KEYS as _TAKE's; ARGV: 1 the entry, 2 its bytes. Uncounts it if it is there.
_GIVE_BACK = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  local total = tonumber(redis.call('GET', KEYS[2]) or '0') - tonumber(ARGV[2])
  redis.call('SET', KEYS[2], math.max(total, 0), 'KEEPTTL')
end
return 1
"""


class StoredBytes:
    """What each team stored on Kafka through the Files and Batches API within its 7 days,
    against ``LANEWAY_TEAM_STORED_BYTES``: one team cannot fill the brokers' disks (nor
    Redis, with the records of millions of small files) for every other."""

    def __init__(self, settings: IngressSettings, redis: aioredis.Redis) -> None:
        self.limit = settings.team_stored_bytes
        self.redis = redis
        self.keys: RedisKeys = settings.keys
        self._take = redis.register_script(_TAKE)
        self._give_back = redis.register_script(_GIVE_BACK)

    def _keys(self, team: str) -> list[str]:
        entries = self.keys.team_stored(team)
        return [entries, f"{entries}:total"]

    async def take(self, team: str, what: str, size: int) -> None:
        """Count ``size`` bytes of ``what`` (``file:<id>``, ``batch:<id>``) against
        ``team``'s allowance, or raise ``RateLimited`` naming the setting."""
        counted = max(size, _LEAST_COUNTED)
        now = time.time()
        total = int(
            await self._take(
                keys=self._keys(team),
                args=[
                    now,
                    now - FILE_RETENTION_S,
                    f"{what}:{counted}",
                    self.limit,
                    counted,
                    FILE_RETENTION_S,
                ],
            )
        )
        if total >= 0:
            raise RateLimited(
                f"team {team!r} stored {total} bytes within the last 7 days; {size} more "
                f"(each counted as at least {_LEAST_COUNTED}) would pass its allowance of "
                f"{self.limit} (LANEWAY_TEAM_STORED_BYTES)",
                team=team,
                limit=self.limit,
                retry_after=3600.0,
            )

    async def give_back(self, team: str, what: str, size: int) -> None:
        """Uncount what ``take`` counted and was not stored after all."""
        counted = max(size, _LEAST_COUNTED)
        await self._give_back(keys=self._keys(team), args=[f"{what}:{counted}", counted])


class TeamTransfers:
    """Uploads and downloads each team has under way on this replica, at most ``limit`` at
    once (429 beyond): each holds a Kafka consumer or a spooled file of up to 100 MiB, and
    one team's thousand slow ones would use up the replica's connections and disk."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def take(self, team: str) -> None:
        held = self._open.get(team, 0)
        if held >= self.limit:
            raise RateLimited(
                f"team {team!r} has {held} file uploads and downloads under way on this "
                "ingress already; start this one once one of them ended",
                team=team,
                limit=self.limit,
                retry_after=1.0,
            )
        self._open[team] = held + 1

    def give_back(self, team: str) -> None:
        held = self._open.get(team, 0) - 1
        if held > 0:
            self._open[team] = held
        else:
            self._open.pop(team, None)


class FileStore:
    def __init__(
        self, settings: IngressSettings, redis: aioredis.Redis, producer: AIOKafkaProducer
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.producer = producer
        self.topics: Topics = settings.topics
        self.keys: RedisKeys = settings.keys
        self.stored = StoredBytes(settings, redis)
        self.transfers = TeamTransfers(_TEAM_TRANSFERS_MAX)

    async def get(self, file_id: str, team: str, *, param: str = "file_id") -> FileRecord:
        """The team's file ``file_id``; another team's is "not found" like a missing one."""
        keyable = object_id_keyable(file_id)
        raw = await self.redis.get(self.keys.file(file_id)) if keyable else None
        record = FileRecord.model_validate_json(raw) if raw is not None else None
        if record is None or record.team != team:
            raise NotFound(f"no file {file_id[:200]!r} of team {team!r}", param=param)
        return record

    async def put(self, record: FileRecord) -> None:
        ttl = max(1, record.expires_at - int(time.time()))
        await self.redis.set(self.keys.file(record.id), record.model_dump_json(), ex=ttl)

    async def upload(self, team: str, filename: str, data: IO[bytes]) -> FileRecord:
        """Check an uploaded batch input file, then store it; ``BadRequest`` names what is
        wrong with it (nothing is stored then)."""
        # A read of the whole file: off the event loop (it may be on disk, 100 MiB).
        size, _ = await asyncio.to_thread(_check_upload, data, self.settings)
        file_id = new_file_id()
        await self.stored.take(team, f"file:{file_id}", size)
        data.seek(0)
        try:
            sent = []
            while chunk := data.read(_CHUNK_BYTES):
                sent.append(
                    await self.producer.send(self.topics.files, chunk, key=file_id.encode())
                )
            stored = [await future for future in sent]
        except BaseException:
            await asyncio.shield(self.stored.give_back(team, f"file:{file_id}", size))
            raise
        now = int(time.time())
        record = FileRecord(
            id=file_id,
            team=team,
            purpose="batch",
            filename=filename[:255] or "input.jsonl",
            bytes=size,
            created_at=now,
            expires_at=now + FILE_RETENTION_S,
            partition=stored[0].partition,
            first_offset=stored[0].offset,
            last_offset=stored[-1].offset,
        )
        await self.put(record)
        return record

    async def content(self, record: FileRecord) -> AsyncIterator[bytes]:
        """The file's bytes, as uploaded (or as the batch's output lines)."""
        if record.job_id is None:
            tp = TopicPartition(self.topics.files, record.partition)
            key = record.id.encode()
            async for _, chunk_key, chunk in read_range(
                self.settings, tp, record.first_offset, record.last_offset + 1
            ):
                if chunk_key == key:
                    yield chunk
            return
        tp = TopicPartition(record.results_topic or self.topics.results_batch, record.partition)
        job = record.job_id.encode()
        seen: set[str] = set()
        async for _, rkey, value in read_range(
            self.settings, tp, record.first_offset, record.last_offset + 1, committed=True
        ):
            if rkey != job:
                continue
            result = results_record(value)
            if (
                not isinstance(result, BatchResult)
                or result.team != record.team
                or result.line_id in seen
            ):
                continue
            seen.add(result.line_id)  # one line per input line, whatever else was written
            if (result.status_code == 200) == record.results_ok:
                yield output_line_bytes(result)

    async def lines(self, record: FileRecord) -> list[str]:
        """The file's lines (split at ``\n`` alone), decoded as its chunks come: one copy of
        its text in memory, not its chunks, their join and its text at once."""
        decoder = codecs.getincrementaldecoder("utf-8")()
        lines: list[str] = []
        line: list[str] = []  # the pieces of a line that spans chunks
        try:
            async for chunk in self.content(record):
                *ended, rest = decoder.decode(chunk).split("\n")
                if ended:
                    line.append(ended[0])
                    lines.append("".join(line))
                    lines.extend(ended[1:])
                    line = []
                line.append(rest)
            line.append(decoder.decode(b"", final=True))
        except UnicodeDecodeError as exc:  # checked at upload: a file stored before that was
            raise BadRequest(f"file {record.id} is not UTF-8 text: {exc.reason}") from None
        lines.append("".join(line))
        return lines


def _check_upload(data: IO[bytes], settings: IngressSettings) -> tuple[int, int]:
    """Size and line count of an upload, which must be UTF-8 text of JSON lines."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    size = lines = 0
    last = b"\n"
    data.seek(0)
    while chunk := data.read(_CHUNK_BYTES):
        size += len(chunk)
        if size > settings.max_file_bytes:
            raise BodyTooLarge(
                f"file over the limit of {settings.max_file_bytes} bytes (LANEWAY_MAX_FILE_BYTES)",
                param="file",
            )
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as exc:
            raise BadRequest(
                f"file is not UTF-8 text (byte {size - len(chunk) + exc.start}): a batch input "
                "file has one JSON request per line",
                param="file",
            ) from None
        lines += chunk.count(b"\n")
        last = chunk[-1:]
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise BadRequest(
            f"file is not UTF-8 text: it ends inside a character (byte {size - 1})",
            param="file",
        ) from None
    if size == 0:
        raise BadRequest(
            "file is empty: a batch input file has one JSON request per line", param="file"
        )
    lines += last != b"\n"
    if lines > settings.batch_max_lines:
        raise BadRequest(
            f"file has {lines} lines, over the limit of {settings.batch_max_lines} "
            "(LANEWAY_BATCH_MAX_LINES)",
            param="file",
        )
    return size, lines


async def read_range(
    settings: IngressSettings, tp: TopicPartition, start: int, end: int, *, committed: bool = False
) -> AsyncIterator[tuple[int, bytes | None, bytes]]:
    """(offset, key, value) of the records of ``tp`` from ``start`` up to ``end`` (or the
    partition's end, if sooner), on a consumer of its own."""
    consumer: AIOKafkaConsumer = make_consumer(
        settings, isolation_level="read_committed" if committed else "read_uncommitted"
    )
    await start_client(consumer)  # a client that hangs up may cut the start short
    try:
        consumer.assign([tp])
        consumer.seek(tp, start)
        end = min(end, (await consumer.end_offsets([tp]))[tp])
        while await consumer.position(tp) < end:
            batches = await consumer.getmany(tp, timeout_ms=1000)
            for record in batches.get(tp, []):
                if record.offset >= end:
                    return
                yield record.offset, record.key, record.value
    finally:
        await consumer.stop()
