"""The batch lane on the real broker: exactly-once results, bad lines, yielding, the CLI."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from laneway.batch import BatchClient, JobStatus
from laneway.settings import CommonSettings
from tests.stack import LiveStack, eventually
from workers.batch_lane import BatchLane


def _line(i: int, **body: Any) -> str:
    request = {
        "model": "laneway-chat",
        "messages": [{"role": "user", "content": f"summarise doc {i}"}],
        "max_tokens": 8,
    }
    request.update(body)
    return orjson.dumps(
        {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions", "body": request}
    ).decode()


def _spawn_batch_worker(stack: LiveStack) -> subprocess.Popen[bytes]:
    return stack.spawn(
        "workers",
        LANEWAY_POOL="batch",
        LANEWAY_WORKER_ID="batch-kill",
        LANEWAY_ENGINE="sim",
        LANEWAY_SIM_PREFILL_MS_PER_TOKEN="0",
        LANEWAY_SIM_DECODE_MS_PER_STEP="3",
        LANEWAY_MAX_INFLIGHT="32",
        LANEWAY_COMMIT_INTERVAL_MS="100",
        LANEWAY_LOG_LEVEL="WARNING",
    )


async def _status_when(
    client: BatchClient, job: str, done_at_least: int, within_s: float
) -> JobStatus:
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        status = await client.status(job)
        if status.done >= done_at_least:
            return status
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"job {job}: {status.done}/{status.lines} after {within_s}s")
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_thousand_lines_exactly_once_through_two_sigkills(stack: LiveStack) -> None:
    await stack.api_key("docs", size=1000)
    settings = CommonSettings(**stack.common)
    worker = _spawn_batch_worker(stack)
    try:
        async with BatchClient(settings) as client:
            job = await client.submit([_line(i) for i in range(1000)], team="docs")
            for kill_at in (250, 600):
                await _status_when(client, job, kill_at, 120)
                worker.send_signal(signal.SIGKILL)
                worker.wait(timeout=10)
                worker = _spawn_batch_worker(stack)
            status = await _status_when(client, job, 1000, 180)
            results = await client.results(job)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    assert (status.lines, status.done, status.ok, status.duplicates) == (1000, 1000, 1000, 0)
    assert sorted(r.line_id for r in results) == sorted(f"doc-{i}" for i in range(1000))
    # Usage events were written in the same transactions: one per line, none twice.
    usage = await stack.read_all(stack.topics.usage)
    assert sorted(e["id"] for e in usage if e["job_id"] == job) == sorted(
        f"batch-{job}-doc-{i}" for i in range(1000)
    )


async def test_bad_lines_become_error_results_and_the_cli_writes_openai_output(
    stack: LiveStack, tmp_path: Path
) -> None:
    """The CLI goes through the ingress's Batches API with the team's key (no Kafka)."""
    ingress = await stack.start_ingress()
    await stack.start_worker("batch")
    key = await stack.api_key("docs", size=100)
    lines = [_line(i) for i in range(95)]
    lines += [
        "{this is not json",
        _line(95, model="no-such-model"),
        _line(96, messages=[{"role": "user", "content": "x" * 200_000}]),
        orjson.dumps({"custom_id": "doc-97", "url": "/v1/embeddings", "body": {}}).decode(),
        _line(98, max_tokens="lots"),
    ]
    source = tmp_path / "job.jsonl"
    source.write_text("\n".join(lines) + "\n")
    env = stack.process_env(LANEWAY_API_KEY=key, LANEWAY_INGRESS_URL=f"{ingress.base_url}/v1")
    # Nothing of Kafka or Redis: a tenant holds its key and the ingress's address only.
    env["LANEWAY_KAFKA_BOOTSTRAP"] = "127.0.0.1:1"
    env["LANEWAY_REDIS_URL"] = "redis://127.0.0.1:1/0"
    laneway = str(Path(sys.executable).parent / "laneway")

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [laneway, "batch", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )

    submit = await asyncio.to_thread(run, "submit", str(source), "--wait", "--timeout", "120")
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().splitlines()[-1]
    assert "completed, 95 ok, 5 failed of 100" in submit.stdout

    out = tmp_path / "out.jsonl"
    fetched = await asyncio.to_thread(run, "results", job, "-o", str(out))
    assert fetched.returncode == 0, fetched.stderr
    rows = {row["custom_id"]: row for row in map(orjson.loads, out.read_text().splitlines())}
    assert len(rows) == 100
    assert rows["doc-0"]["response"]["status_code"] == 200
    assert rows["doc-0"]["response"]["body"]["object"] == "chat.completion"
    assert rows["doc-0"]["error"] is None
    expected = {"line-96": 400, "doc-95": 404, "doc-96": 413, "doc-97": 400, "doc-98": 400}
    assert {cid: rows[cid]["response"]["status_code"] for cid in expected} == expected
    assert "invalid JSON" in rows["line-96"]["error"]["message"]
    assert rows["doc-98"]["response"]["body"]["error"]["param"] == "body.max_tokens"

    status = await asyncio.to_thread(run, "status", job)
    assert "completed, 100/100 done, 95 ok, 5 failed" in status.stdout, status.stderr
    # Another team's key sees no such batch.
    env["LANEWAY_API_KEY"] = await stack.api_key("rivals")
    foreign = await asyncio.to_thread(run, "status", job)
    assert foreign.returncode == 2
    assert "404" in foreign.stderr


async def test_the_kafka_path_names_the_team_and_carries_no_key(
    stack: LiveStack, tmp_path: Path
) -> None:
    """``--kafka``: a service principal writes the lines itself, for the team it names."""
    await stack.start_worker("batch")
    source = tmp_path / "job.jsonl"
    source.write_text("\n".join(_line(i) for i in range(5)) + "\n")
    laneway = str(Path(sys.executable).parent / "laneway")
    env = stack.process_env()
    refused = await asyncio.to_thread(
        subprocess.run,
        [laneway, "batch", "submit", str(source), "--kafka"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--team" in refused.stderr
    submit = await asyncio.to_thread(
        subprocess.run,
        [laneway, "batch", "submit", str(source), "--kafka", "--team", "docs", "--wait"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert submit.returncode == 0, submit.stderr
    assert "5 ok, 0 failed of 5" in submit.stdout
    lines = await stack.read_all(stack.topics.request("batch"))
    assert [line["team"] for line in lines] == ["docs"] * 5
    assert not any("api_key" in line for line in lines)


async def test_a_line_queued_with_a_key_by_an_older_client_still_runs(stack: LiveStack) -> None:
    """Lines written before teams travelled on the topic carry a key: they run for its team,
    and one re-queued goes back with the team and without the key."""
    await stack.start_worker("batch")
    key = await stack.api_key("docs", size=100)
    producer = await stack.producer()
    legacy = orjson.loads(_line(0))
    record = {"v": 1, "job_id": "old-job", "line_id": "doc-0", "api_key": key, **legacy}
    await producer.send_and_wait(
        stack.topics.request("batch"), orjson.dumps(record), key=b"old-job:doc-0"
    )
    results = await stack.read_topic(
        stack.topics.results_batch, count=1, where=lambda r: r.get("job_id") == "old-job"
    )
    assert [(r["team"], r["status_code"]) for r in results] == [("docs", 200)]


async def test_batch_lane_yields_to_interactive_backlog(stack: LiveStack) -> None:
    # The burst waits its turn in the completion worker's queue for seconds: a deadline
    # that lets every completion start.
    ingress = await stack.start_ingress(completion_deadline_ms=30_000)
    await stack.start_worker("completion", sim_batch_slots=1, sim_decode_ms_per_step=30.0)
    batch = await stack.start_worker("batch", sim_decode_ms_per_step=5.0)
    http = stack.http(ingress, await stack.api_key("ide", size=100))
    body = {"model": "laneway-code", "prompt": "def f():", "max_tokens": 16}
    burst = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(12)]
    lane = batch.lane
    assert isinstance(lane, BatchLane)
    await eventually(lambda: lane.yielding, 10, "batch to yield to the interactive backlog")
    assert set(batch.consumer.paused()) == batch.consumer.assignment()
    responses = await asyncio.gather(*burst)
    assert {r.status_code for r in responses} == {200}
    await eventually(lambda: not lane.yielding, 10, "batch to resume")
    assert not batch.consumer.paused()


async def test_memory_pressure_sheds_batch_work_and_runs_it_again_exactly_once(
    stack: LiveStack,
) -> None:
    # A simulated engine with room for about three long lines at once, six lines in flight.
    await stack.start_worker(
        "batch",
        sim_kv_tokens=1200,
        sim_decode_ms_per_step=20.0,
        max_inflight=6,
        memory_check_ms=20,
        memory_cooldown_s=0.2,
    )
    await stack.api_key("docs", size=100)
    lines = [
        _line(i, messages=[{"role": "user", "content": f"doc {i} " * 200}], max_tokens=30)
        for i in range(12)
    ]
    async with BatchClient(CommonSettings(**stack.common)) as client:
        job = await client.submit(lines, team="docs")
        status = await _status_when(client, job, 12, 120)
    assert (status.done, status.ok, status.duplicates) == (12, 12, 0)
    await stack.read_topic(  # every line's final event, then all the job's events so far
        stack.topics.usage, count=12, where=lambda e: e["job_id"] == job and e["status"] == "ok"
    )
    usage = await stack.read_all(stack.topics.usage, where=lambda e: e["job_id"] == job)
    assert any(e["preempted"] for e in usage), "the engine never came under pressure"
    # One event per line, its final one: a shed attempt is not billed (or counted twice).
    assert sorted(e["id"] for e in usage) == sorted(f"batch-{job}-doc-{i}" for i in range(12))
    assert {e["status"] for e in usage} == {"ok"}


def _spawn_batch_worker_as(stack: LiveStack, worker_id: str) -> subprocess.Popen[bytes]:
    return stack.spawn(
        "workers",
        LANEWAY_POOL="batch",
        LANEWAY_WORKER_ID=worker_id,
        LANEWAY_ENGINE="sim",
        LANEWAY_SIM_PREFILL_MS_PER_TOKEN="0",
        LANEWAY_SIM_DECODE_MS_PER_STEP="5",
        LANEWAY_MAX_INFLIGHT="16",
        LANEWAY_COMMIT_INTERVAL_MS="100",
        LANEWAY_SESSION_TIMEOUT_MS="6000",
        LANEWAY_LOG_LEVEL="WARNING",
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_paused_batch_worker_cannot_commit_what_its_partitions_new_owner_ran(
    stack: LiveStack,
) -> None:
    """A worker frozen past its session (a long GC, a SIGSTOP) is expelled from the group and
    its partitions go to the other; when it wakes it still holds finished lines of them. Its
    transactions are fenced by the new owner's producers, so nothing is written twice."""
    await stack.api_key("docs", size=1000)
    first = _spawn_batch_worker_as(stack, "batch-a")
    second = _spawn_batch_worker_as(stack, "batch-b")
    try:
        async with BatchClient(CommonSettings(**stack.common)) as client:
            job = await client.submit([_line(i, max_tokens=16) for i in range(400)], team="docs")
            await _status_when(client, job, 40, 120)
            first.send_signal(signal.SIGSTOP)
            try:
                # The second worker takes the first's partitions once its session expired,
                # and runs to the end what the first held, finished or not.
                await _status_when(client, job, 400, 150)
            finally:
                first.send_signal(signal.SIGCONT)
            await asyncio.sleep(5)  # the woken worker's commits, had they gone through
            status = await client.status(job)
            results = await client.results(job)
    finally:
        for worker in (first, second):
            worker.send_signal(signal.SIGCONT)
            worker.send_signal(signal.SIGTERM)
        for worker in (first, second):
            worker.wait(timeout=30)
    assert (status.lines, status.done, status.duplicates) == (400, 400, 0)
    assert sorted(r.line_id for r in results) == sorted(f"doc-{i}" for i in range(400))
