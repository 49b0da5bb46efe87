"""The batch lane: lines of jobs in, exactly-once results out.

A batch line is checked like an HTTP request (key, model, limits); a bad line becomes an
error result for that line and the job goes on. Results and the usage event of each line
are written in one Kafka transaction together with the input offsets they complete, so a
crash anywhere neither loses nor duplicates a result: records wait in the ledger until every
line before them on their partition has finished, then go out with the offset commit.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis
from aiokafka import TopicPartition

from laneway.apikeys import lookup_team
from laneway.batch import batch_request_id
from laneway.cache import TtlCache
from laneway.constants import API_KEY_CACHE_S, RedisKeys, Topics
from laneway.errors import BadRequest, Cancelled, Expired, LanewayError, Unauthorized
from laneway.openai_api import ChatRequest, CompletionRequest, validate_body
from laneway.openai_format import error_body, final_body
from laneway.requests import shape_request
from laneway.schema import (
    BatchRequest,
    BatchResult,
    Outcome,
    Reply,
    RequestEnvelope,
    UsageEvent,
)
from laneway.settings import CommonSettings
from workers.answered import Answered

__all__ = [
    "BatchIntake",
    "BatchLedger",
    "KafkaRecord",
    "batch_request_id",
    "batch_result",
    "error_result",
]

KafkaRecord = tuple[str, bytes, bytes]  # topic, key, value

_STATUS_CODES = {
    "ok": 200,
    "error": 500,
    "rejected": 400,  # the engine refused the request itself (a prompt over its context)
    "unsupported": 400,  # the engine has not what it asks for (a suffix, on the vllm engine)
    "cancelled": 499,
    "aborted": 503,
    "expired": 504,
}


# The largest result record written: Kafka's largest record (1 MiB by default, for the
# producer and the broker) with room for the record's key and headers.
MAX_RESULT_BYTES = 1_000_000

# A cancelled job's lines stop within this long of the cancel on every worker.
_CANCEL_CHECK_S = 1.0


class BatchIntake:
    """Turns a batch line into an envelope, or raises the error that becomes its result.

    The line's team is the one its door vouched for (the ingress's authenticated key, or
    the ACL of the Kafka principal that wrote it); a line from before teams travelled on
    the topic names its team by its key, looked up once here.
    """

    def __init__(self, settings: CommonSettings, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = keys
        self._teams: TtlCache[str] = TtlCache(API_KEY_CACHE_S)
        self._cancelled: TtlCache[bool] = TtlCache(_CANCEL_CHECK_S)

    async def team_of(self, line: BatchRequest) -> str:
        """The team a line runs for (``Unauthorized`` for a legacy line's unknown key)."""
        if line.team is not None:
            return line.team
        if line.api_key is None:
            raise Unauthorized("batch line names no team")
        team = self._teams.get(line.api_key)
        if team is None:
            found = await lookup_team(self.redis, self.keys, line.api_key)
            if found is None:
                raise Unauthorized("unknown API key in this batch line")
            self._teams.put(line.api_key, found)
            team = found
        return team

    async def job_cancelled(self, team: str, job_id: str) -> bool:
        """Whether the job was cancelled (``POST /v1/batches/{id}/cancel``); read at most
        every ``_CANCEL_CHECK_S`` per job, so a job costs Redis one read a second."""
        key = self.keys.batch_cancelled(team, job_id)
        cancelled = self._cancelled.get(key)
        if cancelled is None:
            cancelled = bool(await self.redis.exists(key))
            self._cancelled.put(key, cancelled)
        return cancelled

    async def envelope(
        self, line: BatchRequest, request_id: str, accepted_ts: float
    ) -> RequestEnvelope:
        """``line`` as the envelope it runs as, known by ``request_id``. ``accepted_ts``:
        when its record was stored (the same for every run of it, so a re-run settles under
        the first run's mark)."""
        if line.error is not None:
            raise BadRequest(line.error)
        if line.body is None:
            raise BadRequest("batch line has no body", param="body")
        team = await self.team_of(line)
        if await self.job_cancelled(team, line.job_id):
            raise Cancelled(f"batch {line.job_id} was cancelled before this line ran")
        body: CompletionRequest | ChatRequest
        if line.url == "/v1/completions":
            body = validate_body(CompletionRequest, line.body, prefix="body.")
        else:
            body = validate_body(ChatRequest, line.body, prefix="body.")
        shape = shape_request(self.settings, body, "batch", where="body.")
        return shape.envelope(
            id=request_id,
            team=team,
            cls="batch",
            affinity=f"{line.job_id}:{line.line_id}",
            accepted_ts=accepted_ts,
            job_id=line.job_id,
            line_id=line.line_id,
        )


def error_result(line: BatchRequest, request_id: str, exc: LanewayError) -> BatchResult:
    status: Outcome = "rejected"
    status_code = int(getattr(exc, "status_code", 500))
    code: str | None = getattr(exc, "code", None)
    param: str | None = getattr(exc, "param", None)
    kind = "invalid_request_error"
    if isinstance(exc, Cancelled):
        status, status_code, code = "cancelled", _STATUS_CODES["cancelled"], "cancelled"
    elif isinstance(exc, Expired):  # a parked line that retention deleted before it ran
        status, status_code = "expired", _STATUS_CODES["expired"]
    return BatchResult(
        job_id=line.job_id,
        line_id=line.line_id,
        request_id=request_id,
        team=line.team or "",
        status=status,
        status_code=status_code,
        body=error_body(str(exc), type_=kind, code=code, param=param),
    )


def batch_result(env: RequestEnvelope, final: Reply) -> BatchResult:
    status = final.status or "error"
    if status == "ok":
        body = final_body(env, final.text, final)
    else:
        refused = status in ("rejected", "unsupported")
        kind = "invalid_request_error" if refused else "server_error"
        body = error_body(final.error or status, type_=kind, code=status, param=final.param)
    return BatchResult(
        job_id=env.job_id or "",
        line_id=env.line_id or env.id,
        request_id=env.id,
        team=env.team,
        status=status,
        status_code=_STATUS_CODES.get(status, 500),
        body=body,
    )


def too_large(result: BatchResult, size: int) -> BatchResult:
    """``result`` answered with an error: written, it was ``size`` bytes."""
    message = (
        f"the result of this line was {size} bytes, over the {MAX_RESULT_BYTES} a result "
        "record may have (Kafka's largest record); it was not kept, its tokens are charged"
    )
    return result.model_copy(
        update={
            "status": "error",
            "status_code": _STATUS_CODES["error"],
            "body": error_body(message, type_="server_error", code="result_too_large"),
        }
    )


def result_records(
    topics: Topics, result: BatchResult, usage: UsageEvent | None = None, input_topic: str = ""
) -> list[KafkaRecord]:
    """The result (to the results topic of the line's input topic) and its usage event."""
    results = topics.batch_results_for(input_topic) if input_topic else topics.results_batch
    value = result.to_json()
    if len(value) > MAX_RESULT_BYTES:
        # Kafka would refuse it, and its transaction with it, at every try: the partition's
        # commits would stop there. Its line is answered with why; the tokens stay charged.
        value = too_large(result, len(value)).to_json()
    records = [(results, result.job_id.encode(), value)]
    if usage is not None:
        records.append((topics.usage, usage.team.encode(), usage.to_json()))
    return records


class BatchLedger:
    """Output records per input offset, held until their offsets commit in one transaction."""

    def __init__(self) -> None:
        self._records: dict[TopicPartition, dict[int, list[KafkaRecord]]] = {}

    def add(self, tp: TopicPartition, offset: int, records: Iterable[KafkaRecord]) -> None:
        self._records.setdefault(tp, {})[offset] = list(records)

    def ready(self, tp: TopicPartition, answered: Answered) -> list[int]:
        """The offsets of ``tp`` whose records a commit of ``answered`` completes, in order."""
        held = self._records.get(tp, {})
        return sorted(o for o in held if o < answered.high and o not in answered.pending)

    def holds(self, tp: TopicPartition) -> bool:
        return bool(self._records.get(tp))

    def records(self, tp: TopicPartition, offsets: Iterable[int]) -> list[KafkaRecord]:
        held = self._records.get(tp, {})
        return [record for offset in offsets for record in held[offset]]

    def drop(self, tp: TopicPartition, offsets: Iterable[int]) -> None:
        held = self._records.get(tp, {})
        for offset in offsets:
            held.pop(offset, None)

    def forget(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self._records.pop(tp, None)

    def __len__(self) -> int:
        return sum(len(held) for held in self._records.values())
