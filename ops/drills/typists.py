"""Typists for a typing storm: bursts of keystrokes, each a streamed completion on the typist's
session that abandons the previous one by closing its connection, as an IDE plugin does
(``bench.cancel_storm`` and ``laneway drill storm`` both type with it).

After a burst the typist pauses, and the burst's last completion runs to its end: that one
is *kept*. Without a storm a burst is one keystroke, so only the kept ones are sent.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from ops.drills.http_pool import HttpPool, server_timing

__all__ = ["LETTERS", "MAX_TOKENS", "PROMPT_CHARS", "TypingStats", "typist"]

PROMPT_CHARS = 4000  # about 1k tokens of file context
MAX_TOKENS = 48
LETTERS = "abcdefghij klmnop\n"


@dataclass
class TypingStats:
    """What the typists' client side saw."""

    sent: int = 0
    abandoned: set[str] = field(default_factory=set)  # ids of the ones abandoned while open
    abandoned_requests: int = 0
    kept: dict[str, float] = field(default_factory=dict)  # request id: its latency (ms)
    # request id: the ingress's Server-Timing parts (admit, enqueue, worker) in ms, and the
    # wall clock times it was sent and its stream ended (sent_at, done_at)
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: int = 0


async def _completion(
    http: HttpPool,
    session: str,
    seq: int,
    text: str,
    *,
    ids: list[str],
    timings: dict[str, float],
) -> float | None:
    """Latency of a completed stream, or None when it ended in an error. ``timings`` gets
    the ingress's Server-Timing parts, the client's connect time, and the wall clock times
    the request was sent and its stream ended (for the parts outside the stack)."""
    started, started_at = time.perf_counter(), time.time()
    body = {
        "model": "laneway-code",
        "prompt": text,
        "suffix": "\n",
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    headers = {"X-Laneway-Session": session, "X-Laneway-Seq": str(seq)}
    elapsed: float | None = None
    failed = False
    dials: list[float] = []
    async with http.stream("/v1/completions", body, headers, dials) as (status, response, lines):
        failed = status != 200
        if not failed:
            ids.append(response["x-laneway-request-id"])
            timings.update(server_timing(response.get("server-timing", "")))
            timings["connect"] = sum(dials)
            timings["sent_at"] = started_at + timings["connect"] / 1000
        async for line in lines:
            # Read to the end of the body, so the connection can serve the next keystroke.
            if line.startswith(b'data: {"error"'):
                failed = True
            elif line == b"data: [DONE]":
                elapsed = (time.perf_counter() - started) * 1000
                timings["done_at"] = time.time()
    return None if failed else elapsed


async def typist(
    address: tuple[str, int],
    key: str,
    number: int,
    *,
    deadline: float,
    storm: bool,
    stats: TypingStats,
) -> None:
    """Bursts of keystrokes to the ingress at ``address`` until ``deadline`` (monotonic),
    each abandoning the one before; a burst's last is kept. Without ``storm`` a burst is one
    keystroke."""
    rng = random.Random(number)
    document = "".join(rng.choice(LETTERS) for _ in range(PROMPT_CHARS))
    session = f"typist-{number}-{int(time.time())}"
    seq = 0
    http = HttpPool(*address, {"Authorization": f"Bearer {key}"})
    try:
        await asyncio.sleep(rng.uniform(0, 0.5))
        while time.monotonic() < deadline:
            burst = rng.randint(3, 8) if storm else 1
            previous: tuple[asyncio.Task[float | None], list[str]] | None = None
            for keystroke in range(burst):
                seq += 1
                document += rng.choice("abcdefgh")
                ids: list[str] = []
                timings: dict[str, float] = {}
                stats.sent += 1
                task = asyncio.create_task(
                    _completion(http, session, seq, document, ids=ids, timings=timings)
                )
                if previous is not None:
                    # Like an IDE plugin: fire the new keystroke, then drop the old request
                    # by closing its connection.
                    await _abandon(*previous, stats)
                if keystroke < burst - 1:
                    previous = (task, ids)
                    await asyncio.sleep(rng.uniform(0.08, 0.2))
                    continue
                try:
                    elapsed = await task
                except (OSError, ValueError, asyncio.IncompleteReadError):
                    stats.errors += 1
                    continue
                if elapsed is None:
                    stats.errors += 1
                else:
                    stats.kept.update((rid, elapsed) for rid in ids)
                    stats.timing.update((rid, timings) for rid in ids)
            await asyncio.sleep(rng.uniform(0.5, 1.5))
    finally:
        await http.close()


async def _abandon(task: asyncio.Task[float | None], ids: list[str], stats: TypingStats) -> None:
    """The typist moved on; whatever this request answered no longer matters to anyone."""
    stats.abandoned_requests += 1
    if task.done():
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    stats.abandoned.update(ids)
