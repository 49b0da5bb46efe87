"""Each request's usage counted once, whatever the workers sent.

A worker re-runs what it had not committed when it crashed, and the re-run sends a second
usage event for the same request (its first one may have reached the topic just before the
crash). The streams app remembers the request ids it folded for ``window_s`` and skips an id
seen before at another offset. The same record read again after the app's own restart
(same partition and offset) is left to the rollups' offset watermarks (``streams.tables``),
which travel with the counts they guard.
"""

from __future__ import annotations

from streams.tables import delete_outside_stream
from streams.types import ChangelogTable

__all__ = ["UsageIds"]


class UsageIds:
    """Request ids of usage events folded lately: id → [event time, partition, offset]."""

    def __init__(self, table: ChangelogTable, window_s: float) -> None:
        self.table = table
        self.window_s = window_s

    def repeat(self, request_id: str, ts: float, partition: int, offset: int) -> bool:
        """Whether this event repeats one already folded; a new one is remembered."""
        seen = self.table.get(request_id)
        if seen is not None:
            return (int(seen[1]), int(seen[2])) != (partition, offset)
        self.table[request_id] = [ts, partition, offset]
        return False

    async def expire(self, now: float) -> int:
        """Forget ids older than the window (a timer's work); returns how many."""
        horizon = now - self.window_s
        old = [(key, int(v[1])) for key, v in list(self.table.items()) if v[0] < horizon]
        for key, partition in old:
            delete_outside_stream(self.table, key, partition)
        return len(old)
