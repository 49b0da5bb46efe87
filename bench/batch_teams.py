"""Batch: one team far over its budget, another team's job behind it on the same partitions.

A team with budget for about 60 lines queues a job of ``--waiting`` lines; another team's job
of ``--lines`` lines comes after it on the same topic. The second job's time to complete is
compared with the same job alone, in the same run, alternated (ABAB). The waiting team's
lines park beside the lane (``workers.batch_budget``: past LANEWAY_BATCH_PARKED_BODIES, 2048,
without their bodies): they should cost the other team little more than fetching past them.

Sim engine (a simulated GPU: decode 3 ms/step, 32 slots), one batch worker. Each "behind"
round uses a team of its own, so the waiting lines of earlier rounds stay parked (they hold
no engine slot) while later rounds run.

    .venv/bin/python -m bench.batch_teams [--waiting 3000] [--lines 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench._proc import machine
from bench._stack import BenchStack, bench_stack, document_lines
from laneway.batch import BatchClient
from laneway.settings import CommonSettings

COSTS = {
    "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0",
    "LANEWAY_SIM_DECODE_MS_PER_STEP": "3",
    "LANEWAY_SIM_BATCH_SLOTS": "32",
}
# Within this, the job behind the waiting team must finish, or the round reports it did not.
_WITHIN_S = 180.0


def _lines(n: int, what: str) -> list[str]:
    return document_lines((f"summarise {what} {i} " * 5 for i in range(n)), max_tokens=16)


async def _job_time(client: BatchClient, team: str, lines: int) -> float:
    """Submit ``lines`` lines for ``team``; seconds until every line has its result (inf if
    not within ``_WITHIN_S``)."""
    started = time.perf_counter()
    job = await client.submit(_lines(lines, team), team=team)
    while not (await client.status(job)).complete:
        if time.perf_counter() - started > _WITHIN_S:
            return float("inf")
        await asyncio.sleep(0.2)
    return time.perf_counter() - started


async def _rounds(stack: BenchStack, settings: CommonSettings, args: argparse.Namespace) -> None:
    print(f"# batch, one team over its budget — {machine()}")
    print("# sim engine (a simulated GPU): decode 3 ms/step, 32 slots; one batch worker")
    print(
        f"# a team with budget for ~60 lines queues {args.waiting} lines; "
        f"another team's {args.lines}-line job follows"
    )
    print(f"{'round':>6} {'run':>28} {'job s':>8}")
    alone: list[float] = []
    behind: list[float] = []
    async with BatchClient(settings) as client:
        for n in range(1, args.rounds + 1):
            took = await _job_time(client, "rich", args.lines)
            alone.append(took)
            print(f"{n:>6} {'alone':>28} {took:>8.1f}", flush=True)
            thrifty = f"thrifty-{n}"
            await asyncio.to_thread(stack.api_key, thrifty, 1, complexity=0.1)
            await client.submit(_lines(args.waiting, thrifty), team=thrifty)
            took = await _job_time(client, "rich", args.lines)
            behind.append(took)
            print(f"{n:>6} {'behind the waiting team':>28} {took:>8.1f}", flush=True)
    ratios = [b / a for a, b in zip(alone, behind, strict=True)]
    print(f"\nbehind / alone, per round: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"spread: {min(ratios):.2f}–{max(ratios):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--waiting", type=int, default=3000, help="lines of the team over budget")
    parser.add_argument("--lines", type=int, default=200, help="lines of the other team's job")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    worker = {
        "LANEWAY_POOL": "batch",
        "LANEWAY_MAX_INFLIGHT": "32",
        "LANEWAY_QUOTA_OFFPEAK": "",
        **COSTS,
    }
    stack = BenchStack(workers=[worker], partitions=2)
    with bench_stack(stack):
        stack.api_key("rich")
        asyncio.run(_rounds(stack, stack.settings(), args))


if __name__ == "__main__":
    main()
