"""A fetched record batch decompresses into a bounded buffer, or is skipped.

aiokafka decompresses a whole record batch in memory before it yields a record of it, and
nothing upstream bounds what a batch expands to: ``max.message.bytes`` and the fetch sizes
count compressed bytes, and the broker stores a batch in the producer's codec after only
streaming through it. A tenant's batch topic is written with the tenant's own Kafka
credentials: a few KB of zstd can expand to gigabytes, and a batch past a worker's memory
killed it; restarted, it fetched the same batch and died again, and every team's batch work
stopped. A batch the process cannot decode at all (a codec it lacks) stopped the fetch loop
the same way.

So every consumer laneway makes (``laneway.clients.make_consumer``) decompresses a batch into
at most ``LANEWAY_MAX_DECOMPRESSED_BATCH_BYTES``; a batch past that, or one that cannot be
decoded, yields no records: it is logged with its topic, partition and offsets, counted
(``laneway_kafka_batches_skipped_total``) and passed, as aiokafka passes an aborted
transaction's batch. The commit passes it with the next record read after it (until then, a
new owner of the partition skips it again, and logs and counts it again). aiokafka 0.14 is
patched in two places, its decoders and the fetcher's ``PartitionRecords``;
``tests/test_kafka_bounds.py`` holds both to it.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import aiokafka.record._crecords.default_records as c_default_records
import aiokafka.record.default_records as py_default_records
import cramjam
from aiokafka.codec import snappy_decode as _aiokafka_snappy
from aiokafka.consumer import fetcher
from aiokafka.errors import CorruptRecordException, UnsupportedCodecError
from prometheus_client import Counter

from laneway.constants import DECOMPRESSED_BATCH_BYTES

__all__ = ["BatchTooLarge", "install"]

log = logging.getLogger(__name__)

# The first buffer tried, as a multiple of the compressed size (grown eightfold while the
# output does not fit): text fits the first, and a bomb costs a few tries up to the bound.
_FIRST_RATIO = 16
_MIN_FIRST = 256 * 1024

SKIPPED = Counter(
    "laneway_kafka_batches_skipped_total",
    "Fetched record batches passed unread: past the decompressed bound, or undecodable",
    ["topic", "reason"],
)


class _Bound:
    """The process's bound (one per process: ``install`` sets it from the settings)."""

    bytes = DECOMPRESSED_BATCH_BYTES


class BatchTooLarge(CorruptRecordException):  # type: ignore[misc]
    """A record batch does not decompress within the bound (or is corrupt)."""


def _gzip(data: Any) -> bytes:
    """``aiokafka.codec.gzip_decode`` that never holds more than the bound."""
    compressed = bytes(data)
    size = len(compressed)
    parts: list[bytes] = []
    total = 0
    while compressed:
        stream = zlib.decompressobj(16 + zlib.MAX_WBITS)  # one gzip member
        while True:
            try:
                part = stream.decompress(compressed, _Bound.bytes + 1 - total)
            except zlib.error as exc:
                raise BatchTooLarge(f"gzip record batch of {size} bytes is corrupt") from exc
            total += len(part)
            if total > _Bound.bytes:
                raise BatchTooLarge(
                    f"gzip record batch of {size} bytes decompresses past {_Bound.bytes} bytes"
                )
            parts.append(part)
            if stream.eof:
                # Another member, or nothing; zeros after the last one are padding (gzip's
                # own reader passes them too).
                compressed = stream.unused_data.lstrip(b"\0")
                break
            compressed = stream.unconsumed_tail
            if not compressed:
                raise BatchTooLarge(f"gzip record batch of {size} bytes ends mid-stream")
    return b"".join(parts)


def _snappy(data: Any) -> bytes:
    """``aiokafka.codec.snappy_decode``, then held to the bound: snappy's format caps what
    a batch expands to (about 21 times), so it is decoded first and measured."""
    out: bytes = _aiokafka_snappy(data)
    if len(out) > _Bound.bytes:
        raise BatchTooLarge(
            f"snappy record batch of {len(data)} bytes decompresses past {_Bound.bytes} bytes"
        )
    return out


def _bounded(
    codec: str, decompress_into: Callable[[bytes, bytearray], int]
) -> Callable[..., bytes]:
    """A cramjam decoder into a buffer that grows up to the bound: cramjam fails a buffer
    too small, having written no more than it holds."""

    def decode(data: Any) -> bytes:
        compressed = bytes(data)
        room = min(_Bound.bytes, max(_MIN_FIRST, _FIRST_RATIO * len(compressed)))
        while True:
            out = bytearray(room)
            try:
                return bytes(memoryview(out)[: decompress_into(compressed, out)])
            except cramjam.DecompressionError as exc:
                if room >= _Bound.bytes:
                    raise BatchTooLarge(
                        f"{codec} record batch of {len(compressed)} bytes does not "
                        f"decompress within {_Bound.bytes} bytes (larger, or corrupt)"
                    ) from exc
                room = min(_Bound.bytes, room * 8)

    return decode


class _Guarded:
    """A fetched record batch that yields no records when it cannot be decompressed."""

    def __init__(self, batch: Any, tp: Any) -> None:
        self._batch = batch
        self._tp = tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def __next__(self) -> Any:
        return next(self._batch)  # a control batch's marker (never compressed)

    def __iter__(self) -> Iterator[Any]:
        try:
            return iter(self._batch)  # decompresses
        except Exception as exc:  # noqa: BLE001 - whatever a writer's bytes make a decoder raise
            batch, tp = self._batch, self._tp
            reason = (
                "too_large"
                if isinstance(exc, BatchTooLarge)
                else "codec"
                if isinstance(exc, UnsupportedCodecError)
                else "corrupt"
            )
            SKIPPED.labels(tp.topic, reason).inc()
            log.warning(
                "record batch %s:%d@%d-%d skipped, none of it read: %s",
                tp.topic,
                tp.partition,
                batch.base_offset,
                batch.next_offset - 1,
                exc,
            )
            return iter(())


class _GuardedRecords:
    """The records of one fetch, each batch of them guarded."""

    def __init__(self, records: Any, tp: Any) -> None:
        self._records = records
        self._tp = tp

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> _Guarded | None:
        batch = self._records.next_batch()
        return None if batch is None else _Guarded(batch, self._tp)


class _BoundedPartitionRecords(fetcher.PartitionRecords):  # type: ignore[misc]
    def __init__(self, tp: Any, records: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tp, _GuardedRecords(records, tp), *args, **kwargs)


def install(max_bytes: int = DECOMPRESSED_BATCH_BYTES) -> None:
    """Bound every batch this process decompresses to ``max_bytes`` (idempotent). One
    bound per process: the last call sets it (a process has one set of settings)."""
    _Bound.bytes = max_bytes
    if fetcher.PartitionRecords is _BoundedPartitionRecords:
        return
    decoders: dict[str, Callable[..., bytes]] = {
        "gzip_decode": _gzip,
        "zstd_decode": _bounded("zstd", cramjam.zstd.decompress_into),
        "lz4_decode": _bounded("lz4", cramjam.lz4.decompress_into),
        "snappy_decode": _snappy,
    }
    modules: tuple[ModuleType, ...] = (c_default_records, py_default_records)
    for module in modules:
        for name, decode in decoders.items():
            if not hasattr(module, name):
                raise RuntimeError(f"aiokafka changed: {module.__name__}.{name} is gone")
            setattr(module, name, decode)
    fetcher.PartitionRecords = _BoundedPartitionRecords
