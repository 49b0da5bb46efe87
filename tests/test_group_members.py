"""Static members of a consumer group, counted and removed on the real broker."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from ops.group_members import GroupMembers
from tests.stack import Services


async def test_a_stopped_static_member_is_removed_by_its_instance_id(
    services: Services, prefix: str
) -> None:
    topic, group = f"{prefix}.req", f"{prefix}.workers"
    admin = AIOKafkaAdminClient(bootstrap_servers=services.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 2, 1)])
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=services.bootstrap,
        group_id=group,
        group_instance_id=f"{prefix}-1",
        session_timeout_ms=60_000,  # far beyond the test: only the removal can end it
    )
    await consumer.start()
    async with GroupMembers(services.bootstrap) as members:
        try:
            await consumer.getmany(timeout_ms=5000)  # joined once it has fetched
            assert await members.count(group) == 1
        finally:
            await consumer.stop()
        # A static member stays in its group after it stopped...
        assert await members.count(group) == 1
        assert await members.remove(group, [f"{prefix}-1", f"{prefix}-9"]) == [f"{prefix}-1"]
        # ...until it is removed by its id.
        assert await members.count(group) == 0
        assert await members.count(f"{prefix}.nobody") == 0
