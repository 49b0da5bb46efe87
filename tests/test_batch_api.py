"""OpenAI's Files and Batches API on the real stack, driven by the official OpenAI SDK."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from aiokafka import AIOKafkaProducer
from openai import AsyncOpenAI
from openai.types import Batch
from redis.exceptions import ConnectionError as RedisConnectionError

from ingress import batch_progress, batch_submission, files
from ingress.batch_records import BatchRecord, BatchRecords, started
from ingress.settings import IngressSettings
from laneway.batch import BatchClient
from laneway.schema import BatchJob, BatchRequest, BatchResult
from laneway.settings import CommonSettings
from tests.stack import (
    Ingress,
    LiveStack,
    eventually,
    free_port,
    status_before_the_body_ends,
)
from workers import metrics


def _line(i: int, **body: Any) -> bytes:
    request = {
        "model": "laneway-chat",
        "messages": [{"role": "user", "content": f"summarise doc {i}"}],
        "max_tokens": 8,
    }
    request.update(body)
    line = {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions"}
    return orjson.dumps({**line, "body": request})


def _client(stack: LiveStack, ingress: Ingress, key: str) -> AsyncOpenAI:
    return stack.sdk(ingress, key)


async def _until_done(client: AsyncOpenAI, batch_id: str, within_s: float = 120) -> Batch:
    deadline = asyncio.get_running_loop().time() + within_s
    seen = []
    while True:
        batch = await client.batches.retrieve(batch_id)
        seen.append(batch.status)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"batch {batch_id} still {batch.status} after {within_s}s")
        await asyncio.sleep(0.2)


async def _until(client: AsyncOpenAI, batch_id: str, status: str, within_s: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while (await client.batches.retrieve(batch_id)).status != status:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"batch {batch_id} not {status} after {within_s}s")
        await asyncio.sleep(0.1)


async def _lines(client: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [orjson.loads(line) for line in content.content.splitlines()]


async def test_sdk_batch_end_to_end_one_result_per_line(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    await stack.start_worker("batch")
    key = await stack.api_key("docs", size=100)
    client = _client(stack, ingress, key)
    good = [_line(i) for i in range(20)]
    bad = [
        b"{this is not json",
        _line(20, model="no-such-model"),
        _line(21, max_tokens="lots"),
        orjson.dumps({"custom_id": "doc-22", "url": "/v1/completions", "body": {}}),
    ]
    data = b"\n".join(good[:10] + bad + good[10:]) + b"\n"

    uploaded = await client.files.create(file=("docs.jsonl", data), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == (
        "batch",
        len(data),
        "docs.jsonl",
    )
    assert (await client.files.content(uploaded.id)).content == data
    created = await client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly docs"},
    )
    assert created.status == "validating"
    assert created.metadata == {"job": "nightly docs"}
    batch = await _until_done(client, created.id)

    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (24, 20, 4)
    assert batch.completed_at is not None
    assert batch.finalizing_at is not None
    assert batch.in_progress_at is not None
    output = await _lines(client, batch.output_file_id)
    errors = await _lines(client, batch.error_file_id)
    ids = [row["custom_id"] for row in output + errors]
    assert sorted(ids) == sorted([f"doc-{i}" for i in range(23)] + ["line-11"])
    assert {row["custom_id"] for row in output} == {f"doc-{i}" for i in range(20)}
    for row in output:
        assert row["error"] is None
        assert row["response"]["status_code"] == 200
        assert row["response"]["body"]["object"] == "chat.completion"
    by_id = {row["custom_id"]: row for row in errors}
    assert by_id["line-11"]["response"]["status_code"] == 400
    assert "invalid JSON" in by_id["line-11"]["error"]["message"]
    assert by_id["doc-20"]["response"]["status_code"] == 404
    assert by_id["doc-21"]["response"]["body"]["error"]["param"] == "body.max_tokens"
    assert "not the batch's endpoint" in by_id["doc-22"]["error"]["message"]
    # The file objects say how big their content is.
    assert batch.output_file_id is not None
    output_file = await client.files.retrieve(batch.output_file_id)
    content = (await client.files.content(batch.output_file_id)).content
    assert (output_file.purpose, output_file.bytes) == ("batch_output", len(content))
    listed = await client.batches.list()
    assert [b.id for b in listed.data] == [batch.id]

    # The lines went on the HTTP batches' topic with the team, and no key.
    lines = await stack.read_all(stack.topics.batch_http)
    assert len(lines) == 24
    assert {line["team"] for line in lines} == {"docs"}
    raw = orjson.dumps(lines).decode()
    assert key not in raw
    assert "api_key" not in raw


async def test_records_no_worker_wrote_on_the_results_topic_count_for_nothing(
    stack: LiveStack,
) -> None:
    """Whoever may write the shared results topic (an operator's batch service) can write
    anything there under a batch's id: bytes that are no result, a result of another team.
    Neither stops the batch's counting nor counts toward it, and its output has one line per
    input line."""
    ingress = await stack.start_ingress()
    key = await stack.api_key("docs", size=100)
    client = _client(stack, ingress, key)
    data = b"\n".join(_line(i) for i in range(3)) + b"\n"
    uploaded = await client.files.create(file=("docs.jsonl", data), purpose="batch")
    created = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    await _until(client, created.id, "in_progress")
    forged = BatchResult(
        job_id=created.id,
        line_id="doc-0",
        request_id="forged",
        team="rivals",
        status="ok",
        status_code=200,
        body={"forged": True},
    )
    producer = await stack.producer()
    for value in (b"not json", b'{"type": "result"}', forged.to_json()):
        await producer.send_and_wait(
            stack.topics.results_batch_http, value, key=created.id.encode()
        )
    still = await client.batches.retrieve(created.id)  # counted past them: no error
    assert still.status == "in_progress"
    assert still.request_counts is not None
    assert (still.request_counts.completed, still.request_counts.failed) == (0, 0)

    await stack.start_worker("batch")
    batch = await _until_done(client, created.id)
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 0)
    output = await _lines(client, batch.output_file_id)
    assert sorted(row["custom_id"] for row in output) == ["doc-0", "doc-1", "doc-2"]
    assert all(row["response"]["body"]["object"] == "chat.completion" for row in output)


async def test_a_team_stores_no_more_than_its_allowance_and_others_still_can(
    stack: LiveStack,
) -> None:
    """Uploads, and batches reading a file again, write to Kafka: one team's loop of them
    would fill the brokers' disks for every team. Each counts (at least 1 MiB) against
    LANEWAY_TEAM_STORED_BYTES for 7 days; past it, 429 naming the setting."""
    ingress = await stack.start_ingress(team_stored_bytes=3 * 1024 * 1024)
    client = _client(stack, ingress, await stack.api_key("docs", size=100))
    data = _line(0) + b"\n"
    uploaded = await client.files.create(file=("a.jsonl", data), purpose="batch")
    for _ in range(2):  # each batch writes the file's lines once more
        await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.RateLimitError) as refused:
        await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert "LANEWAY_TEAM_STORED_BYTES" in refused.value.message
    with pytest.raises(openai.RateLimitError):
        await client.files.create(file=("b.jsonl", data), purpose="batch")
    assert len((await client.batches.list()).data) == 2  # the refused one left nothing

    other = _client(stack, ingress, await stack.api_key("rivals", size=100))
    await other.files.create(file=("c.jsonl", data), purpose="batch")

    # A batch that stored nothing (its file has no request line) is not counted: created
    # again and again, it never uses up the team's allowance.
    third = _client(stack, ingress, await stack.api_key("third", size=100))
    blank = await third.files.create(file=("blank.jsonl", b"\n \n"), purpose="batch")
    for _ in range(3):
        failed = await third.batches.create(
            input_file_id=blank.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert (await _until_done(third, failed.id)).status == "failed"
    uploaded = await third.files.create(file=("d.jsonl", data), purpose="batch")
    await third.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


async def test_a_team_has_a_few_file_transfers_at_once_per_replica(stack: LiveStack) -> None:
    """Each download holds a Kafka consumer while its client reads: one key's thousand slow
    downloads used up the replica. Eight at once per team; past them, 429 until one ends;
    another team is not held up."""
    ingress = await stack.start_ingress()
    key = await stack.api_key("docs", size=100)
    client = _client(stack, ingress, key)
    data = b"\n".join(_line(i, metadata={"pad": "x" * 100_000}) for i in range(200)) + b"\n"
    uploaded = await client.files.create(file=("big.jsonl", data), purpose="batch")
    http = stack.http(ingress, key)
    url = f"/v1/files/{uploaded.id}/content"
    async with contextlib.AsyncExitStack() as held:
        for _ in range(8):  # each read no further than its headers: the rest waits
            response = await held.enter_async_context(http.stream("GET", url))
            assert response.status_code == 200
        refused = await http.get(url)
        assert refused.status_code == 429, refused.text
        assert "under way on this ingress" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        other = _client(stack, ingress, await stack.api_key("rivals", size=100))
        await other.files.create(file=("c.jsonl", _line(0) + b"\n"), purpose="batch")

    # The eight ended with their clients: the team may download again.
    async def again() -> bool:
        response = await http.get(url)
        return response.status_code == 200 and response.content == data

    await eventually(again, 10, "a download after the others ended")


async def test_another_team_cannot_see_or_cancel_a_batch(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    await stack.start_worker("batch")
    owner = _client(stack, ingress, await stack.api_key("docs", size=100))
    other = _client(stack, ingress, await stack.api_key("rivals", size=100))
    uploaded = await owner.files.create(file=("a.jsonl", _line(0) + b"\n"), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        await other.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    batch = await owner.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await _until_done(owner, batch.id)
    assert done.output_file_id is not None
    for attempt in (
        other.batches.retrieve(batch.id),
        other.batches.cancel(batch.id),
        other.files.retrieve(uploaded.id),
        other.files.content(uploaded.id),
        other.files.retrieve(done.output_file_id),
        other.files.content(done.output_file_id),
    ):
        with pytest.raises(openai.NotFoundError):
            await attempt
    assert (await other.batches.list()).data == []
    with pytest.raises(openai.BadRequestError, match="is completed"):
        await owner.batches.cancel(batch.id)


async def test_cancel_answers_the_lines_not_started(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    # Slow lines, two at a time: most of the job is still queued when it is cancelled.
    await stack.start_worker("batch", sim_decode_ms_per_step=40.0, max_inflight=2)
    client = _client(stack, ingress, await stack.api_key("docs", size=100))
    data = b"\n".join(_line(i, max_tokens=16) for i in range(60))
    uploaded = await client.files.create(file=("slow.jsonl", data), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    await _until(client, batch.id, "in_progress")
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    assert cancelling.cancelling_at is not None
    done = await _until_done(client, batch.id)

    assert done.status == "cancelled"
    assert done.request_counts is not None
    counts = done.request_counts
    assert counts.total == 60
    assert counts.completed + counts.failed == 60
    assert counts.completed < 30, "the cancel stopped nothing"
    output = await _lines(client, done.output_file_id)
    errors = await _lines(client, done.error_file_id)
    assert sorted(r["custom_id"] for r in output + errors) == sorted(f"doc-{i}" for i in range(60))
    assert {r["error"]["code"] for r in errors} == {"cancelled"}
    assert (await client.batches.cancel(batch.id)).status == "cancelled"  # says so again
    # The cancel's flag is kept at <prefix>:batch:cancelled:<id>, under the batches' own
    # keys: read as a batch, that id was a 500 for any team, which told it what was cancelled.
    other = _client(stack, ingress, await stack.api_key("rivals", size=100))
    for caller in (client, other):
        for attempt in (
            caller.batches.retrieve(f"cancelled:{batch.id}"),
            caller.batches.cancel(f"cancelled:{batch.id}"),
        ):
            with pytest.raises(openai.NotFoundError):
                await attempt
    # The cancel is the team's: another team's job of the same id (a pipeline writing
    # straight to Kafka may name its jobs) still runs every line.
    lines = [_line(i, max_tokens=2).decode() for i in range(3)]
    async with BatchClient(CommonSettings(**stack.common)) as service:
        await service.submit(lines, team="rivals", job_id=batch.id)
    events = await stack.read_topic(
        stack.topics.usage,
        count=3,
        where=lambda e: e["job_id"] == batch.id and e["team"] == "rivals",
    )
    assert [e["status"] for e in events] == ["ok"] * 3


async def test_bad_files_and_batch_requests_are_400s_naming_the_problem(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress(max_file_bytes=64 * 1024, batch_max_lines=10)
    key = await stack.api_key("docs", size=100)
    client = _client(stack, ingress, key)

    async def refused(call: Any, status: int, param: str | None, words: str) -> None:
        with pytest.raises(openai.APIStatusError) as caught:
            await call
        assert caught.value.status_code == status, caught.value.body
        body = caught.value.body
        assert isinstance(body, dict)
        assert body.get("param") == param, body
        assert words in body["message"], body

    await refused(
        client.files.create(file=("a.jsonl", _line(0)), purpose="fine-tune"),
        400,
        "purpose",
        "purpose 'fine-tune' is not supported",
    )
    await refused(client.files.create(file=("a.jsonl", b""), purpose="batch"), 400, "file", "empty")
    await refused(
        client.files.create(file=("a.jsonl", b"\xff\xfe{}"), purpose="batch"),
        400,
        "file",
        "not UTF-8",
    )
    # Cut inside its last character: valid up to there, so only the end can tell (it was
    # taken, and the batch made of it failed as laneway's own fault, every line lost).
    await refused(
        client.files.create(file=("a.jsonl", _line(0) + b"\n\xc3"), purpose="batch"),
        400,
        "file",
        "ends inside a character",
    )
    await refused(
        client.files.create(file=("a.jsonl", b"\n".join([_line(0)] * 11)), purpose="batch"),
        400,
        "file",
        "11 lines, over the limit of 10 (LANEWAY_BATCH_MAX_LINES)",
    )
    await refused(
        client.files.create(file=("a.jsonl", b"x" * 100_000), purpose="batch"),
        413,
        "file",
        "file over the limit of 65536 bytes (LANEWAY_MAX_FILE_BYTES)",
    )
    uploaded = await client.files.create(file=("a.jsonl", _line(0)), purpose="batch")
    await refused(
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",  # type: ignore[arg-type]
            completion_window="24h",
        ),
        400,
        "endpoint",
        "endpoint",
    )
    await refused(
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="48h",  # type: ignore[arg-type]
        ),
        400,
        "completion_window",
        "completion_window",
    )
    await refused(
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        ),
        404,
        "input_file_id",
        "no file 'file-nope'",
    )
    await refused(client.batches.retrieve("batch_nope"), 404, "batch_id", "no batch")
    async with httpx.AsyncClient(
        base_url=str(client.base_url), headers={"Authorization": f"Bearer {key}"}
    ) as http:
        # A JSONL body sent as it is, not as a form: the answer says what an upload is.
        as_json = await http.post(
            "files", content=_line(0), headers={"Content-Type": "application/json"}
        )
        assert as_json.status_code == 400, as_json.text
        error = as_json.json()["error"]
        assert "multipart/form-data" in error["message"], error
        assert "application/json" in error["message"], error
        # A method the path does not take: 405 with the methods it does (RFC 9110).
        listed = await http.get("completions")
        assert listed.status_code == 405, listed.text
        assert listed.headers["allow"] == "POST"
        assert listed.json()["error"]["type"] == "invalid_request_error"


async def test_a_submission_cut_short_runs_no_line_and_fails_the_batch(stack: LiveStack) -> None:
    """A replica that stopped mid-submission leaves its batch validating with its lines in an
    open transaction; Kafka aborts it. Another replica finds the batch later: aborted → failed
    (no line ran: the workers read committed), committed → in progress, and it completes."""
    ingress = await stack.start_ingress()
    worker = await stack.start_worker("batch")
    client = _client(stack, ingress, await stack.api_key("docs", size=100))
    uploaded = await client.files.create(file=("a.jsonl", _line(0)), purpose="batch")
    settings = IngressSettings(**stack.common)
    # Records as a replica made them before HTTP batches had topics of their own (no
    # results_topic): read where they are, on the lane's topics.
    request_topic = stack.topics.request("batch")
    ended: dict[str, str] = {}
    # The last two were cancelled while their replica queued them: they end cancelled, not
    # cancelling for ever; the committed one's lines run (a line not started is answered
    # "cancelled" where the cancel is known: this test wrote the record alone).
    for outcome, status, commit in (
        ("aborted", "validating", False),
        ("committed", "validating", True),
        ("cancelled", "cancelling", False),
        ("cancelled-committed", "cancelling", True),
    ):
        batch_id = f"batch_{outcome}_{stack.prefix}"
        producer = AIOKafkaProducer(
            bootstrap_servers=stack.services.bootstrap, transactional_id=f"test-{batch_id}"
        )
        await producer.start()
        stack.track(producer)
        await producer.begin_transaction()
        for i in range(3):
            line = BatchRequest(
                job_id=batch_id,
                line_id=f"doc-{i}",
                team="docs",
                body=orjson.loads(_line(i))["body"],
            )
            await producer.send(request_topic, line.to_json(), key=f"{batch_id}:doc-{i}".encode())
        header = BatchJob(job_id=batch_id, team="docs", lines=3)
        sent = await producer.send(
            stack.topics.results_batch, header.to_json(), key=batch_id.encode()
        )
        meta = await sent
        now = int(time.time())
        record = BatchRecord(
            id=batch_id,
            team="docs",
            endpoint="/v1/chat/completions",
            input_file_id=uploaded.id,
            created_at=now - 120,  # its replica's grace is over
            expires_at=now + 3600,
            partition=meta.partition,
            header_offset=meta.offset,
            scanned_to=meta.offset + 1,
            total=3,
            status=status,
            cancelling_at=now if status == "cancelling" else None,
        )
        await stack.redis.set(settings.keys.batch(batch_id), record.model_dump_json(), ex=3600)
        assert (await client.batches.retrieve(batch_id)).status == status  # still open
        if commit:
            await producer.commit_transaction()
        else:
            await producer.abort_transaction()
        ended[outcome] = (await _until_done(client, batch_id)).status
    # One whose replica stopped before it wrote a line, cancelled meanwhile, given up on.
    now = int(time.time())
    never = BatchRecord(
        id=f"batch_never_{stack.prefix}",
        team="docs",
        endpoint="/v1/chat/completions",
        input_file_id=uploaded.id,
        created_at=now - 3600,
        expires_at=now + 3600,
        status="cancelling",
        cancelling_at=now - 3000,
    )
    await stack.redis.set(settings.keys.batch(never.id), never.model_dump_json(), ex=3600)
    ended["never"] = (await _until_done(client, never.id)).status

    assert ended == {
        "aborted": "failed",
        "committed": "completed",
        "cancelled": "cancelled",
        "cancelled-committed": "cancelled",
        "never": "cancelled",
    }
    failed = await client.batches.retrieve(f"batch_aborted_{stack.prefix}")
    assert failed.errors is not None
    assert failed.errors.data
    assert "cut short" in (failed.errors.data[0].message or "")
    # The worker has fetched past every line of both transactions (reading committed, it
    # was never handed the aborted ones); only the committed ran.
    ends = await worker.consumer.end_offsets(list(worker.consumer.assignment()))

    async def read_past_all() -> bool:
        return all([await worker.consumer.position(tp) >= end for tp, end in ends.items()])

    deadline = time.monotonic() + 30
    while not await read_past_all():
        assert time.monotonic() < deadline, "the worker did not get past the aborted lines"
        await asyncio.sleep(0.1)
    results = await stack.read_all(stack.topics.results_batch)
    ran = sorted(r["job_id"] for r in results if r.get("type") == "result")
    assert ran == sorted(
        [f"batch_committed_{stack.prefix}", f"batch_cancelled-committed_{stack.prefix}"] * 3
    )


async def test_a_redis_error_after_the_lines_were_committed_does_not_fail_the_batch(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its lines committed, the batch's record could not be moved on (Redis dropped the
    connection just after the commit). The batch is not failed: its lines run all the same,
    and a client told to create it again would have each run twice. Recovery finds the
    commit, and it completes with every line counted."""
    monkeypatch.setattr(batch_progress, "_VALIDATING_OWNED_S", 0)  # recovery at the next poll
    refused: list[str] = []

    def refused_once(current: BatchRecord, now: int) -> BatchRecord | None:
        if not refused:
            refused.append(current.id)
            raise RedisConnectionError("connection reset by peer (injected)")
        return started(current, now)

    monkeypatch.setattr(batch_submission, "started", refused_once)
    ingress = await stack.start_ingress()
    await stack.start_worker("batch")
    client = _client(stack, ingress, await stack.api_key("docs", size=100))
    data = b"\n".join(_line(i) for i in range(3))
    uploaded = await client.files.create(file=("a.jsonl", data), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await _until_done(client, batch.id)
    assert refused == [batch.id]  # the error came where it should
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
    assert sorted(line["custom_id"] for line in await _lines(client, done.output_file_id)) == [
        "doc-0",
        "doc-1",
        "doc-2",
    ]


async def test_a_file_read_back_in_chunks_that_cut_lines_and_characters_keeps_each_line(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file is stored in chunks and read back one chunk at a time (never whole in memory
    three times over); a chunk's end may fall inside a line or inside a character."""
    monkeypatch.setattr(files, "_CHUNK_BYTES", 7)
    ingress = await stack.start_ingress()
    await stack.start_worker("batch")
    client = _client(stack, ingress, await stack.api_key("docs", size=100))
    ids = ["doc-é", "doc-→-2", "doc-3", "doc-😀"]
    data = b"\n".join(
        orjson.dumps({**orjson.loads(_line(i)), "custom_id": custom_id})
        for i, custom_id in enumerate(ids)
    )
    uploaded = await client.files.create(file=("a.jsonl", data + b"\n"), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await _until_done(client, batch.id)
    assert done.status == "completed", done.errors
    output = await _lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(ids)


async def test_a_team_that_creates_many_batches_at_once_waits_behind_its_own(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each submission holds its file's text (up to LANEWAY_MAX_FILE_BYTES), so a replica
    runs two at once; a team's own batches are queued one after another, so one that
    creates many at once holds up no other team (whose batch would otherwise wait, and be
    taken for lost after ten minutes). Past eight waiting on a replica, a team gets a 429."""
    running: list[int] = [0, 0]  # submissions under way now, most at once
    submit_now = batch_submission.BatchSubmissions._submit_now

    async def slow(
        self: batch_submission.BatchSubmissions, record: Any, file: files.FileRecord
    ) -> None:
        running[0] += 1
        running[1] = max(running[1], running[0])
        try:
            await asyncio.sleep(1.0)  # a large file's read
            await submit_now(self, record, file)
        finally:
            running[0] -= 1

    monkeypatch.setattr(batch_submission.BatchSubmissions, "_submit_now", slow)
    ingress = await stack.start_ingress()
    await stack.start_worker("batch")
    busy = _client(stack, ingress, await stack.api_key("busy", size=100))
    other = _client(stack, ingress, await stack.api_key("other", size=100))

    async def create(client: AsyncOpenAI) -> Batch:
        uploaded = await client.files.create(file=("a.jsonl", _line(0)), purpose="batch")
        return await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

    # Ten at once: each holds its place from its check on, so two are refused though none
    # of the others was queued yet when they were checked.
    inputs = [
        await busy.files.create(file=("a.jsonl", _line(0)), purpose="batch") for _ in range(10)
    ]
    made = await asyncio.gather(
        *(
            busy.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            for f in inputs
        ),
        return_exceptions=True,
    )
    refused = [r for r in made if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 2, made
    assert all("8 batches being queued on this ingress" in str(r) for r in refused)
    flood = [r for r in made if isinstance(r, Batch)]
    mine = await create(other)

    async def queued() -> bool:  # in progress, or done already: a line runs in no time
        return (await other.batches.retrieve(mine.id)).status != "validating"

    await eventually(queued, 60, "the other team's batch queued")
    statuses = [(await busy.batches.retrieve(b.id)).status for b in flood]
    # Behind the flood, it would have come after all eight (two at a time).
    assert statuses.count("validating") >= 3, statuses
    ended = [await _until_done(busy, batch.id) for batch in flood]
    assert [batch.status for batch in ended] == ["completed"] * 8
    assert running[1] == 2  # the other team's beside the flood's one, never more


async def test_a_batch_given_up_on_while_it_waited_its_turn_is_not_queued(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch waiting behind its team's others can be taken for lost by another replica
    (failed, "create it again"). Its turn come, its lines are not queued: they would run
    and be charged, uncounted, beside the batch created again. A team keeps at most
    LANEWAY_BATCH_MAX_BATCHES batches (each has a Redis record for 7 days): 429 beyond."""
    gate = asyncio.Event()
    lines_of = files.FileStore.lines

    async def held(self: files.FileStore, record: files.FileRecord) -> list[str]:
        await gate.wait()
        return await lines_of(self, record)

    monkeypatch.setattr(files.FileStore, "lines", held)
    ingress = await stack.start_ingress(batch_max_batches=2)
    await stack.start_worker("batch")
    client = _client(stack, ingress, await stack.api_key("docs", size=100))
    uploaded = await client.files.create(file=("a.jsonl", _line(0)), purpose="batch")

    async def create() -> Batch:
        return await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

    first, second = await create(), await create()
    with pytest.raises(openai.RateLimitError) as refused:
        await create()
    assert "LANEWAY_BATCH_MAX_BATCHES" in str(refused.value)
    # The second waits behind the first; another replica's recovery fails it meanwhile.
    key = IngressSettings(**stack.common).keys.batch(second.id)
    stored = BatchRecord.model_validate_json(await stack.redis.get(key))
    given_up = stored.model_copy(update={"status": "failed", "failed_at": int(time.time())})
    await stack.redis.set(key, given_up.model_dump_json(), ex=3600)
    gate.set()
    assert (await _until_done(client, first.id)).status == "completed"
    await asyncio.sleep(1.0)  # the second's turn has come and gone
    assert (await client.batches.retrieve(second.id)).status == "failed"
    queued = await stack.read_all(stack.topics.batch_http)
    assert {line["job_id"] for line in queued} == {first.id}
    # What it took of the team's stored bytes is back: its lines were never written.
    counted = await stack.redis.zrange(
        IngressSettings(**stack.common).keys.team_stored("docs"), 0, -1
    )
    assert not [c for c in counted if c.decode().startswith(f"batch:{second.id}:")]
    assert [c for c in counted if c.decode().startswith(f"batch:{first.id}:")]


async def test_a_chunked_upload_is_answered_as_it_comes_not_held_first(
    stack: LiveStack,
) -> None:
    """An upload without Content-Length (chunked) was held whole in the ingress's memory,
    up to LANEWAY_MAX_FILE_BYTES, before its key was even looked at. Now a caller without a
    key is answered while its body is still coming, and one past the limit gets the 413."""
    ingress = await stack.start_ingress(max_file_bytes=64 * 1024)
    boundary = "lanewaytest"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        'filename="a.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
    ).encode()
    status = await status_before_the_body_ends(
        ingress.port, "/v1/files", f"multipart/form-data; boundary={boundary}", head
    )
    assert status.split()[1] == b"401", status

    key = await stack.api_key("docs", size=100)
    http = stack.http(ingress, key)

    async def body() -> AsyncIterator[bytes]:  # no Content-Length: chunked
        yield head
        for _ in range(40):
            yield (_line(0) + b"\n") * 10  # about 70 kB in all, over the 64 kB limit
        yield f"\r\n--{boundary}--\r\n".encode()

    response = await http.post(
        "/v1/files",
        content=body(),
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert response.status_code == 413, response.text
    assert "LANEWAY_MAX_FILE_BYTES" in response.json()["error"]["message"]


async def test_cancel_ends_a_batch_waiting_for_its_teams_budget(stack: LiveStack) -> None:
    """Lines held back by an exhausted batch budget wait (they never fail); a cancel ends
    them at once, as cancelled, without waiting for the budget."""
    ingress = await stack.start_ingress()
    await stack.start_worker("batch", max_inflight=8, quota_offpeak="")
    # 1,000 tokens an hour in the batch pool: about ten of these lines, then it waits.
    key = await stack.api_key("docs", size=1, complexity=0.02)
    client = _client(stack, ingress, key)
    data = b"\n".join(_line(i, max_tokens=64) for i in range(40))
    uploaded = await client.files.create(file=("big.jsonl", data), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    waits_before = metrics.QUOTA_WAITS.labels("docs")._value.get()
    await eventually(
        lambda: metrics.QUOTA_WAITS.labels("docs")._value.get() > waits_before,
        60,
        "the batch to wait for its budget",
    )
    await client.batches.cancel(batch.id)
    done = await _until_done(client, batch.id, within_s=60)

    assert done.status == "cancelled"
    assert done.request_counts is not None
    assert done.request_counts.total == 40
    assert done.request_counts.completed < 40
    errors = await _lines(client, done.error_file_id)
    output = await _lines(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in output + errors) == sorted(f"doc-{i}" for i in range(40))
    assert {r["response"]["status_code"] for r in errors} == {499}


async def test_a_line_no_budget_can_ever_hold_is_answered_at_once_and_stalls_no_one(
    stack: LiveStack,
) -> None:
    """A line asking more than its team's whole hourly batch budget fails at once with the
    reason; waiting for it would hold up every team's lines behind it on its partition."""
    ingress = await stack.start_ingress()
    await stack.start_worker("batch", quota_offpeak="")
    # 1,000 tokens an hour in the batch pool: a line of max_tokens 2,000 can never fit.
    tiny = _client(stack, ingress, await stack.api_key("tiny", size=1, complexity=0.02))
    other = _client(stack, ingress, await stack.api_key("other", size=50))
    data = b"\n".join([_line(0, max_tokens=2000), _line(1, max_tokens=8)])
    uploaded = await tiny.files.create(file=("tiny.jsonl", data), purpose="batch")
    tiny_batch = await tiny.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    data = b"\n".join(_line(i, max_tokens=8) for i in range(6))
    uploaded = await other.files.create(file=("other.jsonl", data), purpose="batch")
    other_batch = await other.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    other_done = await _until_done(other, other_batch.id, within_s=60)
    assert other_done.status == "completed"
    assert len(await _lines(other, other_done.output_file_id)) == 6
    tiny_done = await _until_done(tiny, tiny_batch.id, within_s=60)
    assert tiny_done.status == "completed"
    (refused,) = await _lines(tiny, tiny_done.error_file_id)
    assert refused["custom_id"] == "doc-0"
    assert refused["response"]["status_code"] == 429
    assert "can never fit" in orjson.dumps(refused).decode()
    (served,) = await _lines(tiny, tiny_done.output_file_id)
    assert served["custom_id"] == "doc-1"


async def test_a_batch_given_up_on_while_its_lines_were_written_runs_none_of_them(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another replica takes a batch for lost (failed, "create it again") while its submitter
    writes its lines, their transaction not committed yet: the transaction is aborted, so no
    line runs, charged and uncounted, under a batch its client was told had failed."""
    gate = asyncio.Event()
    lines_of = files.FileStore.lines

    async def held(self: files.FileStore, record: files.FileRecord) -> list[str]:
        await gate.wait()
        return await lines_of(self, record)

    given_up: list[str] = []
    update = BatchRecords.update

    async def raced(
        self: BatchRecords, batch_id: str, change: Callable[[BatchRecord], BatchRecord | None]
    ) -> BatchRecord:
        if batch_id in given_up and gate.is_set():  # the first update after the lines: theirs
            given_up.remove(batch_id)
            await update(self, batch_id, lambda r: r.model_copy(update={"status": "failed"}))
        return await update(self, batch_id, change)

    monkeypatch.setattr(files.FileStore, "lines", held)
    monkeypatch.setattr(BatchRecords, "update", raced)
    ingress = await stack.start_ingress()
    client = _client(stack, ingress, await stack.api_key("docs", size=100))
    uploaded = await client.files.create(file=("a.jsonl", _line(0) + _line(1)), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    given_up.append(batch.id)
    gate.set()
    await eventually(lambda: not given_up, 30, "the batch given up on during its submission")
    await asyncio.sleep(1.0)  # its submission ends
    stored = await client.batches.retrieve(batch.id)
    assert stored.status == "failed"
    assert stored.request_counts is not None
    assert stored.request_counts.total == 0
    queued = await stack.read_all(stack.topics.batch_http)  # read committed
    assert batch.id not in {line["job_id"] for line in queued}


def _validating(batch_id: str, **fields: Any) -> BatchRecord:
    """A record of team docs's batch ``batch_id``, created now, still validating."""
    now = int(time.time())
    return BatchRecord(
        id=batch_id,
        team="docs",
        endpoint="/v1/chat/completions",
        input_file_id="file-x",
        created_at=now,
        expires_at=now + 24 * 3600,
        **fields,
    )


async def test_a_batch_whose_header_is_stored_is_never_failed_blindly(stack: LiveStack) -> None:
    """Its submitter got as far as the commit: whether its lines run is read from Kafka by
    recovery, not guessed by a failure that says "create it again"."""
    records = BatchRecords(stack.redis, IngressSettings(**stack.common).keys)
    record = _validating(f"batch_header_{stack.prefix}", partition=0, header_offset=5)
    await records.insert(record)
    await records.fail(record.id, "not_queued", "lost")
    stored = await records.load(record.id)
    assert stored is not None
    assert stored.status == "validating"


async def test_a_replica_whose_clock_runs_ahead_gives_up_on_no_batch_early(
    stack: LiveStack, tmp_path: Path
) -> None:
    """Batches are aged on Redis's clock: a replica whose own clock is 700 s ahead does not
    take a batch created a moment ago by another replica for lost (failed after 600 s)."""
    ahead = tmp_path / "ahead"
    ahead.mkdir()
    (ahead / "sitecustomize.py").write_text(
        "import time\n_real = time.time\ntime.time = lambda: _real() + 700.0\n"
    )
    key = await stack.api_key("docs", size=100)
    records = BatchRecords(stack.redis, IngressSettings(**stack.common).keys)
    # Created now on this process's clock, which is Redis's here (one machine).
    waiting = _validating(f"batch_waiting_{stack.prefix}")
    await records.insert(waiting)  # a batch another replica is about to queue
    port = free_port()
    replica = stack.spawn(
        "ingress",
        LANEWAY_PORT=str(port),
        PYTHONPATH=f"{ahead}{os.pathsep}{stack.process_env()['PYTHONPATH']}",
        LANEWAY_LOG_LEVEL="WARNING",
    )
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}
        ) as http:

            async def answered() -> httpx.Response | None:
                with contextlib.suppress(httpx.TransportError):
                    return await http.get(f"/v1/batches/{waiting.id}")
                return None

            response = await eventually(answered, 60, "the replica answering", every_s=0.5)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "validating"
        assert response.json()["created_at"] == waiting.created_at
    finally:
        replica.terminate()
        await asyncio.to_thread(replica.wait, 30)


async def test_a_file_field_laneway_does_not_keep_is_refused_not_dropped(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress()
    client = _client(stack, ingress, await stack.api_key("docs", size=100))
    with pytest.raises(openai.BadRequestError) as refused:
        await client.files.create(
            file=("a.jsonl", _line(0)),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
    assert refused.value.body is not None
    assert refused.value.body["param"] == "expires_after"  # type: ignore[index]
    assert "7 days" in str(refused.value)
    stored = await client.files.create(file=("a.jsonl", _line(0)), purpose="batch")
    assert stored.expires_at == stored.created_at + 7 * 24 * 3600
