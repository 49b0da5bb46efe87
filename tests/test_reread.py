"""A batch line parked without its body is read back by its offset (``workers.reread``), on
the real broker: the record itself, or a clear "gone" once retention deleted it; the lines
after it come with the same fetch."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from tests.stack import LiveStack
from workers import metrics
from workers.reread import RecordGone, RecordReader


def _fetches() -> float:
    return metrics.BATCH_READ_BACK_FETCHES._value.get()


async def test_a_record_is_read_back_by_its_offset_until_retention_deletes_it(
    stack: LiveStack,
) -> None:
    tp = TopicPartition(stack.topics.request("batch"), 0)
    producer = await stack.producer()
    offsets = []
    for n in range(4):
        sent = await producer.send_and_wait(tp.topic, f"line {n}".encode(), partition=0)
        offsets.append(sent.offset)
    reader = RecordReader(stack.worker_settings("batch"))
    fresh = RecordReader(stack.worker_settings("batch"))
    admin = AIOKafkaAdminClient(
        bootstrap_servers=stack.services.bootstrap, **stack.services.admin_auth
    )
    await admin.start()
    try:
        before = _fetches()
        for n in (3, 0, 1, 2):  # in any order
            assert (await reader.read(tp, offsets[n])).value == f"line {n}".encode()
        # Line 3 took a fetch, line 0 another; lines 1 and 2 came with line 0's.
        assert _fetches() - before == 2
        # Retention (here its admin call) deletes the first three: a reader that did not
        # fetch them is told they are gone, never answered by another record in their
        # place; the one that did still has them.
        await admin.delete_records({tp: RecordsToDelete(before_offset=offsets[3])})
        with pytest.raises(RecordGone, match="no longer holds"):
            await fresh.read(tp, offsets[0])
        assert (await fresh.read(tp, offsets[3])).value == b"line 3"
        assert (await reader.read(tp, offsets[1])).value == b"line 1"
    finally:
        await admin.close()
        await reader.close()
        await fresh.close()
