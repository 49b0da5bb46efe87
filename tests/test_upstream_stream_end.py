"""Where the openai engine ends an upstream's stream, against a separate upstream process
(``bench.upstream_server``) that misbehaves as told and logs what it ran: at ``max_tokens``
when the upstream ignores it, and soon after the last chunk when the upstream never ends
the stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from laneway.tokens import estimate_tokens
from tests.stack import eventually
from tests.upstream_process import UpstreamProcess
from workers.types import EngineDelta, EngineRequest
from workers.upstream import OpenAICompatibleEngine


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
    assert deltas[-1].completion_tokens == 16  # billed what the client asked for at most
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
