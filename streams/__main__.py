"""``python -m streams``: run the streams app until SIGTERM (or SIGINT)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from laneway.clients import make_admin
from laneway.errors import ConfigError, ServiceError
from laneway.logs import setup_logging
from laneway.metrics import serve_metrics
from laneway.settings import load_settings, settings_only
from laneway.watchdog import AliveFile
from streams.app import TABLES, StreamsApp
from streams.settings import StreamsSettings

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


async def serve(settings: StreamsSettings) -> int:
    """Run the app until SIGTERM or SIGINT (0) or until it fails (1)."""
    # First: a start that blocks the loop is as hung as a run that does.
    async with AliveFile(settings.watchdog_file):
        return await _serve_app(settings)


async def _serve_app(settings: StreamsSettings) -> int:
    partitions = await usage_partitions(settings)
    if settings.streams_partitions not in (0, partitions):
        # Each table partition folds the usage partition of its number: fewer would leave
        # usage unfolded, more would never be written, and the changelogs would not be
        # listed as Faust expects (a start that only timed out, naming no setting).
        raise ConfigError(
            f"LANEWAY_STREAMS_PARTITIONS={settings.streams_partitions}, but "
            f"{settings.topics.usage} has {partitions} partitions: the tables are partitioned "
            "as the topic they fold; set it to that or 0 (the topic's own)"
        )
    await ensure_changelogs(settings, partitions)
    streams = StreamsApp(settings, partitions=partitions)
    serve_metrics(settings.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Faust's start returns once the tables are recovered: a failure, or a signal, may come
    # before that (a recovery lost at the first start would hold it for ever).
    starting = asyncio.ensure_future(streams.start())
    stopping = asyncio.ensure_future(stop.wait())
    crashed = asyncio.ensure_future(streams.wait_crashed())
    await asyncio.wait({starting, stopping, crashed}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()  # a start that failed says why
        await asyncio.wait({stopping, crashed}, return_when=asyncio.FIRST_COMPLETED)
    for waiter in (stopping, crashed):
        waiter.cancel()
    if streams.failure is not None:
        # Gone at once, as a killed process is: a graceful stop could commit past the record
        # (Faust acks an event as its agent lets go of it). The committed offsets and the
        # tables' changelogs are a state a restart continues from; what it reads again is
        # counted once (each table records the offsets it applied).
        log.error("%s; exiting to be restarted", streams.failure)
        logging.shutdown()
        os._exit(1)
    log.info("stopping: committing offsets and flushing table changelogs")
    await streams.stop()
    if not starting.done():  # the stop ended a start still waiting for recovery
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
    if not stop.is_set():
        log.error("the streams app stopped by itself: %r", streams.app.crash_reason)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    settings_only("python -m streams", __doc__, argv)
    try:
        settings = load_settings(StreamsSettings)
    except ConfigError as exc:
        print(f"laneway streams: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    setup_logging(settings.log_level, settings.log_format)
    # Faust and mode narrate every service start and stop at INFO; keep their warnings.
    for name in ("faust", "mode"):
        logging.getLogger(name).setLevel(
            max(logging.WARNING, logging.getLevelName(settings.log_level))
        )
    # Except table recovery's few lines a rebalance: where a recovery stopped, if one does.
    logging.getLogger("faust.tables.recovery").setLevel(settings.log_level)
    try:
        return asyncio.run(serve(settings))
    except (ConfigError, ServiceError) as exc:
        log.error("%s", exc)  # noqa: TRY400 - the message says what to do; no traceback
        return 2


if __name__ == "__main__":
    sys.exit(main())
