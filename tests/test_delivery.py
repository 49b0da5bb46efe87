"""Affinity and at-least-once delivery, with real worker processes killed by SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from pathlib import Path

import httpx
import orjson
import pytest
from aiokafka.errors import KafkaError

from ingress.admission import affinity_key
from laneway.schema import UsageEvent
from ops.redis_server import RedisServer
from tests.stack import (
    LiveStack,
    Services,
    eventually,
    free_port,
    frozen,
    partition_of,
)
from workers.reports import Reports
from workers.sim import SimEngine
from workers.types import EngineRequest


def _partition(session: str, team: str = "team-a") -> int:
    return partition_of(affinity_key(team, session))


async def test_same_session_same_partition_same_worker(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    first = await stack.start_worker("completion")
    second = await stack.start_worker("completion", wait_assigned=False)
    await eventually(
        lambda: bool(first.consumer.assignment()) and bool(second.consumer.assignment()),
        30,
        "both workers assigned",
    )
    sessions = ["doc-0"]
    sessions.append(
        next(f"doc-{i}" for i in range(1, 100) if _partition(f"doc-{i}") != _partition("doc-0"))
    )
    http = stack.http(ingress, await stack.api_key("team-a"))
    ids: dict[str, list[str]] = {s: [] for s in sessions}
    for seq in range(5):
        for session in sessions:
            response = await http.post(
                "/v1/completions",
                json={
                    "model": "laneway-code",
                    "prompt": f"keystroke {seq} in {session}",
                    "max_tokens": 8,
                },
                headers={"X-Laneway-Session": session},
            )
            assert response.status_code == 200, response.text
            ids[session].append(response.json()["id"])
    events = await stack.read_topic(stack.topics.usage, count=10)
    worker_of = {e["id"]: e["worker"] for e in events}
    served_by = {s: {worker_of[i] for i in ids[s]} for s in sessions}
    assert all(len(workers) == 1 for workers in served_by.values()), served_by
    assert served_by[sessions[0]] != served_by[sessions[1]]


def _spawn_worker(stack: LiveStack, worker_id: str, **env: str) -> subprocess.Popen[bytes]:
    return stack.spawn(
        "workers",
        LANEWAY_WORKER_ID=worker_id,
        LANEWAY_ENGINE="sim",
        LANEWAY_COMMIT_INTERVAL_MS="50",
        LANEWAY_HEARTBEAT_INTERVAL_S="0.5",
        **env,
    )


@pytest.mark.slow
async def test_sigkill_mid_stream_loses_nothing(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    key = await stack.api_key("team-a")
    # A chat prompt whose (deterministic) sim answer is long enough to kill mid-stream.
    sim = SimEngine()
    for i in range(200):
        prompt = f"user: summarise file {i}\n"
        words = sim._completion_words(
            EngineRequest(
                id="x", route="laneway-chat", prompt=prompt + "assistant: ", max_tokens=64
            )
        )
        if len(words) >= 40:
            break
    expected = "".join(words)
    slow = {
        "LANEWAY_POOL": "chat",
        "LANEWAY_SIM_DECODE_MS_PER_STEP": "40",
        "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0",
    }

    victim = _spawn_worker(stack, "chat-kill", **slow)
    replacement: subprocess.Popen[bytes] | None = None
    try:
        async with httpx.AsyncClient(
            base_url=ingress.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"}
        ) as http:
            body = {
                "model": "laneway-chat",
                "messages": [{"role": "user", "content": f"summarise file {i}"}],
                "max_tokens": 64,
                "stream": True,
            }
            pieces: list[str] = []
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                request_id = response.headers["x-laneway-request-id"]
                lines = response.aiter_lines()
                async for line in lines:
                    if not line.startswith("data: {"):
                        continue
                    delta = orjson.loads(line[6:])["choices"][0]["delta"]
                    pieces.append(delta.get("content", ""))
                    if len([p for p in pieces if p]) == 5:
                        break
                victim.send_signal(signal.SIGKILL)
                victim.wait(timeout=10)
                # Accepted while the pool has no worker at all: must not be lost either.
                queued = asyncio.create_task(
                    http.post("/v1/chat/completions", json={**body, "stream": False})
                )
                await asyncio.sleep(0.5)
                replacement = _spawn_worker(stack, "chat-kill", **slow)
                async for line in lines:
                    if line.startswith("data: {"):
                        chunk = orjson.loads(line[6:])
                        if chunk["choices"]:
                            pieces.append(chunk["choices"][0]["delta"].get("content", ""))
                    if line == "data: [DONE]":
                        break
            assert "".join(pieces) == expected
            queued_response = await asyncio.wait_for(queued, 60)
            assert queued_response.status_code == 200, queued_response.text
            assert queued_response.json()["choices"][0]["message"]["content"] == expected
    finally:
        for proc in (victim, replacement):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=20)
    events = await stack.read_topic(stack.topics.usage, count=2)
    ok = [e for e in events if e["status"] == "ok"]
    assert len(ok) == 2
    assert request_id in {e["id"] for e in ok}


@pytest.mark.slow
async def test_a_worker_killed_between_its_answer_and_its_usage_event_loses_no_usage(
    stack: LiveStack,
) -> None:
    """The worker answers a completion (through Redis) and is killed before the broker stores
    its usage event (frozen meanwhile). The partition's next owner sends the event the worker
    left in Redis, with the tokens its client got, and does not run the request again: past
    its start deadline, a second run would have recorded a drop instead."""
    assert stack.services.broker_pid is not None
    ingress = await stack.start_ingress()
    key = await stack.api_key("team-a")
    slow = {"LANEWAY_POOL": "completion", "LANEWAY_SIM_DECODE_MS_PER_STEP": "40"}
    victim = _spawn_worker(stack, "completion-kill", **slow)
    replacement: subprocess.Popen[bytes] | None = None
    try:
        async with stack.http(ingress, key) as http:

            async def served() -> bool:
                body = {"model": "laneway-code", "prompt": "def warm():", "max_tokens": 2}
                return (await http.post("/v1/completions", json=body)).status_code == 200

            await eventually(served, 60, "the worker serving", every_s=0.5)
            body = {"model": "laneway-code", "prompt": "def killed_after_answering():"}
            body |= {"max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
            got: dict[str, int] = {}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                request_id = response.headers["x-laneway-request-id"]
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # its first token: it runs
                with frozen(stack.services.broker_pid):
                    async for line in lines:
                        if line.startswith("data: {"):
                            got |= orjson.loads(line[6:]).get("usage") or {}
                        if line == "data: [DONE]":
                            break
                    victim.send_signal(signal.SIGKILL)
                    victim.wait(timeout=10)
        assert got.get("completion_tokens"), got
        replacement = _spawn_worker(stack, "completion-kill", **slow)
        events = await stack.read_topic(
            stack.topics.usage, count=1, within_s=60, where=lambda e: e["id"] == request_id
        )
    finally:
        for proc in (victim, replacement):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=20)
    assert events[0]["status"] == "ok", events
    assert events[0]["completion_tokens"] == got["completion_tokens"]
    assert (await stack.usage_counts({request_id}))[request_id] == 1  # not run again


async def test_redis_holds_a_usage_event_only_until_the_broker_stores_it(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress()
    worker = await stack.start_worker("completion")
    http = stack.http(ingress, await stack.api_key("team-a"))
    for i in range(5):
        body = {"model": "laneway-code", "prompt": f"def held_{i}():", "max_tokens": 4}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
    held = f"{worker.keys.usage_held('')}*"
    assert worker.outbox.keys is not None  # an interactive pool's outbox holds them

    async def none_held() -> bool:
        return not [key async for key in stack.redis.scan_iter(held)]

    await eventually(none_held, 10, "the held usage events released")


async def test_worker_stops_when_a_loop_swallows_its_cancellation(stack: LiveStack) -> None:
    # A library can swallow a cancellation (redis-py has turned one into a timeout error), and
    # a loop that catches the error goes on; the worker's stop (its SIGTERM) must still end.
    worker = await stack.start_worker("completion")

    async def stubborn() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        await asyncio.sleep(3600)

    worker._loops.append(asyncio.create_task(stubborn(), name="stubborn"))
    await asyncio.wait_for(worker.stop(), 20)
    assert all(loop.done() for loop in worker._loops)


async def test_a_usage_event_the_broker_refused_is_sent_again_before_the_offset_moves() -> None:
    """``delivered`` is what lets a request's offset move: a usage event the broker refused
    must be stored by then, or the tokens it served go unbilled and the breaker never sees
    the request. (The broker's refusal is the one thing faked here.)"""
    usage = UsageEvent(id="r-1", team="t", cls="completion", model="m", route="m", status="ok")
    sent: list[UsageEvent] = []
    released: list[str] = []

    class _Outbox:
        async def send_usage(self, event: UsageEvent) -> asyncio.Future[object]:
            sent.append(event)
            done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

        def release(self, request_id: str) -> None:
            released.append(request_id)  # Redis need not hold the event once it is stored

    reports = Reports(_Outbox(), worker_id="w", clock=lambda: 0.0)  # type: ignore[arg-type]
    refused: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    refused.set_exception(KafkaError("broker refused it"))
    reports.deliveries["r-1"] = (refused, usage)
    await asyncio.wait_for(reports.delivered("r-1"), 5)
    assert sent == [usage]
    assert released == ["r-1"]


async def test_an_ingress_stopped_past_its_grace_tells_the_worker_to_stop_what_it_dropped(
    stack: LiveStack,
) -> None:
    """A rolling update stops an ingress while a long chat is still running: past the grace
    its client's connection closes and the client (the SDK) retries elsewhere. The dropped
    request must stop, not run on to its end and be charged beside the retry."""
    await stack.start_worker("chat", sim_decode_ms_per_step=20.0)  # 1,000 tokens: 20 s
    key = await stack.api_key("rolling")
    port = free_port()
    proc = stack.spawn("ingress", LANEWAY_PORT=str(port), LANEWAY_SHUTDOWN_GRACE_S="1")
    base = f"http://127.0.0.1:{port}"
    body = {"model": "laneway-chat", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with httpx.AsyncClient(
            base_url=base, timeout=60, headers={"Authorization": f"Bearer {key}"}
        ) as http:

            async def answers() -> bool:
                try:
                    return (await http.get("/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(answers, 30, "the ingress to answer")
            chat = asyncio.create_task(
                http.post("/v1/chat/completions", json={**body, "max_tokens": 1000})
            )
            await eventually(
                lambda: bool(stack.workers[0].runs.tasks), 20, "the chat to start running"
            )
            proc.send_signal(signal.SIGTERM)
            dropped = await chat
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    # Told to send it again (the SDK does), not a bare 500.
    assert dropped.status_code == 503, dropped.text
    assert dropped.headers["retry-after"] == "1"
    [event] = await stack.read_topic(
        stack.topics.usage, count=1, within_s=15, where=lambda e: e["team"] == "rolling"
    )
    assert event["status"] != "ok", event
    assert event["completion_tokens"] < 1000, event


async def test_an_ingress_stopped_past_its_grace_before_admitting_a_request_says_send_it_again(
    services: Services, tmp_path: Path, prefix: str
) -> None:
    """A rolling update stops an ingress while a request still waits for its quota (Redis
    hangs). Past the grace it is told to send it again (a 503 the OpenAI SDK retries), as a
    request dropped later is, not a bare 500; and the reservation its admission made in Redis
    goes back to the team, as for any request that was never run."""
    redis = RedisServer(port=free_port(), data_dir=tmp_path / "redis")
    redis.start()
    stack = LiveStack(Services(services.bootstrap, redis.url), prefix)
    try:
        await stack.create_topics()
        await stack.start_worker("completion")
        key = await stack.api_key("rolling")
        # No grace; a request waits for a hung Redis longer than that, and takes its quota
        # by a reservation of its own (no lease).
        ingress = await stack.start_ingress(
            shutdown_grace_s=0, redis_hot_timeout_ms=10_000, quota_lease_share=0
        )
        http = stack.http(ingress, key)
        body = {"model": "laneway-code", "prompt": "def f(", "max_tokens": 8}
        # Served once: its key, breaker level and canary are cached for a second, so the
        # next request waits on Redis in its quota admission.
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        pid = redis.pid
        assert pid is not None
        with frozen(pid):
            waiting = asyncio.create_task(http.post("/v1/completions", json=body))
            [request] = await eventually(
                lambda: [t for t in ingress.server.server_state.tasks if not t.done()],
                5,
                "the request to be open",
            )
            stopping = asyncio.create_task(ingress.stop())
            await eventually(
                lambda: request.cancelling() or request.done(),
                10,
                "the stopping ingress to cancel the open request",
            )
        dropped = await waiting
        await stopping
        assert dropped.status_code == 503, dropped.text
        assert dropped.headers["retry-after"] == "1"
        assert dropped.json()["error"]["message"] == (
            "this ingress is stopping: send the request again"
        )
        request_id = dropped.headers["x-request-id"]
        reservations = await stack.redis.hgetall(
            ingress.settings.keys.quota_reservations("rolling")
        )
        assert request_id.encode() not in reservations, reservations
    finally:
        await stack.stop()
        redis.stop()
