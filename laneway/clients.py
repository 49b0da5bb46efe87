"""Factories for the Kafka and Redis clients every service uses, with laneway's defaults."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from redis.asyncio.sentinel import Sentinel

from laneway import kafka_bounds
from laneway.errors import ConfigError
from laneway.redis_circuit import attach_circuit
from laneway.settings import CommonSettings

__all__ = [
    "kafka_auth",
    "make_admin",
    "make_consumer",
    "make_producer",
    "make_redis",
    "sentinel_redis",
    "start_client",
    "topic_partitions",
]


def kafka_auth(settings: CommonSettings) -> dict[str, Any]:
    """The SASL options of this service's Kafka principal, for any aiokafka client."""
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    options: dict[str, Any] = {
        "security_protocol": protocol,
        "sasl_mechanism": settings.kafka_sasl_mechanism,
        "sasl_plain_username": settings.kafka_username,
        "sasl_plain_password": settings.kafka_password.get_secret_value(),
    }
    if protocol == "SASL_SSL":
        options["ssl_context"] = ssl.create_default_context(
            cafile=settings.kafka_ssl_cafile or None
        )
    return options


def make_admin(settings: CommonSettings, **overrides: Any) -> AIOKafkaAdminClient:
    """An admin client as this service's principal."""
    options: dict[str, Any] = {"bootstrap_servers": settings.kafka_bootstrap}
    options.update(kafka_auth(settings))
    options.update(overrides)
    return AIOKafkaAdminClient(**options)


def make_producer(settings: CommonSettings, **overrides: Any) -> AIOKafkaProducer:
    """An idempotent producer that acknowledges only what the broker has stored."""
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "acks": "all",
        "enable_idempotence": True,
        # Interactive traffic: send at once; batches still form under load.
        "linger_ms": 0,
        "request_timeout_ms": 10_000,
        **kafka_auth(settings),
    }
    options.update(overrides)
    return AIOKafkaProducer(**options)


def make_consumer(settings: CommonSettings, *topics: str, **overrides: Any) -> AIOKafkaConsumer:
    """A consumer that commits only when told (at-least-once is the caller's job), and reads
    no record batch past the decompressed bound (``laneway.kafka_bounds``)."""
    kafka_bounds.install(settings.max_decompressed_batch_bytes)
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        # A long poll: the broker answers as soon as one record is there (fetch_min_bytes=1),
        # so this only bounds idle polling; shorter only burns broker CPU on idle consumers.
        "fetch_max_wait_ms": 500,
        **kafka_auth(settings),
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


async def start_client(client: AIOKafkaConsumer | AIOKafkaProducer) -> None:
    """``await client.start()``, which a cancel cannot cut short into an open socket.

    aiokafka's bootstrap (0.14) closes its first connection when the metadata request fails,
    but not when it is cancelled between connecting and the answer: the socket stays open
    until the garbage collector finds it (seen when a probe's timeout cut a consumer's
    start). So a cancel waits here for the start to end (bounded by the client's request
    timeout), stops the client, and then goes on."""
    starting = asyncio.ensure_future(client.start())
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        while not starting.done():
            with contextlib.suppress(asyncio.CancelledError):  # raised below all the same
                await asyncio.wait({starting})
        if not starting.cancelled():
            starting.exception()  # retrieved: the cancel is the outcome the caller gets
        await client.stop()
        raise


def make_redis(settings: CommonSettings) -> aioredis.Redis:
    """A client whose pool waits for a free connection instead of failing under a burst, with
    the process's Redis circuit (``laneway.redis_circuit``) attached.

    ``redis+sentinel://`` URLs reach the master a set of Sentinels names, and follow it
    when they fail over."""
    client: aioredis.Redis
    if settings.redis_url.startswith(SENTINEL_SCHEMES):
        client = sentinel_redis(settings.redis_url)
    else:
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


SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")


class _SentinelRedis(aioredis.Redis):
    """The master's client; closing it closes the connections to the Sentinels too."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        manager = getattr(self.connection_pool, "sentinel_manager", None)
        await super().aclose(close_connection_pool)
        for sentinel in getattr(manager, "sentinels", ()):
            await sentinel.aclose()


def sentinel_redis(url: str) -> aioredis.Redis:
    """A client of the master that Sentinels name, from
    ``redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>]`` (the user
    and password are the data nodes'; the Sentinels themselves take none)."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    path = [p for p in parts.path.split("/") if p]
    try:
        sentinels = [
            (host, int(port)) for host, _, port in (h.rpartition(":") for h in hosts.split(","))
        ]
        db = int(path[1]) if len(path) > 1 else 0
    except ValueError:
        sentinels, db = [], -1
    if not sentinels or any(not host for host, _ in sentinels) or not path or db < 0:
        raise ConfigError(
            "LANEWAY_REDIS_URL: a Sentinel URL is "
            "redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>]"
        )
    sentinel = Sentinel(
        sentinels,
        sentinel_kwargs={"socket_timeout": 2.0, "socket_connect_timeout": 2.0},
        ssl=parts.scheme.startswith("rediss"),
    )
    client: aioredis.Redis = sentinel.master_for(
        path[0],
        redis_class=_SentinelRedis,
        db=db,
        username=unquote(username) or None,
        password=unquote(password) or None,
        socket_connect_timeout=2.0,
        socket_timeout=5.0,
        health_check_interval=15,
    )
    return client


async def topic_partitions(settings: CommonSettings, topic: str) -> list[int]:
    """Partition numbers of ``topic``; empty when it does not exist."""
    admin = make_admin(settings)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return sorted(
        p["partition"] for t in described if not t.get("error_code") for p in t["partitions"]
    )
