"""What one hop costs on this machine: the client operations a completion is made of, alone.

A completion crosses processes about ten times (client → ingress → Redis → ingress → broker
→ ingress, broker → worker → Redis → ingress → client), and each crossing wakes a process
that was waiting. This bench prices those crossings one at a time, from one client process
against the real broker and Redis with laneway's client settings: each operation is paced
at ``--interval`` (5 ms: one request at 200/s), so it starts from an idle event loop exactly
as a lone request does. Printed per operation: CPU of the client per operation (the pacing
wake-up, measured first, is subtracted from the others) and wall time P50/P99.

A row prices a wake-up from a blocking sleep with no event loop at all, so the loop's own
share of the first row shows. The last rows price the HTTP framework in-process (no
sockets): the same trivial handler as a FastAPI route and as a plain Starlette route in a
FastAPI app, as the ingress mounts its completion routes.

    .venv/bin/python -m bench.hops [--ops 2000] [--interval-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvloop
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response
from starlette.routing import Route

from bench._proc import machine
from bench._stack import BenchStack, services
from bench._stats import percentile
from laneway.clients import make_producer, make_redis
from laneway.constants import REPLY_STREAM_MAXLEN, RedisKeys
from laneway.schema import RequestEnvelope
from quota import QuotaEnforcer, QuotaPolicy, Team

Op = Callable[[], Awaitable[object]]


async def paced(op: Op, ops: int, interval: float) -> tuple[float, list[float]]:
    """CPU µs per operation and wall µs of each, one operation every ``interval`` s."""
    for _ in range(min(200, ops)):  # connections, scripts, metadata, the broker's JIT
        await op()
    walls: list[float] = []
    cpu = time.process_time()
    for _ in range(ops):
        await asyncio.sleep(interval)
        started = time.perf_counter()
        await op()
        walls.append((time.perf_counter() - started) * 1e6)
    return (time.process_time() - cpu) / ops * 1e6, walls


def _envelope() -> bytes:
    """A request envelope of the usual size, as the ingress produces it."""
    now = time.time()
    return RequestEnvelope(
        id="cmpl-hops",
        team="bench",
        cls="completion",
        kind="completion",
        model="laneway-code",
        route="laneway-code",
        prompt="def f(x):\n    return" * 8,
        max_tokens=16,
        affinity="s:hops",
        reply_to="bench:replies:hops",
        accepted_ts=now,
        deadline_ts=now + 2,
    ).to_json()


async def _nothing() -> None:
    return None


async def hops(
    stack: BenchStack, ops: int, interval: float
) -> list[tuple[str, float, list[float]]]:
    settings = stack.settings()
    redis = make_redis(settings)
    producer = make_producer(settings)
    await producer.start()
    keys = RedisKeys(stack.prefix)
    quota = QuotaEnforcer(redis, keys, QuotaPolicy.from_settings(settings))
    team = Team("bench", size=1_000_000)
    topic = stack.topics.request("completion", "hi")
    payload = _envelope()
    counter = iter(range(10**9))

    async def reserve() -> object:
        return await quota.reserve(team, "interactive", f"hops-{next(counter)}", 64)

    async def xadd() -> object:
        stream = "bench:replies:hops"
        return await redis.xadd(stream, {"d": payload}, maxlen=REPLY_STREAM_MAXLEN)

    async def produce() -> object:
        return await producer.send_and_wait(topic, payload, key=b"s:hops")

    measured: list[tuple[str, Op]] = [
        ("event-loop wake-up alone", _nothing),
        ("Redis PING", redis.ping),
        ("quota reserve (Lua, ingress)", reserve),
        ("reply XADD (worker)", xadd),
        ("Kafka produce acks=all (ingress)", produce),
    ]
    rows: list[tuple[str, float, list[float]]] = []
    try:
        for name, op in measured:
            cpu, walls = await paced(op, ops, interval)
            rows.append((name, cpu, walls))
    finally:
        await producer.stop()
        await redis.aclose()
    wake = rows[0][1]
    return [rows[0]] + [(name, cpu - wake, walls) for name, cpu, walls in rows[1:]]


async def _handler(request: Request) -> Response:
    await request.body()
    return Response(b"{}", media_type="application/json")


def _fastapi_route() -> FastAPI:
    app, router = FastAPI(), APIRouter()
    router.post("/v1/completions")(_handler)
    app.include_router(router)
    return app


def _starlette_route() -> FastAPI:
    app = FastAPI()
    app.router.routes.append(Route("/v1/completions", _handler, methods=["POST"]))
    return app


async def framework(app: FastAPI, calls: int) -> float:
    """CPU µs of one POST through ``app``, called in-process (no sockets)."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"bench"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        return None

    for _ in range(200):
        await app({**scope, "state": {}}, receive, send)
    cpu = time.process_time()
    for _ in range(calls):
        await app({**scope, "state": {}}, receive, send)
    return (time.process_time() - cpu) / calls * 1e6


def thread_wake(ops: int, interval: float) -> float:
    """CPU µs of one wake-up from a blocking ``time.sleep``: no event loop, no epoll, only
    the kernel's timer and scheduler, and on a virtual machine the exits they cost."""
    cpu = time.process_time()
    for _ in range(ops):
        time.sleep(interval)
    return (time.process_time() - cpu) / ops * 1e6


def report(rows: list[tuple[str, float, list[float]]], ops: int, interval_ms: float) -> None:
    print(f"# one hop at a time, every {interval_ms:g} ms, {ops} each — {machine()}")
    print(f"{'operation':<36} {'CPU us/op':>10} {'wall P50 us':>12} {'wall P99 us':>12}")
    for name, cpu, walls in rows:
        p50, p99 = percentile(walls, 50), percentile(walls, 99)
        print(f"{name:<36} {cpu:>10.0f} {p50:>12.0f} {p99:>12.0f}")
    cpu = thread_wake(ops, interval_ms / 1000)
    print(f"{'sleep wake-up, no event loop':<36} {cpu:>10.0f} {'-':>12} {'-':>12}")
    for name, app in (
        ("FastAPI route, in-process", _fastapi_route()),
        ("Starlette route in FastAPI, in-proc.", _starlette_route()),
    ):
        cpu = uvloop.run(framework(app, ops * 5))
        print(f"{name:<36} {cpu:>10.0f} {'-':>12} {'-':>12}")
    print(
        "# CPU of a hop: the client's CPU per operation beyond the pacing wake-up (first row);"
        " the peer's CPU (Redis, broker) is not in it"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=2000, help="operations of each kind")
    parser.add_argument("--interval-ms", type=float, default=5.0)
    args = parser.parse_args()

    stack = BenchStack()
    with services(stack):
        rows = uvloop.run(hops(stack, args.ops, args.interval_ms / 1000))
        report(rows, args.ops, args.interval_ms)


if __name__ == "__main__":
    main()
