"""The cancel storm's runs on one stack: its scenarios, a measured window, and the windows of
several runs interleaved after a warm-up."""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

from bench._proc import CpuWatch, StealWatch
from bench._stack import BenchStack
from bench._storm_load import (
    CHAT_USERS,
    ChatCount,
    RunStats,
    chat_user,
    documents,
    loop_lag,
    watch_open,
)
from laneway.batch import BatchClient
from ops.drills.engine_time import EngineTime, engine_time
from ops.drills.typists import typist

COSTS = {
    "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0.05",
    "LANEWAY_SIM_DECODE_MS_PER_STEP": "15",
    "LANEWAY_SIM_BATCH_SLOTS": "32",
    "LANEWAY_MAX_INFLIGHT": "256",
}
# Lines the batch worker runs at once. It sizes the fleet's background so that without the
# shield the typists' stale work is 15-20 % of all engine time, the issue's baseline for
# mixed deployments (with all 32 slots busy it is about 12 %).
BATCH_LINES_AT_ONCE = 24


@dataclass(frozen=True)
class Scenario:
    name: str
    fleet: bool  # chat users and a batch job beside the typists

    def workers(self, shield: bool, stream_interval: int = 1) -> list[dict[str, str]]:
        """The settings of each worker process: a completion pool, and chat and batch pools
        on a fleet, each with its own sim engine."""
        completion = {"LANEWAY_POOL": "completion", "LANEWAY_SHIELD": str(shield).lower()}
        pools = [completion]
        if self.fleet:
            batch = {"LANEWAY_POOL": "batch", "LANEWAY_MAX_INFLIGHT": str(BATCH_LINES_AT_ONCE)}
            pools += [{"LANEWAY_POOL": "chat"}, batch]
        costs = {**COSTS, "LANEWAY_STREAM_INTERVAL": str(stream_interval)}
        return [{**costs, **pool} for pool in pools]


SCENARIOS = {"storm": Scenario("storm", fleet=False), "fleet": Scenario("fleet", fleet=True)}


async def _window(
    stack: BenchStack, key: str, typists: int, seconds: float, storm: bool, chat: ChatCount
) -> tuple[RunStats, EngineTime]:
    """One measured window: the typists type (a storm, or only the keystrokes they keep)."""
    stats = RunStats()
    turns, chat_errors = chat.turns, chat.errors
    since_ms = int(time.time() * 1000)
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_open(stack.base_url, stats, stop))
    lag = asyncio.create_task(loop_lag(stats.lag, stop))
    deadline = time.monotonic() + seconds
    with CpuWatch(stack) as cpu, StealWatch() as steal:
        await asyncio.gather(
            *(
                typist(
                    ("127.0.0.1", stack.ingress_port),
                    key,
                    i,
                    deadline=deadline,
                    storm=storm,
                    stats=stats,
                )
                for i in range(typists)
            )
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
    return stats, await engine_time(stack.settings(), since_ms, until_ms, stats.abandoned)


async def session(
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
            await client.submit(documents(int(lasts * 40) + 200), team="typists")
        background = [
            asyncio.create_task(chat_user(stack, key, i, stop, chat)) for i in range(CHAT_USERS)
        ]
        await asyncio.sleep(5)  # the batch slots fill and the conversations get going
    if args.warmup > 0:
        # Not measured: a fresh broker JVM compiles its hot paths in its first minutes.
        deadline = time.monotonic() + args.warmup
        await asyncio.gather(
            *(
                typist(
                    ("127.0.0.1", stack.ingress_port),
                    key,
                    i,
                    deadline=deadline,
                    storm=True,
                    stats=RunStats(),
                )
                for i in range(args.typists)
            )
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
