"""A small in-process cache with a time to live, for records that change rarely (keys, teams)."""

from __future__ import annotations

import time
from typing import Generic, TypeVar

__all__ = ["TtlCache"]

V = TypeVar("V")


class TtlCache(Generic[V]):
    """Entries expire ``ttl_s`` after they were put; a full cache starts over (bounded memory)."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._data: dict[str, tuple[float, V]] = {}

    def get(self, key: str, *, stale_ok: bool = False) -> V | None:
        """The live entry, or with ``stale_ok`` an expired one (fallback while a store is down)."""
        hit = self._data.get(key)
        if hit is None or (hit[0] < time.monotonic() and not stale_ok):
            return None
        return hit[1]

    def pop(self, key: str) -> None:
        """``key``'s entry is let go (its record changed)."""
        self._data.pop(key, None)

    def put(self, key: str, value: V) -> None:
        if len(self._data) >= self.max_entries:
            self._data.clear()
        self._data[key] = (time.monotonic() + self.ttl_s, value)
