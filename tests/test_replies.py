"""Reply chunks: the worker coalesces text while a write is in flight, the ingress passes on
each character once, however a re-run cuts the same text into chunks."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import ResponseError

from ingress.replies import ReplyChannel, ReplyRouter
from laneway.constants import REPLY_STREAM_TTL_S, RedisKeys, Topics
from laneway.redis_circuit import attach_circuit
from laneway.schema import Reply, UsageEvent, decode
from ops.kafka_topics import create_topics
from ops.redis_server import RedisServer
from tests.stack import LiveStack, Services, envelope, eventually, free_port, redis_client
from workers.outbox import Outbox
from workers.replies import ChunkStream
from workers.round_trips import RoundTrips


class _Pipelines:
    """Counts the pipelines a Redis client opens."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.count = 0
        self._open = redis.pipeline
        redis.pipeline = self._counted  # type: ignore[method-assign]

    def _counted(self, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        return self._open(*args, **kwargs)


def _drain(channel: ReplyChannel) -> list[Reply]:
    out = []
    while (reply := channel.take()) is not None:
        out.append(reply)
    return out


def test_channel_passes_on_each_character_once_across_a_rerun() -> None:
    channel = ReplyChannel("r-1", "team-a")
    channel.feed(Reply(id="r-1", n=0, at=0, text="def "))
    channel.feed(Reply(id="r-1", n=1, at=4, text="main"))
    # The worker died; its replacement runs the request again and cuts the text otherwise.
    channel.feed(Reply(id="r-1", n=0, at=0, text="de"))
    channel.feed(Reply(id="r-1", n=1, at=2, text="f ma"))
    channel.feed(Reply(id="r-1", n=2, at=6, text="in():"))
    channel.feed(Reply(id="r-1", n=3, at=11, text=" pass", done=True, status="ok"))
    replies = _drain(channel)
    assert "".join(r.text for r in replies) == "def main(): pass"
    assert [r.at for r in replies] == [0, 4, 8, 11]
    assert replies[-1].done


def test_channel_keeps_a_rerun_final_reply_without_repeating_its_text() -> None:
    channel = ReplyChannel("r-2", "team-a")
    channel.feed(Reply(id="r-2", n=0, at=0, text="abc"))
    channel.feed(Reply(id="r-2", n=0, at=0, text="abc", done=True, status="ok"))
    replies = _drain(channel)
    assert [(r.text, r.done) for r in replies] == [("abc", False), ("", True)]


def test_channel_goes_by_message_numbers_for_a_worker_without_offsets() -> None:
    # A worker from before text offsets (a rolling upgrade): one message per token.
    channel = ReplyChannel("r-4", "team-a")
    for n, text in enumerate(["def ", "main", "():"]):
        channel.feed(Reply(id="r-4", n=n, text=text))
    channel.feed(Reply(id="r-4", n=0, text="def "))  # its re-run after a crash
    channel.feed(Reply(id="r-4", n=3, text="", done=True, status="ok"))
    assert "".join(r.text for r in _drain(channel)) == "def main():"


async def test_channel_holds_text_that_came_ahead_of_a_gap() -> None:
    # Redis came back: the next chunk went through Redis and overtook the last one that
    # went through Kafka.
    channel = ReplyChannel("r-5", "team-a")
    channel.feed(Reply(id="r-5", n=0, at=0, text="def "))
    channel.feed(Reply(id="r-5", n=2, at=8, text="():", done=True, status="ok"))
    assert [r.text for r in _drain(channel)] == ["def "]
    channel.feed(Reply(id="r-5", n=1, at=4, text="main"))
    replies = _drain(channel)
    assert [r.text for r in replies] == ["main", "():"]
    assert replies[-1].done


async def test_a_gap_that_never_fills_ends_the_answer_with_an_error() -> None:
    channel = ReplyChannel("r-6", "team-a", gap_wait_s=0.05)
    channel.feed(Reply(id="r-6", n=0, at=0, text="def "))
    channel.feed(Reply(id="r-6", n=2, at=8, text="():", done=True, status="ok"))
    assert [r.text for r in _drain(channel)] == ["def "]
    final = await channel.get(1.0)  # not held for good: the request does not hang
    assert (final.done, final.status) == (True, "error")
    assert "4..8 never arrived" in (final.error or "")
    channel.feed(Reply(id="r-6", n=1, at=4, text="main"))  # too late: nothing more
    assert _drain(channel) == []


def test_a_rerun_that_differs_from_what_was_sent_is_an_error_not_a_splice() -> None:
    # The worker crashed after "def main"; its re-run sampled another text (temperature > 0
    # on an engine that ignored the seed). The client must not get "def main" + the re-run's
    # end as if it were one answer.
    channel = ReplyChannel("r-8", "team-a")
    channel.feed(Reply(id="r-8", n=0, at=0, text="def "))
    channel.feed(Reply(id="r-8", n=1, at=4, text="main"))
    channel.feed(Reply(id="r-8", n=0, at=0, text="class Foo:", done=True, status="ok"))
    replies = _drain(channel)
    assert [r.text for r in replies[:2]] == ["def ", "main"]
    assert (replies[2].done, replies[2].status) == (True, "error")
    assert "re-run's text differs" in (replies[2].error or "")


def test_a_rerun_that_repeats_what_was_sent_goes_on_seamlessly() -> None:
    channel = ReplyChannel("r-9", "team-a")
    channel.feed(Reply(id="r-9", n=0, at=0, text="def "))
    channel.feed(Reply(id="r-9", n=1, at=4, text="main"))
    channel.feed(Reply(id="r-9", n=0, at=0, text="def main():", done=True, status="ok"))
    assert "".join(r.text for r in _drain(channel)) == "def main():"


async def test_channel_gives_each_gap_its_own_wait() -> None:
    # Waits of 1 s, each step a quarter of one away from its edge: a loop that stalls for
    # less than that (a busy machine) changes nothing.
    channel = ReplyChannel("r-7", "team-a", gap_wait_s=1.0)
    channel.feed(Reply(id="r-7", n=0, at=0, text="a"))
    channel.feed(Reply(id="r-7", n=2, at=2, text="c"))  # "b" missing
    channel.feed(Reply(id="r-7", n=4, at=4, text="e", done=True, status="ok"))  # "d" too
    await asyncio.sleep(0.75)
    channel.feed(Reply(id="r-7", n=1, at=1, text="b"))  # the first gap fills
    assert [r.text for r in _drain(channel)] == ["a", "b", "c"]
    await asyncio.sleep(0.5)  # past the first gap's wait (1.0), within the second's (1.75)
    assert _drain(channel) == []
    final = await channel.get(5.0)  # the second never filled
    assert (final.done, final.status) == (True, "error")


class _ReplyStream:
    """A reply stream of its own on the real Redis, written through an Outbox (Redis path)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.name = f"c{uuid.uuid4().hex[:8]}:reply:test"
        self.writer = Outbox(redis, None, Topics("c")).replies  # type: ignore[arg-type]

    async def written(self, chunks: ChunkStream, count: int = 1) -> list[Reply]:
        """The messages in the stream once ``chunks`` has written ``count`` (2 s at most)."""
        for _ in range(200):
            if chunks.count >= count:
                break
            await asyncio.sleep(0.01)
        return [decode(Reply, fields[b"d"]) for _, fields in await self.redis.xrange(self.name)]


@pytest.fixture
async def reply_stream(services: Services) -> AsyncIterator[_ReplyStream]:
    redis = redis_client(services.redis_url)
    stream = _ReplyStream(redis)
    try:
        yield stream
    finally:
        await redis.delete(stream.name)
        await redis.aclose()


async def test_chunk_stream_coalesces_text_and_leaves_the_rest_to_the_final_reply(
    reply_stream: _ReplyStream,
) -> None:
    chunks = ChunkStream(reply_stream.writer, reply_stream.name, "r-3")
    chunks.add("ab")
    chunks.add("c")  # both before the writer ran: one message
    written = await reply_stream.written(chunks)
    chunks.add("d")
    chunks.add("e")
    count, offset, rest = await chunks.close()
    assert (count, offset, rest) == (1, 3, "de")
    assert [(r.n, r.at, r.text) for r in written] == [(0, 0, "abc")]
    final = Reply(id="r-3", n=count, at=offset, text=rest, done=True, status="ok")
    channel = ReplyChannel("r-3", "team-a")
    for reply in [*written, final]:
        channel.feed(reply)
    assert "".join(r.text for r in _drain(channel)) == "abcde"


async def test_chunk_stream_with_an_interval_sends_the_first_text_at_once_then_every_n_tokens(
    reply_stream: _ReplyStream,
) -> None:
    chunks = ChunkStream(reply_stream.writer, reply_stream.name, "r-4", interval=3)
    chunks.add("a", 1)
    written = await reply_stream.written(chunks, 1)
    assert [(r.n, r.at, r.text) for r in written] == [(0, 0, "a")]  # the first does not wait
    chunks.add("b", 2)
    chunks.add("c", 3)
    await asyncio.sleep(0.05)
    assert chunks.count == 1  # two tokens since the last message: held
    chunks.add("de", 4)  # the third since the last message
    written = await reply_stream.written(chunks, 2)
    assert [(r.n, r.at, r.text) for r in written] == [(0, 0, "a"), (1, 1, "bcde")]
    chunks.add("f", 5)
    assert await chunks.close() == (2, 5, "f")  # the rest rides on the final reply


async def test_chunks_that_come_together_share_one_round_trip(services: Services) -> None:
    # One engine step gives every running sequence a token: their chunks go out together.
    redis = redis_client(services.redis_url)
    streams = [f"c{uuid.uuid4().hex[:8]}:reply:test" for _ in range(2)]
    outbox = Outbox(redis, None, Topics("c"))  # type: ignore[arg-type]  # Redis path only
    pipelines = _Pipelines(redis)
    try:
        writers = [ChunkStream(outbox.replies, streams[i % 2], f"r-{i}") for i in range(6)]
        for i, chunks in enumerate(writers):
            chunks.add(f"token {i}")
        for _ in range(200):
            if all(chunks.sent for chunks in writers):
                break
            await asyncio.sleep(0.01)
        closed = [await chunks.close() for chunks in writers]
        assert closed == [(1, 7, "")] * 6
        assert pipelines.count == 1
        for i, stream in enumerate(streams):
            written = [decode(Reply, f[b"d"]) for _, f in await redis.xrange(stream)]
            assert [(r.id, r.text) for r in written] == [
                (f"r-{k}", f"token {k}") for k in range(i, 6, 2)
            ]
    finally:
        await redis.delete(*streams)
        await redis.aclose()


async def test_final_replies_that_come_together_share_one_round_trip(services: Services) -> None:
    # Requests that end on the same engine step: their final replies (and, with quotas, their
    # settlements) go to the ingress in one pipeline, behind the chunks queued before them.
    redis = redis_client(services.redis_url)
    stream = f"c{uuid.uuid4().hex[:8]}:reply:test"
    outbox = Outbox(redis, None, Topics("c"), capture=True)  # type: ignore[arg-type]
    pipelines = _Pipelines(redis)
    envs = [envelope(id=f"r-{i}", max_tokens=8, reply_to=stream) for i in range(4)]
    try:
        chunk = asyncio.create_task(
            outbox.replies.reply(stream, Reply(id="r-0", n=0, at=0, text="x"))
        )
        await asyncio.gather(
            *(
                outbox.finish(
                    env,
                    Reply(id=env.id, n=1, at=1, text="y", done=True, status="ok"),
                    UsageEvent(
                        id=env.id,
                        team=env.team,
                        cls=env.cls,
                        model=env.model,
                        route=env.route,
                        status="ok",
                    ),
                )
                for env in envs
            )
        )
        await chunk
        assert pipelines.count == 1
        written = [decode(Reply, f[b"d"]) for _, f in await redis.xrange(stream)]
        assert [(r.id, r.done) for r in written] == [("r-0", False)] + [
            (env.id, True) for env in envs
        ]
        assert set(outbox.captured) == {env.id for env in envs}
    finally:
        await redis.delete(stream)
        await redis.aclose()


async def test_a_writer_whose_command_redis_refuses_fails_alone(services: Services) -> None:
    # Writers share a pipeline: one command Redis refuses (a stream written as a string) is
    # that writer's error, and the writes before and after it in the pipeline still land.
    redis = redis_client(services.redis_url)
    stream = f"c{uuid.uuid4().hex[:8]}:reply:test"
    wrong_type = f"{stream}:string"
    await redis.set(wrong_type, "not a stream")
    round_trips = RoundTrips(redis)
    pipelines = _Pipelines(redis)
    good = [("XADD", stream, "*", "d", b"x")]
    bad = [("XADD", wrong_type, "*", "d", b"y")]
    try:
        first, middle, last = await asyncio.gather(
            round_trips.send(good), round_trips.send(bad), round_trips.send(good)
        )
        assert [type(r[0]) if r else None for r in (first, middle, last)] == [
            bytes,
            ResponseError,
            bytes,
        ]
        assert pipelines.count == 1
        assert [f[b"d"] for _, f in await redis.xrange(stream)] == [b"x", b"x"]
    finally:
        await redis.delete(stream, wrong_type)
        await redis.aclose()


async def test_chunk_stream_keeps_the_text_of_a_failed_write_for_the_final_reply(
    services: Services,
) -> None:
    # Redis is not listening and the replies topic does not exist (the broker creates none on
    # its own): the write fails on both paths.
    redis = redis_client(f"redis://127.0.0.1:{free_port()}/0")
    producer = AIOKafkaProducer(bootstrap_servers=services.bootstrap, request_timeout_ms=1000)
    await producer.start()
    outbox = Outbox(redis, producer, Topics(f"missing{uuid.uuid4().hex[:8]}"))
    try:
        chunks = ChunkStream(outbox.replies, "c:reply:test", "r-5")
        chunks.add("ab")
        for _ in range(500):
            if chunks._task.done():
                break
            await asyncio.sleep(0.01)
        chunks.add("c")
        assert await chunks.close() == (0, 0, "abc")
    finally:
        await producer.stop()
        await redis.aclose()


async def test_a_final_reply_no_path_takes_is_tried_again_until_one_does(
    services: Services, caplog: pytest.LogCaptureFixture
) -> None:
    # Redis is not listening and the replies topic is not there yet (a broker that cannot
    # take the reply now, as under overload): its client waits for it, so the worker tries
    # again, and it goes out once Kafka takes it.
    redis = redis_client(f"redis://127.0.0.1:{free_port()}/0")
    producer = AIOKafkaProducer(bootstrap_servers=services.bootstrap, request_timeout_ms=500)
    await producer.start()
    topics = Topics(f"late{uuid.uuid4().hex[:8]}")
    outbox = Outbox(redis, producer, topics)
    env = envelope(id="r-6", reply_to="c:reply:test")
    final = Reply(id="r-6", n=0, at=0, text="done", done=True, status="ok")
    usage = UsageEvent(
        id=env.id, team=env.team, cls=env.cls, model=env.model, route=env.route, status="ok"
    )
    try:
        finishing = asyncio.create_task(outbox.finish(env, final, usage))
        await eventually(lambda: "trying again" in caplog.text, 20, "a first attempt to fail")
        assert not finishing.done()
        specs = {name: spec for name, *spec in topics.specs(1)}
        replies_only = [(topics.replies, *specs[topics.replies])]
        await asyncio.to_thread(create_topics, services.bootstrap, replies_only)
        delivery = await asyncio.wait_for(finishing, 30)
        assert [decode(Reply, v) for v in await _values(services, topics.replies)] == [final]
        # The usage topic is not there yet either: the delivery fails, the call does not,
        # and whoever awaits it sends the event again (RequestExecutor.delivered).
        assert delivery is not None
        with pytest.raises(KafkaError):
            await delivery
        await asyncio.to_thread(create_topics, services.bootstrap, topics.specs(1))
        await (await outbox.send_usage(usage))
        assert [decode(UsageEvent, v).id for v in await _values(services, topics.usage)] == [env.id]
    finally:
        await producer.stop()
        await redis.aclose()


async def test_a_reply_redis_took_just_before_it_stopped_goes_again_through_kafka(
    services: Services, tmp_path: Path
) -> None:
    # Redis took the final reply, then stopped (SIGSTOP: a fork for a snapshot, a paused VM)
    # before the ingress's reader asked for it: that reader's next XREAD waits on the stopped
    # server, past the request's deadline. Once the worker's circuit opens, it sends again
    # through Kafka what Redis took in its last second, and the ingress gets the answer while
    # Redis is still stopped.
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis")
    server.start()
    redis = aioredis.Redis.from_url(server.url, socket_timeout=5)
    attach_circuit(redis, hot_timeout_ms=50, failures=1, probe_interval_ms=50)
    topics = Topics(f"again{uuid.uuid4().hex[:8]}")
    await asyncio.to_thread(create_topics, services.bootstrap, topics.specs(1))
    producer = AIOKafkaProducer(bootstrap_servers=services.bootstrap)
    consumer = AIOKafkaConsumer(
        topics.replies, bootstrap_servers=services.bootstrap, auto_offset_reset="earliest"
    )
    await producer.start()
    await consumer.start()
    stream = "i-1:reply:test"
    router = ReplyRouter(redis, stream)  # its stream reader not running: between two reads
    channel = router.open("r-7", "team-a")
    tail = asyncio.create_task(router.tail_kafka(consumer))
    outbox = Outbox(redis, producer, topics)
    env = envelope(id="r-7", reply_to=stream)
    final = Reply(id="r-7", n=0, at=0, text="done", done=True, status="ok")
    usage = UsageEvent(
        id=env.id, team=env.team, cls=env.cls, model=env.model, route=env.route, status="ok"
    )
    assert server.pid is not None
    try:
        await outbox.finish(env, final, usage)
        assert [fields[b"d"] for _, fields in await redis.xrange(stream)] == [final.to_json()]
        os.kill(server.pid, signal.SIGSTOP)
        # The worker's next Redis write finds it stopped: the circuit opens.
        other = Reply(id="r-8", n=0, at=0, text="x", done=True, status="ok")
        await outbox.replies.reply(stream, other)
        assert outbox.round_trips.circuit.open
        assert await channel.get(10) == final
        assert channel.take() is None  # once
    finally:
        os.kill(server.pid, signal.SIGCONT)
        tail.cancel()
        await outbox.close()
        await consumer.stop()
        await producer.stop()
        await redis.aclose()
        server.stop()


async def _values(services: Services, topic: str) -> list[bytes]:
    """What ``topic`` (one partition) holds, from its start."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=services.bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        batches = await consumer.getmany(timeout_ms=5000)
        return [r.value for records in batches.values() for r in records if r.value]
    finally:
        await consumer.stop()


async def test_a_reply_to_an_ingress_gone_for_good_leaves_a_stream_that_expires(
    stack: LiveStack,
) -> None:
    """An ingress's stream outlives it by its TTL. A worker's reply that comes later (a
    backlog, a worker that was away) makes the stream again: it must expire too, not stay in
    Redis for ever, one more for every replica that ever went away."""
    await stack.start_worker("completion")
    stream = RedisKeys(stack.prefix).reply_stream("ingress-gone")
    await stack.send_records(envelope(reply_to=stream))
    await eventually(lambda: stack.redis.exists(stream), 20, "the worker's reply")
    assert 0 < await stack.redis.ttl(stream) <= REPLY_STREAM_TTL_S
