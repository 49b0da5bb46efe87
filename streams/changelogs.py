"""The Kafka topics the streams app needs before Faust starts: the usage topic it folds
(its partition count) and the tables' changelogs, made with settings that keep a restart's
replay short."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from laneway.clients import make_admin
from laneway.errors import ConfigError, ServiceError
from streams.app import TABLES
from streams.settings import StreamsSettings

__all__ = ["CHANGELOG_CONFIGS", "ensure_changelogs", "usage_partitions"]

log = logging.getLogger("streams")


async def usage_partitions(settings: StreamsSettings) -> int:
    """Partitions of ``laneway.usage``: the changelog topics must have as many."""
    admin = make_admin(settings)
    try:
        await admin.start()
        described = await admin.describe_topics([settings.topics.usage])
    except KafkaError as exc:
        raise ServiceError(f"Kafka at {settings.kafka_bootstrap} is not reachable: {exc}") from exc
    finally:
        await admin.close()
    partitions = [p for topic in described if not topic["error_code"] for p in topic["partitions"]]
    if not partitions:
        raise ConfigError(
            f"topic {settings.topics.usage} does not exist; create the topics first "
            "(`laneway topics create`)"
        )
    return len(partitions)


# A start replays the changelogs whole before it folds anything, so they are kept compact:
# each event rewrites its rollup and outcome records and adds an id (deleted 30 min later).
# With Kafka's defaults (1 GiB segments rolled weekly; the cleaner never touches the segment
# being written; tombstones kept a day) every write of days stayed, and a restart read
# them all first: 47,000 records for 41,700 keys took 38 s here, a busy day would take hours.
CHANGELOG_CONFIGS: dict[str, str] = {
    "cleanup.policy": "compact",
    "segment.ms": str(10 * 60 * 1000),
    "segment.bytes": str(64 * 1024 * 1024),
    "min.cleanable.dirty.ratio": "0.1",
    # Longer than a recovery from nothing takes: one that read a key's value but not yet its
    # tombstone when the tombstone went would keep the key (the tables delete such keys
    # again as they go, but not at once).
    "delete.retention.ms": str(60 * 60 * 1000),
}


async def ensure_changelogs(settings: StreamsSettings, partitions: int) -> None:
    """Create the tables' changelog topics before Faust starts, and wait until the broker
    lists them with their partitions. Left to Faust, a first start on a new cluster races:
    the first event's table write finds no changelog in the metadata yet and the agent
    crashes (PartitionsMismatch) on it. Changelogs made before (by an older laneway, or by
    Faust) get ``CHANGELOG_CONFIGS`` too."""
    names = [f"{settings.app_id}-{table}-changelog" for table in TABLES]
    admin = make_admin(settings)
    try:
        await admin.start()
        new = [
            NewTopic(
                name,
                num_partitions=partitions,
                replication_factor=settings.streams_replication_factor,
                topic_configs=CHANGELOG_CONFIGS,
            )
            for name in names
        ]
        with contextlib.suppress(TopicAlreadyExistsError):
            await admin.create_topics(new)
        for _ in range(100):
            described = await admin.describe_topics(names)
            if all(not t["error_code"] and len(t["partitions"]) == partitions for t in described):
                await _configure(admin, names)
                return
            await asyncio.sleep(0.1)
    except KafkaError as exc:
        raise ServiceError(
            f"changelog topics not created on {settings.kafka_bootstrap}: {exc}"
        ) from exc
    finally:
        await admin.close()
    raise ServiceError(f"changelog topics {names} not listed with {partitions} partitions")


async def _configure(admin: AIOKafkaAdminClient, names: list[str]) -> None:
    """``CHANGELOG_CONFIGS`` on the changelogs ``names`` where they are not set yet, beside
    what an operator set on them (Kafka's AlterConfigs replaces a topic's settings whole).
    Refused (a principal without the right), each is named in a warning and the app runs."""
    described = await admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
    )
    changes = []
    for response in described:
        for resource in response.to_object()["resources"]:
            own = {
                entry["config_names"]: entry["config_value"]
                for entry in resource["config_entries"]
                if _set_on_topic(entry) and not entry["is_sensitive"]
            }
            if any(own.get(name) != value for name, value in CHANGELOG_CONFIGS.items()):
                changes.append(
                    ConfigResource(
                        ConfigResourceType.TOPIC,
                        resource["resource_name"],
                        {**own, **CHANGELOG_CONFIGS},
                    )
                )
    if not changes:
        return
    for response in await admin.alter_configs(changes):
        for code, message, _, name in response.resources:
            if code:
                log.warning(
                    "changelog %s keeps its old settings (error %d %s): a restart replays "
                    "more than it needs; set %s on it",
                    name,
                    code,
                    message or "",
                    ", ".join(f"{k}={v}" for k, v in CHANGELOG_CONFIGS.items()),
                )


def _set_on_topic(entry: dict[str, Any]) -> bool:
    """Whether a described config entry was set on the topic itself (not a default)."""
    if "config_source" in entry:  # DescribeConfigs v1 on
        return bool(entry["config_source"] == _DYNAMIC_TOPIC_CONFIG)
    return not entry["is_default"]


_DYNAMIC_TOPIC_CONFIG = 1  # Kafka's ConfigSource: set on the topic
