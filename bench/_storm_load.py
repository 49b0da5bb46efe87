"""The cancel storm's load: typists who abandon most completions, the fleet's chat users and
document job, and what the client side sees of them (latencies, open requests, loop lag)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx
import orjson

from bench._http import HttpPool, server_timing
from bench._stack import BenchStack, document_lines

PROMPT_CHARS = 4000  # about 1k tokens of file context
_LETTERS = "abcdefghij klmnop\n"
MAX_TOKENS = 48
# The fleet's other traffic: chat users with long conversations, and a document job.
CHAT_USERS = 2
CHAT_CONTEXT_CHARS = 32_000  # about 8k tokens
CHAT_MAX_TOKENS = 128
DOCUMENT_CHARS = 8_000  # about 2k tokens a document
DOCUMENT_MAX_TOKENS = 128
# The load generator's loop-lag probe sleeps this long, over and over.
LAG_TICK_S = 0.01


@dataclass
class RunStats:
    """What the clients saw of one run, window by window."""

    sent: int = 0
    abandoned: set[str] = field(default_factory=set)
    abandoned_requests: int = 0
    kept: dict[str, float] = field(default_factory=dict)  # request id: its latency (ms)
    # request id: the ingress's Server-Timing parts (admit, enqueue, worker) in ms
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: int = 0
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


async def _completion(
    http: HttpPool,
    session: str,
    seq: int,
    text: str,
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
    stack: BenchStack, key: str, number: int, deadline: float, storm: bool, stats: RunStats
) -> None:
    """Bursts of keystrokes until ``deadline``, each abandoning the one before; a burst's last
    is kept. Without ``storm`` a burst is one keystroke: only the kept ones are sent."""
    rng = random.Random(number)
    document = "".join(rng.choice(_LETTERS) for _ in range(PROMPT_CHARS))
    session = f"typist-{number}-{int(time.time())}"
    seq = 0
    http = HttpPool("127.0.0.1", stack.ingress_port, {"Authorization": f"Bearer {key}"})
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
                task = asyncio.create_task(_completion(http, session, seq, document, ids, timings))
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


async def _abandon(task: asyncio.Task[float | None], ids: list[str], stats: RunStats) -> None:
    """The typist moved on; whatever this request answered no longer matters to anyone."""
    stats.abandoned_requests += 1
    if task.done():
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    stats.abandoned.update(ids)


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
            for line in text.splitlines():
                if line.startswith("laneway_ingress_open_requests "):
                    value = float(line.split()[1])
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
