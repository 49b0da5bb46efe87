"""Redis paused (SIGSTOP) under steady completion traffic: what does interactive traffic pay?

Completions go at a fixed rate (open loop: each leaves on time whatever the earlier ones
take) to a stack of real processes: Kafka, Redis, an ingress and a completion worker on the
simulated engine, both on the default Redis timeouts. Each round is ``--quiet-s`` with Redis
running, then ``--pause-s`` with the Redis server stopped by SIGSTOP (as a fork for a
snapshot, a paused VM or a partition leaves it: connections open, no answers), then SIGCONT;
``--after-s`` of traffic follow the last round. Quiet and paused windows alternate in the
same run, so each pause is compared with the quiet window just before it.

The table gives the completions by the window they were sent in: sent, answered 200, failed,
P50 and P99 end to end, the P99 against the quiet window before (target: under 2x), and the
machine's steal in the window. Then the team's quota usage in Redis (its hourly counters)
against the tokens the completions were served, once the worker has stopped (nothing it owes
is still on its way): equal, when no charge was lost and none counted twice.

    .venv/bin/python -m bench.redis_pause [--rate 10] [--rounds 2] [--quiet-s 20] [--pause-s 10]

tests/test_redis_pause.py runs the same drill, one short round, and asserts what does not
depend on the machine's speed (no failure, usage equal to what was served).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson
import redis.asyncio as aioredis

from bench._open_loop import open_loop
from bench._proc import cpu_times, machine
from bench._stack import BenchStack, services
from bench._stats import percentile, steal_percent
from laneway.constants import RedisKeys
from ops.devstack import stop_processes
from ops.drills.http_pool import HttpPool

TEAM = "pause-drill"


@dataclass(frozen=True, slots=True)
class Sample:
    sent: float  # seconds since the drill began
    window: int  # index into Drill.windows
    status: int  # 0: no HTTP answer
    latency_ms: float
    tokens: int  # prompt + completion, as the response's usage says
    error: str = ""  # what a failed one was answered (or why it had no answer)


@dataclass(frozen=True, slots=True)
class Window:
    name: str  # "quiet 1", "paused 1", ..., "after"
    paused: bool
    start: float  # seconds since the drill began, as it happened
    steal: float  # % of the machine's CPU time taken by the hypervisor meanwhile


@dataclass(frozen=True, slots=True)
class WindowRow:
    name: str
    paused: bool
    sent: int
    ok: int
    failed: int
    p50_ms: float
    p99_ms: float
    ratio: float  # P99 against the quiet window before (paused windows; NaN otherwise)
    steal: float
    failures: tuple[str, ...] = ()  # each failed one's status and answer


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
    rounds: int = 1,
    quiet_s: float = 20.0,
    pause_s: float = 10.0,
    after_s: float = 10.0,
) -> tuple[list[Window], list[Sample]]:
    """Completions at ``rate`` a second through ``rounds`` of (quiet, paused) windows and the
    window after; ``pause()`` opens a paused window and ``resume()`` closes it (called
    whatever fails). Returns once every completion has its answer; each belongs to the
    window it was sent in."""
    address = urlsplit(base_url)
    http = HttpPool(address.hostname or "127.0.0.1", address.port or 80, _auth(key))
    began = time.monotonic()
    # (name, paused, start as it happened, cpu_times() at the start)
    marks: list[tuple[str, bool, float, list[int]]] = []

    def mark(name: str, paused: bool) -> None:
        marks.append((name, paused, time.monotonic() - began, cpu_times()))

    async def pausing() -> None:
        for r in range(1, rounds + 1):
            mark(f"quiet {r}", False)
            await asyncio.sleep(
                max(0.0, began + (r - 1) * (quiet_s + pause_s) + quiet_s - time.monotonic())
            )
            pause()
            mark(f"paused {r}", True)
            try:
                await asyncio.sleep(max(0.0, began + r * (quiet_s + pause_s) - time.monotonic()))
            finally:
                resume()
        mark("after", False)

    async def one(i: int) -> tuple[float, int, float, int, str]:
        sent = time.monotonic() - began
        # A prompt of its own each: no supersession, no type-through, no prefix-cache hits.
        body = {"model": "laneway-code", "prompt": f"def handler_{i}(request):", "max_tokens": 16}
        started = time.perf_counter()
        try:
            status, _, raw = await http.post("/v1/completions", body)
        except (OSError, EOFError, ValueError) as exc:
            status, raw = 0, repr(exc).encode()
        latency_ms = (time.perf_counter() - started) * 1000
        tokens = orjson.loads(raw)["usage"]["total_tokens"] if status == 200 else 0
        error = "" if status == 200 else f"{status} after {latency_ms:.0f} ms: {raw[:160]!r}"
        return sent, status, latency_ms, tokens, error

    pauser = asyncio.create_task(pausing())
    requests: list[asyncio.Task[tuple[float, int, float, int, str]]] = []
    total = int((rounds * (quiet_s + pause_s) + after_s) * rate)
    try:
        async for i in open_loop(rate, total):
            requests.append(asyncio.create_task(one(i)))
        done = await asyncio.gather(*requests)
        await pauser
    finally:
        pauser.cancel()  # resumes Redis if it is still paused
        for task in requests:
            task.cancel()
        await asyncio.gather(pauser, *requests, return_exceptions=True)
        await http.close()
    ends = [*(m[3] for m in marks[1:]), cpu_times()]
    windows = [
        Window(name, paused, start, steal_percent(first, end))
        for (name, paused, start, first), end in zip(marks, ends, strict=True)
    ]
    starts = [w.start for w in windows]
    samples = [
        Sample(sent, sum(1 for s in starts[1:] if s <= sent), status, latency_ms, tokens, error)
        for sent, status, latency_ms, tokens, error in done
    ]
    return windows, samples


def window_rows(windows: list[Window], samples: list[Sample]) -> list[WindowRow]:
    """Completions by the window they were sent in."""
    rows: list[WindowRow] = []
    for index, window in enumerate(windows):
        mine = [s for s in samples if s.window == index]
        ok = [s.latency_ms for s in mine if s.status == 200]
        p99 = percentile(ok, 99)
        before = rows[-1].p99_ms if window.paused and rows else float("nan")
        rows.append(
            WindowRow(
                window.name,
                window.paused,
                len(mine),
                len(ok),
                len(mine) - len(ok),
                percentile(ok, 50),
                p99,
                p99 / before if before else float("nan"),
                window.steal,
                tuple(s.error for s in mine if s.status != 200),
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


def table(rows: list[WindowRow]) -> str:
    lines = [
        "| window | sent | 200 | failed | P50 | P99 | P99 / quiet before | steal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.paused else ""
        lines.append(
            f"| {r.name} | {r.sent} | {r.ok} | {r.failed} | {r.p50_ms:.0f} ms | "
            f"{r.p99_ms:.0f} ms | {ratio} | {r.steal:.1f} % |"
        )
    lines += [f"failed in {r.name}: {failure}" for r in rows for failure in r.failures]
    return "\n".join(lines)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="completions a second")
    parser.add_argument("--rounds", type=int, default=2, help="quiet then paused windows")
    parser.add_argument("--quiet-s", type=float, default=20.0)
    parser.add_argument("--pause-s", type=float, default=10.0)
    parser.add_argument("--after-s", type=float, default=10.0)
    parser.add_argument("--decode-ms", default="10", help="sim engine: one decode step")
    args = parser.parse_args()
    # Ports of its own (other benches use 31092/31379/31800): it may run beside them.
    stack = BenchStack(kafka_port=31192, redis_port=31479, ingress_port=31900)
    with services(stack):
        try:
            stack.spawn(
                "ingress",
                {
                    "LANEWAY_PORT": str(stack.ingress_port),
                    "LANEWAY_PROBE_INTERVAL_S": "0",
                    **stack.ingress_admin_env,
                },
            )
            worker = stack.spawn(
                "workers",
                {
                    "LANEWAY_POOL": "completion",
                    "LANEWAY_ENGINE": "sim",
                    "LANEWAY_WORKER_ID": "pause-drill-0",
                    "LANEWAY_SIM_DECODE_MS_PER_STEP": args.decode_ms,
                },
                role="worker",
            )
            stack.wait_ready({"completion"})
            # Size 1: a budget of 50,000 tokens an hour, leased 500 at a time, so a pause
            # spends the lease the ingress holds and then goes to its local limiter.
            key = stack.api_key(TEAM, size=1)
            asyncio.run(warm_up(stack.base_url, stack.api_key("pause-warm-up")))
            since = time.time()
            redis = stack.pids["redis"]
            windows, samples = asyncio.run(
                drive(
                    stack.base_url,
                    key,
                    pause=sigstop(redis),
                    resume=sigcont(redis),
                    rate=args.rate,
                    rounds=args.rounds,
                    quiet_s=args.quiet_s,
                    pause_s=args.pause_s,
                    after_s=args.after_s,
                )
            )
            # The worker stops (SIGTERM): what it owed is paid, or logged, before it exits.
            worker.send_signal(signal.SIGTERM)
            code = worker.wait(60)
            used = asyncio.run(used_tokens(stack.redis_url, stack.prefix, TEAM, since))
        except subprocess.TimeoutExpired:
            raise SystemExit("the worker did not stop within 60 s") from None
        finally:
            stop_processes(stack.procs)
    served = sum(s.tokens for s in samples)
    print(
        f"# Redis paused {args.rounds} x {args.pause_s:.0f} s (after {args.quiet_s:.0f} s quiet "
        f"each) at {args.rate:g} completions/s, max_tokens 16 ({machine()})"
    )
    print(table(window_rows(windows, samples)))
    print(
        f"quota usage in Redis {used} tokens, served {served} tokens ({used - served:+d}); "
        f"worker exit code {code}"
    )


if __name__ == "__main__":
    main()
