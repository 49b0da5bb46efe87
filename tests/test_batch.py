"""The batch lane on the real broker: exactly-once results, bad lines, yielding, the CLI."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import orjson
import pytest
from aiokafka import AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import ProducerFenced

from laneway.batch import BatchClient, JobStatus, batch_request_id
from laneway.clients import make_consumer
from laneway.constants import RedisKeys
from laneway.errors import BadRequest
from laneway.schema import BatchRequest, BatchResult, Reply, RequestEnvelope, UsageEvent
from laneway.settings import CommonSettings
from ops.kafka_topics import create_topics
from quota import QuotaEnforcer, QuotaPolicy, Team
from tests.stack import PARTITIONS, LiveStack, envelope, eventually, free_port
from workers import batch_lane, batch_txn, batch_txn_failures
from workers.batch import BatchIntake, batch_result
from workers.batch_lane import BatchLane
from workers.batch_yield import yield_to_interactive
from workers.dispatch import Work
from workers.pool import PoolWorker


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


def _spawn_batch_worker(stack: LiveStack, **extra: str) -> subprocess.Popen[bytes]:
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
        **extra,
    )


async def _worker_gauge(port: int, name: str) -> int:
    """A gauge of a worker's ``/metrics`` (LANEWAY_METRICS_PORT); 0 until it serves them."""
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    except httpx.HTTPError:
        return 0
    for row in text.splitlines():
        if row.startswith(name + " "):
            return int(float(row.split()[1]))
    return 0


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
    first_hour = await _redis_hour(stack)
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
        batch_request_id(job, f"doc-{i}") for i in range(1000)
    )
    # And the team's batch budget was charged once per line: a line run again after a kill
    # (settled, not committed) gives its second reservation back instead of paying twice.
    keys = RedisKeys(stack.prefix)
    hours = range(first_hour, await _redis_hour(stack) + 1)  # the hour may turn meanwhile
    used = [await stack.redis.get(keys.quota_used("docs", "batch", h)) for h in hours]
    spent = sum(e["prompt_tokens"] + e["completion_tokens"] for e in usage if e["job_id"] == job)
    assert sum(int(u or 0) for u in used) == spent
    assert not await stack.redis.hlen(keys.quota_reservations("docs"))


async def _redis_hour(stack: LiveStack) -> int:
    seconds, _ = await stack.redis.time()
    return int(seconds) // 3600


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
        # Its error names the model: in full, its result would be over a Kafka record, and
        # the partition's commits would stop there.
        _line(99, model="'" * 420_000 + '"'),
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
    assert "completed, 95 ok, 6 failed of 101" in submit.stdout

    out = tmp_path / "out.jsonl"
    fetched = await asyncio.to_thread(run, "results", job, "-o", str(out))
    assert fetched.returncode == 0, fetched.stderr
    rows = {row["custom_id"]: row for row in map(orjson.loads, out.read_text().splitlines())}
    assert len(rows) == 101
    assert rows["doc-0"]["response"]["status_code"] == 200
    assert rows["doc-0"]["response"]["body"]["object"] == "chat.completion"
    assert rows["doc-0"]["error"] is None
    expected = {"line-96": 400, "doc-95": 404, "doc-96": 400, "doc-97": 400, "doc-98": 400}
    expected["doc-99"] = 404
    assert "more characters" in rows["doc-99"]["error"]["message"]
    assert {cid: rows[cid]["response"]["status_code"] for cid in expected} == expected
    assert "invalid JSON" in rows["line-96"]["error"]["message"]
    assert rows["doc-98"]["response"]["body"]["error"]["param"] == "body.max_tokens"
    assert rows["doc-96"]["response"]["body"]["error"]["code"] == "context_length_exceeded"

    status = await asyncio.to_thread(run, "status", job)
    assert "completed, 101/101 done, 95 ok, 6 failed" in status.stdout, status.stderr
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
    # Prompts of their own: twelve identical ones share one generation (coalesced), and
    # whether they did hung on how fast they came (no backlog, no yield, on an idle machine).
    burst = [
        asyncio.create_task(
            http.post(
                "/v1/completions",
                json={"model": "laneway-code", "prompt": f"def f{i}():", "max_tokens": 16},
            )
        )
        for i in range(12)
    ]
    lane = batch.lane
    assert isinstance(lane, BatchLane)
    await eventually(lambda: lane.yielding, 30, "batch to yield to the interactive backlog")
    assert set(batch.consumer.paused()) == batch.consumer.assignment()
    responses = await asyncio.gather(*burst)
    assert {r.status_code for r in responses} == {200}
    await eventually(lambda: not lane.yielding, 10, "batch to resume")
    assert not batch.consumer.paused()


async def test_a_partition_is_fetched_only_once_its_start_is_done_even_when_a_yield_ends(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition assigned while the lane yields to interactive work is fetched only once
    its start is done: its producer open, its committed offset read and sought. Resumed at
    the yield's end as soon as its producer had opened, it was fetched from the offset read
    at the assignment, and lines its previous owner had answered ran again."""
    gate = asyncio.Event()
    read_commits = batch_lane.read_commits

    async def held(consumer: Any, partitions: set[TopicPartition]) -> dict[TopicPartition, Any]:
        await gate.wait()
        return await read_commits(consumer, partitions)

    monkeypatch.setattr(batch_lane, "read_commits", held)
    worker = await stack.start_worker("batch")
    lane = worker.lane
    assert isinstance(lane, BatchLane)
    assigned = worker.consumer.assignment()
    await eventually(lambda: all(lane.txns.has(tp) for tp in assigned), 30, "producers open")
    lane.yielding = True  # interactive backlog seen as the partitions came
    await yield_to_interactive(lane)  # none now (no interactive worker): the yield ends
    assert not lane.yielding
    assert set(worker.consumer.paused()) == assigned  # still starting: not fetched
    gate.set()
    await eventually(lambda: not worker.consumer.paused(), 30, "fetched once started")


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
    assert sorted(e["id"] for e in usage) == sorted(
        batch_request_id(job, f"doc-{i}") for i in range(12)
    )
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


@pytest.mark.slow
@pytest.mark.parametrize("member", [True, False], ids=["still-a-member", "maybe-replaced"])
async def test_a_transaction_whose_end_never_comes_is_replaced_and_nothing_written_twice(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch, member: bool
) -> None:
    """A producer that lost its coordinator with a broker can wait for good on the end of a
    transaction that did commit. The worker replaces that producer and learns from the
    group's offsets what went out, so it neither stalls nor writes those results again.
    Not a member any more (its heartbeat refused: cut off that long, the group may have
    given the partition to another), it starts no producer there, which would fence the
    new owner: it asks the group, and runs the partition again once assigned it."""
    monkeypatch.setattr(batch_lane, "_TXN_STUCK_S", 5.0)  # the real commit ends well before
    worker = await stack.start_worker("batch")
    lane = worker.lane
    assert isinstance(lane, BatchLane)
    assignments: list[set[TopicPartition]] = []
    assign = lane.assigned

    async def noted_assign(partitions: set[TopicPartition]) -> None:
        if stuck:  # assigned again, after the transaction that never ended
            assignments.append(set(partitions))
        await assign(partitions)

    monkeypatch.setattr(lane, "assigned", noted_assign)
    opened = lane.txns.open
    # After the stuck transaction: each producer start, and how many assignments came first.
    opens: list[int] = []

    async def noted_open(partitions: Any) -> None:
        if stuck and stuck[0][0] in partitions:
            opens.append(len(assignments))
        await opened(partitions)

    monkeypatch.setattr(lane.txns, "open", noted_open)
    if not member:
        # The coordinator does not answer its heartbeat as a member's (cut off that long,
        # expelled). raising=False: code without the check runs as it did.
        async def expelled(_lane: BatchLane) -> bool:
            return False

        monkeypatch.setattr(batch_txn_failures, "_still_a_member", expelled, raising=False)
    commit = lane.txns.commit
    stuck: list[tuple[TopicPartition, int]] = []

    async def commit_then_hang(
        tp: TopicPartition, records: list[Any], offset: int, metadata: str = ""
    ) -> None:
        await commit(tp, records, offset, metadata)
        if records and not stuck:
            stuck.append((tp, offset))
            await asyncio.Event().wait()  # its end is never reported

    monkeypatch.setattr(lane.txns, "commit", commit_then_hang)
    await stack.api_key("docs", size=1000)
    async with BatchClient(CommonSettings(**stack.common)) as client:
        job = await client.submit([_line(i) for i in range(60)], team="docs")
        status = await _status_when(client, job, 60, 90)
        results = await client.results(job)
        assert stuck, "no transaction was cut off"
        # Lines after it, on both partitions: the stuck one's need a producer again.
        later = await client.submit([_line(i) for i in range(60, 80)], team="docs")
        later_status = await _status_when(client, later, 20, 90)
    assert (status.done, status.duplicates) == (60, 0)
    assert sorted(r.line_id for r in results) == sorted(f"doc-{i}" for i in range(60))
    assert (later_status.done, later_status.duplicates) == (20, 0)
    assert opens, "no producer started again: the partition stalled"
    if member:  # it goes on where it was, its producer replaced at once
        assert (assignments, opens[0]) == ([], 0)
    else:  # it starts none before the group assigns it the partition again
        assert assignments
        assert 0 not in opens, opens


async def test_a_submit_cut_short_leaves_nothing_and_sent_again_runs_once(
    stack: LiveStack,
) -> None:
    """``laneway batch submit --kafka`` cut short (Ctrl-C, a send refused) left the header
    promising 1,200 lines and the lines sent so far, which ran, and ran again when the job
    was sent again. Lines and header now go in one transaction."""

    def interrupted(_sent: int) -> None:
        raise KeyboardInterrupt

    lines = [_line(i) for i in range(1200)]
    async with BatchClient(CommonSettings(**stack.common)) as client:
        with pytest.raises(KeyboardInterrupt):
            await client.submit(lines, team="docs", job_id="cut-short", progress=interrupted)
        with pytest.raises(BadRequest, match="no batch job"):
            await client.status("cut-short")
        assert await client.submit(lines, team="docs", job_id="cut-short") == "cut-short"
        assert (await client.status("cut-short")).lines == 1200
    queued = await stack.read_all(
        stack.topics.request("batch"), where=lambda line: line.get("job_id") == "cut-short"
    )
    assert len(queued) == 1200  # the first attempt's 500 were never committed


@pytest.mark.slow
async def test_commits_that_overlap_write_each_result_once(stack: LiveStack) -> None:
    """A rebalance commits what is done while the commit loop may be committing too: both
    through one producer per partition. Neither may begin while the other runs (aiokafka
    refuses, which looked like a fence) nor write what the other just wrote."""
    lane = (await stack.start_worker("batch", sim_decode_ms_per_step=2.0)).lane
    assert isinstance(lane, BatchLane)
    await stack.api_key("docs", size=1000)
    async with BatchClient(CommonSettings(**stack.common)) as client:
        job = await client.submit([_line(i) for i in range(150)], team="docs")
        deadline = asyncio.get_running_loop().time() + 60
        while (status := await client.status(job)).done < 150:
            assert asyncio.get_running_loop().time() < deadline, f"stalled: {status}"
            await asyncio.gather(lane.commit(), lane.commit(), lane.commit())
    assert (status.done, status.duplicates) == (150, 0)
    assert not lane.fenced


@pytest.mark.slow
async def test_an_owner_fenced_while_the_group_gives_it_the_partition_takes_it_back(
    stack: LiveStack,
) -> None:
    """Another producer of a partition's transactional id (a start that came too late, a
    tool run with the worker's id) fences the partition's owner while the group still gives
    it the partition. The owner used to read no more of it until some other rebalance: the
    job's remaining lines waited for good. It asks the group for it again and goes on, and
    every line is answered once."""
    await stack.api_key("docs", size=1000)
    # Four lines at a time of 8 steps of 40 ms (the sim engine, a simulated GPU): the job
    # takes about 5 s, most of it after the fence.
    worker = await stack.start_worker("batch", sim_decode_ms_per_step=40.0, max_inflight=4)
    lane = worker.lane
    assert isinstance(lane, BatchLane)
    topic = stack.topics.request("batch")
    intruders = []
    try:
        async with BatchClient(CommonSettings(**stack.common)) as client:
            job = await client.submit([_line(i) for i in range(60)], team="docs")
            await _status_when(client, job, 10, 60)
            for partition in range(PARTITIONS):
                intruders.append(await _fence(stack, lane, TopicPartition(topic, partition)))
            status, results = await _settled(client, job, 60)
    finally:
        for intruder in intruders:
            await intruder.stop()
    assert lane.fences >= 1, "the worker was never fenced: the test proves nothing"
    assert (status.done, status.ok, status.duplicates) == (60, 60, 0)
    assert sorted(r.line_id for r in results) == sorted(f"doc-{i}" for i in range(60))


@pytest.mark.slow
async def test_a_follower_fenced_on_its_partition_takes_it_back_without_the_leader(
    stack: LiveStack,
) -> None:
    """The same fence on a follower of a two-member group: its rejoin gets the group's
    current assignment back without a rebalance of the others (Kafka's answer to a follower
    that changed nothing), and its assignment callback still starts the producer again. The
    leader's partition is never fenced and runs on."""
    await stack.api_key("docs", size=1000)
    workers = []
    for worker_id in ("batch-a", "batch-b"):
        workers.append(
            await stack.start_worker(
                "batch", worker_id=worker_id, sim_decode_ms_per_step=40.0, max_inflight=4
            )
        )
    lane_topic = stack.topics.request("batch")  # the job below goes there

    def on_the_lane(worker: PoolWorker) -> list[TopicPartition]:
        return [tp for tp in worker.consumer.assignment() if tp.topic == lane_topic]

    await eventually(
        lambda: all(len(on_the_lane(w)) == 1 for w in workers), 60, "one lane partition each"
    )
    # Only the leader computes assignments: it is the one that knows the group's topics.
    followers = [w for w in workers if w.consumer._coordinator._group_subscription is None]
    assert len(followers) == 1, "expected one leader and one follower"
    follower = followers[0]
    lane = follower.lane
    assert isinstance(lane, BatchLane)
    (tp,) = on_the_lane(follower)
    leader = next(w for w in workers if w is not follower)
    generation = leader.consumer._coordinator.generation
    async with BatchClient(CommonSettings(**stack.common)) as client:
        job = await client.submit([_line(i) for i in range(80)], team="docs")
        await _status_when(client, job, 10, 60)
        intruder = await _fence(stack, lane, tp)
        try:
            status, results = await _settled(client, job, 80)
        finally:
            await intruder.stop()
    assert lane.fences >= 1, "the follower was never fenced: the test proves nothing"
    assert leader.consumer._coordinator.generation == generation, "the group rebalanced"
    assert (status.done, status.ok, status.duplicates) == (80, 80, 0)
    assert sorted(r.line_id for r in results) == sorted(f"doc-{i}" for i in range(80))


async def _fence(stack: LiveStack, lane: BatchLane, tp: TopicPartition) -> AIOKafkaProducer:
    """A producer of ``tp``'s transactional id, started: that bumps the id's epoch, so the
    lane's producer of ``tp`` is fenced at its next commit."""
    intruder = AIOKafkaProducer(
        bootstrap_servers=stack.services.bootstrap,
        transactional_id=lane.txns.transactional_id(tp),
    )
    await intruder.start()
    return intruder


async def _settled(
    client: BatchClient, job: str, lines: int
) -> tuple[JobStatus, list[BatchResult]]:
    """The job's status and results once all its lines are done, and 2 s more: a result
    written twice would show by then."""
    await _status_when(client, job, lines, 90)
    await asyncio.sleep(2)
    return await client.status(job), await client.results(job)


class _HeldRevoke(ConsumerRebalanceListener):
    """A group member that, once ``hold`` is cleared, rejoins a rebalance only when it is set:
    the group's rebalance stays open that long, as it does while a member commits or sleeps."""

    def __init__(self) -> None:
        self.hold = asyncio.Event()
        self.hold.set()

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.hold.wait()

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        pass


@pytest.mark.slow
async def test_lines_fetched_before_a_rebalance_are_not_run_as_the_next_tenures(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group takes a worker's partitions back in a rebalance (and may give them back)
    while the worker is still going through a batch of lines it fetched before. What is left
    of that batch belongs to no tenure: were it run and committed during the rebalance, the
    line the worker was on when its partition was revoked would be skipped for good (the
    commit goes past it), and a partition given back would run the rest a second time."""
    await stack.api_key("docs", size=1000)
    common = CommonSettings(**stack.common)
    envelope = BatchIntake.envelope
    on_first, go_on, first_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def first_line_waits(
        intake: BatchIntake, line: BatchRequest, request_id: str, accepted_ts: float
    ) -> RequestEnvelope:
        if on_first.is_set():
            return await envelope(intake, line, request_id, accepted_ts)
        on_first.set()
        await go_on.wait()
        try:
            return await envelope(intake, line, request_id, accepted_ts)
        finally:
            first_done.set()

    monkeypatch.setattr(BatchIntake, "envelope", first_line_waits)
    # Two more members of the worker's group, reading a topic of their own: the first is in
    # the group before the worker; when the second joins, the first's rejoin is held, and
    # the rebalance with it.
    first, second = (
        make_consumer(
            common,
            group_id=stack.topics.consumer_group("batch"),
            partition_assignment_strategy=(RangePartitionAssignor,),
        )
        for _ in range(2)
    )
    held = _HeldRevoke()
    try:
        await first.start()
        first.subscribe([stack.topics.results_batch], listener=held)
        await eventually(first.assignment, 30, "the first member's assignment")
        async with BatchClient(common) as client:
            # All of the job is there at the worker's first fetch: one batch of many lines.
            job = await client.submit([_line(i) for i in range(120)], team="docs")
            worker = await stack.start_worker("batch", sim_decode_ms_per_step=1.0)
            lane = worker.lane
            assert isinstance(lane, BatchLane)
            await asyncio.wait_for(on_first.wait(), 60)  # stuck on the batch's first line
            revoked, assigned = _noted(lane, monkeypatch)
            held.hold.clear()
            await second.start()
            second.subscribe([stack.topics.results_batch])
            await asyncio.wait_for(revoked.wait(), 30)
            # The rebalance is open (the first member has not rejoined): the worker goes on
            # through its batch until nothing of it is in flight or left to commit.
            go_on.set()
            await asyncio.wait_for(first_done.wait(), 30)
            await eventually(
                lambda: not worker.offsets.in_flight() and not worker.offsets.committable(),
                60,
                "the rest of the fetched batch settled",
            )
            held.hold.set()
            status = await _status_when(client, job, 120, 90)
            results = await client.results(job)
        # The worker settles in its group without the two before it stops: a producer's
        # start cut short leaves aiokafka's bootstrap connection behind.
        assigned.clear()
        await asyncio.gather(first.stop(), second.stop())
        await asyncio.wait_for(assigned.wait(), 30)
        await eventually(
            lambda: all(lane.txns.has(tp) for tp in worker.consumer.assignment()),
            30,
            "the worker's producers started",
        )
    finally:
        held.hold.set()
        for member in (first, second):
            await member.stop()
    assert (status.done, status.duplicates) == (120, 0)
    assert sorted(r.line_id for r in results) == sorted(f"doc-{i}" for i in range(120))


def _noted(lane: BatchLane, monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Events set once the lane's partitions were revoked and once assigned, from now."""
    revoke, revoked = lane.revoked, asyncio.Event()
    assign, assigned = lane.assigned, asyncio.Event()

    async def noted_revoke(partitions: set[TopicPartition]) -> None:
        await revoke(partitions)
        revoked.set()

    async def noted_assign(partitions: set[TopicPartition]) -> None:
        await assign(partitions)
        assigned.set()

    monkeypatch.setattr(lane, "revoked", noted_revoke)
    monkeypatch.setattr(lane, "assigned", noted_assign)
    return revoked, assigned


async def test_a_kafka_line_that_names_its_job_but_is_malformed_is_answered(
    stack: LiveStack,
) -> None:
    """A record on the batch topic with a job and line id but a body or version laneway
    cannot run gets an error result naming the problem (its submitter counts on one result
    a line); a record that names no line is skipped, as it has nowhere to be answered."""
    await stack.api_key("docs", size=100)
    await stack.start_worker("batch")
    body = {"model": "laneway-chat", "messages": [{"role": "user", "content": "hi"}]}
    producer = await stack.producer()
    topic = stack.topics.request("batch")
    line = {"v": 1, "job_id": "j-bad", "team": "docs"}
    # JSON that orjson cannot write out again: an integer beyond 64 bits (written by hand),
    # nesting past laneway's limit. Ahead of the good line: the worker must live through them.
    huge = orjson.dumps({**line, "line_id": "huge", "body": {**body, "max_tokens": 7}})
    deep: Any = []
    for _ in range(100):
        deep = [deep]
    records: list[dict[str, Any] | bytes] = [
        huge.replace(b'"max_tokens":7', b'"max_tokens":' + str(10**30).encode()),
        {**line, "line_id": "deep", "body": {**body, "metadata": deep}},
        {"v": 1, "job_id": "j-bad", "line_id": "good", "team": "docs", "body": body},
        {"v": 1, "job_id": "j-bad", "line_id": "a-string", "team": "docs", "body": "hi"},
        {"v": 2, "job_id": "j-bad", "line_id": "newer", "team": "docs", "body": body},
        b"{not json",
        {"v": 1, "job_id": "j-bad", "team": "docs", "body": body},  # no line id
        {"v": 1, "job_id": "j-bad", "line_id": "x" * 600, "team": "docs", "body": body},
        # An id written as a number, and a team no line can name: answered all the same.
        {"v": 1, "job_id": "j-bad", "line_id": 7, "team": "docs", "body": body},
        {"v": 1, "job_id": "j-bad", "line_id": "long-team", "team": "d" * 300, "body": body},
        # Past what orjson parses at all (1024 levels): its top level still names the line.
        b'{"v": 1, "job_id": "j-bad", "line_id": "abyss", "team": "docs", "body": '
        + b"[" * 3000
        + b"]" * 3000
        + b"}",
    ]
    for record in records:
        value = record if isinstance(record, bytes) else orjson.dumps(record)
        await producer.send_and_wait(topic, value, key=b"j-bad")
    results = await stack.read_topic(
        stack.topics.results_batch, count=9, where=lambda r: r.get("job_id") == "j-bad"
    )
    by_line = {r["line_id"]: r for r in results}
    answered = ["7", "a-string", "abyss", "deep", "good", "huge", "long-team", "newer"]
    (cut,) = set(by_line) - set(answered)
    assert cut.startswith("x" * 400)
    assert len(cut) <= 500
    assert "line_id" in by_line.pop(cut)["body"]["error"]["message"]
    assert sorted(by_line) == answered
    assert by_line["good"]["status_code"] == 200
    for name, words in (
        ("a-string", "body"),
        ("newer", "v"),
        ("huge", "body: max_tokens: an integer above the 64-bit range (100 bits)"),
        ("deep", "nested more than 64 levels deep"),
        ("abyss", "recursion limit exceeded"),
        ("7", "line_id"),
        ("long-team", "team"),
    ):
        assert by_line[name]["status_code"] == 400, by_line[name]
        message = by_line[name]["body"]["error"]["message"]
        assert "not a laneway batch line" in message, message
        assert words in message, message
    await asyncio.sleep(1)  # nothing more comes: the two that name no line are not answered
    assert len(await stack.read_all(stack.topics.results_batch)) == 9


_JOBS = {"thrifty": ("j-thrifty", 120), "rich": ("j-rich", 40)}


async def _thrifty_ahead_of_rich(stack: LiveStack) -> None:
    """A team with budget for about half its job, every line of it queued ahead of every
    line of a team with budget to spare, on the same partitions."""
    await stack.api_key("thrifty", size=1, complexity=0.1)  # 5,000 tokens/h: ~60 of its lines
    await stack.api_key("rich", size=1000)
    producer = await stack.producer()
    topic = stack.topics.request("batch")
    for team, (job, lines) in _JOBS.items():
        for line in range(lines):
            request = BatchRequest(
                job_id=job,
                line_id=str(line),
                team=team,
                url="/v1/completions",
                body={"model": "laneway-code", "prompt": f"document {line} " * 5, "max_tokens": 64},
            )
            await producer.send(topic, request.to_json(), key=f"{job}:{line}".encode())
    await producer.flush()


def _of(job: str) -> Any:
    return lambda result: result.get("job_id") == job


async def _each_line_answered_once(stack: LiveStack) -> list[dict[str, Any]]:
    """Both jobs' results: every line answered once, ok, and charged once."""
    results = await stack.read_all(stack.topics.results_batch)
    usage = await stack.read_all(stack.topics.usage)
    for team, (job, lines) in _JOBS.items():
        got = sorted(int(r["line_id"]) for r in results if r.get("job_id") == job)
        assert got == list(range(lines)), f"{team}: each line answered once"
        assert all(r["status"] == "ok" for r in results if r.get("job_id") == job)
        charged = sorted(e["id"] for e in usage if e["job_id"] == job)
        assert charged == sorted(batch_request_id(job, str(line)) for line in range(lines))
    return results


@pytest.mark.slow
async def test_a_team_over_its_budget_holds_up_no_other_team_and_nothing_runs_twice(
    stack: LiveStack,
) -> None:
    """One team's lines wait for its batch pool beside the lane, not in it: another team's
    job queued behind them on the same partitions runs and is answered meanwhile. A SIGKILL
    then leaves both jobs whole: the new worker runs exactly the lines still unanswered."""
    await _thrifty_ahead_of_rich(stack)
    worker = _spawn_batch_worker(stack, LANEWAY_QUOTA_OFFPEAK="")
    try:
        await stack.read_topic(
            stack.topics.results_batch, count=40, where=_of("j-rich"), within_s=60
        )
        answered = await stack.read_all(stack.topics.results_batch, where=_of("j-thrifty"))
        assert 0 < len(answered) < 120  # thrifty's pool ran dry: the rest of its job waits
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        await stack.api_key("thrifty", size=1000)  # its budget raised: the rest may run
        worker = _spawn_batch_worker(stack, LANEWAY_QUOTA_OFFPEAK="")
        await stack.read_topic(
            stack.topics.results_batch, count=120, where=_of("j-thrifty"), within_s=90
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    await _each_line_answered_once(stack)


@pytest.mark.slow
async def test_lines_waiting_without_their_bodies_are_read_back_and_answered_once(
    stack: LiveStack,
) -> None:
    """Past LANEWAY_BATCH_PARKED_BODIES, a line waiting for its team's budget keeps only its
    place. Another team is answered meanwhile; once the budget is raised, the same worker
    reads each of those lines back from Kafka and runs it, with its own prompt, once."""
    await _thrifty_ahead_of_rich(stack)
    worker = _spawn_batch_worker(stack, LANEWAY_QUOTA_OFFPEAK="", LANEWAY_BATCH_PARKED_BODIES="4")
    try:
        await stack.read_topic(
            stack.topics.results_batch, count=40, where=_of("j-rich"), within_s=60
        )
        waiting = 120 - len(
            await stack.read_all(stack.topics.results_batch, where=_of("j-thrifty"))
        )
        assert waiting > 4  # more wait than keep their bodies
        await stack.api_key("thrifty", size=1000)
        await stack.read_topic(
            stack.topics.results_batch, count=120, where=_of("j-thrifty"), within_s=90
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    results = await _each_line_answered_once(stack)
    # Read back whole: every line ran on its own prompt, "document <n> " five times, whose
    # tokens depend only on the digits of n (a line run without its body would show none).
    prompts: dict[int, set[int]] = {}
    for result in results:
        if result.get("job_id") == "j-thrifty":
            digits = len(result["line_id"])
            prompts.setdefault(digits, set()).add(result["body"]["usage"]["prompt_tokens"])
    assert sorted(prompts) == [1, 2, 3]
    assert all(len(tokens) == 1 and min(tokens) >= 10 for tokens in prompts.values()), prompts


@pytest.mark.slow
async def test_a_waiting_line_that_retention_deleted_is_answered_not_lost(
    stack: LiveStack,
) -> None:
    """A line waiting without its body for its team's budget is read back from Kafka when
    admitted. If retention deleted it meanwhile, it is answered with an ``expired`` result
    saying so: the job still gets one result per line, and nothing else run in its place.
    Those that waited with their bodies run."""
    # The team's pool spent by other work before the job comes: every line waits, and none
    # is admitted (2,000 tokens/h refill one line's ~80 in about two minutes) until the
    # budget is raised. (With room at the start, which lines were left waiting with their
    # bodies depended on how intake and the first answers interleaved.)
    await stack.api_key("thrifty", size=1, complexity=0.04)
    policy = replace(QuotaPolicy.from_settings(CommonSettings(**stack.common)), offpeak="")
    quota = QuotaEnforcer(stack.redis, RedisKeys(stack.prefix), policy)
    team = Team("thrifty", size=1, complexity=0.04)
    left = (await quota.reserve(team, "batch", "earlier-work", 1)).remaining
    await quota.reserve(team, "batch", "earlier-work-rest", left)
    producer = await stack.producer()
    tp = TopicPartition(stack.topics.request("batch"), 0)
    for line in range(90):
        request = BatchRequest(
            job_id="j-late",
            line_id=str(line),
            team="thrifty",
            url="/v1/completions",
            body={"model": "laneway-code", "prompt": f"document {line} " * 5, "max_tokens": 64},
        )
        sent = await producer.send_and_wait(tp.topic, request.to_json(), partition=0)
    metrics_port = free_port()
    worker = _spawn_batch_worker(
        stack,
        LANEWAY_QUOTA_OFFPEAK="",
        LANEWAY_BATCH_PARKED_BODIES="4",
        LANEWAY_METRICS_PORT=str(metrics_port),
    )
    admin = AIOKafkaAdminClient(
        bootstrap_servers=stack.services.bootstrap, **stack.services.admin_auth
    )
    await admin.start()
    try:

        async def all_parked() -> bool:
            return await _worker_gauge(metrics_port, "laneway_batch_parked") == 90

        await eventually(all_parked, 60, "every line waiting for the team's budget")
        await admin.delete_records({tp: RecordsToDelete(before_offset=sent.offset + 1)})
        await stack.api_key("thrifty", size=1000)
        await stack.read_topic(stack.topics.results_batch, count=90, within_s=60)
    finally:
        await admin.close()
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    results = await stack.read_all(stack.topics.results_batch)
    assert sorted(int(r["line_id"]) for r in results) == list(range(90))  # each once
    status = {int(r["line_id"]): r["status"] for r in results}
    assert {line for line, said in status.items() if said == "ok"} == {0, 1, 2, 3}  # bodies
    for result in results:
        if result["status"] != "ok":
            assert result["status"] == "expired"
            assert result["status_code"] == 504
            assert "deleted from Kafka" in result["body"]["error"]["message"]


async def test_a_job_sent_twice_while_its_first_copy_runs_loses_no_line(
    stack: LiveStack,
) -> None:
    """A line is known by its id in the queue, on the engine, in its reservation and in its
    reply: a second copy fetched while the first is still on the worker (a job submitted
    again after a client timeout) took the first's place, and one of the two was never
    answered. Now the same line again is answered by the one run, and a different line of
    the same id is answered at once (409 ``duplicate_line``, saying why) and not run."""
    await stack.api_key("docs", size=1000)
    # The sim engine (a simulated GPU) slow enough that the first copies still run when the
    # others come: 8 tokens of 750 ms each. At 250 ms (2 s in all) a loaded CI run once
    # answered the changed doc-0 with a run of its own: by then the first had ended.
    await stack.start_worker("batch", sim_decode_ms_per_step=750.0, quota_offpeak="")
    lines = [_line(i) for i in range(3)]
    async with BatchClient(CommonSettings(**stack.common)) as client:
        await client.submit(lines, team="docs", job_id="twice")
        await client.submit(lines, team="docs", job_id="twice")  # the same lines again
        changed = [_line(0, max_tokens=4)]  # doc-0 again, but another line
        await client.submit(changed, team="docs", job_id="twice")

        async def answered() -> list[dict[str, Any]]:
            records = await stack.read_all(stack.topics.results_batch)
            answers = [r for r in records if r.get("type") == "result"]
            return answers if len(answers) == 4 else []

        answers = await eventually(answered, 60, "the three lines' results and the 409")
        # Sent again once the first copies are answered, the lines run again.
        await client.submit(lines, team="docs", job_id="twice")

        async def ran_again() -> list[dict[str, Any]]:
            usage = await stack.read_all(stack.topics.usage)
            ok = [e for e in usage if e.get("job_id") == "twice" and e["status"] == "ok"]
            return ok if len(ok) == 6 else []

        await eventually(ran_again, 60, "the fourth copy run")
        results = await client.results("twice")
    by_line: dict[str, list[int]] = {}
    for answer in answers:
        by_line.setdefault(answer["line_id"], []).append(answer["status_code"])
    assert {line: sorted(codes) for line, codes in by_line.items()} == {
        "doc-0": [200, 409],
        "doc-1": [200],
        "doc-2": [200],
    }
    twice = next(a for a in answers if a["status_code"] == 409)
    assert twice["body"]["error"]["code"] == "duplicate_line"
    assert "used twice" in twice["body"]["error"]["message"]
    assert sorted((r.line_id, r.status) for r in results) == [(f"doc-{i}", "ok") for i in range(3)]


async def test_two_teams_topics_may_use_one_job_id(stack: LiveStack) -> None:
    """Each direct-Kafka tenant chooses its job ids: a line of another team's topic with the
    same job and custom_id is its own request. Before, the worker knew a line by job and
    custom_id alone, and one team's lines were answered ``duplicate_line`` while the other's
    ran: a tenant that knew another's job id could have that team's job refused."""
    teams = ("north", "south")
    topics = stack.topics
    for team in teams:
        await stack.api_key(team, size=1000)
        specs = topics.team_specs(team, 1)
        await asyncio.to_thread(
            create_topics, stack.services.bootstrap, specs, 1, stack.services.admin_auth
        )
    producer = await stack.producer()
    for team in teams:  # both teams' lines wait for the worker, so it holds them at once
        for line in range(3):
            request = BatchRequest(
                job_id="nightly",
                line_id=f"doc-{line}",
                url="/v1/completions",
                body={"model": "laneway-code", "prompt": f"{team} {line}", "max_tokens": 8},
            )
            await producer.send_and_wait(topics.batch_team(team), request.to_json())
    # The sim engine (a simulated GPU) slow enough that every line is on the worker at
    # once: 8 tokens of 250 ms each.
    await stack.start_worker("batch", sim_decode_ms_per_step=250.0, quota_offpeak="")
    answered = {
        team: await stack.read_topic(topics.results_batch_team(team), count=3, within_s=60)
        for team in teams
    }
    for team, results in answered.items():
        assert sorted((r["line_id"], r["status_code"]) for r in results) == [
            (f"doc-{i}", 200) for i in range(3)
        ], results
        assert {r["team"] for r in results} == {team}
    ids = {r["request_id"] for results in answered.values() for r in results}
    assert len(ids) == 6  # each team's line is a request of its own, charged to it

    async def charged() -> list[tuple[str, str]]:
        usage = await stack.read_all(topics.usage)
        ok = sorted((e["team"], e["id"]) for e in usage if e["status"] == "ok")
        return ok if len(ok) == 6 else []

    usage = await eventually(charged, 30, "each team's three lines in the usage stream")
    assert sorted(team for team, _ in usage) == ["north"] * 3 + ["south"] * 3
    assert {request_id for _, request_id in usage} == ids


async def test_a_revoke_ends_a_start_of_its_partitions_producers_under_way(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Revoked while its producers still start: the start ends before the group hands the
    partitions on, and no producer of them is left here (a late one would fence their next
    owner's)."""
    lane = (await stack.start_worker("batch")).lane
    assert isinstance(lane, BatchLane)
    started, go_on = asyncio.Event(), asyncio.Event()
    open_producers = lane.txns._open

    async def slow_open(partitions: Any) -> None:
        started.set()
        await go_on.wait()  # a start retried while a transaction left open ends
        await open_producers(partitions)

    monkeypatch.setattr(lane.txns, "_open", slow_open)
    taken = {TopicPartition(stack.topics.request("batch"), 1)}
    await lane.assigned(taken)
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.wait_for(lane.revoked(taken), 10)
    go_on.set()
    await asyncio.sleep(1)
    assert not lane.starting
    assert not any(lane.txns.has(tp) for tp in taken)


def test_a_fenced_producers_leftover_futures_are_not_logged_as_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fence leaves its error on futures nobody awaits (the transaction's end, the records'
    deliveries): asyncio logged each as an error with a traceback. Only the fence is quiet."""
    # Garbage of earlier tests in this process (a producer's task that failed, say) is
    # logged when it is collected: collected before, so that only this test's is judged.
    gc.collect()
    caplog.clear()
    loop = asyncio.new_event_loop()
    try:
        batch_txn._quiet_fences(loop)
        batch_txn._quiet_fences(loop)  # once per loop, however many producers start
        for error in (ProducerFenced(), RuntimeError("something else")):
            future = loop.create_future()
            future.set_exception(error)
            del future
            gc.collect()
    finally:
        loop.close()
    logged = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert [str(r.exc_info[1]) if r.exc_info else r.getMessage() for r in logged] == [
        "something else"
    ]


async def test_a_dash_in_a_job_id_does_not_make_two_lines_one(stack: LiveStack) -> None:
    """Job ``nightly`` line ``doc-0`` and job ``nightly-doc`` line ``0`` both had the request
    id ``batch-nightly-doc-0``: held at once by the worker, the second was answered 409
    ``duplicate_line`` and never run, and a usage total that knows requests by id would
    have counted one."""
    await stack.api_key("docs", size=1000)
    # The sim engine (a simulated GPU) slow enough that both lines are on the worker at
    # once: 8 tokens of 250 ms each.
    await stack.start_worker("batch", sim_decode_ms_per_step=250.0, quota_offpeak="")
    async with BatchClient(CommonSettings(**stack.common)) as client:
        await client.submit([_line(0)], team="docs", job_id="nightly")  # custom_id doc-0
        line = orjson.loads(_line(0)) | {"custom_id": "0"}
        await client.submit([orjson.dumps(line).decode()], team="docs", job_id="nightly-doc")
    records = await stack.read_topic(stack.topics.results_batch, count=4, within_s=60)
    results = [r for r in records if r["type"] == "result"]  # and each job's header
    assert sorted((r["job_id"], r["line_id"], r["status_code"]) for r in results) == [
        ("nightly", "doc-0", 200),
        ("nightly-doc", "0", 200),
    ], results
    ids = {r["request_id"] for r in results}
    assert ids == {"batch-nightly-doc-0", "batch-nightly~2Ddoc-0"}

    async def charged() -> set[str]:
        usage = await stack.read_all(stack.topics.usage)
        found = {e["id"] for e in usage if e["status"] == "ok"}
        return found if len(found) == 2 else set()

    assert await eventually(charged, 30, "both lines in the usage stream") == ids


def test_no_two_lines_share_a_request_id() -> None:
    # Every pair of job and line id over an alphabet of the characters that matter, each
    # on the lane and on two teams' topics.
    names = ["".join(p) for n in range(1, 4) for p in itertools.product("a-~2D7E.%", repeat=n)]
    seen: dict[str, tuple[str | None, str, str]] = {}
    for team in (None, "docs", "docs-2"):
        for job in names:
            for line in ("0", "-0", "0-", "a-b", "~2D", "%2D.x"):
                request_id = batch_request_id(job, line, team)
                assert seen.setdefault(request_id, (team, job, line)) == (team, job, line)
                # The same in a URL path (DELETE /v1/requests/{id}), which is percent-decoded.
                assert unquote(request_id) == request_id or "%" in job + line
    assert batch_request_id("batch_0f3a", "doc-1") == "batch-batch_0f3a-doc-1"  # as before
    assert batch_request_id("nightly", "doc-1", "docs") == "batch.docs.nightly-doc-1"
    assert batch_request_id("nightly-doc", "0") == "batch-nightly~2Ddoc-0"
    assert batch_request_id("a~b", "0", "docs") == "batch.docs.a~7Eb-0"


@pytest.mark.parametrize("status", ["rejected", "unsupported"])
def test_an_engines_refusal_of_a_line_is_a_400_naming_the_field(status: str) -> None:
    """A batch line with a suffix on the vllm engine is refused as an interactive request
    is: a 400 ``invalid_request_error`` naming the field, not a 500."""
    env = envelope(id="batch-j-0", cls="batch", job_id="j", line_id="0", suffix="x")
    said = "suffix is not supported by this model's engine"
    final = Reply(id=env.id, n=0, done=True, status=status, error=said, param="suffix")
    result = batch_result(env, final)
    assert (result.status, result.status_code) == (status, 400)
    assert result.body is not None
    error = result.body["error"]
    assert (error["type"], error["param"], error["message"]) == (
        "invalid_request_error",
        "suffix",
        said,
    )


async def test_a_line_that_ends_after_its_partition_went_away_leaves_no_result(
    stack: LiveStack,
) -> None:
    """A run that ends after a rebalance took its partition (the next owner runs the line
    again) adds nothing to the ledger: its records would go out a second time if the
    partition came back to this worker. The same run within its tenure is kept."""
    worker = await stack.start_worker("batch")
    lane = worker.lane
    assert isinstance(lane, BatchLane)
    tp = min(worker.consumer.assignment())
    env = envelope(id="batch-j-l1", cls="batch", job_id="j", line_id="l1")
    usage = UsageEvent(
        id=env.id, team=env.team, cls="batch", model=env.model, route=env.route, status="ok"
    )

    def ended(offset: int, epoch: int) -> None:
        worker.outbox.captured[env.id] = Reply(id=env.id, n=2, at=0, text="ok", done=True)
        lane.finished(Work(tp, offset, env, epoch), usage)

    tenure = worker.offsets.epoch(tp)
    worker.runs.forget({tp})  # the rebalance took it away
    ended(7, tenure)
    assert not lane.ledger.holds(tp)
    ended(8, worker.offsets.epoch(tp))  # a run of the tenure now
    assert lane.ledger.holds(tp)
