"""When a usage event counts: by its own time, the broker's, or the app's clock.

Workers stamp usage by Redis's clock, which this app reads too, so an event's ``ts`` is when it
happened, give or take the clocks' error. This module decides what to do when it is not:

- More than 60 s ahead of the app's clock, or more than the hours the tables keep before its
  record was stored, an event counts when the broker stored the record (``restamped_at``).
  That time is the same however late the record is read, so a restart counts it in the same hour.
- Less ahead than that is the clocks' error: its rollup hour is its own, but the live views
  (breaker, canary and shadow windows, a partition's clock) take it at most 2 s ahead
  (``as_live``): a bucket ahead would count until its time came, a clock ahead would close
  hours early.
- Older than the hours the tables keep, an event is not counted (``too_old``): its hour was
  published, and a record of it now would clash with the one published.
- Each partition's clock (the newest event time folded) closes hours (``passed``). How far
  behind the partitions are read tells when the app reads a backlog (``reading_backlog``): an
  empty breaker window then says nothing.

A writer with a wrong clock writes every record wrong, so each kind of warning is logged once a
minute, with how many went unsaid in between.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from laneway.schema import UsageEvent
from streams.metrics import RESTAMPED
from streams.variance import WINDOW_HOURS, hour_of

__all__ = ["RETENTION_HOURS", "EventTimes", "as_live"]

log = logging.getLogger(__name__)

# Hours of rollups kept: the 24 complete hours the variance needs, the current one, and one
# more so an hour that closes late is still there when its last events arrive.
RETENTION_HOURS = WINDOW_HOURS + 2

# Workers stamp usage by Redis's clock, which this app reads too (each process learns it
# every 30 s): an event more than this far ahead of it says more about its writer than about
# when it happened, and is counted when the broker stored it.
_MAX_AHEAD_S = 60.0
# Less than that ahead, an event is the clocks' error: its rollup hour is its own, but the
# breaker windows and the partition's clock take it as no later than this ahead of now (a
# bucket ahead would count until its time came; a clock ahead would close hours early).
_CLOCK_SLACK_S = 2.0
# An event this many hours before its record was stored counts in the hour it was stored:
# two fewer than the hours kept, so one stored in time is not read (an hour or two late, in a
# catch-up) only once its own hour has left the tables.
_BEHIND_HOURS = RETENTION_HOURS - 2
# One warning a minute of each kind of record counted at another time than its own.
_WARN_EVERY_S = 60.0
# The app is reading a backlog while the records it read within this long were stored, and
# happened, longer ago than the breaker window (a catch-up reads without pause).
_READING_WITHIN_S = 5.0


def _utc(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return repr(ts)


def as_live(event: UsageEvent, now: float) -> UsageEvent:
    """``event`` as the sliding windows and the partition's clock take it: no later than the
    app's clock shows, give or take the clocks' error."""
    if event.ts > now + _CLOCK_SLACK_S:
        return event.model_copy(update={"ts": now + _CLOCK_SLACK_S})
    return event


class EventTimes:
    """The usage stream's clock per partition, and the time each of its events counts at."""

    def __init__(self) -> None:
        self.stream_clock: dict[int, float] = {}  # partition → newest event time seen
        self._started: float | None = None  # see ``begin``
        self._last_event: dict[int, float] = {}  # partition → wall time of its last event
        # partition → (when its last record was read, how long before that it was stored
        # and happened): how far behind the app reads
        self._read_lag: dict[int, tuple[float, float]] = {}
        self._warned: dict[str, tuple[float, int]] = {}  # kind → (last warned, records since)

    def read(self, partition: int, ts: float, stored_at: float | None, now: float) -> None:
        """A record of ``partition`` with time ``ts``, stored at ``stored_at``, was read now."""
        # Old by both its own time and the broker's: a clock that is off (the writer's, or
        # a producer's on a topic that keeps producer times) makes only one of them old.
        newest = ts if stored_at is None else max(ts, stored_at)
        self._read_lag[partition] = (now, now - newest)

    def restamped_at(
        self,
        event: UsageEvent,
        partition: int,
        offset: int,
        stored_at: float | None,
        now: float,
    ) -> float | None:
        """When the broker stored ``event`` (or, with no plausible stored time, now) if no
        clock could show its own time then; ``None`` if its own time stands. Decided the same
        however late the record is read (a restart reads some records again)."""
        stored = stored_at if stored_at is not None and stored_at <= now + _MAX_AHEAD_S else None
        # Ahead of when it was stored, where that is known: the same answer however late the
        # record is read (ahead of the reading, a record re-read after a restart 45 s later
        # could count in the next hour too).
        reference = now if stored is None else stored
        if event.ts > reference + _MAX_AHEAD_S:
            # Not a time Redis's clock showed yet: counted when stored (or, with no plausible
            # stored time, now), rather than moving the stream's clock on.
            kind, at = "ahead", reference
            how = f"{event.ts - reference:.0f} s ahead of the " + (
                "app's clock" if stored is None else "broker's when it was stored"
            )
            when = "when it was read" if stored is None else "when it was stored"
        elif stored is not None and hour_of(event.ts) < hour_of(stored) - _BEHIND_HOURS:
            # A day or more before it reached the topic (its writer's clock far behind, or
            # a worker that held it that long): its own hour has left the tables, so it is
            # billed in the hour it was stored in rather than lost.
            kind, at = "behind", stored
            how = f"{(stored - event.ts) / 3600:.1f} h before it was stored"
            when = "when it was stored"
        else:
            return None
        RESTAMPED.labels(kind).inc()
        self._warn(
            kind,
            now,
            "usage record at %d/%d says %s, %s; counted at %s, %s",
            partition,
            offset,
            _utc(event.ts),
            how,
            _utc(at),
            when,
        )
        return at

    def too_old(self, event: UsageEvent, partition: int, offset: int, now: float) -> bool:
        """Whether ``event``'s hour has left the tables (published, and maybe deleted): a
        record of it now would clash with the one published. A backlog older than they keep."""
        if hour_of(event.ts) >= hour_of(now) - RETENTION_HOURS:
            return False
        self._warn(
            "too_old",
            now,
            "usage record at %d/%d of %s is older than the %d hours kept; not counted",
            partition,
            offset,
            _utc(event.ts),
            RETENTION_HOURS,
        )
        return True

    def advance(self, partition: int, ts: float, now: float) -> None:
        """An event of (live) time ``ts`` from ``partition`` is folded at wall time ``now``."""
        self._last_event[partition] = now
        self.stream_clock[partition] = max(self.stream_clock.get(partition, 0.0), ts)

    def begin(self, now: float) -> None:
        """The first publish looks at ``now``: a partition with no event yet is idle since
        then. Not since the process was built: its clock is synced to Redis's only once the
        app starts, and a machine's clock ahead of it would close such hours that much late."""
        if self._started is None:
            self._started = now

    def passed(self, partition: int, at: float, now: float, idle_s: float) -> bool:
        """Whether ``partition``'s events passed ``at``, or it has been idle ``idle_s`` and
        the wall clock passed it."""
        if self.stream_clock.get(partition, 0.0) >= at:
            return True
        idle_since = self._last_event.get(
            partition, now if self._started is None else self._started
        )
        return now >= at and now - idle_since >= idle_s

    def reading_backlog(self, now: float, window_s: float, *, levels_raised: bool) -> bool:
        """Whether a partition is being read further behind than the breaker window: its
        events reach the window only once read, so an empty window says nothing (after a
        restart with a backlog, raised levels would step down, then jump back up)."""
        behind = [
            lag
            for read_at, lag in self._read_lag.values()
            if now - read_at <= _READING_WITHIN_S and lag > window_s
        ]
        if behind and levels_raised:
            self._warn(
                "backlog",
                now,
                "reading usage %.0f s behind: raised breaker levels are held",
                max(behind),
            )
        return bool(behind)

    def _warn(self, kind: str, now: float, message: str, *args: object) -> None:
        """Log one warning of ``kind`` a minute, with how many went unsaid in between (a
        writer with a wrong clock writes every record wrong)."""
        last, unsaid = self._warned.get(kind, (float("-inf"), 0))
        if now - last < _WARN_EVERY_S:
            self._warned[kind] = (last, unsaid + 1)
            return
        self._warned[kind] = (now, 0)
        if unsaid:
            message, args = message + " (and %d more since the last warning)", (*args, unsaid)
        log.warning(message, *args)
