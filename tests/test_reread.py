"""A batch line parked without its body is read back by its offset (``workers.reread``), on
the real broker: the record itself, or a clear "gone" once retention deleted it or when no
data record sits at that offset; the lines after it come with the same fetch, and what is
kept is bounded and let go when asked."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from prometheus_client import REGISTRY

from laneway.schema import BatchRequest
from tests.stack import LiveStack, envelope, eventually
from workers import reread
from workers.batch import batch_request_id
from workers.batch_lane import BatchLane
from workers.batch_parked import read_back
from workers.dispatch import Work
from workers.reread import RecordGone, RecordReader


def _fetches() -> float:
    return REGISTRY.get_sample_value("laneway_batch_read_back_fetches_total") or 0.0


@pytest.fixture
async def readers(stack: LiveStack) -> AsyncIterator[list[RecordReader]]:
    """The readers a test makes (``_reader``), closed after it."""
    made: list[RecordReader] = []
    yield made
    for reader in made:
        await reader.close()


def _reader(made: list[RecordReader], stack: LiveStack) -> RecordReader:
    reader = RecordReader(stack.worker_settings("batch"))
    made.append(reader)
    return reader


async def _send(stack: LiveStack, tp: TopicPartition, *values: str) -> list[int]:
    producer = await stack.producer()
    offsets = []
    for value in values:
        sent = await producer.send_and_wait(tp.topic, value.encode(), partition=tp.partition)
        offsets.append(sent.offset)
    return offsets


async def test_a_record_is_read_back_by_its_offset_until_retention_deletes_it(
    stack: LiveStack, readers: list[RecordReader]
) -> None:
    tp = TopicPartition(stack.topics.request("batch"), 0)
    offsets = await _send(stack, tp, *(f"line {n}" for n in range(4)))
    reader = _reader(readers, stack)
    fresh = _reader(readers, stack)
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
        # And nothing more is fetched meanwhile (the reader's consumer fetches no further
        # records ahead, nor long-polls while idle).
        assert reader._consumer is not None
        assert reader._consumer.paused() == {tp}
        # Retention (here its admin call) deletes the first three: a reader that did not
        # fetch them is told they are gone, never answered by another record in their
        # place; the one that did still has them, until it forgets them.
        await admin.delete_records({tp: RecordsToDelete(before_offset=offsets[3])})
        with pytest.raises(RecordGone, match="no longer holds"):
            await fresh.read(tp, offsets[0])
        assert (await fresh.read(tp, offsets[3])).value == b"line 3"
        assert (await reader.read(tp, offsets[1])).value == b"line 1"
        reader.forget({tp})
        with pytest.raises(RecordGone, match="no longer holds"):
            await reader.read(tp, offsets[1])
    finally:
        await admin.close()


async def test_an_aborted_line_in_a_fetch_is_not_read_back(
    stack: LiveStack, readers: list[RecordReader]
) -> None:
    """Between two lines, one of an aborted transaction and its marker: the fetch that
    brings the first line brings the second, and the offsets between hold no line (the
    broker is asked again: a kept fetch without a line there may be a stale one)."""
    tp = TopicPartition(stack.topics.request("batch"), 1)
    [first] = await _send(stack, tp, "line 0")
    txn = AIOKafkaProducer(
        bootstrap_servers=stack.services.bootstrap,
        transactional_id=f"{stack.prefix}-reread-{uuid.uuid4().hex[:6]}",
        **stack.services.admin_auth,
    )
    await txn.start()
    try:
        await txn.begin_transaction()
        aborted = await txn.send_and_wait(tp.topic, b"never ran", partition=tp.partition)
        await txn.abort_transaction()
    finally:
        await txn.stop()
    # The abort's marker is written after the abort returns: line 1 goes after it.
    probe = AIOKafkaConsumer(
        bootstrap_servers=stack.services.bootstrap, **stack.services.admin_auth
    )
    await probe.start()
    try:

        async def marked() -> bool:
            end: int = (await probe.end_offsets([tp]))[tp]
            return end >= aborted.offset + 2

        await eventually(marked, 10, "the abort's marker written")
    finally:
        await probe.stop()
    [last] = await _send(stack, tp, "line 1")
    reader = _reader(readers, stack)
    before = _fetches()
    assert (await reader.read(tp, first)).value == b"line 0"
    assert (await reader.read(tp, last)).value == b"line 1"
    assert _fetches() - before == 1
    for offset in range(first + 1, last):
        with pytest.raises(RecordGone, match="has no record"):
            await reader.read(tp, offset)
    assert _fetches() - before == 1 + (last - first - 1)


@pytest.mark.parametrize("bound", ["_KEPT_PARTITIONS", "_KEPT_BYTES"])
async def test_what_is_kept_is_bounded(
    stack: LiveStack, readers: list[RecordReader], monkeypatch: pytest.MonkeyPatch, bound: str
) -> None:
    """Past its bound (partitions or bytes) the partition read least recently is let go;
    the latest fetch stays, whatever its size."""
    monkeypatch.setattr(reread, bound, 1)
    zero, one = (TopicPartition(stack.topics.request("batch"), n) for n in (0, 1))
    on_zero = await _send(stack, zero, "zero 0", "zero 1", "zero 2")
    on_one = await _send(stack, one, "one 0", "one 1")
    reader = _reader(readers, stack)
    before = _fetches()
    assert (await reader.read(zero, on_zero[0])).value == b"zero 0"
    assert (await reader.read(one, on_one[0])).value == b"one 0"
    assert (await reader.read(one, on_one[1])).value == b"one 1"  # kept: the latest
    assert _fetches() - before == 2
    assert (await reader.read(zero, on_zero[1])).value == b"zero 1"  # let go: fetched again
    assert _fetches() - before == 3


async def test_the_lane_asks_again_when_the_kept_line_at_an_offset_is_another(
    stack: LiveStack,
) -> None:
    """A parked line is read back, and what the reader kept at its offset is another line:
    a fetch from before its topic was deleted and made anew, planted here. The lane lets it
    go and asks the broker, which has the line; a line the broker does not have there either
    is answered as gone. A partition the worker no longer owns leaves nothing kept."""
    lane = (await stack.start_worker("batch")).lane
    assert isinstance(lane, BatchLane)
    tp = TopicPartition(stack.topics.request("batch"), 0)
    body = {"model": "laneway-chat", "messages": [{"role": "user", "content": "hi"}]}

    def line(line_id: str) -> bytes:
        return BatchRequest(job_id="j", line_id=line_id, team="docs", body=body).to_json()

    def parked(line_id: str) -> Work:
        return Work(tp, offset, envelope(id=batch_request_id("j", line_id), cls="batch"))

    producer = await stack.producer()
    offset = (await producer.send_and_wait(tp.topic, line("new"), partition=0)).offset
    stale = ConsumerRecord(tp.topic, 0, offset, 0, 0, None, line("old"), None, -1, -1, ())
    lane.reread._keep(tp, reread._Fetched([stale]))
    before = _fetches()
    read, _ = await read_back(lane, parked("new"))
    assert (read.job_id, read.line_id) == ("j", "new")
    assert _fetches() - before == 1
    with pytest.raises(RecordGone, match="is another line"):
        await read_back(lane, parked("other"))
    assert _fetches() - before == 2  # it asked the broker before it said so
    lane.forgot({tp}, [])
    await read_back(lane, parked("new"))
    assert _fetches() - before == 3
