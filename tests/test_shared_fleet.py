"""One upstream shared by every pool: completions never wait behind batch, chat ranks between,
preempted batch lines finish exactly once. Judged by the upstream process's own log."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from laneway.batch import BatchClient
from laneway.settings import CommonSettings
from tests.stack import LiveStack, eventually
from tests.upstream_process import UpstreamProcess
from workers import metrics
from workers.pool import PoolWorker

pytestmark = pytest.mark.slow

TOKEN_MS = 20


@pytest.fixture
async def upstream(tmp_path: Path) -> AsyncIterator[UpstreamProcess]:
    process = UpstreamProcess(tmp_path / "upstream.jsonl", slots=4, token_ms=TOKEN_MS)
    await process.ready()
    yield process
    process.stop()


async def _fleet(
    stack: LiveStack, upstream: UpstreamProcess, slots: int, **options: Any
) -> dict[str, PoolWorker]:
    """A worker per pool, all on the one upstream, declared as one shared engine."""
    shared = {
        "engine": "openai",
        "upstream_url": upstream.url,
        "upstream_model": "up",
        "upstream_slots": slots,
        "upstream_metrics_url": "",
        "engine_id": "gpu-fleet",
        "fleet_peak_window_s": 2.0,
        **options,
    }
    return {
        pool: await stack.start_worker(pool, **shared) for pool in ("completion", "chat", "batch")
    }


def _line(i: int, max_tokens: int) -> str:
    body = {
        "model": "laneway-chat",
        "messages": [{"role": "user", "content": f"doc-{i}"}],
        "max_tokens": max_tokens,
    }
    line = {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return orjson.dumps(line).decode()


async def _results(client: BatchClient, job: str, lines: int, within_s: float) -> Any:
    deadline = asyncio.get_running_loop().time() + within_s
    while (status := await client.status(job)).done < lines:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"job {job}: {status.done}/{lines} after {within_s}s")
        await asyncio.sleep(0.2)
    return status, await client.results(job)


async def test_completions_start_at_once_while_batch_fills_the_upstream(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    ingress = await stack.start_ingress()
    await _fleet(stack, upstream, slots=4)
    key = await stack.api_key(size=1000)
    http = stack.http(ingress, key)
    preempted_before = metrics.FLEET_PREEMPTIONS.labels("gpu-fleet")._value.get()
    async with BatchClient(CommonSettings(**stack.common)) as client:
        job = await client.submit([_line(i, 40) for i in range(24)], team="team-a")
        # Batch takes every slot but the reserve (one): three lines of 800 ms each.
        await upstream.until(lambda running, _: running == 3, "batch to fill its share")
        body = {"model": "laneway-code", "max_tokens": 4}
        burst = [
            asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": f"k{i}"}))
            for i in range(3)
        ]
        assert [r.status_code for r in await asyncio.gather(*burst)] == [200] * 3
        status, results = await _results(client, job, 24, 90)
    # Two of the three found no free slot: batch lines were preempted for them, and none of
    # the three waited in the upstream's queue behind a batch line.
    preempted = metrics.FLEET_PREEMPTIONS.labels("gpu-fleet")._value.get() - preempted_before
    assert 2 <= preempted <= 4  # what the burst needed, give or take a race: no thrashing
    completions = [e for e in upstream.entries() if e["prompt"] in ("k0", "k1", "k2")]
    assert len(completions) == 3
    assert all(e["start"] - e["recv"] < 5 * TOKEN_MS / 1000 for e in completions)
    # Every line exactly once, the preempted ones included (they ran to the end later).
    assert (status.lines, status.done, status.ok, status.duplicates) == (24, 24, 24, 0)
    assert sorted(r.line_id for r in results) == sorted(f"doc-{i}" for i in range(24))
    batch = [e for e in upstream.entries() if e["prompt"].startswith("doc-")]
    cut = {e["prompt"] for e in batch if e["outcome"] == "gone_running"}
    assert len(cut) >= 2
    assert all(any(e["prompt"] == p and e["outcome"] == "done" for e in batch) for p in cut)
    usage = await stack.read_all(stack.topics.usage)
    batch_usage = [u for u in usage if u.get("job_id") == job]
    assert len(batch_usage) == 24  # one event per line: a preempted attempt is not billed


async def test_chat_ranks_between_completions_and_batch(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    # The completion waits while chat-1 holds its slot: a start deadline that lets it.
    ingress = await stack.start_ingress(completion_deadline_ms=60_000)
    workers = await _fleet(stack, upstream, slots=2, fleet_reserve_min=0)
    key = await stack.api_key(size=1000)
    http = stack.http(ingress, key)
    async with BatchClient(CommonSettings(**stack.common)) as client:
        job = await client.submit([_line(i, 10) for i in range(12)], team="team-a")
        await upstream.until(lambda running, _: running == 2, "batch on both slots")

        def chat(name: str, max_tokens: int) -> Any:
            body = {
                "model": "laneway-chat",
                "messages": [{"role": "user", "content": name}],
                "max_tokens": max_tokens,
            }
            return asyncio.create_task(http.post("/v1/chat/completions", json=body))

        # Batch is preempted for them. Both keep their slots until released, so the order
        # below does not hang on how fast this machine carries a request through Kafka.
        await upstream.hold("chat-1", "chat-2")
        first, second = chat("chat-1", 15), chat("chat-2", 10)
        await eventually(
            lambda: len(workers["chat"].running) == 2, 10, "both chats on the upstream"
        )
        third = chat("chat-3", 10)
        await eventually(lambda: len(workers["chat"].queue) == 1, 10, "the third chat to wait")
        body = {"model": "laneway-code", "prompt": "completion-1", "max_tokens": 4}
        completion = asyncio.create_task(http.post("/v1/completions", json=body))
        await eventually(
            lambda: len(workers["completion"].queue) == 1, 10, "the completion to wait"
        )
        # chat-1 ends and frees one slot; chat-2 keeps the other until chat-3 has run, so
        # the completion, chat-3 and the batch lines all wait for that one slot.
        await upstream.release("chat-1")
        responses = await asyncio.wait_for(asyncio.gather(first, third, completion), 60)
        await upstream.release("chat-2")
        responses.append(await second)
        assert [r.status_code for r in responses] == [200] * 4
        status, _ = await _results(client, job, 12, 90)
    assert (status.done, status.duplicates) == (12, 0)
    done = {e["prompt"]: e for e in upstream.entries() if e["outcome"] == "done"}
    # The slot chat-1 freed went to the completion, which came last; the waiting chat got
    # the next one (the completion's); no batch line started until both had.
    assert done["chat-1"]["end"] <= done["completion-1"]["start"] < done["chat-3"]["start"]
    batch_between = [
        e
        for e in upstream.entries()
        if e["prompt"].startswith("doc-")
        and e["start"] is not None
        and done["chat-1"]["start"] < e["start"] < done["chat-3"]["start"]
    ]
    assert batch_between == []


async def test_a_draining_batch_worker_still_makes_way_for_completions(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    """A batch worker that stops (a scale-down, a rollout) lets what runs finish for up to
    its grace period. Its dispatch loop stopped first, and with it both what it told the
    fleet (the slots it held when the stop began, for the whole drain) and its preemption:
    completions waited behind its lines, past their deadlines. Now it keeps telling, and its
    lines make way (their next owner runs them)."""
    ingress = await stack.start_ingress()
    workers = await _fleet(stack, upstream, slots=4)
    http = stack.http(ingress, await stack.api_key(size=1000))
    async with BatchClient(CommonSettings(**stack.common)) as client:
        await client.submit([_line(i, 200) for i in range(6)], team="team-a")  # 4 s a line
        await upstream.until(lambda running, _: running == 3, "batch to fill its share")
        stopping = asyncio.create_task(workers["batch"].stop(grace_s=30))
        await eventually(lambda: workers["batch"]._stopped, 5, "the batch worker to stop")
        # Each keeps its slot until released: all three need one at once.
        await upstream.hold("d0", "d1", "d2")
        body = {"model": "laneway-code", "max_tokens": 4}
        burst = [
            asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": f"d{i}"}))
            for i in range(3)
        ]
        # Within their 2 s start deadline (else 504): batch lines made way.
        await eventually(
            lambda: len(workers["completion"].running) == 3, 10, "all three on the upstream"
        )
        await upstream.release("d0", "d1", "d2")
        assert [r.status_code for r in await asyncio.gather(*burst)] == [200] * 3
        await asyncio.wait_for(stopping, 40)
