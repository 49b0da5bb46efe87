"""Engines: the sim model's arithmetic, and the openai engine against a real OpenAI-style server."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from laneway.errors import Aborted, EngineError
from tests.stack import LiveStack
from workers.sim import SimEngine, SimProfile
from workers.types import EngineDelta, EngineRequest
from workers.upstream import OpenAICompatibleEngine


async def _run(
    engine: SimEngine | OpenAICompatibleEngine, request: EngineRequest
) -> list[EngineDelta]:
    return [delta async for delta in engine.generate(request)]


async def test_sim_is_deterministic_and_costed() -> None:
    engine = SimEngine(SimProfile(prefill_ms_per_token=0.5, decode_ms_per_step=0.0, block_tokens=4))
    request = EngineRequest(id="a", route="m", prompt="x" * 64, max_tokens=20)
    first = await _run(engine, request)
    again = await _run(engine, EngineRequest(id="b", route="m", prompt="x" * 64, max_tokens=20))
    assert "".join(d.text for d in first) == "".join(d.text for d in again)
    assert first[-1].finish_reason in ("stop", "length")
    assert first[-1].completion_tokens == len(first)
    assert first[-1].prompt_tokens == 16  # four characters a token
    # First run: 16 uncached tokens at 0.5 ms. Second: the whole prefix is cached.
    assert first[-1].engine_ms == pytest.approx(8.0)
    assert again[-1].cached_tokens == 16
    assert again[-1].engine_ms == pytest.approx(0.0)


async def test_sim_stops_at_a_stop_sequence_and_leaves_it_out() -> None:
    engine = SimEngine(SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=0.0))
    plain = await _run(engine, EngineRequest(id="a", route="m", prompt="def f():", max_tokens=64))
    words = [d.text for d in plain]
    text = "".join(words)
    assert len(words) >= 6
    # A stop that begins inside the fourth step and ends inside the fifth.
    cut = len("".join(words[:3])) + 2
    stop = text[cut : len("".join(words[:4])) + 1]
    assert text.find(stop) == cut, "the stop must first occur where the test cut the text"
    stopped = await _run(
        engine,
        EngineRequest(id="b", route="m", prompt="def f():", max_tokens=64, stop=["zz", stop]),
    )
    assert "".join(d.text for d in stopped) == text[:cut]
    assert stopped[-1].finish_reason == "stop"
    assert stopped[-1].completion_tokens == 5  # the step that completed the stop was generated
    # At max_tokens, a stop met on the last step is still a stop, not the length.
    capped = await _run(
        engine, EngineRequest(id="c", route="m", prompt="def f():", max_tokens=5, stop=[stop])
    )
    assert (len(capped), capped[-1].finish_reason) == (5, "stop")
    unmatched = await _run(
        engine, EngineRequest(id="d", route="m", prompt="def f():", max_tokens=64, stop=["\n\n"])
    )
    assert [d.text for d in unmatched] == words


async def test_sim_prefix_cache_counts_only_whole_shared_blocks() -> None:
    engine = SimEngine(SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=0.0, block_tokens=4))
    await _run(engine, EngineRequest(id="a", route="m", prompt="a" * 40 + "tail-one", max_tokens=4))
    deltas = await _run(
        engine, EngineRequest(id="b", route="m", prompt="a" * 40 + "tail-two", max_tokens=4)
    )
    assert deltas[-1].cached_tokens == 8  # 10 shared tokens → two whole 4-token blocks
    assert engine.stats().prefix_cache_hits == 2


async def test_sim_full_prefix_cache_is_not_memory_pressure() -> None:
    # Workers shed low-priority work at LANEWAY_MEMORY_SHED_AT KV usage; a warm prefix
    # cache must not set that off (it once did, every heartbeat, under a document job).
    unlimited = SimEngine(SimProfile(decode_ms_per_step=0.0, prefix_cache_blocks=4))
    await _run(unlimited, EngineRequest(id="a", route="m", prompt="d" * 4096, max_tokens=4))
    assert unlimited.stats().kv_cache_usage == 0.0
    bounded = SimEngine(
        SimProfile(
            prefill_ms_per_token=0.0, decode_ms_per_step=50.0, prefix_cache_blocks=4, kv_tokens=2000
        )
    )
    stream = bounded.generate(EngineRequest(id="b", route="m", prompt="d" * 4000, max_tokens=8))
    await anext(stream)  # prefilled its 1000 prompt tokens, decoding
    assert 0.5 <= bounded.stats().kv_cache_usage < 0.6
    await bounded.abort("b")
    with pytest.raises(Aborted):
        await anext(stream)
    assert bounded.stats().kv_cache_usage == 0.0


async def test_sim_steps_do_not_wait_for_a_slow_consumer() -> None:
    # A GPU keeps decoding while the worker writes a chunk out; steps that fell due while
    # the consumer was away are ready at once, not started only when it asks.
    engine = SimEngine(SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=20.0))
    prompt = next(
        p
        for p in (f"def f{i}():" for i in range(100))
        if len(engine._completion_words(EngineRequest(id="x", route="m", prompt=p, max_tokens=64)))
        >= 8
    )
    stream = engine.generate(EngineRequest(id="s", route="m", prompt=prompt, max_tokens=64))
    first = await anext(stream)
    await asyncio.sleep(0.12)  # the worker is busy for six steps' time
    back = time.monotonic()
    caught_up = [await anext(stream) for _ in range(4)]
    assert [d.completion_tokens for d in caught_up] == [2, 3, 4, 5]
    # They were made while the worker was away, one step apart from the first; paced by
    # the consumer, the first of them would only have begun when it came back.
    ends = [d.ended for d in (first, *caught_up)]
    assert all(end is not None and end <= back for end in ends)
    assert ends == pytest.approx([ends[0] + 0.02 * k for k in range(5)], abs=0.002)
    await engine.abort("s")
    with pytest.raises(Aborted) as info:
        await anext(stream)
    # Steps 6 to 8 ran before the abort came (140 ms in) though nobody asked for them yet.
    assert info.value.engine_ms >= 8 * 20.0


async def test_sim_sequences_share_the_batch_steps() -> None:
    # One step of a continuous batch gives every running sequence its next token: a
    # sequence that joins later gets its tokens at the same moments as the others.
    engine = SimEngine(SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=20.0))
    early = engine.generate(EngineRequest(id="a", route="m", prompt="def a():", max_tokens=64))
    first = await anext(early)
    await asyncio.sleep(0.007)  # the second request arrives in the middle of a step
    late = await anext(
        engine.generate(EngineRequest(id="b", route="m", prompt="def b():", max_tokens=64))
    )
    assert first.ended is not None
    assert late.ended is not None
    steps_apart = (late.ended - first.ended) / 0.02
    assert steps_apart >= 1
    assert steps_apart == pytest.approx(round(steps_apart), abs=1e-6)


async def test_sim_abort_while_waiting_to_join_the_batch_costs_nothing() -> None:
    engine = SimEngine(SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=50.0))
    await asyncio.sleep(0.001)  # off a step boundary: the request waits for the next one
    stream = engine.generate(EngineRequest(id="j", route="m", prompt="def j():", max_tokens=64))
    first = asyncio.create_task(anext(stream))
    await asyncio.sleep(0.01)  # it is waiting to join (about 49 ms to go)
    await engine.abort("j")
    with pytest.raises(Aborted) as info:
        await first
    assert info.value.engine_ms == 0.0


async def test_sim_batch_slots_queue_the_rest() -> None:
    engine = SimEngine(SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=20.0, batch_slots=2))
    requests = [EngineRequest(id=str(i), route="m", prompt=f"p{i}", max_tokens=2) for i in range(3)]
    tasks = [asyncio.create_task(_run(engine, r)) for r in requests]
    await asyncio.sleep(0.01)
    assert (engine.stats().running, engine.stats().waiting) == (2, 1)
    await asyncio.gather(*tasks)
    assert (engine.stats().running, engine.stats().waiting) == (0, 0)


async def test_sim_abort_stops_within_one_step() -> None:
    engine = SimEngine(SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=10.0))
    request = EngineRequest(id="long", route="m", prompt="q", max_tokens=128)
    seen: list[EngineDelta] = []
    aborted_after_s = 0.0

    async def consume() -> None:
        nonlocal aborted_after_s
        started = time.monotonic()
        async for delta in engine.generate(request):
            seen.append(delta)
            if len(seen) == 3:
                aborted_after_s = time.monotonic() - started
                await engine.abort("long")

    with pytest.raises(Aborted) as info:
        await consume()
    assert len(seen) == 3
    # The engine runs on its own clock: at least the step it began as it handed out token 3
    # runs to its end (40 ms); on a busy machine the consumer reads late and the engine has
    # begun more steps by the abort, but never one after it (plus the step under way).
    steps_by_abort = math.ceil(aborted_after_s / 0.010) + 1
    assert info.value.engine_ms % 10.0 == pytest.approx(0.0, abs=1e-6)
    assert 40.0 <= info.value.engine_ms <= 10.0 * max(4, steps_by_abort)


async def test_sim_injected_failures_follow_the_rate() -> None:
    engine = SimEngine(
        SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=0.0, failure_rate=0.25, seed=7)
    )
    failures = 0
    for i in range(400):
        try:
            await _run(engine, EngineRequest(id=str(i), route="m", prompt=str(i), max_tokens=2))
        except EngineError:
            failures += 1
    assert 60 <= failures <= 140


async def test_openai_engine_streams_from_a_real_server(stack: LiveStack) -> None:
    """The openai engine against laneway's own ingress, which is an OpenAI-compatible server."""
    upstream = await stack.start_ingress()
    await stack.start_worker("completion")
    await stack.start_worker("chat")
    key = await stack.api_key("upstream-team")
    engine = OpenAICompatibleEngine(upstream.base_url + "/v1", api_key=key)
    await engine.start()
    try:
        sim = SimEngine()
        request = EngineRequest(id="u1", route="laneway-code", prompt="def f():", max_tokens=12)
        expected = "".join(d.text for d in await _run(sim, request))
        deltas = await _run(engine, request)
        assert "".join(d.text for d in deltas) == expected
        assert deltas[-1].finish_reason in ("stop", "length")
        assert deltas[-1].completion_tokens == len(expected.split())

        bad = EngineRequest(id="u2", route="no-such-model", prompt="x", max_tokens=4)
        with pytest.raises(EngineError, match="404"):
            await _run(engine, bad)
    finally:
        await engine.stop()
