"""Streams app: usage events per second it sustains, and how long an error burst takes to
reach the ingress's breaker gate.

1. Throughput: produce N usage events (6 teams, one past hour) as fast as Kafka takes them
   while ``python -m streams`` runs; time until its hourly rollups account for all N.
2. Breaker delay: steady ok traffic, then every event an error; time from the first error
   produced to (a) the level in Redis and (b) ``BreakerGate.route_for`` (the ingress side,
   with its one-second cache, polled every 10 ms) answering the quantized route.

    .venv/bin/python -m bench.streams [--events 20000] [--bursts 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from types import SimpleNamespace

import orjson
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench._proc import machine
from bench._stack import BenchStack, bench_stack
from bench._stats import percentile
from ingress.breaker import BreakerGate
from laneway.constants import RedisKeys
from laneway.schema import UsageEvent
from streams.variance import HOUR_S, hour_of

TEAMS = [f"team-{i}" for i in range(6)]
ROUTES = {"laneway-code": {"quantized": "laneway-code-fp8", "fallback": "laneway-code-small"}}


def _event(team: str, ts: float, status: str = "ok") -> bytes:
    return UsageEvent(
        id=uuid.uuid4().hex, team=team, cls="completion", model="laneway-code",
        route="laneway-code", status=status, prompt_tokens=900, completion_tokens=40,
        total_ms=35.0, ts=ts,
    ).to_json()  # fmt: skip


async def _produce(
    producer: AIOKafkaProducer, topic: str, records: list[tuple[str, bytes]]
) -> None:
    futures = [await producer.send(topic, value, key=key.encode()) for key, value in records]
    await asyncio.gather(*futures)


async def throughput(stack: BenchStack, events: int) -> tuple[float, float]:
    """(events/s, seconds) from the first produced event to the last one counted."""
    topics = stack.topics
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, linger_ms=5)
    consumer = AIOKafkaConsumer(
        topics.usage_hourly, bootstrap_servers=stack.bootstrap, auto_offset_reset="latest"
    )
    await producer.start()
    await consumer.start()
    try:
        await asyncio.sleep(1.0)  # let the consumer take its partitions (auto offset: latest)
        base = (hour_of(time.time()) - 2) * HOUR_S
        records = [(TEAMS[i % 6], _event(TEAMS[i % 6], base + i * 0.01)) for i in range(events)]
        started = time.perf_counter()
        await _produce(producer, topics.usage, records)
        produced_s = time.perf_counter() - started
        counted: dict[str, int] = {}
        last = started
        while sum(counted.values()) < events:
            batches = await consumer.getmany(timeout_ms=500)
            for batch in batches.values():
                for message in batch:
                    record = orjson.loads(message.value)
                    counted[record["team"]] = max(
                        counted.get(record["team"], 0), record["revision"]
                    )
                    last = time.perf_counter()
            if time.perf_counter() - started > 300:
                raise TimeoutError(f"only {sum(counted.values())} of {events} counted in 300 s")
        # The rollup goes out once the partition is idle (LANEWAY_ROLLUP_IDLE_S=0.2); the last
        # event was folded at least that long before its rollup appeared.
        elapsed = max(last - started - 0.2 - 0.2, produced_s)
        return events / elapsed, elapsed
    finally:
        await consumer.stop()
        await producer.stop()


async def breaker_delay(stack: BenchStack, bursts: int) -> list[tuple[float, float]]:
    """(to Redis, to the ingress gate) in ms, per burst."""
    keys = RedisKeys(stack.prefix)
    redis = aioredis.Redis.from_url(stack.redis_url)
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, linger_ms=0)
    await producer.start()
    results = []
    try:
        for burst in range(bursts):
            route_key = keys.breaker("laneway-code")
            gate = BreakerGate(redis, keys, SimpleNamespace(breaker_routes=ROUTES))
            # Healthy traffic to fill the window past the minimum request count.
            ok = [(t, _event(t, time.time())) for t in TEAMS for _ in range(40)]
            await _produce(producer, stack.topics.usage, ok)
            await asyncio.sleep(1.0)
            await gate.route_for("team-0", "laneway-code")  # cache warm, as in a busy ingress
            errors = [(t, _event(t, time.time(), "error")) for t in TEAMS for _ in range(4)]
            started = time.perf_counter()
            await _produce(producer, stack.topics.usage, errors)
            to_redis = to_gate = 0.0
            while not to_gate:
                raw = await redis.get(route_key)
                if not to_redis and raw and orjson.loads(raw)["level"] >= 1:
                    to_redis = (time.perf_counter() - started) * 1000
                if (await gate.route_for("team-0", "laneway-code")).level >= 1:
                    to_gate = (time.perf_counter() - started) * 1000
                if time.perf_counter() - started > 30:
                    raise TimeoutError(f"burst {burst}: breaker not raised within 30 s")
                await asyncio.sleep(0.01)
            results.append((to_redis or to_gate, to_gate))
            # Wait for the window to empty and the level to return to 0 before the next burst.
            while True:
                raw = await redis.get(route_key)
                if raw is None or orjson.loads(raw)["level"] == 0:
                    break
                await asyncio.sleep(0.1)
    finally:
        await producer.stop()
        await redis.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--kafka-port", type=int, default=31292)
    parser.add_argument("--redis-port", type=int, default=31579)
    parser.add_argument("--ingress-port", type=int, default=31900)
    args = parser.parse_args()
    stack = BenchStack(
        kafka_port=args.kafka_port,
        redis_port=args.redis_port,
        ingress_port=args.ingress_port,
        prefix=f"bench{uuid.uuid4().hex[:6]}",
    )
    with bench_stack(stack):
        stack.spawn(
            "streams",
            {
                "LANEWAY_STREAMS_DATA_DIR": f"/tmp/laneway-bench-streams-{stack.prefix}",
                "LANEWAY_ROLLUP_IDLE_S": "0.2",
                "LANEWAY_ROLLUP_GRACE_S": "0",
                "LANEWAY_ROLLUP_FLUSH_INTERVAL_S": "0.2",
                "LANEWAY_BREAKER_WINDOW_S": "5",
                "LANEWAY_BREAKER_MIN_REQUESTS": "100",
                "LANEWAY_BREAKER_COOLDOWN_S": "1",
            },
        )
        rate, seconds = asyncio.run(throughput(stack, args.events))
        delays = asyncio.run(breaker_delay(stack, args.bursts))
    to_redis = [d[0] for d in delays]
    to_gate = [d[1] for d in delays]
    print(f"streams bench on {machine()} (1 streams process, 6 partitions, memory tables)")
    print("| measure | value |")
    print("|---|---|")
    print(f"| usage events folded | {args.events} in {seconds:.1f} s = **{rate:,.0f} events/s** |")
    print(
        f"| error burst → level in Redis (P50 / max of {len(delays)}) | "
        f"{percentile(to_redis, 50):.0f} / {max(to_redis):.0f} ms |"
    )
    print(
        f"| error burst → ingress gate reroutes (P50 / max of {len(delays)}) | "
        f"{percentile(to_gate, 50):.0f} / {max(to_gate):.0f} ms |"
    )


if __name__ == "__main__":
    main()
