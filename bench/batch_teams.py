"""Batch: one team far over its budget, another team's job behind it on the same partitions.

A team with budget for about 100 lines queues a job of ``--waiting`` lines; another team's job
of ``--lines`` lines comes after it on the same topic. The second job's time to complete is
compared with the same job alone, in the same run, alternated (ABAB). The waiting team's
lines park beside the lane (``workers.batch_budget``: past LANEWAY_BATCH_PARKED_BODIES, 2048,
without their bodies): they should cost the other team little more than fetching past them.

One batch worker. ``--engine sim`` (the default): the sim engine, a simulated GPU (decode
3 ms/step, 32 slots). ``--engine openai``: the worker's openai engine in front of a separate
server process (``bench.upstream_server``, 32 slots, 3 ms a token) that logs every request it
ran; the bench then counts, from that log, how many lines of each team the server ran: every
line of the other team's jobs once, and of the team over its budget no more than its budget
covers. Each "behind" round uses a team of its own, so the waiting lines of earlier rounds
stay parked (they hold no engine slot) while later rounds run.

``--drain``: instead, how fast parked lines run once their budget is raised. Per round, a
job of ``--waiting`` lines is run straight by a team with budget to spare, then the same
number by a team over its budget: its lines park (here all without their bodies,
LANEWAY_BATCH_PARKED_BODIES=0) and, once all are parked, the team's budget is raised; the
time from the raise until every line has its result is compared with the straight run, with
the lines read back per Kafka fetch. With ``--engine openai`` the server's log says how
many times each line ran.

    .venv/bin/python -m bench.batch_teams [--waiting 3000] [--lines 200] [--rounds 2] \
        [--engine sim|openai] [--drain]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

import httpx
from aiokafka.admin import AIOKafkaAdminClient
from redis import Redis

from bench._proc import machine
from bench._stack import BenchStack, bench_stack, document_lines, metric_samples
from bench._upstream import Upstream, upstream_process
from bench.upstream_server import reported_usage
from laneway.batch import BatchClient
from laneway.constants import RedisKeys
from laneway.settings import CommonSettings
from quota import QuotaPolicy, Team
from workers.answered import MAX_METADATA_CHARS

COSTS = {
    "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0",
    "LANEWAY_SIM_DECODE_MS_PER_STEP": "3",
    "LANEWAY_SIM_BATCH_SLOTS": "32",
}
# Within this, the job behind the waiting team must finish, or the round reports it did not.
_WITHIN_S = 180.0
UPSTREAM_PORT = 31950
METRICS_PORT = 31960  # the worker's, read by --drain
# The team over its budget: one member at a tenth of the default complexity.
THRIFTY = Team("thrifty", size=1, complexity=0.1)


def _lines(n: int, what: str) -> list[str]:
    return document_lines((f"summarise {what} {i} " * 5 for i in range(n)), max_tokens=16)


def _upstream_counts(
    upstream: Upstream, stack: BenchStack, args: argparse.Namespace, over: list[str]
) -> None:
    """What the server ran, by its own log: the other team's lines, each once per job; the
    over-budget teams' lines, and the tokens the server reported for them, against their
    budget and what laneway charged them."""
    keys = RedisKeys(stack.prefix)
    redis = Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + 30  # the last lines admitted settle
    while any(redis.hlen(keys.quota_reservations(n)) for n in over) and time.monotonic() < deadline:
        time.sleep(0.5)
    done = [e for e in upstream.entries() if e["outcome"] == "done"]
    rich = Counter(e["prompt"] for e in done if e["prompt"].startswith("summarise rich "))
    print(f"\nthe upstream's log ({len(done)} requests done):")
    print(
        f"  rich: {len(rich)} of {args.lines} lines ran, times each: "
        f"{dict(sorted(Counter(rich.values()).items()))} (expected {3 * args.rounds}: one "
        "per job)"
    )
    budget = QuotaPolicy.from_settings(stack.settings()).base_tokens(THRIFTY, "batch")
    print(f"  over budget ({budget:.0f} batch tokens an hour each), of {args.waiting} lines:")
    print(f"  {'team':>18} {'lines ran':>10} {'tokens, upstream':>17} {'charged':>8}")
    for name in over:
        ran = [e for e in done if e["prompt"].startswith(f"summarise {name} ")]
        reported = sum(reported_usage(e)["total_tokens"] for e in ran)
        charged = sum(
            int(redis.get(key) or 0)
            for key in redis.scan_iter(keys.quota_used(name, "batch", 0)[:-1] + "*")
        )
        print(f"  {name:>18} {len(ran):>10} {reported:>17} {charged:>8}")
    redis.close()


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


async def _rounds(
    stack: BenchStack, settings: CommonSettings, args: argparse.Namespace
) -> list[str]:
    """The rounds; the teams over their budget."""
    budget = QuotaPolicy.from_settings(settings).base_tokens(THRIFTY, "batch")
    print(f"# batch, one team over its budget — {machine()}")
    if args.engine == "sim":
        print("# sim engine (a simulated GPU): decode 3 ms/step, 32 slots; one batch worker")
    else:
        print(
            "# openai engine in front of a separate server process (bench.upstream_server): "
            "3 ms a token, 32 slots; one batch worker"
        )
    print(
        f"# a team with a batch budget of {budget:.0f} tokens an hour (~100 of these lines) "
        f"queues {args.waiting} lines; another team's "
        f"{args.lines}-line job follows it (behind) or is sent at the same time by another "
        "producer (beside: the two jobs' lines interleave on the partitions)"
    )
    print(f"{'round':>6} {'run':>28} {'job s':>8}")
    runs: dict[str, list[float]] = {"alone": [], "behind": [], "beside": []}
    over: list[str] = []

    async def over_budget(name: str) -> str:
        await asyncio.to_thread(stack.api_key, name, THRIFTY.size, complexity=THRIFTY.complexity)
        over.append(name)
        return name

    def report(n: int, run: str, took: float) -> None:
        runs[run].append(took)
        print(f"{n:>6} {run:>28} {took:>8.1f}", flush=True)

    async with BatchClient(settings) as client, BatchClient(settings) as other:
        for n in range(1, args.rounds + 1):
            report(n, "alone", await _job_time(client, "rich", args.lines))
            thrifty = await over_budget(f"thrifty-{n}")
            await other.submit(_lines(args.waiting, thrifty), team=thrifty)
            report(n, "behind", await _job_time(client, "rich", args.lines))
            thrifty = await over_budget(f"thrifty-{n}-beside")
            _, took = await asyncio.gather(
                other.submit(_lines(args.waiting, thrifty), team=thrifty),
                _job_time(client, "rich", args.lines),
            )
            report(n, "beside", took)
    for run in ("behind", "beside"):
        ratios = [b / a for a, b in zip(runs["alone"], runs[run], strict=True)]
        print(
            f"\n{run} / alone, per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
            f"spread {min(ratios):.2f}–{max(ratios):.2f}",
            end="",
        )
    print()
    await _metadata(stack)
    return over


async def _gauges(port: int) -> dict[str, float]:
    """The batch worker's metrics, by name."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
    return metric_samples(text, "laneway_batch_")


async def _drain(
    stack: BenchStack, settings: CommonSettings, args: argparse.Namespace, port: int
) -> list[str]:
    """The drain rounds (see the module); the teams that waited."""
    print(f"# batch, parked lines once their budget is raised — {machine()}")
    engine = "sim engine (a simulated GPU)" if args.engine == "sim" else "openai engine"
    print(f"# {engine}, 32 slots, 3 ms a token; one batch worker, every parked line")
    print(f"# without its body; per round {args.waiting} lines straight, then {args.waiting}")
    print("# parked and their team's budget raised (announced on Redis: the worker looks at")
    print("# once); lines/s counts from the first line read back (first s after the raise)")
    print(
        f"{'round':>6} {'run':>10} {'lines':>6} {'job s':>7} {'first s':>8} {'lines/s':>8} "
        f"{'per fetch':>10}"
    )
    ratios: list[float] = []  # a line's seconds read back over straight, from the raise
    drains: list[float] = []  # the same, from the first line read back
    waited: list[str] = []
    async with BatchClient(settings) as client:
        for n in range(1, args.rounds + 1):
            straight = await _job_time(client, f"rich-{n}", args.waiting)
            print(
                f"{n:>6} {'straight':>10} {args.waiting:>6} {straight:>7.1f} {'':>8} "
                f"{args.waiting / straight:>8.0f} {'':>10}",
                flush=True,
            )
            team = f"thrifty-{n}"
            await asyncio.to_thread(
                stack.api_key, team, THRIFTY.size, complexity=THRIFTY.complexity
            )
            waited.append(team)
            job = await client.submit(_lines(args.waiting, team), team=team)
            started = time.perf_counter()
            while (await _gauges(port)).get("laneway_batch_parked", 0) + (
                await client.status(job)
            ).done < args.waiting:
                if time.perf_counter() - started > _WITHIN_S:
                    raise SystemExit(f"round {n}: the lines of {team} did not all park in time")
                await asyncio.sleep(0.2)
            before = await client.status(job)
            fetches = (await _gauges(port)).get("laneway_batch_read_back_fetches_total", 0)
            raised = time.perf_counter()
            await asyncio.to_thread(stack.api_key, team, 10_000)
            first = None  # seconds from the raise to the first line answered
            while not (status := await client.status(job)).complete:
                if first is None and status.done > before.done:
                    first = time.perf_counter() - raised
                if time.perf_counter() - raised > _WITHIN_S:
                    raise SystemExit(f"round {n}: the parked lines of {team} did not all run")
                await asyncio.sleep(0.1)
            took = time.perf_counter() - raised
            first = took if first is None else first
            fetched = (await _gauges(port)).get("laneway_batch_read_back_fetches_total", 0)
            lines = args.waiting - before.done
            per_fetch = lines / max(fetched - fetches, 1)
            print(
                f"{n:>6} {'read back':>10} {lines:>6} {took:>7.1f} {first:>8.1f} "
                f"{lines / (took - first):>8.0f} {per_fetch:>10.1f}",
                flush=True,
            )
            ratios.append((took / lines) / (straight / args.waiting))
            drains.append((took - first) / lines / (straight / args.waiting))
    for what, values in (("from the raise", ratios), ("from the first line read back", drains)):
        print(
            f"read back / straight, seconds a line {what}, per round: "
            f"{', '.join(f'{r:.2f}' for r in values)}; "
            f"spread {min(values):.2f}–{max(values):.2f}"
        )
    return waited


def _drain_counts(upstream: Upstream, args: argparse.Namespace, teams: list[str]) -> None:
    """How many times the server ran each line of the drain rounds, by its own log."""
    done = [e for e in upstream.entries() if e["outcome"] == "done"]
    print(f"\nthe upstream's log ({len(done)} requests done), times each line ran:")
    for n, team in enumerate(teams, start=1):
        for name in (f"rich-{n}", team):
            ran = Counter(e["prompt"] for e in done if e["prompt"].startswith(f"summarise {name} "))
            print(
                f"  {name:>10}: {len(ran)} of {args.waiting} lines ran, times each: "
                f"{dict(sorted(Counter(ran.values()).items()))}"
            )


async def _metadata(stack: BenchStack) -> None:
    """How much of the commit metadata (``workers.answered``) the waiting lines take, per
    partition: past MAX_METADATA_CHARS, results above the cut would wait to be written."""
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(stack.topics.consumer_group("batch"))
    finally:
        await admin.close()
    sizes = [
        f"{tp.partition}: {len(meta.metadata or '')}"
        for tp, meta in sorted(committed.items())
        if tp.topic == stack.topics.request("batch")
    ]
    print(f"commit metadata, characters per partition of {MAX_METADATA_CHARS}: {', '.join(sizes)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--waiting", type=int, default=3000, help="lines of the team over budget")
    parser.add_argument("--lines", type=int, default=200, help="lines of the other team's job")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engine", choices=["sim", "openai"], default="sim")
    parser.add_argument(
        "--drain", action="store_true", help="parked lines once their budget is raised instead"
    )
    args = parser.parse_args()
    if args.waiting < 1 or args.lines < 1 or args.rounds < 1:
        parser.error("--waiting, --lines and --rounds must be at least 1")
    worker = {
        "LANEWAY_POOL": "batch",
        "LANEWAY_MAX_INFLIGHT": "32",
        "LANEWAY_QUOTA_OFFPEAK": "",
        **COSTS,
    }
    if args.drain:
        worker |= {"LANEWAY_BATCH_PARKED_BODIES": "0", "LANEWAY_METRICS_PORT": str(METRICS_PORT)}
    if args.engine == "openai":
        worker |= {
            "LANEWAY_ENGINE": "openai",
            "LANEWAY_UPSTREAM_URL": f"http://127.0.0.1:{UPSTREAM_PORT}/v1",
            "LANEWAY_UPSTREAM_MODEL": "up",
            "LANEWAY_UPSTREAM_SLOTS": "32",
            "LANEWAY_UPSTREAM_METRICS_URL": "",
        }
        with upstream_process(UPSTREAM_PORT, slots=32, token_ms=3) as upstream:
            _run(worker, args, upstream)
    else:
        _run(worker, args, None)


def _run(worker: dict[str, str], args: argparse.Namespace, upstream: Upstream | None) -> None:
    stack = BenchStack(workers=[worker], partitions=2)
    with bench_stack(stack):
        if args.drain:
            for n in range(1, args.rounds + 1):
                stack.api_key(f"rich-{n}")
            waited = asyncio.run(_drain(stack, stack.settings(), args, METRICS_PORT))
            if upstream is not None:
                _drain_counts(upstream, args, waited)
            return
        stack.api_key("rich")
        over = asyncio.run(_rounds(stack, stack.settings(), args))
        if upstream is not None:
            _upstream_counts(upstream, stack, args, over)


if __name__ == "__main__":
    main()
