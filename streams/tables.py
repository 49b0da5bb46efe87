"""Table values that remember which input offsets they already contain.

Faust flushes table changelogs *before* it commits input offsets, so after a crash the
changelog can be ahead of the committed offsets and some input is read a second time. Every
value therefore carries, per input partition, the offset of the last event folded into it
(``"o"``); an event at or below that offset is already counted and is skipped. The value and
its watermark travel in one changelog record, so they can never disagree.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from streams.types import ChangelogTable

__all__ = ["already_applied", "delete_outside_stream", "mark_applied", "put_outside_stream"]


def already_applied(value: MutableMapping[str, Any], partition: int, offset: int) -> bool:
    applied: dict[str, int] = value.get("o", {})
    return offset <= applied.get(str(partition), -1)


def mark_applied(value: MutableMapping[str, Any], partition: int, offset: int) -> None:
    value.setdefault("o", {})[str(partition)] = offset


def put_outside_stream(table: ChangelogTable, key: str, value: Any, partition: int) -> None:
    """Write a table value from a timer: Faust only knows the partition inside an event."""
    table.data[key] = value
    table.send_changelog(partition, key, value)


def delete_outside_stream(table: ChangelogTable, key: str, partition: int) -> None:
    table.data.pop(key, None)
    table.send_changelog(partition, key, None, value_serializer="raw")
