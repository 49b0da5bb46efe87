"""The cancel shield on the real broker: stale completions never reach the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from aiokafka.errors import KafkaTimeoutError
from prometheus_client import REGISTRY

from ingress.cancels import CancelOutbox
from laneway.constants import SESSION_RESTART_S, RedisKeys
from laneway.errors import Cancelled, Superseded
from laneway.schema import CancelRecord, RequestEnvelope
from tests.stack import (
    LiveStack,
    await_chain,
    envelope,
    eventually,
    free_port,
    long_prompt,
    sim_answer_tokens,
)
from workers.pool import PoolWorker
from workers.shield import CancelShield

# A long answer (118 tokens) runs 4.7 s: long enough that what a test sends while it runs
# (a fresh producer's records, a newer keystroke's round trip) arrives before it ends, even
# when the broker makes a producer retry.
STEP_MS = 40.0
# Long enough that a tombstone crosses Kafka (a few ms on loopback) within one step.
RACE_STEP_MS = 100.0


def _envelope(stack: LiveStack, **fields: Any) -> RequestEnvelope:
    return envelope(**{"reply_to": f"{stack.prefix}:reply:test", **fields})


async def test_stale_requests_never_reach_the_engine(stack: LiveStack) -> None:
    cancelled = _envelope(stack)
    superseded = _envelope(stack, session="doc-1", seq=1, affinity="s:doc-1")
    newer = _envelope(stack, session="doc-1", seq=2, affinity="s:doc-1", max_tokens=4)
    past = time.time() - 1
    expired = _envelope(stack, accepted_ts=past - 2, deadline_ts=past)
    fresh = _envelope(stack, max_tokens=4)
    # The tombstone first, then the requests; the worker starts after all of them are queued.
    await stack.send_records(
        CancelRecord(id=cancelled.id, team="team-a"),
        cancelled,
        superseded,
        newer,
        expired,
        fresh,
    )
    await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)

    usage = await stack.usage_of(cancelled.id, superseded.id, newer.id, expired.id, fresh.id)
    assert usage[cancelled.id]["status"] == "cancelled"
    assert usage[superseded.id]["status"] == "superseded"
    assert usage[expired.id]["status"] == "expired"
    for rid in (cancelled.id, superseded.id, expired.id):
        assert usage[rid]["engine_ms"] == 0
        assert usage[rid]["completion_tokens"] == 0
    assert usage[newer.id]["status"] == "ok"
    assert usage[fresh.id]["status"] == "ok"
    assert usage[fresh.id]["engine_ms"] > 0


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_cancel_racing_its_request_never_runs_past_one_step(
    stack: LiveStack, cancel_first: bool
) -> None:
    await stack.start_worker("completion", sim_decode_ms_per_step=RACE_STEP_MS)
    envs = [_envelope(stack, max_tokens=128, prompt=f"race {i}") for i in range(6)]
    for env in envs:
        cancel = CancelRecord(id=env.id, team=env.team)
        await stack.send_records(*((cancel, env) if cancel_first else (env, cancel)))
    usage = await stack.usage_of(*(e.id for e in envs))
    prompts = {e.id: e.prompt for e in envs}
    for event in usage.values():
        assert event["status"] == "cancelled"
        # Either dropped before execution, or aborted within one decode step of the tombstone
        # reaching the worker. How long Kafka takes to deliver it is not the shield's to
        # promise, so the step is counted from its arrival (stale_engine_ms).
        assert event["completion_tokens"] < sim_answer_tokens(prompts[event["id"]])
        assert event["stale_engine_ms"] <= RACE_STEP_MS + 1


async def test_running_request_is_aborted_by_supersession(stack: LiveStack) -> None:
    worker = await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)
    old = _envelope(
        stack, session="doc-9", seq=1, affinity="s:doc-9", max_tokens=128, prompt=long_prompt(100)
    )
    await stack.send_records(old)
    await eventually(lambda: old.id in worker.executor.live, 20, "the old keystroke running")
    new = _envelope(stack, session="doc-9", seq=2, affinity="s:doc-9", max_tokens=4)
    await stack.send_records(new)
    usage = await stack.usage_of(old.id, new.id)
    assert usage[old.id]["status"] == "superseded"
    assert usage[old.id]["engine_ms"] > 0
    assert 0 < usage[old.id]["completion_tokens"] < sim_answer_tokens(old.prompt)
    # How long the newer keystroke took from the ingress to the worker is reported apart.
    assert 0 < usage[old.id]["stale_news_ms"] < 10_000
    assert usage[new.id]["status"] == "ok"
    assert usage[new.id]["stale_news_ms"] == 0


async def test_team_cannot_cancel_another_teams_request(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    worker = await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)
    owner = stack.http(ingress, await stack.api_key("team-a"))
    other = stack.http(ingress, await stack.api_key("team-b"))
    body = {"model": "laneway-code", "prompt": long_prompt(100), "max_tokens": 128, "stream": True}
    async with owner.stream("POST", "/v1/completions", json=body) as response:
        request_id = response.headers["x-laneway-request-id"]
        refused = await other.delete(f"/v1/requests/{request_id}")
        assert refused.status_code == 404
        # A forged tombstone from team-b straight onto Kafka is ignored by the worker too,
        # and it reached the worker while the request ran (a marker behind it proves it).
        marker = CancelRecord(id=f"marker-{request_id}", team="team-b")
        await stack.send_records(CancelRecord(id=request_id, team="team-b"), marker)
        await until_seen(worker, marker)
        assert request_id in worker.executor.live
        text = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert text[-1] == "data: [DONE]"
    assert (await stack.usage_of(request_id))[request_id]["status"] == "ok"


async def test_owner_cancels_with_delete(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)
    owner = stack.http(ingress, await stack.api_key("team-a"))
    body = {"model": "laneway-code", "prompt": long_prompt(60), "max_tokens": 128, "stream": True}
    async with owner.stream("POST", "/v1/completions", json=body) as response:
        request_id = response.headers["x-laneway-request-id"]
        accepted = await owner.delete(f"/v1/requests/{request_id}")
        assert accepted.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = orjson.loads(lines[-2][6:])["error"]
    assert error["code"] == "cancelled"
    event = (await stack.usage_of(request_id))[request_id]
    assert event["status"] == "cancelled"
    assert event["completion_tokens"] < sim_answer_tokens(body["prompt"])
    # On the compacted topic its key is its team's and its id: another team's tombstone of
    # the same id (refused by the workers, stored all the same) is kept beside it, never in
    # its place, and a worker that replays the topic still finds the owner's.
    reader = stack._reader(stack.topics.cancel)
    await reader.start()
    try:
        batches = await reader.getmany(timeout_ms=5000)
    finally:
        await reader.stop()
    keys = [record.key for records in batches.values() for record in records]
    assert keys == [f"team-a\0{request_id}".encode()]


async def until_seen(worker: PoolWorker, marker: CancelRecord) -> None:
    """Until the worker holds ``marker``, a tombstone of a request that does not exist: the
    records stored before it reached the worker too (on Redis, one channel keeps the order;
    on Kafka, the test broker is one node, so the fetch that brings the marker brings every
    record of any partition stored before it)."""
    probe = envelope(id=marker.id, team=marker.team)
    await eventually(lambda: worker.shield.verdict(probe) is not None, 20, "the marker")


async def _subscribed(stack: LiveStack, channel: str) -> None:
    deadline = time.monotonic() + 10
    while dict(await stack.redis.pubsub_numsub(channel)).get(channel.encode(), 0) < 1:
        assert time.monotonic() < deadline, f"nobody subscribed to {channel}"
        await asyncio.sleep(0.02)


async def test_tombstone_on_redis_alone_aborts_a_running_request(stack: LiveStack) -> None:
    """The early path: a tombstone published on Redis, and (yet) on no topic, is honoured;
    a malformed message on the channel is skipped without stopping the worker."""
    worker = await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)
    channel = RedisKeys(stack.prefix).cancels()
    await _subscribed(stack, channel)
    env = _envelope(stack, max_tokens=128, prompt=long_prompt(100))
    await stack.send_records(env)
    await eventually(lambda: worker.engine.stats().running > 0, 10, "the request to start")
    await stack.redis.publish(channel, b"{not a tombstone")
    marker = CancelRecord(id=f"marker-{env.id}", team="team-b")
    for record in (CancelRecord(id=env.id, team="team-b"), marker):
        await stack.redis.publish(channel, record.to_json())
    await until_seen(worker, marker)
    assert env.id in worker.executor.live  # another team's tombstone ended nothing
    await stack.redis.publish(channel, CancelRecord(id=env.id, team=env.team).to_json())
    event = (await stack.usage_of(env.id))[env.id]
    assert event["status"] == "cancelled"
    assert event["completion_tokens"] < 100
    # Within a step of the news, or a few when the worker fell behind the engine's clock on
    # a busy machine (the engine's steps go on: CI once saw 1.5 steps); not the ~100 left.
    # How a step is split at the news: test_stale_time_counts_only_the_part_of_a_step_...
    assert event["stale_engine_ms"] <= 4 * STEP_MS


async def test_delete_publishes_the_tombstone_on_redis_too(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)
    owner = stack.http(ingress, await stack.api_key("team-a"))
    body = {"model": "laneway-code", "prompt": long_prompt(60), "max_tokens": 128, "stream": True}
    async with stack.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
        await pubsub.subscribe(RedisKeys(stack.prefix).cancels())
        async with owner.stream("POST", "/v1/completions", json=body) as response:
            request_id = response.headers["x-laneway-request-id"]
            assert (await owner.delete(f"/v1/requests/{request_id}")).status_code == 200
            message = await _next_message(pubsub)
        tombstone = orjson.loads(message["data"])
        assert (tombstone["id"], tombstone["team"], tombstone["reason"]) == (
            request_id,
            "team-a",
            "api",
        )


async def test_client_disconnect_cancels_and_frees_the_handler(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)
    key = await stack.api_key("team-a")
    body = {"model": "laneway-code", "prompt": long_prompt(60), "max_tokens": 128, "stream": True}
    async with (
        httpx.AsyncClient(
            base_url=ingress.base_url, headers={"Authorization": f"Bearer {key}"}
        ) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        request_id = response.headers["x-laneway-request-id"]
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break
    # Not streamed: the client gives up before any reply. (Another prompt: the same one,
    # sent while the first's generation still runs, would be served from it.)
    other = {**body, "prompt": body["prompt"] + "\n", "stream": False}
    async with httpx.AsyncClient(
        base_url=ingress.base_url, headers={"Authorization": f"Bearer {key}"}
    ) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=other, timeout=0.3)
    await eventually(lambda: ingress.state.replies.open_channels == 0, 10, "handlers to let go")
    # Nothing of the two requests is left in the ingress's loop: no handler, and no task
    # still waiting for their replies (until LANEWAY_REPLY_TIMEOUT_S, 300 s).
    await eventually(lambda: not _waiting_for_replies(), 5, "no task to wait for replies")
    events = await stack.read_topic(stack.topics.usage, count=2)
    by_id = {e["id"]: e for e in events}
    assert by_id[request_id]["status"] == "cancelled"
    assert by_id[request_id]["completion_tokens"] < sim_answer_tokens(body["prompt"])
    assert all(e["status"] == "cancelled" for e in events)


def _waiting_for_replies() -> list[str]:
    """The tasks in this loop (the ingress runs in the test's) that serve a request or wait
    for a reply."""
    chains = [await_chain(task) for task in asyncio.all_tasks()]
    return [
        chain
        for chain in chains
        if any(
            any(f"ingress/{name}.py:" in line for name in ("completions", "reply_delivery"))
            or (line.endswith(" in get") and "ingress/" in line)
            for line in chain.splitlines()
        )
    ]


def test_shield_memory_is_bounded() -> None:
    shield = CancelShield(max_entries=100, ttl_s=60)
    for i in range(1000):
        shield.cancel(CancelRecord(id=f"r{i}", team="t", ts=1000.0))
    assert len(shield) == 100
    shield.expire(now=1000.0 + 61)
    assert len(shield) == 0


def test_a_tombstone_lasts_its_ttl_on_redis_time_whatever_this_machines_clock_says() -> None:
    # The ingress stamps tombstones on Redis's clock, here in 1970: read on this machine's
    # clock (decades ahead of it, as one 20 min ahead would be past the 15 min TTL), each
    # would expire the moment the cancel feed's next fetch ended.
    redis_now = [1_000_000.0]
    shield = CancelShield(wall=lambda: redis_now[0])
    env = envelope(team="team-a")
    shield.cancel(CancelRecord(id=env.id, team="team-a", ts=redis_now[0]))
    shield.expire()  # what the cancel feed calls after each fetch
    assert isinstance(shield.verdict(env), Cancelled)
    redis_now[0] += shield.ttl_s - 1
    shield.expire()
    assert isinstance(shield.verdict(env), Cancelled)
    redis_now[0] += 2  # past the TTL on Redis's clock: forgotten
    shield.expire()
    assert shield.verdict(env) is None


def test_another_teams_tombstone_does_not_undo_the_owners_cancel() -> None:
    # Team b DELETEs team a's request id through a replica that does not hold it: the
    # ingress cannot tell, the worker honours it for nobody's work but b's own.
    shield = CancelShield()
    env = envelope(team="team-a")
    shield.cancel(CancelRecord(id=env.id, team="team-a"))
    shield.cancel(CancelRecord(id=env.id, team="team-b"))
    assert isinstance(shield.verdict(env), Cancelled)
    assert shield.verdict(envelope(team="team-c").model_copy(update={"id": env.id})) is None


def test_a_request_that_starts_stale_stays_stale_while_it_runs() -> None:
    # A superseded keystroke whose generation others follow starts all the same (for them):
    # its own client is still told it was superseded, not given the text as its answer.
    shield = CancelShield()
    owner = envelope(session="doc", seq=1)
    shield.observe(envelope(session="doc", seq=2))
    verdict = shield.verdict(owner)
    assert isinstance(verdict, Superseded)
    shield.started(owner, stale=verdict)
    assert shield.stale_reason(owner.id) is verdict
    assert shield.abort_latency(owner.id) is not None


def test_a_tombstone_that_came_before_the_start_is_not_lost() -> None:
    # A keystroke served from another's generation is known to the shield only from its
    # start: its tombstone may come while the worker still looks at it (the cancel feed
    # runs beside the fetch loop), and is kept among the cancels of requests not here.
    shield = CancelShield()
    env = envelope(session="doc", seq=1)
    shield.cancel(CancelRecord(id=env.id, team=env.team))
    shield.started(env)
    assert isinstance(shield.stale_reason(env.id), Cancelled)
    other = envelope()
    shield.cancel(CancelRecord(id=other.id, team="team-b"))  # not its owner's: ignored
    shield.started(other)
    assert shield.stale_reason(other.id) is None


def test_a_tombstone_that_came_while_it_ran_holds_when_it_is_queued_again() -> None:
    # Running for the followers it started for, a request is cancelled; then the engine has
    # no room for it after all (an upstream's 429) and it is queued again: it must not run
    # at its next start.
    shield = CancelShield()
    env = envelope()
    shield.started(env)
    shield.cancel(CancelRecord(id=env.id, team=env.team))
    assert isinstance(shield.stale_reason(env.id), Cancelled)
    shield.requeued(env.id)
    assert isinstance(shield.verdict(env), Cancelled)


def test_stale_time_counts_only_the_part_of_a_step_after_the_news() -> None:
    """Of the step under way when the news arrives, only the part after it is waste."""
    now = [100.0]
    shield = CancelShield(clock=lambda: now[0])
    env = envelope(id="cmpl-1", team="t", prompt="x", max_tokens=16, affinity="p:x")

    def run(rid: str, *events: tuple[float, str, float] | tuple[float, str, float, float]) -> float:
        """Replay (ms after the start, event, engine ms so far[, ms the step ended]); the
        stale engine ms."""
        shield.started(env.model_copy(update={"id": rid}))
        started, engine_ms = now[0], 0.0
        for at_ms, what, reported_ms, *step_end in events:
            now[0] = started + at_ms / 1000
            if what == "cancel":
                # The tombstone left the ingress 8 ms before it got here.
                tombstone = CancelRecord(id=rid, team="t", ts=time.time() - 0.008)
                assert shield.cancel(tombstone) == rid
                continue
            engine_ms = reported_ms  # a chunk, or the engine's last word ("end": an abort)
            if what == "chunk":
                ended = started + step_end[0] / 1000 if step_end else None
                shield.progress(rid, tokens=1, engine_ms=engine_ms, ended=ended)
        waste, news_ms = shield.waste(rid, engine_ms)
        assert 8 <= news_ms < 1000
        shield.finished(rid)
        return waste

    # A tombstone 5 ms into a 15 ms decode step: 10 ms of it are waste, not all 15; a step
    # that still runs after that is waste whole.
    steps = [(15.0, "chunk", 15.0), (30.0, "chunk", 30.0), (35.0, "cancel", 0.0)]
    assert run("a", *steps, (45.0, "chunk", 45.0)) == pytest.approx(10.0)
    assert run("b", *steps, (45.0, "chunk", 45.0), (60.0, "chunk", 60.0)) == pytest.approx(25.0)
    # A step that reports 25 ms after the last one, for 15 ms of engine time, ran in the 15 ms
    # before it reported: the news came 10 ms into that, so its last third is waste.
    late = [(15.0, "chunk", 15.0), (35.0, "cancel", 0.0), (40.0, "chunk", 30.0)]
    assert run("c", *late) == pytest.approx(5.0)
    # News that came before the step began (the worker was busy between steps): the engine
    # ran all of that step for a stale request.
    gap = [(15.0, "chunk", 15.0), (17.0, "cancel", 0.0), (35.0, "chunk", 30.0)]
    assert run("e", *gap) == pytest.approx(15.0)
    # News during a 50 ms prefill, 10 ms in: the engine's abort reports the prefill at once.
    assert run("d", (10.0, "cancel", 0.0), (50.0, "end", 50.0)) == pytest.approx(40.0)
    # The worker fell behind and reads two steps at once, after the news: the engine says
    # they ended at 30 and 45 ms, so the first was useful and the second is 5 ms waste.
    # (Taken as ending when read, the first would be split and 20 ms charged.)
    burst = [(15.0, "chunk", 15.0), (40.0, "cancel", 0.0)]
    burst += [(46.0, "chunk", 30.0, 30.0), (46.5, "chunk", 45.0, 45.0)]
    assert run("f", *burst) == pytest.approx(5.0)


def _tombstones_left_out() -> float:
    return (
        REGISTRY.get_sample_value("laneway_ingress_tombstones_total", {"outcome": "superseded"})
        or 0.0
    )


async def _first_data(lines: AsyncIterator[str], count: int = 1) -> None:
    """Read on until ``count`` SSE data lines came."""
    seen = 0
    async for line in lines:
        if line.startswith("data: "):
            seen += 1
            if seen == count:
                return


async def test_a_gone_keystroke_that_the_next_one_supersedes_needs_no_tombstone(
    stack: LiveStack,
) -> None:
    """An IDE fires the next keystroke and closes the previous one's connection: the
    tombstone reaches the running workers on Redis, and on Kafka the newer keystroke, stored
    right behind the old one, stands in for it, so no record is written for it."""
    # A long hold, so that a slow machine cannot turn this into the other case.
    ingress = await stack.start_ingress(cancel_hold_ms=1000)
    await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)
    http = stack.http(ingress, await stack.api_key("team-a"))
    body = {"model": "laneway-code", "prompt": long_prompt(60), "max_tokens": 128, "stream": True}
    left_out = _tombstones_left_out()
    channel = RedisKeys(stack.prefix).cancels()
    async with (
        stack.redis.pubsub(ignore_subscribe_messages=True) as pubsub,
        http.stream(
            "POST", "/v1/completions", json=body, headers=_keystroke("doc-7", 1)
        ) as response,
    ):
        await pubsub.subscribe(channel)
        old_id = response.headers["x-laneway-request-id"]
        await _first_data(response.aiter_lines())
        newer = asyncio.create_task(
            http.post(
                "/v1/completions",
                json={**body, "stream": False, "max_tokens": 4},
                headers=_keystroke("doc-7", 2),
            )
        )
        new_id = (await newer).json()["id"]
        published = await _next_message(pubsub)
    assert orjson.loads(published["data"])["id"] == old_id
    usage = await stack.usage_of(old_id, new_id)
    # Whichever came first, the Redis tombstone or the newer keystroke, stopped it.
    assert usage[old_id]["status"] in ("cancelled", "superseded")
    assert usage[old_id]["completion_tokens"] < sim_answer_tokens(body["prompt"])
    assert usage[new_id]["status"] == "ok"
    await eventually(lambda: ingress.state.cancels.held == 0, 10, "the hold to end")
    assert _tombstones_left_out() == left_out + 1
    # The hold ended by leaving the tombstone out (counted above), so the topic as it is now
    # shows whether one was sent.
    sent = await stack.read_all(stack.topics.cancel, where=lambda r: r["id"] == old_id)
    assert sent == []


async def _next_message(pubsub: Any, within_s: float = 5) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    # None while it reads past the subscription's own confirmation, or until then
    while (message := await pubsub.get_message(timeout=1)) is None:
        assert time.monotonic() < deadline, "nothing on the Redis channel"
    return dict(message)


@pytest.mark.parametrize("redis_up", [True, False])
async def test_a_superseded_keystrokes_kafka_record_is_left_out_only_when_redis_carried_it(
    stack: LiveStack, redis_up: bool
) -> None:
    """The topic is the record of last resort: with Redis down, the tombstone of a keystroke
    that a newer one supersedes is written after all."""
    redis = stack.redis if redis_up else aioredis.Redis(port=free_port(), socket_timeout=1)
    outbox = CancelOutbox(
        await stack.producer(), redis, stack.topics, RedisKeys(stack.prefix), hold_s=0.2
    )
    outbox.start()
    try:
        old = _envelope(stack, session="doc-6", seq=1, affinity="s:doc-6")
        outbox.accepted(_envelope(stack, session="doc-6", seq=2, affinity="s:doc-6"))
        outbox.add(old)
        await eventually(lambda: outbox.held == 0, 10, "the hold to end")
        # A marker sent after it: the read below sees it, whatever became of the old one.
        marker = CancelRecord(id="marker-" + old.id, team=old.team)
        await outbox.send_now(marker)
    finally:
        await outbox.stop()  # flushes its producer: whatever it sent is on the topic now
        if not redis_up:
            await redis.aclose()
    ours = (old.id, marker.id)
    if redis_up:
        records = await stack.read_all(stack.topics.cancel, where=lambda r: r["id"] in ours)
    else:
        records = await stack.read_topic(
            stack.topics.cancel, count=2, where=lambda r: r["id"] in ours
        )
    assert sorted(r["id"] for r in records) == sorted(
        [marker.id] if redis_up else [old.id, marker.id]
    )


async def test_a_gone_keystroke_of_a_count_started_again_keeps_its_kafka_record(
    stack: LiveStack,
) -> None:
    """A lower seq after a pause is the session's newest (the workers read it so), not an
    old keystroke that seq 500 stands in for: its tombstone must reach the topic."""
    outbox = CancelOutbox(
        await stack.producer(), stack.redis, stack.topics, RedisKeys(stack.prefix), hold_s=0.2
    )
    outbox.start()
    try:
        outbox.accepted(_envelope(stack, session="doc-7", seq=500, affinity="s:doc-7"))
        await asyncio.sleep(SESSION_RESTART_S + 0.1)
        restarted = _envelope(stack, session="doc-7", seq=1, affinity="s:doc-7")
        outbox.accepted(restarted)
        outbox.add(restarted)
        await eventually(lambda: outbox.held == 0, 10, "the hold to end")
    finally:
        await outbox.stop()
    (record,) = await stack.read_topic(
        stack.topics.cancel, count=1, where=lambda r: r["id"] == restarted.id
    )
    assert record["team"] == restarted.team


async def test_tombstones_still_held_go_out_when_the_ingress_stops(stack: LiveStack) -> None:
    outbox = CancelOutbox(
        await stack.producer(), stack.redis, stack.topics, RedisKeys(stack.prefix), hold_s=60
    )
    outbox.start()
    env = _envelope(stack, session="doc-5", seq=1, affinity="s:doc-5")
    outbox.add(env)
    await asyncio.sleep(0.05)
    assert outbox.held == 1  # waiting (a minute) for a newer keystroke
    await outbox.stop()
    tombstones = await stack.read_topic(
        stack.topics.cancel, count=1, where=lambda r: r["id"] == env.id
    )
    assert [(t["team"], t["reason"]) for t in tombstones] == [(env.team, "disconnect")]


@pytest.mark.parametrize("case", ["no newer keystroke", "team lets it finish"])
async def test_a_gone_keystrokes_tombstone_goes_out_when_nothing_supersedes_it(
    stack: LiveStack, case: str
) -> None:
    ingress = await stack.start_ingress(cancel_hold_ms=300)
    await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)
    grace = 1 if case == "team lets it finish" else 0
    http = stack.http(ingress, await stack.api_key("team-a", supersede_grace_tokens=grace))
    body = {"model": "laneway-code", "prompt": long_prompt(60), "max_tokens": 128, "stream": True}
    async with http.stream(
        "POST", "/v1/completions", json=body, headers=_keystroke("doc-8", 1)
    ) as response:
        old_id = response.headers["x-laneway-request-id"]
        await _first_data(response.aiter_lines())
        if grace:
            newer = await http.post(
                "/v1/completions",
                json={**body, "stream": False, "max_tokens": 4},
                headers=_keystroke("doc-8", 2),
            )
            assert newer.status_code == 200
    tombstones = await stack.read_topic(
        stack.topics.cancel, count=1, where=lambda r: r["id"] == old_id
    )
    assert [(t["team"], t["reason"]) for t in tombstones] == [("team-a", "disconnect")]
    event = (await stack.usage_of(old_id))[old_id]
    assert event["status"] == "cancelled"
    assert event["completion_tokens"] < sim_answer_tokens(body["prompt"])


async def test_team_policy_lets_a_superseded_completion_that_streamed_enough_finish(
    stack: LiveStack,
) -> None:
    """Per team: a superseded completion that already streamed N tokens finishes (the user
    may be reading it); one that streamed fewer is dropped."""
    ingress = await stack.start_ingress()
    worker = await stack.start_worker("completion", sim_decode_ms_per_step=STEP_MS)
    body = {"model": "laneway-code", "prompt": long_prompt(100), "max_tokens": 128, "stream": True}
    outcomes = {}
    for team, grace in (("team-g", 3), ("team-h", 1000)):
        http = stack.http(ingress, await stack.api_key(team, supersede_grace_tokens=grace))
        session = f"doc-{team}"
        async with http.stream(
            "POST", "/v1/completions", json=body, headers=_keystroke(session, 1)
        ) as response:
            old_id = response.headers["x-laneway-request-id"]
            lines = response.aiter_lines()
            await _first_data(lines, count=5)
            newer = await http.post(
                "/v1/completions",
                json={**body, "stream": False, "max_tokens": 4},
                headers=_keystroke(session, 2),
            )
            assert newer.status_code == 200
            # The newer keystroke was fetched (it was served) while the old one still ran.
            running_then = old_id in worker.executor.live
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        outcomes[team] = ((await stack.usage_of(old_id))[old_id], rest)
        if team == "team-g":
            assert running_then
    finished, rest = outcomes["team-g"]
    assert finished["status"] == "ok"
    assert "error" not in orjson.loads(rest[-2][6:])
    dropped, rest = outcomes["team-h"]
    assert dropped["status"] == "superseded"
    assert dropped["completion_tokens"] < sim_answer_tokens(body["prompt"])
    assert orjson.loads(rest[-2][6:])["error"]["code"] == "superseded"


def _keystroke(session: str, seq: int) -> dict[str, str]:
    return {"X-Laneway-Session": session, "X-Laneway-Seq": str(seq)}


async def test_a_request_whose_store_timed_out_is_tombstoned_and_never_runs(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A produce that times out may have stored the request all the same (the broker's
    answer was lost). The client gets a 503 and sends it again under a new id; the first
    copy is tombstoned, so no worker runs it beside the second (unbilled, too: its quota
    was given back with the 503)."""
    ingress = await stack.start_ingress()
    admission = ingress.state.admission
    produce = admission.produce

    async def stored_then_timed_out(env: RequestEnvelope) -> None:
        await produce(env)
        raise KafkaTimeoutError()

    monkeypatch.setattr(admission, "produce", stored_then_timed_out)
    http = stack.http(ingress, await stack.api_key("ide", size=100))
    body = {"model": "laneway-code", "prompt": "def f(", "max_tokens": 8}
    # A deadline that outlasts the worker's start: what drops it must be the tombstone.
    refused = await http.post(
        "/v1/completions", json=body, headers={"X-Laneway-Deadline-Ms": "60000"}
    )
    assert refused.status_code == 503
    rid = refused.headers["x-laneway-request-id"]
    (stored,) = await stack.read_topic(stack.topics.request("completion", "hi"), count=1)
    assert stored["id"] == rid  # stored all the same
    await stack.start_worker("completion")
    assert (await stack.usage_of(rid))[rid]["status"] == "cancelled"


async def _typist(stack: LiveStack, prompt: str) -> Callable[[int], Awaitable[int]]:
    """A stack with a completion worker, and one keystroke of session app.py at a seq: its
    answer's status."""
    ingress = await stack.start_ingress()
    await stack.start_worker("completion")
    http = stack.http(ingress, await stack.api_key("team-r", size=100))
    body = {"model": "laneway-code", "prompt": prompt, "max_tokens": 4}

    async def keystroke(seq: int) -> int:
        answer = await http.post("/v1/completions", json=body, headers=_keystroke("app.py", seq))
        return answer.status_code

    return keystroke


async def test_a_session_whose_count_starts_again_is_served_after_a_pause(
    stack: LiveStack,
) -> None:
    """An editor restarted (or a document reopened) counts its keystrokes from 0 again. A
    lower seq right behind a newer one is an old keystroke racing it, and is dropped; one
    that comes SESSION_RESTART_S after the session's newest starts the count again, instead
    of being superseded until the count passes the old one."""
    keystroke = await _typist(stack, "def restart(")

    assert await keystroke(500) == 200
    assert await keystroke(3) == 409  # within a moment of seq 500: the older keystroke
    await asyncio.sleep(SESSION_RESTART_S + 0.2)
    assert [await keystroke(seq) for seq in (0, 1, 2)] == [200, 200, 200]
    assert await keystroke(1) == 409  # the new count supersedes as the old one did


async def test_a_superseded_keystroke_sent_again_after_a_pause_is_superseded_again(
    stack: LiveStack,
) -> None:
    """The Vercel AI SDK retries a 409 after a fixed 2 s, just past SESSION_RESTART_S: the
    superseded keystroke came back as if the count had started again, and ran to its end
    for an answer no one shows, billed. One of the session's last keystrokes sent again is
    a resend: superseded again. A count that starts again from far below still starts."""
    keystroke = await _typist(stack, "def retry(")

    assert [await keystroke(seq) for seq in (40, 41, 42)] == [200, 200, 200]
    await asyncio.sleep(SESSION_RESTART_S + 0.2)
    assert await keystroke(41) == 409  # the retry of seq 41, superseded by 42
    assert await keystroke(0) == 200  # the editor restarted: its count from 0
