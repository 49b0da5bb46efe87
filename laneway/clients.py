"""Factories for the Kafka and Redis clients every service uses, with laneway's defaults."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from laneway.redis_circuit import attach_circuit
from laneway.settings import CommonSettings

__all__ = ["make_consumer", "make_producer", "make_redis", "topic_partitions"]


def make_producer(settings: CommonSettings, **overrides: Any) -> AIOKafkaProducer:
    """An idempotent producer that acknowledges only what the broker has stored."""
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "acks": "all",
        "enable_idempotence": True,
        # Interactive traffic: send at once; batches still form under load.
        "linger_ms": 0,
        "request_timeout_ms": 10_000,
    }
    options.update(overrides)
    return AIOKafkaProducer(**options)


def make_consumer(settings: CommonSettings, *topics: str, **overrides: Any) -> AIOKafkaConsumer:
    """A consumer that commits only when told (at-least-once is the caller's job)."""
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        # A long poll: the broker answers as soon as one record is there (fetch_min_bytes=1),
        # so this only bounds idle polling; shorter only burns broker CPU on idle consumers.
        "fetch_max_wait_ms": 500,
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


def make_redis(settings: CommonSettings) -> aioredis.Redis:
    """A client whose pool waits for a free connection instead of failing under a burst, with
    the process's Redis circuit (``laneway.redis_circuit``) attached."""
    # These timeouts bound the background calls (blocking stream reads, heartbeats); the
    # request path's calls go through the circuit, which cuts them off far sooner.
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=64,
        timeout=5.0,
        socket_connect_timeout=2.0,
        socket_timeout=5.0,
        health_check_interval=15,
    )
    # from_pool: the client owns the pool, so aclose() closes its connections too.
    client = aioredis.Redis.from_pool(pool)
    attach_circuit(
        client,
        hot_timeout_ms=settings.redis_hot_timeout_ms,
        failures=settings.redis_circuit_failures,
        probe_interval_ms=settings.redis_probe_interval_ms,
    )
    return client


async def topic_partitions(settings: CommonSettings, topic: str) -> list[int]:
    """Partition numbers of ``topic``; empty when it does not exist."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return sorted(
        p["partition"] for t in described if not t.get("error_code") for p in t["partitions"]
    )
