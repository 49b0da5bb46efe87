"""Cancel storm: typists abandon most completions; how much engine time goes to stale work?

N simulated typists each type bursts of keystrokes (one every 80–200 ms); every keystroke
sends a streamed completion on the typist's session (X-Laneway-Session / X-Laneway-Seq) and
abandons the previous one by closing its connection. After a burst the typist pauses, and
the burst's last completion runs to the end: that one is *kept*. The sim engine (a
simulation of a GPU, with realistic costs) counts engine time per request.

Three runs: no storm (kept completions only, the baseline latency), storm with the cancel
shield, storm without it. Printed per run: share of engine time spent on stale requests,
P50/P99 of kept completions, HTTP error rate, open requests at the ingress, and the load
generator's own loop lag (how much of a kept completion's measured wait is the client's).

The storm and its baseline are compared on the same stack, window by window (no storm,
storm, storm, no storm, ...: ``--rounds``), after a warm-up: a comparison across two stacks
started minutes apart would measure the broker's JIT and the shared host's speed as much as
the storm. The run without the shield needs a stack of its own.

Two scenarios, each with the three runs:

- ``storm``: the typists alone on the fleet. The harshest case: nearly all engine time is
  completions, so without the shield most of it is stale.
- ``fleet``: the same typists on a mixed fleet, the case the issue's 15–20 % baseline
  describes. Beside the completion pool, a chat pool serves a few users streaming long
  conversations and a batch pool works through a document job that keeps its slots full.
  Each pool has its own sim engine; the stale share is over the engine time of all three.

Engine time is counted from the usage events that end inside a run's window (a steady
background is counted as much at the window's start as it is left out at its end).

``--null-test`` checks the storm-against-baseline comparison itself: the storm's windows carry
no storm either, so the two runs differ by chance alone, and an interval that leaves out zero
there is a false alarm.

    .venv/bin/python -m bench.cancel_storm [--typists 10] [--seconds 30] [--rounds 4]
        [--warmup 20] [--scenario both] [--stream-interval 1] [--null-test]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import httpx
import orjson
import uvloop
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench._http import HttpPool
from bench._stack import (
    BenchStack,
    CpuWatch,
    StealWatch,
    bench_stack,
    document_lines,
    machine,
    percentile,
)
from laneway.batch import BatchClient

COSTS = {
    "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0.05",
    "LANEWAY_SIM_DECODE_MS_PER_STEP": "15",
    "LANEWAY_SIM_BATCH_SLOTS": "32",
    "LANEWAY_MAX_INFLIGHT": "256",
}
PROMPT_CHARS = 4000  # about 1k tokens of file context
_LETTERS = "abcdefghij klmnop\n"
MAX_TOKENS = 48
# The fleet's other traffic: chat users with long conversations, and a document job.
CHAT_USERS = 2
CHAT_CONTEXT_CHARS = 32_000  # about 8k tokens
CHAT_MAX_TOKENS = 128
DOCUMENT_CHARS = 8_000  # about 2k tokens a document
DOCUMENT_MAX_TOKENS = 128
# Lines the batch worker runs at once. It sizes the fleet's background so that without the
# shield the typists' stale work is 15-20 % of all engine time, the issue's baseline for
# mixed deployments (with all 32 slots busy it is about 12 %).
BATCH_LINES_AT_ONCE = 24
# Windows at or under this average steal (%) are compared on their own as well: on a shared
# host, a window the hypervisor slowed says more about the host than about the storm.
QUIET_STEAL = 1.0
# The fewest kept completions, and windows, on each side for that comparison.
QUIET_MIN = 300
QUIET_MIN_WINDOWS = 2
# The load generator's loop-lag probe sleeps this long, over and over.
LAG_TICK_S = 0.01


@dataclass(frozen=True)
class Scenario:
    name: str
    fleet: bool  # chat users and a batch job beside the typists

    def workers(self, shield: bool, stream_interval: int = 1) -> list[dict[str, str]]:
        completion = {"LANEWAY_POOL": "completion", "LANEWAY_SHIELD": str(shield).lower()}
        pools = [completion]
        if self.fleet:
            batch = {"LANEWAY_POOL": "batch", "LANEWAY_MAX_INFLIGHT": str(BATCH_LINES_AT_ONCE)}
            pools += [{"LANEWAY_POOL": "chat"}, batch]
        costs = {**COSTS, "LANEWAY_STREAM_INTERVAL": str(stream_interval)}
        return [{**costs, **pool} for pool in pools]


SCENARIOS = {"storm": Scenario("storm", fleet=False), "fleet": Scenario("fleet", fleet=True)}


@dataclass
class RunStats:
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


def _server_timing(header: str) -> dict[str, float]:
    parts = {}
    for part in header.split(", "):
        name, _, dur = part.partition(";dur=")
        if dur:
            parts[name] = float(dur)
    return parts


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
            timings.update(_server_timing(response.get("server-timing", "")))
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


async def _typist(
    stack: BenchStack, key: str, number: int, deadline: float, storm: bool, stats: RunStats
) -> None:
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


async def _chat_user(
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


def _documents(n: int) -> list[str]:
    rng = random.Random(7)
    texts = (
        f"summarise document {i}: " + "".join(rng.choice(_LETTERS) for _ in range(DOCUMENT_CHARS))
        for i in range(n)
    )
    return document_lines(texts, max_tokens=DOCUMENT_MAX_TOKENS)


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
    by_class: dict[str, float] = field(default_factory=dict)
    by_id: dict[str, float] = field(default_factory=dict)  # completions only
    # completions only: (queue_ms, total_ms) as the worker measured them from acceptance, and
    # the wall clock time the worker ended it
    times: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def add(self, event: dict[str, Any], abandoned: bool) -> None:
        self.total += event["engine_ms"]
        if event["class"] == "completion":
            self.by_id[event["id"]] = event["engine_ms"]
            self.times[event["id"]] = (event["queue_ms"], event["total_ms"], event["ts"])
        self.by_class[event["class"]] = self.by_class.get(event["class"], 0.0) + event["engine_ms"]
        self.stale += event["stale_engine_ms"]
        if event["stale_engine_ms"]:
            self._count("turned stale while running")
            self.news_ms.append(event["stale_news_ms"])
            # The engine ran all along before the news arrived, so while it travelled too.
            before_news = event["engine_ms"] - event["stale_engine_ms"]
            self.in_flight += min(event["stale_news_ms"], before_news)
        if abandoned or event["status"] in ("cancelled", "superseded"):
            self.on_abandoned += event["engine_ms"]
        if event["class"] == "completion":
            self._count(event["status"])

    def _count(self, status: str, n: int = 1) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + n

    def merge(self, other: EngineTime) -> None:
        self.total += other.total
        self.stale += other.stale
        self.on_abandoned += other.on_abandoned
        self.in_flight += other.in_flight
        self.news_ms += other.news_ms
        for status, n in other.statuses.items():
            self._count(status, n)
        for cls, ms in other.by_class.items():
            self.by_class[cls] = self.by_class.get(cls, 0.0) + ms
        self.by_id.update(other.by_id)
        self.times.update(other.times)


async def _engine_time(
    stack: BenchStack, since_ms: int, until_ms: int, abandoned: set[str]
) -> EngineTime:
    """Engine time of the usage events stamped inside [since_ms, until_ms]: everything on
    the topic up to now is read, to its end offsets."""
    # read_committed: a batch transaction that aborted (and ran again) is counted once.
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap, isolation_level="read_committed")
    await consumer.start()
    seen = EngineTime()
    try:
        partitions = [TopicPartition(stack.topics.usage, p) for p in range(stack.partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        give_up = time.monotonic() + 60
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            if time.monotonic() > give_up:
                raise TimeoutError("the usage topic could not be read to its end within 60 s")
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    if since_ms <= record.timestamp <= until_ms:
                        event = orjson.loads(record.value)
                        seen.add(event, event["id"] in abandoned)
    finally:
        await consumer.stop()
    return seen


async def _window(
    stack: BenchStack, key: str, typists: int, seconds: float, storm: bool, chat: ChatCount
) -> tuple[RunStats, EngineTime]:
    """One measured window: the typists type (a storm, or only the keystrokes they keep)."""
    stats = RunStats()
    turns, chat_errors = chat.turns, chat.errors
    since_ms = int(time.time() * 1000)
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_open(stack.base_url, stats, stop))
    lag = asyncio.create_task(_loop_lag(stats.lag, stop))
    deadline = time.monotonic() + seconds
    with CpuWatch(stack) as cpu, StealWatch() as steal:
        await asyncio.gather(
            *(_typist(stack, key, i, deadline, storm, stats) for i in range(typists))
        )
        await asyncio.sleep(2)  # let the ingress notice the last disconnects
    until_ms = int(time.time() * 1000)
    stats.cpu.append(cpu.shares)
    stats.steal.append(steal.average)
    stats.windows.append(list(stats.kept))
    stats.chat_turns, stats.chat_errors = chat.turns - turns, chat.errors - chat_errors
    stop.set()
    await asyncio.gather(watcher, lag)
    await asyncio.sleep(1)  # the worker's usage producer lingers before it sends
    return stats, await _engine_time(stack, since_ms, until_ms, stats.abandoned)


async def _loop_lag(lags: list[float], stop: asyncio.Event) -> None:
    """How late the load generator's own event loop wakes from a short sleep, in ms.

    A kept completion's latency is read on this loop, so its lag is in every measured wait:
    this tells the client's share of a storm's extra milliseconds from laneway's."""
    while not stop.is_set():
        # perf_counter: uvloop's loop.time() moves in whole milliseconds.
        due = time.perf_counter() + LAG_TICK_S
        await asyncio.sleep(LAG_TICK_S)
        lags.append((time.perf_counter() - due) * 1000)


async def _session(
    stack: BenchStack,
    key: str,
    args: argparse.Namespace,
    fleet: bool,
    runs: tuple[str, ...],
    storms: frozenset[str],
) -> dict[str, tuple[RunStats, EngineTime]]:
    """The runs of one stack, ``args.rounds`` windows each, interleaved after a warm-up."""
    chat, stop = ChatCount(), asyncio.Event()
    background: list[asyncio.Task[None]] = []
    if fleet:
        # A document job long enough to keep the batch pool busy past the last window; it
        # is still running when the stack is torn down.
        lasts = args.warmup + args.rounds * len(runs) * (args.seconds + 5) + 10
        async with BatchClient(stack.settings()) as client:
            await client.submit(_documents(int(lasts * 40) + 200), api_key=key)
        background = [
            asyncio.create_task(_chat_user(stack, key, i, stop, chat)) for i in range(CHAT_USERS)
        ]
        await asyncio.sleep(5)  # the batch slots fill and the conversations get going
    if args.warmup > 0:
        # Not measured: a fresh broker JVM compiles its hot paths in its first minutes.
        deadline = time.monotonic() + args.warmup
        await asyncio.gather(
            *(_typist(stack, key, i, deadline, True, RunStats()) for i in range(args.typists))
        )
        await asyncio.sleep(3)  # its last requests end before the first window opens
    results = {name: (RunStats(), EngineTime()) for name in runs}
    for round_ in range(args.rounds):
        # ABBA: the order turns every round, so a drift (the JIT, the host) favours neither.
        for name in runs if round_ % 2 == 0 else runs[::-1]:
            stats, seen = await _window(
                stack, key, args.typists, args.seconds, name in storms, chat
            )
            results[name][0].merge(stats)
            results[name][1].merge(seen)
    stop.set()
    await asyncio.gather(*background)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--typists", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of one window")
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="windows of each run, interleaved (default 4: with fewer, the P99's interval is "
        "too wide to tell a few milliseconds from chance)",
    )
    parser.add_argument(
        "--warmup", type=float, default=20.0, help="seconds of storm on a new stack first"
    )
    parser.add_argument(
        "--scenario",
        choices=(*SCENARIOS, "both"),
        default="both",
        help="the typists alone (storm), on a mixed fleet (fleet), or both (default)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the workers' LANEWAY_STREAM_INTERVAL: tokens a streamed chunk gathers (default 1)",
    )
    parser.add_argument(
        "--null-test",
        action="store_true",
        help="no storm in either run of the shared stack (and no run without the shield): "
        "how far the comparison strays when nothing differs",
    )
    args = parser.parse_args()
    if (
        args.typists < 1
        or args.seconds <= 0
        or args.rounds < 1
        or args.warmup < 0
        or args.stream_interval < 1
    ):
        parser.error(
            "--typists, --rounds and --stream-interval must be at least 1, --seconds positive, "
            "--warmup not negative"
        )

    print(f"# cancel storm — {machine()}")
    print("# sim engine (a simulated GPU) in each pool: prefill 0.05 ms/token, decode 15 ms/step,")
    print(
        f"# 32 slots; {args.typists} typists, prompts ~1k tokens, max_tokens {MAX_TOKENS}; "
        f"each run is {args.rounds} windows of {args.seconds:.0f} s, after {args.warmup:.0f} s "
        f"of warm-up; {'the two runs' if args.null_test else 'no storm and shield on'} "
        "alternate (ABBA) on one stack; stream interval "
        f"{args.stream_interval} token(s)"
    )
    if args.null_test:
        print("# null test: the second run is no storm as well; any difference is chance")
    if args.scenario != "storm":
        print(
            f"# fleet: + {CHAT_USERS} chat users (~{CHAT_CONTEXT_CHARS // 4000}k-token "
            f"conversations, max_tokens {CHAT_MAX_TOKENS}, streamed) + a batch job "
            f"(~{DOCUMENT_CHARS // 4000}k-token documents, max_tokens {DOCUMENT_MAX_TOKENS}, "
            f"{BATCH_LINES_AT_ONCE} at once)"
        )
    header = (
        "scenario",
        "run",
        "requests",
        "abandoned",
        "stale eng %",
        "abandoned eng %",
        "kept",
        "P50 ms",
        "P99 ms",
        "P99 wait ms",
        "err %",
        "open max",
        "open end",
        "steal %",
    )
    print(" ".join(f"{h:>15}" for h in header))
    chosen = SCENARIOS.values() if args.scenario == "both" else [SCENARIOS[args.scenario]]
    for scenario in chosen:
        # The same stack (shield on) serves the storm and its baseline, window by window,
        # so both meet the same broker, the same JIT state and the same host speed.
        plan = [(True, ("no storm", "shield on")), (False, ("shield off",))]
        if args.null_test:
            plan = [(True, ("no storm", "no storm again"))]
        storms = frozenset({"shield on", "shield off"})
        for shield, runs in plan:
            stack = BenchStack(workers=scenario.workers(shield, args.stream_interval))
            with bench_stack(stack):
                key = stack.api_key("typists")
                results = uvloop.run(_session(stack, key, args, scenario.fleet, runs, storms))
            for name in runs:
                _report(scenario, name, *results[name])
            if shield:
                _compare(results[runs[0]], results[runs[1]], f"{runs[1]} - {runs[0]}")


def _report(scenario: Scenario, name: str, stats: RunStats, seen: EngineTime) -> None:
    total = seen.total or 1.0
    share, abandoned_share = 100 * seen.stale / total, 100 * seen.on_abandoned / total
    errors = 100 * stats.errors / max(1, stats.sent - stats.abandoned_requests)
    # A kept completion's latency beyond its own engine time: what the rest of the traffic
    # made it wait, without the luck of how many tokens it happened to generate.
    kept = list(stats.kept.values())
    waits = [ms - seen.by_id[rid] for rid, ms in stats.kept.items() if rid in seen.by_id]
    row = (
        scenario.name,
        name,
        stats.sent,
        stats.abandoned_requests,
        f"{share:.1f}",
        f"{abandoned_share:.1f}",
        len(kept),
        f"{percentile(kept, 50):.0f}",
        f"{percentile(kept, 99):.0f}",
        f"{percentile(waits, 99):.0f}",
        f"{errors:.2f}",
        f"{stats.open_max:.0f}",
        f"{stats.open_end:.0f}",
        f"{sum(stats.steal) / len(stats.steal):.1f}",
    )
    print(" ".join(f"{v:>15}" for v in row), flush=True)
    windows = ", ".join(
        f"{percentile([stats.kept[rid] for rid in ids], 99):.0f} ({steal:.1f} %)"
        for ids, steal in zip(stats.windows, stats.steal, strict=True)
    )
    print(f"#   kept P99 ms (steal) by window: {windows}")
    print(f"#   completion outcomes: {seen.statuses}", flush=True)
    for cpu in stats.cpu:
        print(f"#   cpu, % of one core: {cpu}", flush=True)
    by_class = ", ".join(f"{cls} {ms / 1000:.0f}" for cls, ms in sorted(seen.by_class.items()))
    print(f"#   engine seconds by class: {by_class}", flush=True)
    if parts := _wait_parts(stats, seen):
        print(f"#   kept wait, P50/P99 ms: {parts}", flush=True)
    print(
        f"#   load generator's loop lag, P50/P99/max ms: {percentile(stats.lag, 50):.1f}/"
        f"{percentile(stats.lag, 99):.1f}/{max(stats.lag, default=0.0):.1f}",
        flush=True,
    )
    if scenario.fleet:
        print(f"#   chat turns {stats.chat_turns}, chat errors {stats.chat_errors}", flush=True)
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


def _compare(
    base: tuple[RunStats, EngineTime], storm: tuple[RunStats, EngineTime], label: str
) -> None:
    """The storm's P99 against its baseline's, with how sure the difference is.

    A P99 of a few hundred completions rests on its few largest, so two runs of the same
    load differ by tens of milliseconds by chance. A bootstrap over windows, then the
    completions within them, gives the 95 % interval of the difference: when it holds 0,
    the storm is not told apart from no storm at this sample size. The same comparison over
    the quiet windows alone (average steal at most QUIET_STEAL) follows, when both runs have
    enough of them.
    """

    def kept(stats: RunStats, seen: EngineTime, rid: str) -> float | None:
        return stats.kept[rid]

    def wait(stats: RunStats, seen: EngineTime, rid: str) -> float | None:
        return stats.kept[rid] - seen.by_id[rid] if rid in seen.by_id else None

    def windows(
        run: tuple[RunStats, EngineTime],
        value: Callable[[RunStats, EngineTime, str], float | None],
        quiet: bool,
    ) -> list[list[float]]:
        stats, seen = run
        chosen = []
        for ids, steal in zip(stats.windows, stats.steal, strict=True):
            if quiet and steal > QUIET_STEAL:
                continue
            values = [v for rid in ids if (v := value(stats, seen, rid)) is not None]
            if values:
                chosen.append(values)
        return chosen

    for quiet in (False, True):
        where = f", windows under {QUIET_STEAL:.0f} % steal" if quiet else ""
        for what, value in (("kept P99", kept), ("P99 wait", wait)):
            a, b = windows(base, value, quiet), windows(storm, value, quiet)
            n_a, n_b = sum(map(len, a)), sum(map(len, b))
            if quiet and (min(n_a, n_b) < QUIET_MIN or min(len(a), len(b)) < QUIET_MIN_WINDOWS):
                print(
                    f"#   {what}{where}: too few ({n_a} and {n_b} completions, "
                    f"{len(a)} and {len(b)} windows)"
                )
                continue
            if not a or not b:
                continue
            low, high = bootstrap_interval(a, b, lambda v: percentile(v, 99))
            diff = percentile([*chain(*b)], 99) - percentile([*chain(*a)], 99)
            verdict = "worse" if low > 0 else "better" if high < 0 else "not told apart"
            print(
                f"#   {label}, {what}{where}: {diff:+.0f} ms, 95 % interval "
                f"{low:+.0f} .. {high:+.0f} ({n_a} and {n_b} completions in {len(a)} and "
                f"{len(b)} windows): {verdict}",
                flush=True,
            )


def bootstrap_interval(
    a: list[list[float]],
    b: list[list[float]],
    statistic: Callable[[list[float]], float],
    rounds: int = 2000,
    seed: int = 1,
) -> tuple[float, float]:
    """95 % interval of ``statistic(b) - statistic(a)``, each given as its windows' values.

    Two stages: each round draws a run's windows with replacement, then the values within
    each drawn window. The completions of one window share its host's speed (its steal, the
    broker's collector), so resampling completions alone would read one window's luck as a
    difference between the runs: a null test (``--null-test``) of two identical runs came
    out "better" at -6 ms (-11 .. -0) that way. With four windows a run it is still
    approximate, and a little narrow (a run offers few distinct draws of its windows); with
    one window a run it amounts to resampling completions alone.
    """
    rng = random.Random(seed)

    def draw(windows: list[list[float]]) -> list[float]:
        picked = rng.choices(windows, k=len(windows))
        return [v for window in picked for v in rng.choices(window, k=len(window))]

    diffs = sorted(statistic(draw(b)) - statistic(draw(a)) for _ in range(rounds))
    return diffs[int(0.025 * rounds)], diffs[int(0.975 * rounds) - 1]


def _wait_parts(stats: RunStats, seen: EngineTime) -> str:
    """Where a kept completion's wait went: the client opening a connection (when none of
    its pool was free: in a storm, the previous keystroke's is still streaming), its
    request until the ingress accepted it, before its engine started (ingress, Kafka, worker
    fetch), at the worker beside the engine's own time, and after the worker's last word
    (reply to the ingress, HTTP to the client). The two parts outside the stack compare the
    client's wall clock with the worker's, on the same machine."""
    parts: dict[str, list[float]] = {
        "connect": [],
        "to ingress": [],
        "admit": [],
        "enqueue": [],
        "to worker": [],
        "worker": [],
        "back": [],
    }
    for rid in stats.kept:
        if rid not in seen.times:
            continue
        queue, total, ended_at = seen.times[rid]
        timing = stats.timing.get(rid, {})
        admit, enqueue = timing.get("admit", 0.0), timing.get("enqueue", 0.0)
        parts["connect"].append(timing.get("connect", 0.0))
        if "sent_at" in timing and "done_at" in timing:
            accepted_at = ended_at - total / 1000
            parts["to ingress"].append((accepted_at - timing["sent_at"]) * 1000)
            parts["back"].append((timing["done_at"] - ended_at) * 1000)
        parts["admit"].append(admit)
        parts["enqueue"].append(enqueue)
        parts["to worker"].append(queue - admit - enqueue)
        parts["worker"].append(total - queue - seen.by_id[rid])
    return ", ".join(
        f"{name} {percentile(v, 50):.0f}/{percentile(v, 99):.0f}" for name, v in parts.items() if v
    )


if __name__ == "__main__":
    main()
