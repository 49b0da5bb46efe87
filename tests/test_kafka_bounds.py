"""A compression bomb on a topic a tenant can write: skipped, never read, and the lines
around it run (``laneway.kafka_bounds``)."""

from __future__ import annotations

import gzip
import tracemalloc
from typing import Any

import cramjam
import orjson
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.codec import gzip_decode, snappy_decode, snappy_encode

from laneway import kafka_bounds
from tests.stack import LiveStack, eventually

JOB = "bomb-job"
KEY = JOB.encode()  # one key: every record on one partition, in the order sent
MIB = 1024 * 1024


def _line(i: int) -> bytes:
    body = {"model": "laneway-chat", "messages": [{"role": "user", "content": f"doc {i}"}]}
    line = {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions"}
    record = {"v": 1, "job_id": JOB, "line_id": f"doc-{i}", "team": "docs", **line}
    return orjson.dumps({**record, "body": {**body, "max_tokens": 4}})


async def _producer(stack: LiveStack, codec: str | None) -> AIOKafkaProducer:
    # The adversary's producer: its own size check (before compression) lifted; the broker
    # checks the compressed batch.
    producer = AIOKafkaProducer(
        bootstrap_servers=stack.services.bootstrap,
        compression_type=codec,
        max_request_size=64 * MIB,
    )
    await producer.start()
    stack.track(producer)
    return producer


def _skipped(topic: str) -> float:
    return sum(
        sample.value
        for metric in kafka_bounds.SKIPPED.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["topic"] == topic
    )


@pytest.mark.slow
async def test_a_compression_bomb_is_skipped_and_the_lines_around_it_run(
    stack: LiveStack,
) -> None:
    """Two bombs (gzip and zstd, a few KB each that expand to 8 and 50 MiB) among a job's
    lines, written in zstd, lz4 and plain: a worker bounded to 1 MiB a batch holds neither
    bomb, runs every line, and commits past all of it."""
    topic = stack.topics.request("batch")
    before = _skipped(topic)
    sends: list[tuple[str | None, bytes]] = [
        ("zstd", _line(0)),
        ("gzip", bytes(8 * MIB)),
        ("zstd", bytes(50 * MIB)),
        ("lz4", _line(1)),
        (None, _line(2)),
    ]
    producers = {codec: await _producer(stack, codec) for codec in {c for c, _ in sends}}
    offsets = []
    for codec, value in sends:
        stored = await producers[codec].send_and_wait(topic, value, key=KEY)
        offsets.append(stored.offset)
    del sends
    # What the worker's process allocates from here (the bombs are written): read whole, the
    # zstd one alone would take 100 MiB (its bytes, and aiokafka's copy of them).
    tracemalloc.start()
    try:
        worker = await stack.start_worker("batch", max_decompressed_batch_bytes=MIB)
        results = await stack.read_topic(
            stack.topics.results_batch, count=3, where=lambda r: r.get("job_id") == JOB
        )
        assert sorted((r["line_id"], r["status_code"]) for r in results) == [
            ("doc-0", 200),
            ("doc-1", 200),
            ("doc-2", 200),
        ]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * MIB, f"the worker held {peak / MIB:.0f} MiB"
    assert not worker.failed
    assert _skipped(topic) - before == 2
    # Committed past the last line: a restarted worker fetches neither bomb again.
    tp = TopicPartition(topic, stored.partition)
    past = offsets[-1] + 1

    async def committed_past() -> bool:
        return await worker.consumer.committed(tp) == past

    await eventually(committed_past, 20, "the commit past the job")


def test_the_bounded_decoders_read_what_aiokafka_reads() -> None:
    """Within the bound the decoders give aiokafka's bytes back, past a first buffer's
    size (a high ratio) and across gzip members; past it, they refuse."""
    kafka_bounds.install()
    text = b"def f(x):\n    return x\n" * 100_000  # 2.3 MB, compresses hundreds of times
    two_members = gzip.compress(text[:1000]) + gzip.compress(text[1000:])
    assert kafka_bounds._gzip(two_members) == gzip_decode(two_members) == text
    padded = two_members + bytes(64)  # zeros after the last member: gzip's own reader passes them
    assert kafka_bounds._gzip(padded) == gzip_decode(padded) == text
    framed = snappy_encode(text)  # xerial framing, as aiokafka's producer writes it
    assert kafka_bounds._snappy(framed) == snappy_decode(framed) == text
    for name, codec in (("zstd", cramjam.zstd), ("lz4", cramjam.lz4)):
        compressed = bytes(codec.compress(text))
        assert len(compressed) * 16 < len(text)
        assert kafka_bounds._bounded(name, codec.decompress_into)(compressed) == text
    kafka_bounds.install(MIB)
    try:
        with pytest.raises(kafka_bounds.BatchTooLarge, match="past 1048576 bytes"):
            kafka_bounds._gzip(gzip.compress(bytes(2 * MIB)))
        with pytest.raises(kafka_bounds.BatchTooLarge, match="within 1048576 bytes"):
            kafka_bounds._bounded("zstd", cramjam.zstd.decompress_into)(
                bytes(cramjam.zstd.compress(bytes(2 * MIB)))
            )
        with pytest.raises(kafka_bounds.BatchTooLarge, match="past 1048576 bytes"):
            kafka_bounds._snappy(snappy_encode(bytes(2 * MIB)))
    finally:
        kafka_bounds.install()


class _Undecodable:
    base_offset, next_offset = 7, 9

    def __iter__(self) -> Any:
        raise ValueError("a block that is not snappy")


def test_a_batch_no_decoder_reads_is_skipped_not_raised() -> None:
    """Whatever a writer's bytes make a decoder raise, the fetch goes on past the batch: raised
    out of getmany, it stopped the worker, and again at each restart."""
    tp = TopicPartition("t.req.batch.team.acme", 0)
    before = _skipped(tp.topic)
    assert list(kafka_bounds._Guarded(_Undecodable(), tp)) == []
    assert _skipped(tp.topic) - before == 1
