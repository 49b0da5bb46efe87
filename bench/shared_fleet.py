"""One shared fleet: completions beside a batch job on the same upstream, judged by its log.

Every pool (completion, chat, batch) of one laneway stack points at one upstream process
(``bench.upstream_server``: ``--slots`` decode slots, ``--token-ms`` a token, cancel on
disconnect, a log of what it ran), declared as one shared engine (``LANEWAY_ENGINE_ID``,
``LANEWAY_UPSTREAM_SLOTS``). Each round runs, in order:

1. ``idle``: completions only (``--rate``/s, streamed, max_tokens 16);
2. ``batch``: the same completions while a batch job (chat lines, max_tokens 64) runs;
3. ``batch+chat``: the same, with ``--chats`` users streaming chats back to back;
4. ``quiet``: the batch job alone, once the interactive peak has left the reserve;
5. ``alone``: batch lines sent straight to the upstream by as many clients as it has slots,
   with no laneway: what batch alone gets from this server.

Printed per phase: completion time to first token P50/P99 (client side), batch lines per
second (lines the upstream finished in the window, from its log), batch preemptions. Targets:
completion TTFT P99 during batch ≤ 1.2× idle; batch lines/s with interactive quiet ≥ 80 % of
alone. ``--share off`` runs the same without ``LANEWAY_ENGINE_ID`` (pools unaware of each
other), for comparison.

    .venv/bin/python -m bench.shared_fleet [--seconds 20] [--rounds 2] [--rate 4] [--chats 2]
        [--slots 8] [--token-ms 15] [--share on|off]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvloop

from bench._proc import machine
from bench._stack import BenchStack, bench_stack, scrape
from bench._stats import percentile
from bench._upstream import Upstream, drain, upstream_process
from bench.upstream_storm import usage_events
from laneway.batch import BatchClient
from ops.drills.http_pool import HttpPool

UPSTREAM_PORT = 31890
BATCH_METRICS_PORT = 31892
COMPLETION_TOKENS = 16
BATCH_TOKENS = 64
CHAT_TOKENS = 64
PEAK_WINDOW_S = 10.0


@dataclass
class Phase:
    name: str
    started: float = 0.0
    ended: float = 0.0
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    batch_lines: int = 0
    preemptions: float = 0.0

    @property
    def lines_per_s(self) -> float:
        return self.batch_lines / max(1e-9, self.ended - self.started)


async def _completion(http: HttpPool, phase: Phase, n: int) -> None:
    body = {
        "model": "laneway-code",
        "prompt": f"completion {n}",
        "max_tokens": COMPLETION_TOKENS,
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    try:
        async with http.stream("/v1/completions", body) as (status, _, lines):
            async for line in lines:
                if first is None and line.startswith(b"data: {") and b'"text":"' in line:
                    first = (time.perf_counter() - started) * 1000
            if status != 200 or first is None:
                phase.errors += 1
                return
    except (OSError, ValueError, asyncio.IncompleteReadError):
        phase.errors += 1
        return
    phase.ttft.append(first)


async def _completions(http: HttpPool, phase: Phase, rate: float, until: float) -> None:
    rng = random.Random(int(phase.started))
    tasks = []
    n = 0
    while time.monotonic() < until:
        tasks.append(asyncio.create_task(_completion(http, phase, n)))
        n += 1
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


async def _chat_user(http: HttpPool, number: int, until: float) -> None:
    body = {
        "model": "laneway-chat",
        "messages": [{"role": "user", "content": f"chat {number}"}],
        "max_tokens": CHAT_TOKENS,
        "stream": True,
    }
    while time.monotonic() < until:
        async with http.stream("/v1/chat/completions", body) as (_, _, lines):
            async for _ in lines:
                pass
        await asyncio.sleep(0.2)


async def _alone(upstream: Upstream, slots: int, until: float) -> None:
    """Batch-shaped chat requests straight to the upstream, one client per slot."""
    http = HttpPool("127.0.0.1", upstream.port, {})

    async def client(number: int) -> None:
        i = 0
        while time.monotonic() < until:
            body = {
                "model": "up",
                "messages": [{"role": "user", "content": f"alone-{number}-{i}"}],
                "max_tokens": BATCH_TOKENS,
            }
            await http.post("/v1/chat/completions", body)
            i += 1

    try:
        await asyncio.gather(*(client(n) for n in range(slots)))
    finally:
        await http.close()


def _batch_done(upstream: Upstream, phase: Phase, prefix: str) -> int:
    return sum(
        1
        for e in upstream.entries()
        if e["prompt"].startswith(prefix)
        and e["outcome"] == "done"
        and phase.started <= e["end"] <= phase.ended
    )


def _preemptions() -> float:
    return sum(scrape(BATCH_METRICS_PORT, "laneway_fleet_preemptions_total{").values())


def _job_lines(round_: int, count: int) -> list[str]:
    return [
        orjson.dumps(
            {
                "custom_id": f"r{round_}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "laneway-chat",
                    "messages": [{"role": "user", "content": f"doc-r{round_}-{i}"}],
                    "max_tokens": BATCH_TOKENS,
                },
            }
        ).decode()
        for i in range(count)
    ]


async def _round(
    stack: BenchStack, upstream: Upstream, key: str, args: argparse.Namespace, round_: int
) -> list[Phase]:
    http = HttpPool("127.0.0.1", stack.ingress_port, {"Authorization": f"Bearer {key}"})
    phases: list[Phase] = []

    async def window(name: str, *loads: str) -> Phase:
        phase = Phase(name, started=time.time())
        until = time.monotonic() + args.seconds
        before = _preemptions()
        work = []
        if "completions" in loads:
            work.append(_completions(http, phase, args.rate, until))
        if "chats" in loads:
            work += [_chat_user(http, n, until) for n in range(args.chats)]
        if "alone" in loads:
            work.append(_alone(upstream, args.slots, until))
        if not work:
            work.append(asyncio.sleep(args.seconds))
        await asyncio.gather(*work)
        phase.ended = time.time()
        prefix = "alone-" if "alone" in loads else f"doc-r{round_}-"
        phase.batch_lines = _batch_done(upstream, phase, prefix)
        phase.preemptions = _preemptions() - before
        print(
            f"# round {round_ + 1} {name}: {len(phase.ttft)} completions, "
            f"{phase.lines_per_s:.2f} batch lines/s",
            flush=True,
        )
        phases.append(phase)
        return phase

    try:
        await window("idle", "completions")
        # Enough lines to outlast the three windows that need the job running.
        lines = int(args.slots / (BATCH_TOKENS * args.token_ms / 1000) * (3 * args.seconds + 30))
        async with BatchClient(stack.settings()) as client:
            job = await client.submit(_job_lines(round_, lines), team="fleet")
            await asyncio.sleep(3)  # the job reaches the upstream
            await window("batch", "completions")
            await window("batch+chat", "completions", "chats")
            await asyncio.sleep(PEAK_WINDOW_S)  # the interactive peak leaves the reserve
            await window("quiet")
            while (status := await client.status(job)).done < status.lines:
                await asyncio.sleep(1)
        await drain(upstream.port)
        await window("alone", "alone")
        await drain(upstream.port)
    finally:
        await http.close()
    return phases


def report(phases: list[Phase]) -> None:
    print(
        "| phase | completions | TTFT P50 ms | TTFT P99 ms | errors | batch lines/s | "
        "preemptions | per round: TTFT P99 ms, lines/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    names = list(dict.fromkeys(p.name for p in phases))
    summary: dict[str, tuple[float, float]] = {}
    for name in names:
        mine = [p for p in phases if p.name == name]
        ttft = [t for p in mine for t in p.ttft]
        lines = sum(p.batch_lines for p in mine)
        seconds = sum(p.ended - p.started for p in mine)
        p50 = percentile(ttft, 50) if ttft else float("nan")
        p99 = percentile(ttft, 99) if ttft else float("nan")
        summary[name] = (p99, lines / seconds)
        spread = "; ".join(
            f"{percentile(p.ttft, 99):.0f}, {p.lines_per_s:.2f}"
            if p.ttft
            else f"-, {p.lines_per_s:.2f}"
            for p in mine
        )
        print(
            f"| {name} | {len(ttft)} | {p50:.0f} | {p99:.0f} | {sum(p.errors for p in mine)} | "
            f"{lines / seconds:.2f} | {sum(p.preemptions for p in mine):.0f} | {spread} |"
        )
    print()
    idle_p99 = summary["idle"][0]
    for name in ("batch", "batch+chat"):
        ratio = summary[name][0] / idle_p99
        verdict = "met" if ratio <= 1.2 else "MISSED"
        print(f"completion TTFT P99 {name} / idle: {ratio:.2f} ({verdict}, target ≤ 1.2)")
    share = summary["quiet"][1] / summary["alone"][1]
    verdict = "met" if share >= 0.8 else "MISSED"
    print(f"batch lines/s, interactive quiet / alone: {share:.2f} ({verdict}, target ≥ 0.8)")


def waits(phases: list[Phase], events: list[dict[str, Any]]) -> None:
    """Where a completion's wait for its first token went, from its usage event: laneway's
    queues (Kafka and the worker's dispatch queue: ``queue_ms``) or after dispatch."""
    print()
    print("| phase | queue_ms P50 / P99 | ttft_ms - queue_ms P50 / P99 |")
    print("|---|---|---|")
    for name in dict.fromkeys(p.name for p in phases):
        spans = [(p.started, p.ended) for p in phases if p.name == name]
        mine = [
            e
            for e in events
            if e["class"] == "completion"
            and e.get("ttft_ms") is not None
            and any(a <= e["ts"] <= b for a, b in spans)
        ]
        if not mine:
            continue
        queued = [e["queue_ms"] for e in mine]
        after = [e["ttft_ms"] - e["queue_ms"] for e in mine]
        print(
            f"| {name} | {percentile(queued, 50):.1f} / {percentile(queued, 99):.1f} | "
            f"{percentile(after, 50):.1f} / {percentile(after, 99):.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.shared_fleet", description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of a window")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=4.0, help="completions per second")
    parser.add_argument("--chats", type=int, default=2, help="chat users in batch+chat")
    parser.add_argument("--slots", type=int, default=8, help="the upstream's decode slots")
    parser.add_argument("--token-ms", type=float, default=15.0)
    parser.add_argument("--share", choices=["on", "off"], default="on")
    args = parser.parse_args()

    engine = {
        "LANEWAY_ENGINE": "openai",
        "LANEWAY_UPSTREAM_URL": f"http://127.0.0.1:{UPSTREAM_PORT}/v1",
        "LANEWAY_UPSTREAM_MODEL": "up",
        "LANEWAY_UPSTREAM_SLOTS": str(args.slots),
        "LANEWAY_UPSTREAM_METRICS_URL": "",
        "LANEWAY_FLEET_PEAK_WINDOW_S": str(PEAK_WINDOW_S),
        "LANEWAY_MAX_INFLIGHT": "128",
    }
    if args.share == "on":
        engine["LANEWAY_ENGINE_ID"] = "gpu-fleet"
    stack = BenchStack(
        workers=[
            {"LANEWAY_POOL": "completion", **engine},
            {"LANEWAY_POOL": "chat", **engine},
            {"LANEWAY_POOL": "batch", "LANEWAY_METRICS_PORT": str(BATCH_METRICS_PORT), **engine},
        ]
    )
    print(f"# {machine()}")
    print(
        f"# upstream {args.slots} slots, {args.token_ms:g} ms/token; {args.rate:g} completions/s "
        f"(max_tokens {COMPLETION_TOKENS}), {args.chats} chat users, batch lines of "
        f"{BATCH_TOKENS} tokens; {args.seconds:.0f} s windows, {args.rounds} rounds; "
        f"sharing {args.share}"
    )
    with (
        upstream_process(UPSTREAM_PORT, slots=args.slots, token_ms=args.token_ms) as upstream,
        bench_stack(stack),
    ):
        stack.pids["upstream"] = upstream.pid
        key = stack.api_key("fleet")

        async def rounds() -> list[Phase]:
            # A warm-up window, not counted: the broker, the connections and the workers'
            # first requests are slow on a fresh stack.
            warm = HttpPool("127.0.0.1", stack.ingress_port, {"Authorization": f"Bearer {key}"})
            await _completions(warm, Phase("warm-up"), args.rate, time.monotonic() + 10)
            await warm.close()
            phases: list[Phase] = []
            for round_ in range(args.rounds):
                phases += await _round(stack, upstream, key, args, round_)
            return phases

        phases = uvloop.run(rounds())
        events = uvloop.run(usage_events(stack))
    report(phases)
    waits(phases, events)


if __name__ == "__main__":
    main()
