"""A batch line parked without its body is read back by its offset (``workers.reread``), on
the real broker: the record itself, or a clear "gone" once retention deleted it."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from tests.stack import LiveStack
from workers.reread import RecordGone, RecordReader


async def test_a_record_is_read_back_by_its_offset_until_retention_deletes_it(
    stack: LiveStack,
) -> None:
    tp = TopicPartition(stack.topics.request("batch"), 0)
    producer = await stack.producer()
    offsets = []
    for n in range(3):
        sent = await producer.send_and_wait(tp.topic, f"line {n}".encode(), partition=0)
        offsets.append(sent.offset)
    reader = RecordReader(stack.worker_settings("batch"))
    admin = AIOKafkaAdminClient(
        bootstrap_servers=stack.services.bootstrap, **stack.services.admin_auth
    )
    await admin.start()
    try:
        for n in (2, 0, 1):  # in any order
            assert (await reader.read(tp, offsets[n])).value == f"line {n}".encode()
        # Retention (here its admin call) deletes the first two: they are gone, said so,
        # and never answered by another record in their place.
        await admin.delete_records({tp: RecordsToDelete(before_offset=offsets[2])})
        with pytest.raises(RecordGone, match="no longer holds"):
            await reader.read(tp, offsets[0])
        assert (await reader.read(tp, offsets[2])).value == b"line 2"
    finally:
        await admin.close()
        await reader.close()
