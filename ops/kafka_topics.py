"""Creating topics on a broker, from set-up code or a coroutine, waiting until every new
partition has a leader."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from laneway.clients import kafka_auth
from laneway.errors import ServiceError
from laneway.settings import CommonSettings
from ops.devstack import run_sync

__all__ = ["create_topics", "create_topics_async"]

log = logging.getLogger(__name__)


def create_topics(
    bootstrap: str,
    specs: Sequence[tuple[str, int, dict[str, str]]],
    replication: int = 1,
    auth: dict[str, Any] | None = None,
) -> None:
    """Create the topics in ``specs`` (name, partitions, config) that do not exist yet;
    ``auth``: SASL options of a principal allowed to (laneway.clients.kafka_auth).

    Synchronous (runs its own event loop): call it from set-up code, not from a coroutine.
    """
    run_sync(_create_topics(bootstrap, specs, replication, auth or {}))


async def create_topics_async(
    settings: CommonSettings,
    specs: Sequence[tuple[str, int, dict[str, str]]],
    replication: int = 1,
) -> None:
    """``create_topics`` from a coroutine, as the settings' principal."""
    await _create_topics(settings.kafka_bootstrap, specs, replication, kafka_auth(settings))


async def _create_topics(
    bootstrap: str,
    specs: Sequence[tuple[str, int, dict[str, str]]],
    replication: int,
    auth: dict[str, Any],
) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **auth)
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(name, partitions, replication, topic_configs=dict(config))
            for name, partitions, config in specs
            if name not in existing
        ]
        if not wanted:
            return
        response = await admin.create_topics(wanted)
        failures = [
            f"{item['topic']}: error {item['error_code']} {item.get('error_message') or ''}".strip()
            for item in response.to_object()["topic_errors"]
            if item["error_code"] not in (0, TopicAlreadyExistsError.errno)
        ]
        if failures:
            raise ServiceError(f"could not create topics on {bootstrap}: " + "; ".join(failures))
        # Clients that start right away would otherwise log NotLeaderForPartition and retry.
        await _wait_for_leaders(admin, [topic.name for topic in wanted])
    finally:
        await admin.close()
    log.info("created topics %s", ", ".join(topic.name for topic in wanted))


async def _wait_for_leaders(
    admin: AIOKafkaAdminClient, names: list[str], within_s: float = 15.0
) -> None:
    deadline = time.monotonic() + within_s
    while True:
        described = await admin.describe_topics(names)
        leaderless = [
            topic["topic"]
            for topic in described
            if topic.get("error_code")
            or not topic["partitions"]
            or any(p["leader"] < 0 for p in topic["partitions"])
        ]
        if not leaderless:
            return
        if time.monotonic() > deadline:
            raise ServiceError(f"topics without a partition leader after {within_s}s: {leaderless}")
        await asyncio.sleep(0.05)
