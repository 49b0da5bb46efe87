"""Protocols for what the streams code needs from Faust and from its output topics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, ItemsView, MutableMapping
from typing import Any, Protocol

__all__ = ["ChangelogTable", "SendRecord"]

# Produce one record: (topic, key, value); returns once the broker has it.
SendRecord = Callable[[str, bytes, bytes], Awaitable[None]]


class ChangelogTable(Protocol):
    """The part of a ``faust.Table`` the processor uses (a dict in unit tests)."""

    @property
    def data(self) -> MutableMapping[str, Any]: ...

    def get(self, key: str, /) -> Any: ...

    def __setitem__(self, key: str, value: Any) -> None: ...

    def items(self) -> ItemsView[str, Any]: ...

    def send_changelog(
        self,
        partition: int | None,
        key: Any,
        value: Any,
        key_serializer: Any = None,
        value_serializer: Any = None,
    ) -> Any: ...
