"""A request whose ingress replica died is stopped, not run on to its end for no one.

The ingress runs as a real process here and dies by SIGKILL; the watch reads a real Redis.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from laneway.constants import RedisKeys
from tests.stack import LiveStack, eventually, free_port
from workers import metrics
from workers.ingress_watch import IngressWatch
from workers.settings import WorkerSettings


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_replica_is_gone_once_unheard_of_for_a_while_of_unbroken_reads(
    stack: LiveStack,
) -> None:
    keys = RedisKeys(stack.prefix)
    clock = _Clock()
    watch = IngressWatch(stack.redis, keys, gone_after_s=10, interval_s=2, clock=clock)
    roll = keys.ingresses()

    async def beat(*alive: str) -> None:
        """A heartbeat's look, 2 s after the last; ``alive`` said they run since."""
        clock.now += 2
        for replica in alive:
            await stack.redis.zadd(roll, {replica: clock.now})
        await watch.look()

    await beat("live", "dying")
    assert not watch.gone("live")
    assert not watch.gone("dying")
    for _ in range(4):
        await beat("live")
    assert not watch.gone("dying")  # 8 s unheard of
    await beat("live")
    assert watch.gone("dying")  # 10 s
    assert not watch.gone("live")
    # One never heard of (its requests came before it said it runs, or it never could)
    # has the same while from when it was first asked about.
    assert not watch.gone("stranger")
    for _ in range(5):
        await beat("live")
    assert watch.gone("stranger")

    # A Redis restarted without the set: the live replica is back in it at its next roll
    # call, and nobody is taken for gone meanwhile.
    await stack.redis.delete(roll)
    await beat()
    await beat("live")
    assert not watch.gone("live")

    # Reads that fail, or come far apart (the worker's loop was held), say nothing of the
    # replicas: the while starts again after them.
    clock.now += 60
    await watch.look()
    assert not watch.gone("dying")
    await beat("live")
    assert not watch.gone("dying")
    for _ in range(5):
        await beat("live")
    assert watch.gone("dying")


def test_a_gone_replica_takes_at_least_three_roll_calls() -> None:
    with pytest.raises(ValueError, match="ingress_gone_s"):
        WorkerSettings(ingress_gone_s=3)
    assert WorkerSettings(ingress_gone_s=0).ingress_gone_s == 0


async def test_a_chat_whose_ingress_was_killed_stops_and_another_replicas_runs_on(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """The ingress holding a streamed chat is SIGKILLed: its client's connection is gone
    with it. The chat stops within the watch's while, billed what was made, instead of
    running its 1,000 tokens for no one (and being billed beside the SDK's retry). A chat of
    the replica that lives runs on to its end. Judged by the upstream's own log too."""
    upstream = await upstreams(slots=4, token_ms=20)
    worker = await stack.start_worker(
        "chat", engine="openai", upstream_url=upstream.url, upstream_model="up", ingress_gone_s=6.0
    )
    key = await stack.api_key("gone")
    live = await stack.start_ingress()
    port = free_port()
    proc = stack.spawn("ingress", LANEWAY_PORT=str(port), LANEWAY_PROBE_INTERVAL_S="0")
    orphans = metrics.ORPHANS.labels("chat")._value.get()
    headers = {"Authorization": f"Bearer {key}"}

    def body(prompt: str) -> dict[str, Any]:
        return {"model": "laneway-chat", "messages": [{"role": "user", "content": prompt}]}

    try:
        async with httpx.AsyncClient(timeout=60, headers=headers) as http:

            async def answers() -> bool:
                try:
                    return (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(answers, 30, "the ingress process to answer")
            doomed = asyncio.create_task(
                http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={**body("doomed"), "max_tokens": 1000, "stream": True},
                )
            )
            await eventually(lambda: len(worker.runs.tasks) == 1, 20, "the chat to run")
            kept = asyncio.create_task(
                http.post(
                    f"{live.base_url}/v1/chat/completions", json={**body("kept"), "max_tokens": 500}
                )
            )
            await eventually(lambda: len(worker.runs.tasks) == 2, 20, "the other chat to run")
            proc.send_signal(signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):
                await doomed
            answer = await kept
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 500
    events = await stack.read_topic(
        stack.topics.usage, count=2, within_s=30, where=lambda e: e["team"] == "gone"
    )
    stopped = next(e for e in events if e["id"] != answer.json()["id"])
    assert stopped["status"] == "cancelled", stopped
    assert "ingress_gone" in stopped["error"]
    assert 0 < stopped["completion_tokens"] < 1000, stopped
    assert metrics.ORPHANS.labels("chat")._value.get() == orphans + 1
    ran = await eventually(lambda: upstream.entry("doomed"), 20, "the upstream's entry")
    assert ran["outcome"] == "gone_running", ran
    assert ran["tokens"] < 1000, ran
