"""Redis paused (SIGSTOP) under steady completion traffic: what does interactive traffic pay?

Completions go at a fixed rate (open loop: each leaves on time whatever the earlier ones
take) to a stack of real processes: Kafka, Redis, an ingress and a completion worker on the
simulated engine. After ``--before-s`` the Redis server is stopped with SIGSTOP (as a fork
for a snapshot, a paused VM or a partition would leave it: connections open, no answers),
and continued with SIGCONT ``--pause-s`` later. The table gives completions by the phase
they were sent in, failures, and P50/P99 end to end; then the team's quota usage in Redis
(its hourly counters) against the tokens the completions were served, once the worker has
stopped (nothing it owes is still on its way).

    .venv/bin/python -m bench.redis_pause [--rate 10] [--before-s 20] [--pause-s 10]

The test suite runs the same drill, shorter (tests/test_redis_pause.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson
import redis.asyncio as aioredis

from bench._http import HttpPool
from bench._stack import BenchStack, machine, percentile, services
from laneway.constants import RedisKeys
from laneway.devstack import stop_processes

TEAM = "pause-drill"
PHASES = ("before", "during", "after")


@dataclass(frozen=True, slots=True)
class Sample:
    sent: float  # seconds since the drill began
    phase: str
    status: int
    latency_ms: float
    tokens: int  # prompt + completion, as the response's usage says


@dataclass(frozen=True, slots=True)
class PhaseRow:
    phase: str
    sent: int
    ok: int
    failed: int
    p50_ms: float
    p99_ms: float


def sigstop(pid: int) -> Callable[[], None]:
    return lambda: os.kill(pid, signal.SIGSTOP)


def sigcont(pid: int) -> Callable[[], None]:
    return lambda: os.kill(pid, signal.SIGCONT)


async def drive(
    base_url: str,
    key: str,
    *,
    pause: Callable[[], None],
    resume: Callable[[], None],
    rate: float = 10.0,
    before_s: float = 20.0,
    pause_s: float = 10.0,
    after_s: float = 10.0,
) -> list[Sample]:
    """Completions at ``rate`` a second for the three phases; ``pause()`` after ``before_s``
    and ``resume()`` ``pause_s`` later (called whatever fails). Returns when every
    completion has its answer; each is of the phase it was sent in."""
    address = urlsplit(base_url)
    http = HttpPool(address.hostname or "127.0.0.1", address.port or 80, _auth(key))
    began = time.monotonic()
    window = [before_s, before_s + pause_s]  # when the pause began and ended, as it happened

    async def pausing() -> None:
        await asyncio.sleep(before_s)
        pause()
        window[0] = time.monotonic() - began
        try:
            await asyncio.sleep(pause_s)
        finally:
            resume()
            window[1] = time.monotonic() - began

    async def one(i: int) -> tuple[float, int, float, int]:
        sent = time.monotonic() - began
        # A prompt of its own each: no supersession, no type-through, no prefix-cache hits.
        body = {"model": "laneway-code", "prompt": f"def handler_{i}(request):", "max_tokens": 16}
        started = time.perf_counter()
        try:
            status, _, raw = await http.post("/v1/completions", body)
        except (OSError, EOFError, ValueError):
            status, raw = 0, b""
        latency_ms = (time.perf_counter() - started) * 1000
        tokens = orjson.loads(raw)["usage"]["total_tokens"] if status == 200 else 0
        return sent, status, latency_ms, tokens

    pauser = asyncio.create_task(pausing())
    requests: list[asyncio.Task[tuple[float, int, float, int]]] = []
    try:
        for i in range(int((before_s + pause_s + after_s) * rate)):
            await asyncio.sleep(max(0.0, began + i / rate - time.monotonic()))
            requests.append(asyncio.create_task(one(i)))
        done = await asyncio.gather(*requests)
        await pauser
    finally:
        pauser.cancel()  # resumes Redis if it is still paused
        for task in requests:
            task.cancel()
        await asyncio.gather(pauser, *requests, return_exceptions=True)
        await http.close()
    return [
        Sample(sent, _phase(sent, window), status, latency_ms, tokens)
        for sent, status, latency_ms, tokens in done
    ]


def _phase(sent: float, window: list[float]) -> str:
    return "before" if sent < window[0] else "during" if sent < window[1] else "after"


def phase_rows(samples: list[Sample]) -> list[PhaseRow]:
    """Completions by the phase they were sent in: sent, answered 200, failed, P50, P99."""
    rows = []
    for phase in PHASES:
        mine = [s for s in samples if s.phase == phase]
        ok = [s.latency_ms for s in mine if s.status == 200]
        rows.append(
            PhaseRow(
                phase,
                len(mine),
                len(ok),
                len(mine) - len(ok),
                percentile(ok, 50),
                percentile(ok, 99),
            )
        )
    return rows


async def used_tokens(redis_url: str, prefix: str, team: str, since: float) -> int:
    """The team's interactive usage in Redis (its hourly counters) since ``since`` (epoch s)."""
    redis = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(prefix)
    hours = range(int(since // 3600), int(time.time() // 3600) + 1)
    try:
        counts = await redis.mget([keys.quota_used(team, "interactive", h) for h in hours])
    finally:
        await redis.aclose()
    return sum(int(c) for c in counts if c is not None)


def table(rows: list[PhaseRow]) -> str:
    lines = ["| phase | sent | 200 | failed | P50 | P99 |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r.phase} | {r.sent} | {r.ok} | {r.failed} | {r.p50_ms:.0f} ms | {r.p99_ms:.0f} ms |"
        for r in rows
    ]
    return "\n".join(lines)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="completions a second")
    parser.add_argument("--before-s", type=float, default=20.0)
    parser.add_argument("--pause-s", type=float, default=10.0)
    parser.add_argument("--after-s", type=float, default=10.0)
    parser.add_argument("--decode-ms", default="10", help="sim engine: one decode step")
    args = parser.parse_args()
    # Ports of its own (other benches use 31092/31379/31800): it may run beside them.
    stack = BenchStack(kafka_port=31192, redis_port=31479, ingress_port=31900)
    with services(stack):
        try:
            ingress = {"LANEWAY_PORT": str(stack.ingress_port), "LANEWAY_PROBE_INTERVAL_S": "0"}
            stack.spawn("ingress", ingress)
            worker = {
                "LANEWAY_POOL": "completion",
                "LANEWAY_ENGINE": "sim",
                "LANEWAY_WORKER_ID": "pause-drill-0",
                "LANEWAY_SIM_DECODE_MS_PER_STEP": args.decode_ms,
            }
            stack.spawn("workers", worker, role="worker")
            # Size 1: a budget of 50,000 tokens an hour, leased 500 at a time, so the pause
            # spends the lease the ingress holds and then goes to its local limiter.
            key = stack.api_key(TEAM, size=1)
            asyncio.run(warm_up(stack.base_url, stack.api_key("pause-warm-up")))
            since = time.time()
            redis = stack.pids["redis"]
            samples = asyncio.run(
                drive(
                    stack.base_url,
                    key,
                    pause=sigstop(redis),
                    resume=sigcont(redis),
                    rate=args.rate,
                    before_s=args.before_s,
                    pause_s=args.pause_s,
                    after_s=args.after_s,
                )
            )
            # The worker stops (SIGTERM): what it owed is paid, or logged, before it exits.
            stop_processes([p for p in stack.procs if p.pid == stack.pids["worker"]])
            used = asyncio.run(used_tokens(stack.redis_url, stack.prefix, TEAM, since))
        finally:
            stop_processes(stack.procs)
    served = sum(s.tokens for s in samples)
    print(f"# Redis paused {args.pause_s:.0f} s at {args.rate:g} completions/s ({machine()})")
    print(table(phase_rows(samples)))
    print(f"quota usage in Redis {used} tokens, served {served} tokens ({used - served:+d})")


async def warm_up(base_url: str, key: str, within_s: float = 60.0) -> None:
    """Twenty completions answered 200 (of another team: the drill's usage stays the
    drill's), the first as soon as the stack serves (within ``within_s``)."""
    address = urlsplit(base_url)
    http = HttpPool(address.hostname or "127.0.0.1", address.port or 80, _auth(key))
    deadline = time.monotonic() + within_s
    try:
        answered = 0
        while answered < 20:
            body = {"model": "laneway-code", "prompt": f"def warm_{answered}():", "max_tokens": 16}
            try:
                status, _, _ = await http.post("/v1/completions", body)
            except (OSError, EOFError, ValueError):
                status = 0
            if status == 200:
                answered += 1
            elif time.monotonic() > deadline:
                raise TimeoutError(f"the stack did not serve a completion within {within_s} s")
            else:
                await asyncio.sleep(0.25)
    finally:
        await http.close()


if __name__ == "__main__":
    main()
