"""The Python client of the batch lane: submit a job, follow it, fetch its results.

Jobs use the OpenAI Batch formats: each input line is ``{"custom_id", "method": "POST",
"url": "/v1/chat/completions" | "/v1/completions", "body": {...}}``; each output line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner

from laneway.clients import make_consumer, make_producer, start_client
from laneway.constants import Topics
from laneway.errors import BadRequest, DuplicateLine
from laneway.json_shape import json_problem
from laneway.openai_format import MAX_ERROR_CHARS, clipped
from laneway.schema import (
    MAX_CUSTOM_ID_CHARS,
    MAX_JOB_ID_CHARS,
    BatchJob,
    BatchRequest,
    BatchResult,
)
from laneway.settings import CommonSettings

__all__ = [
    "MAX_CUSTOM_ID_CHARS",
    "MAX_JOB_ID_CHARS",
    "MAX_LINE_BYTES",
    "BatchClient",
    "JobStatus",
    "batch_request_id",
    "new_job_id",
    "output_line",
    "output_line_bytes",
    "parse_input",
    "results_record",
    "submit_transactional_id",
]

_URLS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True, slots=True)
class JobStatus:
    job_id: str
    team: str
    lines: int
    done: int
    ok: int
    failed: int
    duplicates: int = 0  # result records beyond one per line (exactly-once says 0)

    @property
    def complete(self) -> bool:
        return self.lines > 0 and self.done >= self.lines


# A line becomes one Kafka record: it must fit one (the broker's and the producers' limit is
# 1 MiB), with room for the record's other fields.
MAX_LINE_BYTES = 1_000_000


def parse_input(
    lines: Iterable[str],
    *,
    job_id: str,
    team: str,
    endpoint: str | None = None,
    claimed: set[str] | None = None,
) -> Iterator[BatchRequest]:
    """OpenAI Batch input lines → batch requests of ``team``; a bad line becomes an error
    line. ``endpoint``: the batch's endpoint, which every line's ``url`` must name.

    Every line comes back under an id of its own, the one it was sent with where it can be:
    results are matched to lines by id, and a job whose two lines shared one would never be
    seen complete. An id laneway has to make up (a line without a usable ``custom_id``, or
    one whose ``custom_id`` is refused) is never one that another line of the file claims
    (``claimed``: ``claimed_ids`` of the lines, when the caller has them already)."""
    lines = lines if isinstance(lines, Sequence) else list(lines)
    if claimed is None:
        claimed = claimed_ids(lines)
    taken: set[str] = set()

    def fresh(base: str) -> str:
        # ``base`` is at most 487 characters: with its counter, the id stays within 500.
        line_id, count = base, 1
        while line_id in taken or line_id in claimed:
            count += 1
            line_id = f"{base}~{count}"
        return line_id

    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        fallback_id = fresh(f"line-{number}")

        def failed(line_id: str, problem: str, number: int = number) -> BatchRequest:
            taken.add(line_id)
            return BatchRequest(
                job_id=job_id,
                line_id=line_id,
                team=team,
                error=clipped(f"line {number}: {problem}", MAX_ERROR_CHARS),
            )

        size = len(text.encode())
        if size > MAX_LINE_BYTES:
            yield failed(fallback_id, f"{size} bytes, over the {MAX_LINE_BYTES} a line may have")
            continue
        try:
            item = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            yield failed(fallback_id, f"invalid JSON: {exc}")
            continue
        if not isinstance(item, dict):
            yield failed(fallback_id, "not a JSON object")
            continue
        custom_id = item.get("custom_id")
        line_id = custom_id if isinstance(custom_id, str) and custom_id else fallback_id
        problem: str | None
        if len(line_id) > MAX_CUSTOM_ID_CHARS:
            # Cut, it would come back as another id than the one sent (and two ids that differ
            # past the cut would look like one): refused, under an id that says where it was.
            problem = f"custom_id of {len(line_id)} characters, over {MAX_CUSTOM_ID_CHARS}"
            line_id = fresh(f"{line_id[:480]}#{number}")
        elif line_id in taken:
            problem = f"custom_id {line_id!r} repeats an earlier line"
            line_id = fresh(f"{line_id[:480]}#{number}")
        else:
            problem = _line_problem(item, endpoint) or _body_problem(item["body"])
        if problem:
            yield failed(line_id, problem)
            continue
        request = BatchRequest(
            job_id=job_id, line_id=line_id, team=team, url=item["url"], body=item["body"]
        )
        # What goes to Kafka is the line written again, which can be longer than the text
        # read (``1e15`` is written ``1000000000000000.0``): that is what must fit a record.
        if (written := len(request.to_json())) > MAX_LINE_BYTES:
            yield failed(
                line_id,
                f"{written} bytes as written to Kafka ({size} as sent), over the "
                f"{MAX_LINE_BYTES} a line may have",
            )
            continue
        taken.add(line_id)
        yield request


def claimed_ids(lines: Sequence[str]) -> set[str]:
    """The custom_ids the lines of a file name (each line is read twice: orjson reads a
    megabyte in about a millisecond, and a made-up id must not take a later line's)."""
    claimed: set[str] = set()
    for text in lines:
        if len(text) > MAX_LINE_BYTES:
            continue
        try:
            item = orjson.loads(text)
        except orjson.JSONDecodeError:
            continue
        if isinstance(item, dict) and isinstance(item.get("custom_id"), str):
            claimed.add(item["custom_id"])
    return claimed


def _line_problem(item: dict[str, Any], endpoint: str | None) -> str | None:
    """What is wrong with a decoded input line (None: nothing)."""
    custom_id = item.get("custom_id")
    if custom_id is not None and not isinstance(custom_id, str):
        return "custom_id must be a string"
    if item.get("url") not in _URLS:
        return f"url {clipped(repr(item.get('url')), 100)} must be one of {list(_URLS)}"
    if endpoint is not None and item["url"] != endpoint:
        return f"url {item['url']!r} is not the batch's endpoint {endpoint!r}"
    if str(item.get("method", "POST")).upper() != "POST":
        return "method must be POST"
    if not isinstance(item.get("body"), dict):
        return "body must be a JSON object"
    return None


def _body_problem(body: dict[str, Any]) -> str | None:
    """What keeps a line's body from being carried (``laneway.json_shape``)."""
    problem = json_problem(body)
    return None if problem is None else f"body.{problem[0]}: {problem[1]}"


def output_line(result: BatchResult) -> dict[str, Any]:
    """One line of the OpenAI Batch output format."""
    error = None
    if result.status_code != 200:
        detail = (result.body or {}).get("error", {})
        error = {"code": detail.get("code") or result.status, "message": detail.get("message", "")}
    return {
        "id": f"batch_req_{result.request_id}",
        "custom_id": result.line_id,
        "response": {
            "status_code": result.status_code,
            "request_id": result.request_id,
            "body": result.body,
        },
        "error": error,
    }


def batch_request_id(job_id: str, line_id: str, topic_team: str | None = None) -> str:
    """A line's request id: deterministic, so a line re-run after a crash settles the same
    quota reservation.

    ``batch-<job_id>-<line_id>``; a line of a team's own topic (``topic_team``, whose job ids
    its tenant chooses) has ``batch.<team>.<job_id>-<line_id>``, which no other team's line
    can take (a team name has no ``.``, and the lane's ids start ``batch-``). A ``-`` or ``~``
    in the job id is written ``~2D`` or ``~7E``, so the job id ends at the first ``-`` and job
    ``a-b`` line ``c`` is not job ``a`` line ``b-c``; ``~`` is one of the characters a URL
    path carries as they are (``DELETE /v1/requests/{id}``). Ids of job ids without either
    (every ``batch_…`` id the ingress makes) are those of laneway before 2026-12-06.
    """
    job = job_id.replace("~", "~7E").replace("-", "~2D")
    if topic_team is None:
        return f"batch-{job}-{line_id}"
    return f"batch.{topic_team}.{job}-{line_id}"


def new_job_id() -> str:
    """A batch's id (the Batches API's ``batch_…``), which is also its job id on Kafka."""
    return f"batch_{secrets.token_hex(12)}"


def output_line_bytes(result: BatchResult) -> bytes:
    """The output line as the Files API serves it (its size is the file's ``bytes``)."""
    return orjson.dumps(output_line(result)) + b"\n"


class BatchClient:
    """Submits jobs to ``laneway.req.batch`` and reads ``laneway.results.batch``."""

    def __init__(self, settings: CommonSettings) -> None:
        self.settings = settings
        self.topics = settings.topics
        self._producer: AIOKafkaProducer | None = None

    async def __aenter__(self) -> BatchClient:
        self._producer = make_producer(self.settings, linger_ms=20)
        await self._producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._producer is not None:
            await self._producer.stop()

    @property
    def producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise RuntimeError("use BatchClient as `async with BatchClient(settings) as client`")
        return self._producer

    async def submit(
        self,
        lines: Iterable[str],
        *,
        team: str,
        job_id: str | None = None,
        source: str = "",
        progress: Callable[[int], None] | None = None,
    ) -> str:
        """Queue every line of a job of ``team``; returns the job id once Kafka stored all.

        The direct path, for service principals: Kafka's ACLs are what vouch for ``team``
        (tenants submit over HTTP, ``laneway.http_batch``, where their key does). The lines
        and the job's header go in one transaction, as the ingress writes a batch: a submit
        cut short (Ctrl-C, a refused send) leaves no line to run and no header promising
        lines that never come; sent again, the job runs once."""
        job_id = job_id or new_job_id()
        requests = list(parse_input(lines, job_id=job_id, team=team))
        if not requests:
            raise BadRequest("the job has no lines")
        header = BatchJob(job_id=job_id, team=team, lines=len(requests), source=source)
        producer = make_producer(
            self.settings,
            transactional_id=submit_transactional_id(self.topics, job_id),
            linger_ms=20,
        )
        await producer.start()
        try:
            async with producer.transaction():
                topic = self.topics.request("batch")
                pending = []
                for request in requests:
                    key = f"{job_id}:{request.line_id}".encode()
                    pending.append(await producer.send(topic, request.to_json(), key=key))
                    if len(pending) >= 500:
                        await _drain(pending, progress)
                await _drain(pending, progress)
                await producer.send(
                    self.topics.results_batch, header.to_json(), key=job_id.encode()
                )
        finally:
            await producer.stop()
        return job_id

    async def _read_job(self, job_id: str) -> tuple[BatchJob | None, dict[str, BatchResult], int]:
        """The job's header and its results (one per line), read committed from the start."""
        topic = self.topics.results_batch
        try:
            partitions = sorted(await self.producer.partitions_for(topic))
        except KafkaError as exc:
            raise BadRequest(
                f"cannot read {topic} ({exc}); is LANEWAY_TOPIC_PREFIX right?"
            ) from exc
        consumer = make_consumer(self.settings, isolation_level="read_committed")
        await start_client(consumer)  # a status call cut short leaves no socket open
        try:
            return await _scan_job(consumer, topic, partitions, job_id)
        finally:
            await consumer.stop()

    async def status(self, job_id: str) -> JobStatus:
        header, results, records = await self._read_job(job_id)
        if header is None:
            raise BadRequest(f"no batch job {job_id!r} on {self.topics.results_batch}", param="job")
        ok = sum(1 for r in results.values() if r.status_code == 200)
        done = len(results)
        return JobStatus(job_id, header.team, header.lines, done, ok, done - ok, records - done)

    async def results(self, job_id: str) -> list[BatchResult]:
        header, results, _ = await self._read_job(job_id)
        if header is None:
            raise BadRequest(f"no batch job {job_id!r} on {self.topics.results_batch}", param="job")
        return list(results.values())


async def _drain(pending: list[Any], progress: Callable[[int], None] | None) -> None:
    for future in pending:
        await future
    if progress is not None:
        progress(len(pending))
    pending.clear()


def submit_transactional_id(topics: Topics, job_id: str) -> str:
    """The transactional id of a job sent straight to Kafka (``BatchClient.submit``): one a
    job, so a submit sent again after a crash fences the one cut short."""
    return f"{topics.prefix}.batch-submit.{job_id}"


def results_record(value: bytes | None) -> BatchJob | BatchResult | None:
    """A record of a results topic: a job's header or a line's result; None for anything
    else. Whoever may write the topic can write any bytes there: a record that is neither is
    skipped by every reader, never one that stops the reading of its partition."""
    try:
        item = orjson.loads(value or b"")
        if isinstance(item, dict):
            if item.get("type") == "job":
                return BatchJob.model_validate(item)
            if item.get("type") == "result":
                return BatchResult.model_validate(item)
    except ValueError:  # not JSON, or not a header or result (pydantic's error is one)
        pass
    return None


def _duplicate(result: BatchResult) -> bool:
    error = (result.body or {}).get("error")
    return isinstance(error, dict) and error.get("code") == DuplicateLine.code


async def _scan_job(
    consumer: AIOKafkaConsumer, topic: str, partitions: list[int], job_id: str
) -> tuple[BatchJob | None, dict[str, BatchResult], int]:
    key = job_id.encode()
    # Results are keyed by job id: the whole job lives in one partition.
    index = DefaultPartitioner()(key, partitions, partitions)
    tp = TopicPartition(topic, index)
    consumer.assign([tp])
    await consumer.seek_to_beginning(tp)
    end = (await consumer.end_offsets([tp]))[tp]
    header: BatchJob | None = None
    results: dict[str, BatchResult] = {}
    records = 0
    while await consumer.position(tp) < end:
        batches = await consumer.getmany(tp, timeout_ms=1000)
        for record in batches.get(tp, []):
            if record.key != key:
                continue
            item = results_record(record.value)
            if isinstance(item, BatchJob):
                header = item
            elif isinstance(item, BatchResult):
                result = item
                first = results.get(result.line_id)
                # A copy of a line sent twice is answered "duplicate_line" at once while the
                # line itself still runs: the line's own result is the one that counts.
                if first is None or (_duplicate(first) and not _duplicate(result)):
                    results[result.line_id] = result
                records += 1
    return header, results, records
