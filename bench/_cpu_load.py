"""The load of the CPU bench: completions (max_tokens 16) sent to an OpenAI-compatible port,
open loop at a fixed rate for the CPU per completion, or closed loop for the rate it serves."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from bench._open_loop import open_loop
from ops.drills.http_pool import HttpPool

MAX_TOKENS = 16


async def drive(
    port: int, headers: dict[str, str], model: str, rate: float, seconds: float, stream: bool
) -> tuple[int, int, Counter[str]]:
    """Open-loop load: completion i goes at start + i/rate; returns (sent, answered 200, the
    other outcomes: status codes and exceptions, counted)."""
    http = HttpPool("127.0.0.1", port, headers)
    ok = 0
    failed: Counter[str] = Counter()

    async def one(i: int) -> None:
        nonlocal ok
        body = {
            "model": model,
            "prompt": f"def f{i}(x):\n    return",
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        }
        try:
            if stream:
                async with http.stream("/v1/completions", body) as (status, _, lines):
                    async for _ in lines:
                        pass
            else:
                status, _, _ = await http.post("/v1/completions", body)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            failed[type(exc).__name__] += 1
            return
        if status == 200:
            ok += 1
        else:
            failed[str(status)] += 1

    total = int(rate * seconds)
    await asyncio.gather(*[asyncio.create_task(one(i)) async for i in open_loop(rate, total)])
    await http.close()
    return total, ok, failed


async def saturate(
    port: int, headers: dict[str, str], model: str, concurrency: int, seconds: float
) -> float:
    """Closed loop: ``concurrency`` clients back to back; completions answered per second."""
    http = HttpPool("127.0.0.1", port, headers, size=concurrency)
    done = 0
    until = time.monotonic() + seconds

    async def client(n: int) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < until:
            body = {"model": model, "prompt": f"c{n} {i}", "max_tokens": MAX_TOKENS}
            try:
                status, _, _ = await http.post("/v1/completions", body)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                continue
            done += status == 200
            i += 1

    started = time.monotonic()
    await asyncio.gather(*(client(n) for n in range(concurrency)))
    await http.close()
    return done / (time.monotonic() - started)
