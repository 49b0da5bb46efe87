"""Each request's usage counted once, whatever the workers sent.

A worker re-runs what it had not committed when it crashed, and the re-run sends a second
usage event for the same request (its first one may have reached the topic just before the
crash). The streams app remembers the requests it folded for ``window_s`` after it folded
them (not after they ran: an app catching up on a backlog older than the window folds the
first event and the re-run's second minutes of events apart, whatever their times) and skips
one seen before at another offset. A request is its team, its id and when it was accepted
(``accepted_ts``, the same on every run of it): a batch id is chosen by whoever writes the
line, and a line sent again, or another team's line of the same ids, is another request, run
and charged again (the quota marks a batch line by its id and its record's time alike), so
it is counted again. An event without ``accepted_ts`` (from a worker before it) is known by
its id alone; so a request first run by such a worker and re-run by a newer one, during a
rolling upgrade, is counted twice. The same record read again after the app's own restart
(same partition and offset) is left to the rollups' offset watermarks (``streams.tables``),
which travel with the counts they guard.
"""

from __future__ import annotations

from laneway.schema import UsageEvent
from streams.tables import delete_outside_stream
from streams.types import ChangelogTable

__all__ = ["UsageIds", "run_key"]


def run_key(event: UsageEvent) -> str:
    """The request an event is the outcome of, the same for every run of it."""
    if event.accepted_ts is None:
        return event.id
    return f"{event.team}\0{event.id}\0{event.accepted_ts!r}"


class UsageIds:
    """Requests whose usage events were folded lately: ``run_key`` → [when it was folded,
    partition, offset]."""

    def __init__(self, table: ChangelogTable, window_s: float) -> None:
        self.table = table
        self.window_s = window_s

    def repeat(self, event: UsageEvent, partition: int, offset: int, now: float) -> bool:
        """Whether this event repeats one already folded; a new one is remembered as folded
        ``now``."""
        key = run_key(event)
        seen = self.table.get(key)
        if seen is not None:
            return (int(seen[1]), int(seen[2])) != (partition, offset)
        self.table[key] = [now, partition, offset]
        return False

    async def expire(self, now: float) -> int:
        """Forget ids folded longer ago than the window (a timer's work); returns how many."""
        horizon = now - self.window_s
        old = [(key, int(v[1])) for key, v in list(self.table.items()) if v[0] < horizon]
        for key, partition in old:
            delete_outside_stream(self.table, key, partition)
        return len(old)
