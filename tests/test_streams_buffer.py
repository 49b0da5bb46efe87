"""The streams app never commits an input offset ahead of the table changes it made
(``streams.faust_buffer``), on the real broker: shown with a Faust producer buffer whose
hand-over to Kafka's producer stalls, as it can on a busy machine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from faust.transport.producer import ProducerBuffer

from streams.app import StreamsApp
from streams.changelogs import ensure_changelogs
from streams.settings import StreamsSettings
from tests.stack import PARTITIONS, LiveStack, eventually
from tests.test_streams_process import FAST, produce_usage, usage_event

EVENTS = 12
STALL_S = 0.15  # longer than the 0.1 s after which Faust's own flush stops waiting


@pytest.mark.slow
async def test_no_offset_is_committed_ahead_of_its_table_changelog(
    stack: LiveStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Per input partition: the last offset whose rollup change reached Kafka's producer.
    handed_over: dict[int, int] = {}
    hand_over = ProducerBuffer._send_pending

    async def stalled(self: ProducerBuffer, fut: Any) -> None:
        await asyncio.sleep(STALL_S)
        await hand_over(self, fut)
        message = fut.message
        if str(message.channel.get_topic_name()).endswith("rollups-changelog") and message.value:
            value = message.value
            watermarks = orjson.loads(value) if isinstance(value, bytes) else value
            for partition, offset in watermarks.get("o", {}).items():
                handed_over[int(partition)] = max(handed_over.get(int(partition), -1), offset)

    monkeypatch.setattr(ProducerBuffer, "_send_pending", stalled)
    events = [usage_event(team=f"team-{i % 3}") for i in range(EVENTS)]
    await produce_usage(await stack.producer(), stack.topics.usage, events)

    settings = StreamsSettings(**stack.common, streams_data_dir=str(tmp_path), **FAST)
    streams = StreamsApp(settings, partitions=PARTITIONS)
    app = streams.app
    committed: dict[int, int] = {}
    ahead: list[str] = []
    commit = app.consumer._commit

    async def watched(offsets: Any) -> Any:
        for tp, offset in offsets.items():
            if tp.topic == stack.topics.usage:
                # Committing ``offset`` says every event below it is in the tables for good.
                if handed_over.get(tp.partition, -1) < offset - 1:
                    ahead.append(
                        f"{tp.partition}: commit {offset}, changelog up to "
                        f"{handed_over.get(tp.partition, -1)}"
                    )
                committed[tp.partition] = offset
        return await commit(offsets)

    app.consumer._commit = watched
    await streams.start()
    try:
        await eventually(lambda: sum(committed.values()) == EVENTS, 60, "every event committed")
    finally:
        await streams.stop()
    assert ahead == []


@pytest.mark.slow
async def test_the_changelog_topics_exist_before_faust_starts(
    stack: LiveStack, tmp_path: Path
) -> None:
    # Faust would create them while its consumer starts, which on a multi-broker cluster
    # can leave the consumer sure a changelog has 0 partitions: every table write then
    # fails and its usage event goes uncounted (the chaos drill's first 7 events did).
    settings = StreamsSettings(**stack.common, streams_data_dir=str(tmp_path), **FAST)
    await ensure_changelogs(settings, PARTITIONS)
    # The names Faust itself gives the app's tables' changelogs.
    app = StreamsApp(settings, partitions=PARTITIONS).app
    names = sorted(table.changelog_topic_name for table in app.tables.values())
    assert len(names) == 3
    found: dict[str, Any] = {}
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.services.bootstrap)
    await admin.start()
    try:
        for topic in await admin.describe_topics(names):
            found[topic["topic"]] = len(topic["partitions"])
        configs = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
        )
    finally:
        await admin.close()
    for response in configs:
        for resource in response.resources:
            policy = {entry[0]: entry[1] for entry in resource[4]}.get("cleanup.policy")
            found[f"{resource[3]} cleanup.policy"] = policy
    assert found == {
        **dict.fromkeys(names, PARTITIONS),
        **{f"{name} cleanup.policy": "compact" for name in names},
    }
