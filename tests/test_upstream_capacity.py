"""The openai engine's learned capacity against a separate upstream process
(``bench.upstream_server``), judged by what that process ran: first bytes that vary for
reasons of their own (a prefix-cache miss) hold no work back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tests.upstream_process import UpstreamProcess
from workers.types import EngineRequest
from workers.upstream import OpenAICompatibleEngine


async def _clients(engine: OpenAICompatibleEngine, clients: int, requests: int) -> None:
    """``clients`` each sending ``requests`` one after another, each once the engine has
    room (as the dispatcher does); every third request (by client and turn) is cold."""
    room = asyncio.Condition()

    def woken() -> None:
        async def notify() -> None:
            async with room:
                room.notify_all()

        asyncio.get_running_loop().create_task(notify())

    engine.watch_capacity(woken)

    async def client(c: int) -> None:
        for k in range(requests):
            async with room:
                await room.wait_for(lambda: engine.learned.in_flight < engine.capacity())
            prompt = f"cold {c}-{k}" if (c + k) % 3 == 0 else f"warm {c}-{k}"
            request = EngineRequest(id=f"r{c}-{k}", route="up", prompt=prompt, max_tokens=4)
            async for _ in engine.generate(request):
                pass

    await asyncio.gather(*(client(c) for c in range(clients)))


async def test_first_bytes_slow_for_reasons_of_their_own_hold_no_work_back(
    upstreams: Callable[..., Any],
) -> None:
    # Room for every client upstream; a cold prompt's first byte takes 400 ms, a warm one's
    # 20 ms: late first bytes, and never a queue.
    upstream: UpstreamProcess = await upstreams(
        slots=16, token_ms=5, prefill_ms=20, cold_prefill_ms=400
    )
    engine = OpenAICompatibleEngine(upstream.url, model="up")
    await engine.start()
    try:
        await asyncio.wait_for(_clients(engine, clients=8, requests=9), 60)
    finally:
        await engine.stop()
    assert len(upstream.entries()) == 72
    # The eight clients' requests went out together: the limit was never cut below them.
    assert engine.learned.stalls == 0
    assert engine.learned.limit >= 8
