"""Where the openai engine ends an upstream's stream, against a separate upstream process
(``bench.upstream_server``) that misbehaves as told and logs what it ran: at ``max_tokens``
when the upstream ignores it, and soon after the last chunk when the upstream never ends
the stream. What such an upstream's client got is what its team is billed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from laneway.tokens import estimate_tokens
from tests.stack import LiveStack, eventually
from tests.upstream_process import UpstreamProcess
from workers.types import EngineDelta, EngineRequest
from workers.upstream import OpenAICompatibleEngine
from workers.upstream_stream import StreamReading, TokensPerChunk


async def _run(upstream: UpstreamProcess, prompt: str, max_tokens: int) -> list[EngineDelta]:
    engine = OpenAICompatibleEngine(upstream.url, model="up")
    await engine.start()
    try:
        request = EngineRequest(id=prompt, route="up", prompt=prompt, max_tokens=max_tokens)

        async def deltas() -> list[EngineDelta]:
            return [delta async for delta in engine.generate(request)]

        # Bounded: the old engine waited for the read timeout (120 s) on a silent upstream.
        return await asyncio.wait_for(deltas(), 30)
    finally:
        await engine.stop()


async def test_an_upstream_that_ignores_max_tokens_is_stopped_there(
    upstreams: Callable[..., Any],
) -> None:
    upstream = await upstreams(slots=2, token_ms=5, tokens_always=300)
    deltas = await _run(upstream, "ignored", max_tokens=16)
    assert len([d for d in deltas if d.text]) == 16
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == 16  # a token a chunk: billed what it forwarded
    # The upstream stopped too: laneway closed the request there.
    ran = await eventually(lambda: upstream.entry("ignored"), 20, "the upstream's entry")
    assert ran["outcome"] == "gone_running", ran
    assert ran["tokens"] < 300


async def test_an_upstream_that_honours_max_tokens_is_billed_its_own_usage(
    upstreams: Callable[..., Any],
) -> None:
    upstream = await upstreams(slots=2, token_ms=5)
    deltas = await _run(upstream, "honoured " * 40, max_tokens=16)
    assert deltas[-1].finish_reason == "length"
    # The usage chunk after the 16th token was read: the upstream's prompt count, not
    # laneway's estimate.
    assert deltas[-1].prompt_tokens == len("honoured " * 40) // 4
    assert deltas[-1].completion_tokens == 16


async def test_a_stream_that_stays_open_after_its_last_chunk_ends_as_finished(
    upstreams: Callable[..., Any],
) -> None:
    upstream = await upstreams(slots=2, token_ms=5, silent_after_finish=True)
    deltas = await _run(upstream, "silent", max_tokens=8)
    assert "".join(d.text for d in deltas).split() != []
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == 8
    assert deltas[-1].prompt_tokens == 1  # the upstream's usage chunk was read
    # Its connection closed: the upstream's handler ended.
    await eventually(lambda: upstream.entry("silent"), 20, "the upstream's entry")


async def test_usage_an_upstream_sends_late_after_its_finish_is_still_read(
    upstreams: Callable[..., Any],
) -> None:
    """vLLM sends a request's usage in a chunk of its own after the finish, later under
    load. Once the engine has seen an upstream do so, it reads a stream on past its finish
    to its end: the late usage is the request's true count, not laneway's estimate."""
    upstream = await upstreams(slots=2, token_ms=5, usage_apart_ms=2500)
    engine = OpenAICompatibleEngine(upstream.url, model="up")
    await engine.start()
    try:
        answers = []
        code = ": def f(a, b): return a + b\n" * 10  # estimated otherwise than the server counts
        for prompt in ("warm" + code, "late" + code):  # its usage 2.5 s after the finish
            request = EngineRequest(id=prompt[:4], route="up", prompt=prompt, max_tokens=8)
            deltas = [delta async for delta in engine.generate(request)]
            answers.append(deltas[-1])
    finally:
        await engine.stop()
    late = "late" + code
    assert estimate_tokens(late) != len(late) // 4  # the estimate would not pass for it
    assert [a.prompt_tokens for a in answers] == [len(late) // 4] * 2


async def _through_laneway(stack: LiveStack, upstream: UpstreamProcess) -> httpx.AsyncClient:
    """A client of an ingress and a worker in front of ``upstream``."""
    ingress = await stack.start_ingress()
    await stack.start_worker(
        "completion",
        engine="openai",
        upstream_url=upstream.url,
        upstream_model="up",
        upstream_metrics_url="",
    )
    return stack.http(ingress, await stack.api_key())


async def _streamed(
    stack: LiveStack, http: httpx.AsyncClient, prompt: str, max_tokens: int, chunks: int = 0
) -> tuple[str, str, dict[str, Any]]:
    """A streamed completion: the text its client got (its first ``chunks`` chunks, then it
    leaves; 0: all), its finish_reason and its usage event."""
    body = {"model": "laneway-code", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    text, finish, read = "", "", 0
    async with http.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200, await answer.aread()
        request_id = answer.headers["x-laneway-request-id"]
        async for line in answer.aiter_lines():
            if line.startswith("data: {"):
                choice = orjson.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice.get("finish_reason") or finish
                read += 1
                if read == chunks:
                    break
    (event,) = (await stack.usage_of(request_id)).values()
    return text, finish, event


@pytest.mark.slow
async def test_an_upstream_that_ignores_max_tokens_in_chunks_of_several_tokens_is_billed_them(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """Four tokens a chunk, max_tokens ignored, and its usage in its last chunk: the client
    got 48 tokens where it asked for 16 (laneway counts a chunk as one token, and 12 chunks
    are not past 16). Its team is billed the upstream's own count of them, not 16."""
    upstream = await upstreams(slots=2, token_ms=5, tokens_always=48, tokens_per_chunk=4)
    http = await _through_laneway(stack, upstream)
    text, finish, event = await _streamed(stack, http, "chunky", 16)
    assert len(text.split()) == 48  # one word a token, as the upstream counts them
    assert finish == "length"
    assert event["status"] == "ok", event
    assert event["completion_tokens"] == 48, event


@pytest.mark.slow
async def test_a_stream_ended_before_its_usage_is_billed_the_tokens_its_chunks_held(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """Four tokens a chunk (speculative decoding, vLLM's --stream-interval). Once a stream
    with the upstream's usage has shown it, a stream whose client leaves before its usage is
    billed four tokens a chunk, judged by the upstream's own log."""
    upstream = await upstreams(slots=2, token_ms=20, tokens_per_chunk=4)
    http = await _through_laneway(stack, upstream)
    _, _, learned = await _streamed(stack, http, "whole", 40)
    assert (learned["status"], learned["completion_tokens"]) == ("ok", 40), learned
    text, _, left = await _streamed(stack, http, "left midway", 120, chunks=5)
    assert len(text.split()) == 20
    ran = await eventually(lambda: upstream.entry("left midway"), 20, "the upstream's entry")
    assert ran["outcome"] == "gone_running", ran
    assert left["status"] == "cancelled", left
    # What the upstream made, give or take the chunk in flight when the client left.
    assert ran["tokens"] - 8 <= left["completion_tokens"] <= ran["tokens"], (ran, left)


@pytest.mark.slow
async def test_a_stream_cut_at_max_tokens_is_billed_the_tokens_its_chunks_held(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """The same where the upstream ignores max_tokens (and sends 300 tokens whatever it is
    asked): laneway cuts the stream at the first chunk past 16 and forwards no more, but the
    16 before held 64 tokens, which the client got."""
    ignoring = await upstreams(slots=2, token_ms=5, tokens_always=300, tokens_per_chunk=4)
    http = await _through_laneway(stack, ignoring)
    await _streamed(stack, http, "whole", 128)  # 75 chunks, its usage says 300
    text, finish, cut = await _streamed(stack, http, "cut", 16)
    assert len(text.split()) == 16 * 4  # 16 chunks, none after the one past the limit
    assert finish == "length"
    assert cut["status"] == "ok", cut
    assert 16 * 4 - 2 <= cut["completion_tokens"] <= 16 * 4, cut
    ran = await eventually(lambda: ignoring.entry("cut"), 20, "the upstream's entry")
    assert ran["outcome"] == "gone_running", ran  # the upstream stopped there too


def _reading_of(chunks: list[str], usage: int | None, per_chunk: float = 1.0) -> StreamReading:
    reading = StreamReading(5, 0, per_chunk)
    for text in chunks:
        reading.chunk({"choices": [{"text": text, "finish_reason": None}]})
    reading.chunk({"choices": [{"text": "", "finish_reason": "stop"}]})
    if usage is not None:
        reading.chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": usage}})
    return reading


def test_a_server_that_sends_a_token_a_chunk_is_billed_a_token_a_chunk() -> None:
    """Its usage counts one more token than its text chunks (an end-of-sequence with no
    text) or one fewer (a last chunk holding its final token): neither makes a chunk count
    for more than one token in a stream ended before its usage."""
    learned = TokensPerChunk()
    for _ in range(20):
        learned.learn(_reading_of(["a"] * 10, usage=11))
        learned.learn(_reading_of(["a"] * 10, usage=10))
    assert learned.value == 1.0
    assert _reading_of(["a"] * 7, usage=None, per_chunk=learned.value).billed() == 7
    # Four a chunk: a stream left after 7 chunks is billed 7 × 4 less a token at most, from
    # the first stream that showed it on.
    four = TokensPerChunk()
    four.learn(_reading_of(["a b c d"] * 10, usage=41))
    assert 27 <= _reading_of(["a"] * 7, usage=None, per_chunk=four.value).billed() <= 28


def test_streams_cut_at_their_length_teach_the_whole_count_a_chunk() -> None:
    """An answer cut at max_tokens has no end-of-sequence token: its usage over its chunks
    is what a chunk holds (vLLM's --stream-interval 3: 3). Learned less one token, as an
    answer that ended itself, it was 2.9 after one stream and stayed below 3 with every
    such stream: a client that left after 10 chunks was billed 29 of the 30 it got."""
    learned = TokensPerChunk()
    for _ in range(10):
        reading = StreamReading(5, 0, 1.0)
        for _ in range(10):
            reading.chunk({"choices": [{"text": "a b c", "finish_reason": None}]})
        reading.chunk({"choices": [{"text": "", "finish_reason": "length"}]})
        reading.chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 30}})
        learned.learn(reading)
    assert learned.value == 3.0
    assert _reading_of(["a b c"] * 10, usage=None, per_chunk=learned.value).billed() == 30


def test_a_stream_kept_within_max_tokens_is_never_billed_past_it() -> None:
    """Learned at 2.5 tokens a chunk, a stream of 8 chunks of 2 within max_tokens 16, its
    client gone before the usage: billed 16 at most, not 8 × 2.5."""
    reading = StreamReading(5, 16, 2.5)
    for _ in range(8):
        reading.chunk({"choices": [{"text": "ab", "finish_reason": None}]})
    assert reading.billed() == 16
