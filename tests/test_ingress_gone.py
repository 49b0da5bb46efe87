"""A request whose ingress replica died is stopped, not run on to its end for no one.

The ingress runs as a real process here and dies by SIGKILL; the watch reads a real Redis.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ingress.quota_gate import QuotaGate
from laneway.constants import RedisKeys
from quota import QuotaEnforcer, QuotaPolicy
from tests.stack import LiveStack, eventually, free_port, redis_client
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
        await watch.look(writes=True)

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

    # Reads far apart (the worker's loop was held), reads that fail, and beats whose own
    # write Redis refused (full: it refuses the replicas' roll calls too, and still answers
    # reads) say nothing of the replicas: the while starts again after them.
    for silence in ("held", "failed", "refused"):
        if silence == "held":
            clock.now += 60
            await watch.look(writes=True)
        elif silence == "failed":
            watch.redis, working = redis_client("redis://127.0.0.1:1"), watch.redis
            await beat("live")
            await watch.redis.aclose()
            watch.redis = working
        else:
            clock.now += 2
            await watch.look(writes=False)
        assert not watch.gone("dying"), silence
        if silence != "held":
            await beat("live")  # the first read after it: the while starts again here
        for _ in range(4):
            await beat("live")
        assert not watch.gone("dying"), silence
        await beat("live")
        assert watch.gone("dying"), silence


async def test_a_replica_whose_own_round_trips_run_slow_still_says_it_runs(
    stack: LiveStack,
) -> None:
    """A replica whose Redis round trips run past its hot timeout (a slow path, a busy
    host) has its circuit open and admits locally, its clients still answered. Its roll
    call goes on all the same: refused by the open circuit, the replica was taken for gone
    and its clients' requests stopped. And it removes no other replica that a clock seconds
    off would take for gone."""
    keys = RedisKeys(stack.prefix)
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")
    gate = QuotaGate(QuotaEnforcer(stack.redis, keys, policy), policy)
    now = time.time()
    await stack.redis.zadd(keys.ingresses(), {"ahead#1": now + 30})  # its clock 30 s ahead
    gate.circuit._open = True  # as its hot calls left it
    try:
        await gate.roll_call("slow#1", now)
    finally:
        gate.circuit._open = False
    roll = {m.decode() for m in await stack.redis.zrange(keys.ingresses(), 0, -1)}
    assert roll == {"slow#1", "ahead#1"}
    await gate.roll_call("slow#1", now + 40)  # this one's clock 40 s ahead of the other's
    assert await stack.redis.zscore(keys.ingresses(), "ahead#1") is not None


def test_a_gone_replica_takes_at_least_ten_roll_calls() -> None:
    with pytest.raises(ValueError, match="ingress_gone_s"):
        WorkerSettings(ingress_gone_s=19)
    assert WorkerSettings(ingress_gone_s=0).ingress_gone_s == 0


async def test_a_chat_whose_ingress_was_killed_stops_and_another_replicas_runs_on(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """The ingress holding a streamed chat is SIGKILLed, and comes back at once under the
    same id (compose's restart, a pod's): its client's connection is gone with the process.
    The chat stops within the watch's while, billed what was made, instead of running its
    3,000 tokens for no one (and being billed beside the SDK's retry). A chat of the
    replica that lives runs on to its end. Judged by the upstream's own log too."""
    upstream = await upstreams(slots=4, token_ms=20)
    worker = await stack.start_worker(
        "chat", engine="openai", upstream_url=upstream.url, upstream_model="up", ingress_gone_s=20
    )
    key = await stack.api_key("gone")
    live = await stack.start_ingress()
    port = free_port()
    replica = {"LANEWAY_PORT": str(port), "LANEWAY_PROBE_INTERVAL_S": "0"}
    replica["LANEWAY_INSTANCE_ID"] = "ingress-1"
    procs = [stack.spawn("ingress", **replica)]
    orphans = metrics.ORPHANS.labels("chat")._value.get()
    headers = {"Authorization": f"Bearer {key}"}

    def body(prompt: str, tokens: int, *, stream: bool = False) -> dict[str, Any]:
        messages = [{"role": "user", "content": prompt}]
        return {
            "model": "laneway-chat",
            "messages": messages,
            "max_tokens": tokens,
            "stream": stream,
        }

    async def procs_rolled() -> list[bytes]:
        return list(await stack.redis.zrange(RedisKeys(stack.prefix).ingresses(), 0, -1))

    try:
        async with httpx.AsyncClient(timeout=90, headers=headers) as http:

            async def answers() -> bool:
                try:
                    return (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(answers, 30, "the ingress process to answer")
            doomed = asyncio.create_task(
                http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=body("doomed", 3000, stream=True),
                )
            )
            await eventually(lambda: len(worker.runs.tasks) == 1, 20, "the chat to run")
            kept = asyncio.create_task(
                http.post(f"{live.base_url}/v1/chat/completions", json=body("kept", 1300))
            )
            await eventually(lambda: len(worker.runs.tasks) == 2, 20, "the other chat to run")
            # The same replica, restarted: up before the old process dies, so that its roll
            # calls go on without a gap however long a process takes to start here.
            procs.append(stack.spawn("ingress", **{**replica, "LANEWAY_PORT": str(free_port())}))
            await eventually(lambda: _count(procs_rolled(), "ingress-1"), 30, "its roll call")
            procs[0].send_signal(signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):
                await doomed
            answer = await kept
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 1300
    events = await stack.read_topic(
        stack.topics.usage, count=2, within_s=40, where=lambda e: e["team"] == "gone"
    )
    stopped = next(e for e in events if e["id"] != answer.json()["id"])
    assert stopped["status"] == "cancelled", stopped
    assert "ingress_gone" in stopped["error"]
    assert 0 < stopped["completion_tokens"] < 3000, stopped
    assert metrics.ORPHANS.labels("chat")._value.get() == orphans + 1
    ran = await eventually(lambda: upstream.entry("doomed"), 20, "the upstream's entry")
    assert ran["outcome"] == "gone_running", ran
    assert ran["tokens"] < 3000, ran


async def _count(members: Any, instance: str) -> bool:
    """Whether two processes of ``instance`` are in the roll call."""
    return sum(m.decode().startswith(instance) for m in await members) >= 2
