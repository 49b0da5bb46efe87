"""A small in-process cache with a time to live, for records that change rarely (keys, teams),
and reads shared by the callers that want the same record at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["SharedReads", "TtlCache"]

V = TypeVar("V")


class TtlCache(Generic[V]):
    """Entries expire ``ttl_s`` after they were put; a full cache starts over (bounded memory)."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._data: dict[str, tuple[float, V]] = {}
        # Counts the calls of ``expire``: a record read while this changed may be the one
        # expired, and is not put (``put_if``).
        self.changes = 0

    def get(self, key: str, *, stale_ok: bool = False) -> V | None:
        """The live entry, or with ``stale_ok`` an expired one (fallback while a store is down)."""
        hit = self._data.get(key)
        if hit is None or (hit[0] < time.monotonic() and not stale_ok):
            return None
        return hit[1]

    def expire(self, key: str | None) -> None:
        """``key``'s entry expires now (its record changed; None: every entry, any record
        may have): ``get`` reads it only ``stale_ok``, as the fallback while the store does
        not answer."""
        self.changes += 1
        keys = list(self._data) if key is None else [key] if key in self._data else []
        for name in keys:
            self._data[name] = (0.0, self._data[name][1])

    def put_if(self, changes: int, key: str, value: V) -> None:
        """``put``, unless an entry expired early since ``changes`` was read (the value,
        read before, may be the record that changed)."""
        if changes == self.changes:
            self.put(key, value)

    def put(self, key: str, value: V) -> None:
        if len(self._data) >= self.max_entries:
            self._data.clear()
        self._data[key] = (time.monotonic() + self.ttl_s, value)


class SharedReads(Generic[V]):
    """One read of a record at a time: callers that want it while it is being read wait for
    that read rather than making their own. A burst of requests with one key the cache does
    not hold (an ingress just started, the entry just expired) is then one Redis read, not
    one each: a hundred reads at once on a busy host outlast the hot timeout and open the
    Redis circuit for everyone.

    A caller that is cancelled (its client left) stops waiting; the read goes on for the
    others. Its error, when it fails, is every waiter's."""

    def __init__(self) -> None:
        self._reads: dict[str, asyncio.Future[V]] = {}

    async def read(self, key: str, fetch: Callable[[], Awaitable[V]]) -> V:
        pending = self._reads.get(key)
        if pending is None:
            pending = asyncio.ensure_future(fetch())
            self._reads[key] = pending
            pending.add_done_callback(lambda done: self._done(key, done))
        return await asyncio.shield(pending)

    def _done(self, key: str, done: asyncio.Future[V]) -> None:
        if self._reads.get(key) is done:
            del self._reads[key]
        if not done.cancelled():
            done.exception()  # retrieved: no "never retrieved" warning when nobody waits

    def __len__(self) -> int:
        return len(self._reads)
