"""An upstream that is full, judged by the client's answer, the usage event and a separate
upstream process's own log. With no room for a request (a 429 or 503: TGI past its
--max-concurrent-requests, a server overloaded or still loading), the request never started:
it waits in the worker's queue, runs once there is room, and is no engine failure. Queued
upstream behind keep-alive comments, it has not started either: its deadline holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.stack import LiveStack, eventually
from tests.upstream_process import UpstreamProcess
from workers.upstream import OpenAICompatibleEngine

pytestmark = pytest.mark.slow


def _completion(prompt: str) -> dict[str, Any]:
    return {"model": "laneway-code", "prompt": prompt, "max_tokens": 4}


async def _through_laneway(
    stack: LiveStack, upstream: UpstreamProcess
) -> tuple[OpenAICompatibleEngine, httpx.AsyncClient]:
    """An ingress (completions may wait a minute) and a completion worker in front of
    ``upstream``, which publishes no queue; the worker's engine and a client with a key."""
    ingress = await stack.start_ingress(completion_deadline_ms=60_000)
    worker = await stack.start_worker(
        "completion",
        engine="openai",
        upstream_url=upstream.url,
        upstream_model="up",
        upstream_metrics_url="",
    )
    assert isinstance(worker.engine, OpenAICompatibleEngine)
    return worker.engine, stack.http(ingress, await stack.api_key())


async def _full_upstream(
    stack: LiveStack, upstreams: Callable[..., Any], status: int
) -> tuple[UpstreamProcess, OpenAICompatibleEngine, httpx.AsyncClient, asyncio.Task[Any]]:
    """An upstream of one slot that answers ``status`` when full, that slot held by a
    request (``release("holder")`` ends the hold); the worker learns its capacity."""
    upstream: UpstreamProcess = await upstreams(
        slots=1, token_ms=5, when_full=status, retry_after="0.2"
    )
    engine, http = await _through_laneway(stack, upstream)
    await upstream.hold("holder")
    holder = asyncio.create_task(http.post("/v1/completions", json=_completion("holder")))
    await upstream.until(lambda running, _: running == 1, "the holder on the upstream's slot")
    return upstream, engine, http, holder


def _refused(upstream: UpstreamProcess, prompt: str) -> int:
    return sum(1 for e in upstream.entries() if e["prompt"] == prompt and e["outcome"] == "full")


async def test_a_request_the_upstream_has_no_room_for_runs_once_there_is_room(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream, engine, http, holder = await _full_upstream(stack, upstreams, 429)
    second = asyncio.create_task(http.post("/v1/completions", json=_completion("second")))
    await eventually(lambda: _refused(upstream, "second") >= 1, 20, "second refused for room")
    # The upstream is full with what of ours it runs: the limit is that, no more.
    assert engine.learned.limit == 1
    await upstream.release("holder")
    answers = [await holder, await second]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    ran = upstream.entry("second")
    assert ran is not None
    assert ran["outcome"] == "done"
    assert ran["tokens"] == 4
    events = await stack.usage_of(*(a.headers["x-laneway-request-id"] for a in answers))
    assert {e["status"] for e in events.values()} == {"ok"}


async def test_a_request_with_no_room_until_its_deadline_expires_and_is_no_engine_error(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream, _, http, holder = await _full_upstream(stack, upstreams, 503)
    late = await http.post(
        "/v1/completions", json=_completion("late"), headers={"X-Laneway-Deadline-Ms": "1500"}
    )
    assert late.status_code == 504, late.text
    assert _refused(upstream, "late") >= 1
    events = await stack.usage_of(late.headers["x-laneway-request-id"])
    (event,) = events.values()
    # What a deadline is, which the breaker does not count: not an engine error.
    assert event["status"] == "expired", event
    await upstream.release("holder")
    assert (await holder).status_code == 200


async def test_keep_alive_comments_while_queued_upstream_are_not_its_start(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    # The upstream queues (one slot, held) and keeps a queued request's stream alive with
    # ": PROCESSING" comments: the request has not started, and its deadline still holds.
    upstream: UpstreamProcess = await upstreams(slots=1, token_ms=5, keepalive_ms=50)
    _, http = await _through_laneway(stack, upstream)
    await upstream.hold("holder")
    holder = asyncio.create_task(http.post("/v1/completions", json=_completion("holder")))
    await upstream.until(lambda running, _: running == 1, "the holder on the upstream's slot")
    queued = asyncio.create_task(
        http.post(
            "/v1/completions",
            json={**_completion("queued"), "stream": True},
            headers={"X-Laneway-Deadline-Ms": "1500"},
        )
    )
    # Closed at its deadline, still in the upstream's queue (its own log says so).
    closed = await eventually(lambda: upstream.entry("queued"), 20, "the queued request closed")
    assert closed["outcome"] == "gone_queued", closed
    answer = await queued
    events = await stack.usage_of(answer.headers["x-laneway-request-id"])
    (event,) = events.values()
    assert event["status"] == "expired", event
    assert event["engine_ms"] == 0, event
    await upstream.release("holder")
    assert (await holder).status_code == 200


async def test_no_room_with_nothing_of_ours_on_a_silent_upstream_is_taken_for_down(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """A 503 while nothing of ours is on the upstream and none of ours has had a first byte
    for 10 s (a proxy's "no healthy upstream", a server that never came up) is no full
    server to wait for: an engine error, which the breaker counts and a fallback answers."""
    upstream: UpstreamProcess = await upstreams(slots=1, token_ms=5, when_full=503)
    _, http = await _through_laneway(stack, upstream)
    # Another client of the server holds its one slot: every request of ours gets 503.
    await upstream.hold("theirs")
    async with httpx.AsyncClient(base_url=upstream.url, timeout=60) as direct:
        theirs = asyncio.create_task(
            direct.post("/completions", json={"model": "up", "prompt": "theirs"})
        )
        await upstream.until(lambda running, _: running == 1, "their request on the slot")
        refused = await http.post("/v1/completions", json=_completion("ours"))
        await upstream.release("theirs")
        await theirs
    assert refused.status_code == 502, refused.text
    events = await stack.usage_of(refused.headers["x-laneway-request-id"])
    (event,) = events.values()
    assert event["status"] == "error", event
