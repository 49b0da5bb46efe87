"""Reply chunks: the worker coalesces text while a write is in flight, the ingress passes on
each character once, however a re-run cuts the same text into chunks."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from ingress.replies import ReplyChannel
from laneway.constants import Topics
from laneway.schema import Reply, decode
from tests.stack import Services
from workers.replies import ChunkStream, Outbox


def _drain(channel: ReplyChannel) -> list[Reply]:
    out = []
    while not channel._queue.empty():
        out.append(channel._queue.get_nowait())
    return out


def test_channel_passes_on_each_character_once_across_a_rerun() -> None:
    channel = ReplyChannel("r-1", "team-a")
    channel.feed(Reply(id="r-1", n=0, text="def "))
    channel.feed(Reply(id="r-1", n=4, text="main"))
    # The worker died; its replacement runs the request again and cuts the text otherwise.
    channel.feed(Reply(id="r-1", n=0, text="de"))
    channel.feed(Reply(id="r-1", n=2, text="f ma"))
    channel.feed(Reply(id="r-1", n=6, text="in():"))
    channel.feed(Reply(id="r-1", n=11, text=" pass", done=True, status="ok"))
    replies = _drain(channel)
    assert "".join(r.text for r in replies) == "def main(): pass"
    assert [r.n for r in replies] == [0, 4, 8, 11]
    assert replies[-1].done


def test_channel_keeps_a_rerun_final_reply_without_repeating_its_text() -> None:
    channel = ReplyChannel("r-2", "team-a")
    channel.feed(Reply(id="r-2", n=0, text="abc"))
    channel.feed(Reply(id="r-2", n=0, text="abc", done=True, status="ok"))
    replies = _drain(channel)
    assert [(r.text, r.done) for r in replies] == [("abc", False), ("", True)]


async def test_chunk_stream_coalesces_text_and_leaves_the_rest_to_the_final_reply(
    services: Services,
) -> None:
    redis = aioredis.Redis.from_url(services.redis_url)
    stream = f"c{uuid.uuid4().hex[:8]}:reply:test"
    outbox = Outbox(redis, None, Topics("c"))  # type: ignore[arg-type]  # Redis path only
    try:
        chunks = ChunkStream(outbox, stream, "r-3")
        chunks.add("ab")
        chunks.add("c")  # both before the writer ran: one message
        for _ in range(200):
            if chunks.sent:
                break
            await asyncio.sleep(0.01)
        chunks.add("d")
        chunks.add("e")
        offset, rest = await chunks.close()
        assert (offset, rest) == (3, "de")
        written = [decode(Reply, fields[b"d"]) for _, fields in await redis.xrange(stream)]
        assert [(r.n, r.text) for r in written] == [(0, "abc")]
        channel = ReplyChannel("r-3", "team-a")
        for reply in [*written, Reply(id="r-3", n=offset, text=rest, done=True, status="ok")]:
            channel.feed(reply)
        assert "".join(r.text for r in _drain(channel)) == "abcde"
    finally:
        await redis.delete(stream)
        await redis.aclose()
