"""Cancel storm: typists abandon most completions; how much engine time goes to stale work?

N simulated typists each type bursts of keystrokes (one every 80–200 ms); every keystroke
sends a streamed completion on the typist's session (X-Laneway-Session / X-Laneway-Seq) and
abandons the previous one by closing its connection. After a burst the typist pauses, and
the burst's last completion runs to the end: that one is *kept*. The sim engine (a
simulation of a GPU, with realistic costs) counts engine time per request.

Three runs: no storm (kept completions only, the baseline latency), storm with the cancel
shield, storm without it. Printed per run: share of engine time spent on stale requests,
P50/P99 of kept completions, HTTP error rate, open requests at the ingress.

    .venv/bin/python -m bench.cancel_storm [--typists 10] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from aiokafka import AIOKafkaConsumer

from bench._stack import BenchStack, StealWatch, bench_stack, machine, percentile

COSTS = {
    "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0.05",
    "LANEWAY_SIM_DECODE_MS_PER_STEP": "15",
    "LANEWAY_SIM_BATCH_SLOTS": "32",
    "LANEWAY_MAX_INFLIGHT": "256",
}
PROMPT_CHARS = 4000  # about 1k tokens of file context
MAX_TOKENS = 48


@dataclass
class RunStats:
    sent: int = 0
    abandoned: set[str] = field(default_factory=set)
    abandoned_requests: int = 0
    kept_ms: list[float] = field(default_factory=list)
    errors: int = 0
    open_max: float = 0.0
    open_end: float = 0.0


async def _completion(
    http: httpx.AsyncClient, session: str, seq: int, text: str, ids: list[str]
) -> float | None:
    """Latency of a completed stream, or None when it ended in an error."""
    started = time.perf_counter()
    body = {
        "model": "laneway-code",
        "prompt": text,
        "suffix": "\n",
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    headers = {"X-Laneway-Session": session, "X-Laneway-Seq": str(seq)}
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return None
        ids.append(response.headers["x-laneway-request-id"])
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith('data: {"error"'):
                return None
    return (time.perf_counter() - started) * 1000


async def _typist(
    base_url: str, key: str, number: int, deadline: float, storm: bool, stats: RunStats
) -> None:
    rng = random.Random(number)
    document = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(PROMPT_CHARS))
    session = f"typist-{number}-{int(time.time())}"
    seq = 0
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=8)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30, limits=limits
    ) as http:
        await asyncio.sleep(rng.uniform(0, 0.5))
        while time.monotonic() < deadline:
            burst = rng.randint(3, 8) if storm else 1
            previous: tuple[asyncio.Task[float | None], list[str]] | None = None
            for keystroke in range(burst):
                seq += 1
                document += rng.choice("abcdefgh")
                ids: list[str] = []
                stats.sent += 1
                task = asyncio.create_task(_completion(http, session, seq, document, ids))
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
                except httpx.HTTPError:
                    stats.errors += 1
                    continue
                if elapsed is None:
                    stats.errors += 1
                else:
                    stats.kept_ms.append(elapsed)
            await asyncio.sleep(rng.uniform(0.5, 1.5))


async def _abandon(task: asyncio.Task[float | None], ids: list[str], stats: RunStats) -> None:
    """The typist moved on; whatever this request answered no longer matters to anyone."""
    stats.abandoned_requests += 1
    if task.done():
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    stats.abandoned.update(ids)


async def _watch_open(base_url: str, stats: RunStats, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=5) as http:
        while not stop.is_set():
            text = (await http.get("/metrics")).text
            for line in text.splitlines():
                if line.startswith("laneway_ingress_open_requests "):
                    value = float(line.split()[1])
                    stats.open_max = max(stats.open_max, value)
                    stats.open_end = value
            await asyncio.sleep(0.5)


@dataclass
class EngineTime:
    """What the usage events of a run say about engine time (ms)."""

    total: float = 0.0
    stale: float = 0.0  # used after the news reached the worker
    on_abandoned: float = 0.0  # all of it, on requests the typists abandoned
    in_flight: float = 0.0  # used while the news travelled from the ingress to the worker
    news_ms: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)

    def add(self, event: dict[str, Any], abandoned: bool) -> None:
        self.total += event["engine_ms"]
        self.stale += event["stale_engine_ms"]
        if event["stale_engine_ms"]:
            self._count("turned stale while running")
            self.news_ms.append(event["stale_news_ms"])
            # The engine ran all along before the news arrived, so while it travelled too.
            before_news = event["engine_ms"] - event["stale_engine_ms"]
            self.in_flight += min(event["stale_news_ms"], before_news)
        if abandoned or event["status"] in ("cancelled", "superseded"):
            self.on_abandoned += event["engine_ms"]
        self._count(event["status"])

    def _count(self, status: str) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


async def _engine_time(
    stack: BenchStack, since_ms: int, abandoned: set[str], settle_s: float
) -> EngineTime:
    consumer = AIOKafkaConsumer(
        stack.topics.usage, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    seen = EngineTime()
    try:
        quiet_until = time.monotonic() + settle_s
        while time.monotonic() < quiet_until:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    if record.timestamp < since_ms:
                        continue
                    event = orjson.loads(record.value)
                    seen.add(event, event["id"] in abandoned)
                    quiet_until = time.monotonic() + settle_s
    finally:
        await consumer.stop()
    return seen


async def _run(
    stack: BenchStack, key: str, typists: int, seconds: float, storm: bool
) -> tuple[RunStats, EngineTime]:
    stats = RunStats()
    since_ms = int(time.time() * 1000)
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_open(stack.base_url, stats, stop))
    deadline = time.monotonic() + seconds
    await asyncio.gather(
        *(_typist(stack.base_url, key, i, deadline, storm, stats) for i in range(typists))
    )
    await asyncio.sleep(2)  # let the ingress notice the last disconnects
    stop.set()
    await watcher
    return stats, await _engine_time(stack, since_ms, stats.abandoned, settle_s=3.0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--typists", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()

    print(f"# cancel storm — {machine()}")
    print("# sim engine (a simulated GPU): prefill 0.05 ms/token, decode 15 ms/step, 32 slots")
    print(f"# {args.typists} typists, {args.seconds:.0f} s a run, prompts ~1k tokens", end="")
    print(f", max_tokens {MAX_TOKENS}")
    header = (
        "run",
        "requests",
        "abandoned",
        "stale eng %",
        "abandoned eng %",
        "kept",
        "P50 ms",
        "P99 ms",
        "err %",
        "open max",
        "open end",
        "steal %",
    )
    print(" ".join(f"{h:>15}" for h in header))
    for name, storm, shield in (
        ("no storm", False, True),
        ("shield on", True, True),
        ("shield off", True, False),
    ):
        worker = {
            "LANEWAY_POOL": "completion",
            "LANEWAY_SHIELD": "true" if shield else "false",
            **COSTS,
        }
        stack = BenchStack(workers=[worker])
        with bench_stack(stack):
            key = stack.api_key("typists")
            with StealWatch() as steal:
                stats, seen = asyncio.run(_run(stack, key, args.typists, args.seconds, storm))
        total = seen.total or 1.0
        share, abandoned_share = 100 * seen.stale / total, 100 * seen.on_abandoned / total
        errors = 100 * stats.errors / max(1, stats.sent - stats.abandoned_requests)
        row = (
            name,
            stats.sent,
            stats.abandoned_requests,
            f"{share:.1f}",
            f"{abandoned_share:.1f}",
            len(stats.kept_ms),
            f"{percentile(stats.kept_ms, 50):.0f}",
            f"{percentile(stats.kept_ms, 99):.0f}",
            f"{errors:.2f}",
            f"{stats.open_max:.0f}",
            f"{stats.open_end:.0f}",
            f"{steal.average:.1f}",
        )
        print(" ".join(f"{v:>15}" for v in row), flush=True)
        print(f"#   outcomes: {seen.statuses}", flush=True)
        if news := seen.news_ms:
            print(
                f"#   stale ms per request that turned stale while running: {seen.stale / len(news):.1f}"
            )
            print(
                f"#   its news took P50 {percentile(news, 50):.1f} / P99 {percentile(news, 99):.1f} ms "
                "from the ingress to the worker; with the engine time in that gap, stale eng % "
                f"would be {100 * (seen.stale + seen.in_flight) / total:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
