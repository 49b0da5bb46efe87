"""The cancel storm's load: typists who abandon most completions, the fleet's chat users and
document job, and what the client side sees of them (latencies, open requests, loop lag)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx
import orjson

from bench._stack import BenchStack, document_lines, metric_samples
from ops.drills.http_pool import HttpPool
from ops.drills.typists import LETTERS as _LETTERS
from ops.drills.typists import TypingStats

# The fleet's other traffic: chat users with long conversations, and a document job.
CHAT_USERS = 2
CHAT_CONTEXT_CHARS = 32_000  # about 8k tokens
CHAT_MAX_TOKENS = 128
DOCUMENT_CHARS = 8_000  # about 2k tokens a document
DOCUMENT_MAX_TOKENS = 128
# The load generator's loop-lag probe sleeps this long, over and over.
LAG_TICK_S = 0.01


@dataclass
class RunStats(TypingStats):
    """What the clients saw of one run, window by window: the typists' side and the rest."""

    open_max: float = 0.0
    open_end: float = 0.0
    chat_turns: int = 0
    chat_errors: int = 0
    cpu: list[str] = field(default_factory=list)  # per window: share of a core per process
    steal: list[float] = field(default_factory=list)  # per window, %
    windows: list[list[str]] = field(default_factory=list)  # per window: its kept ids
    lag: list[float] = field(default_factory=list)  # the load generator's loop lag, ms

    def merge(self, other: RunStats) -> None:
        self.sent += other.sent
        self.abandoned |= other.abandoned
        self.abandoned_requests += other.abandoned_requests
        self.kept.update(other.kept)
        self.timing.update(other.timing)
        self.errors += other.errors
        self.open_max = max(self.open_max, other.open_max)
        self.open_end = other.open_end
        self.chat_turns += other.chat_turns
        self.chat_errors += other.chat_errors
        self.cpu += other.cpu
        self.steal += other.steal
        self.windows += other.windows
        self.lag += other.lag


@dataclass
class ChatCount:
    """Turns of the fleet's chat users, for the whole life of a stack."""

    turns: int = 0
    errors: int = 0


async def chat_user(
    stack: BenchStack, key: str, number: int, stop: asyncio.Event, count: ChatCount
) -> None:
    """Fleet background: a conversation that grows turn by turn, each reply streamed."""
    rng = random.Random(1000 + number)
    context = "".join(rng.choice(_LETTERS) for _ in range(CHAT_CONTEXT_CHARS))
    messages = [{"role": "user", "content": context}]
    http = HttpPool("127.0.0.1", stack.ingress_port, {"Authorization": f"Bearer {key}"})
    try:
        await asyncio.sleep(rng.uniform(0, 1))
        while not stop.is_set():
            body = {
                "model": "laneway-chat",
                "messages": messages,
                "max_tokens": CHAT_MAX_TOKENS,
                "stream": True,
            }
            answer: list[str] = []
            failed = False
            try:
                async with http.stream("/v1/chat/completions", body) as (status, _, lines):
                    failed = status != 200
                    async for line in lines:
                        if failed or line.startswith(b'data: {"error"'):
                            failed = True
                        elif line.startswith(b"data: {"):
                            choices = orjson.loads(line[6:])["choices"]
                            answer += [c["delta"].get("content") or "" for c in choices]
            except (OSError, ValueError, asyncio.IncompleteReadError):
                failed = True
            count.turns += 1
            if failed:
                count.errors += 1
            else:
                messages += [
                    {"role": "assistant", "content": "".join(answer)},
                    {"role": "user", "content": f"and what about part {len(messages)}?"},
                ]
            await asyncio.sleep(rng.uniform(1, 3))
    finally:
        await http.close()


def documents(n: int) -> list[str]:
    """The fleet's document job: ``n`` summaries of ~2k-token documents, as JSONL lines."""
    rng = random.Random(7)
    texts = (
        f"summarise document {i}: " + "".join(rng.choice(_LETTERS) for _ in range(DOCUMENT_CHARS))
        for i in range(n)
    )
    return document_lines(texts, max_tokens=DOCUMENT_MAX_TOKENS)


async def watch_open(base_url: str, stats: RunStats, stop: asyncio.Event) -> None:
    """The ingress's open requests, every half second until ``stop``: the peak and the last."""
    async with httpx.AsyncClient(base_url=base_url, timeout=5) as http:
        while not stop.is_set():
            text = (await http.get("/metrics")).text
            value = metric_samples(text, "laneway_ingress_open_requests ").get(
                "laneway_ingress_open_requests"
            )
            if value is not None:
                stats.open_max = max(stats.open_max, value)
                stats.open_end = value
            await asyncio.sleep(0.5)


async def loop_lag(lags: list[float], stop: asyncio.Event) -> None:
    """How late the load generator's own event loop wakes from a short sleep, in ms.

    A kept completion's latency is read on this loop, so its lag is in every measured wait:
    this tells the client's share of a storm's extra milliseconds from laneway's."""
    while not stop.is_set():
        # perf_counter: uvloop's loop.time() moves in whole milliseconds.
        due = time.perf_counter() + LAG_TICK_S
        await asyncio.sleep(LAG_TICK_S)
        lags.append((time.perf_counter() - due) * 1000)
