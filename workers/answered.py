"""Out-of-order commits: which lines above a partition's committed offset are answered.

Kafka keeps one committed offset per partition, so a line that waits (for its team's budget,
or a long generation) would hold back every result behind it until it ends. The batch lane
writes each result as it comes instead, and its transaction's offset commit carries, in the
commit's metadata, the lines still unanswered between the committed offset and the highest
offset fetched. A new owner of the partition (after a rebalance or a crash) runs exactly
those again and skips the rest: nothing twice, nothing lost. Confluent's Parallel Consumer
keeps its incomplete offsets in the commit metadata the same way. The interactive lanes
(``workers.lanes``) write the same metadata with their plain offset commits: a chat that
runs for minutes holds its partition's offset back, and what finished behind it (answered,
its usage event stored) is not run again after a rebalance.

The metadata is ``lw2:<span>:<runs>``: everything in ``[offset, offset + span)`` is answered
except the runs of offsets listed. A run is ``<gap>`` (one offset) or ``<gap>.<count>``
(``count`` offsets in a row); its gap is its distance from the last offset of the run before
it (the first run's from ``offset``, which is always its first). A team's job waiting for its
budget is thousands of lines in a row on a partition: one run. ``lw1`` is the same without
runs of more than one, and is what a commit that has none writes (as laneway did before
runs). The broker keeps at most ``offset.metadata.max.bytes`` (4096 by default) of it: a
longer list is cut short, and the lines above the cut are then committed by a later
transaction (their results wait in the ledger meanwhile).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Answered", "answered_by", "commit_metadata", "named_top"]

log = logging.getLogger(__name__)

_VERSION = "lw2"
_SINGLES = "lw1"  # the same, no run of more than one offset
# Below the broker's default offset.metadata.max.bytes (4096), with room to spare.
MAX_METADATA_CHARS = 3000
_SPAN_DIGITS = 19  # an offset is a signed 64-bit number
# More lines than a batch worker ever holds unanswered (parked, queued and running): a run
# longer is not laneway's.
_MAX_PENDING = 1_000_000


@dataclass(frozen=True, slots=True)
class Answered:
    """What a commit says is answered above its offset ``low``: the lines in ``[low, high)``
    but not in ``pending``."""

    low: int
    high: int
    pending: frozenset[int]

    def __contains__(self, offset: object) -> bool:
        # Only the span the commit names: a line below it was never fetched again unless
        # the log was reset (a topic made anew), and then it is a line to run.
        if not isinstance(offset, int):
            return False
        return self.low <= offset < self.high and offset not in self.pending

    def top(self) -> int:
        """The highest offset this commit names answered (``named_top``)."""
        return named_top(self.low, self.high, sorted(self.pending))


def commit_metadata(
    low: int, high: int, pending: Sequence[int], limit: int = MAX_METADATA_CHARS
) -> tuple[str, int]:
    """The metadata of a commit at ``low`` whose lines up to ``high`` (exclusive) are done
    except ``pending`` (sorted, all in ``[low, high)``), and the ``high`` it covers: the
    first pending offset left out when the list is too long, else ``high``."""
    if high <= low:
        return "", low
    entries: list[str] = []
    # The span is sized at its widest, not as written: a span that gains a digit must not
    # move the cut back below lines an earlier commit named as answered.
    size = len(_VERSION) + _SPAN_DIGITS + 2
    previous = low
    for first, count in _runs(pending):
        entry = str(first - previous) if count == 1 else f"{first - previous}.{count}"
        if size + len(entry) + 1 > limit:
            high = first  # it and everything above: for a later commit
            break
        entries.append(entry)
        size += len(entry) + 1
        previous = first + count - 1
    if high <= low:
        return "", low
    version = _VERSION if any("." in entry for entry in entries) else _SINGLES
    return f"{version}:{high - low}:{','.join(entries)}", high


def named_top(low: int, covered: int, pending: Sequence[int]) -> int:
    """The highest offset a commit at ``low`` covering up to ``covered`` names answered
    (``pending``: sorted, the unanswered lines); ``low - 1`` when it names none. A later
    commit must cover past it: covering less, it would un-say a line whose result is out."""
    end = bisect.bisect_left(pending, covered)  # pending[:end] are below the cut
    if end == 0 or pending[end - 1] != covered - 1:
        return covered - 1
    # The cut's last run ends at covered - 1: the first offset of that run, found by halving
    # (in a run, offsets and positions rise together).
    first, last = 0, end - 1
    while first < last:
        middle = (first + last) // 2
        if pending[end - 1] - pending[middle] == end - 1 - middle:
            last = middle
        else:
            first = middle + 1
    return max(pending[first] - 1, low - 1)


def _runs(pending: Sequence[int]) -> list[tuple[int, int]]:
    """``pending`` (sorted, distinct) as runs of offsets in a row: (first, count). Each run's
    end is found by galloping (in a run, offsets and positions rise together): a commit
    names a whole waiting job of tens of thousands of lines in a few dozen steps, not one
    per line, every commit interval."""
    runs: list[tuple[int, int]] = []
    size, start = len(pending), 0
    while start < size:
        first, end, step = pending[start], start, 1

        def in_run(index: int, first: int = first, start: int = start) -> bool:
            return index < size and pending[index] - first == index - start

        while in_run(end + step):
            end += step
            step *= 2
        while step > 1:
            step //= 2
            if in_run(end + step):
                end += step
        runs.append((first, end - start + 1))
        start = end + 1
    return runs


def answered_by(offset: int, metadata: str | None) -> Answered:
    """What the commit at ``offset`` with ``metadata`` says is answered. Metadata laneway did
    not write (an older version's, another tool's) says nothing above ``offset``: those lines
    run again, as any line above a committed offset did before."""
    if not metadata:
        return Answered(offset, offset, frozenset())
    try:
        return _parse(offset, metadata)
    except ValueError:
        log.warning("commit metadata %r at offset %d not understood: ignored", metadata, offset)
        return Answered(offset, offset, frozenset())


def _parse(offset: int, metadata: str) -> Answered:
    version, span_text, runs = metadata.split(":", 2)
    span = int(span_text)
    if version not in (_VERSION, _SINGLES) or span < 0:
        raise ValueError(metadata)
    pending: list[int] = []
    previous = offset
    for entry in filter(None, runs.split(",")):
        gap_text, _, count_text = entry.partition(".")
        step, count = int(gap_text), int(count_text or "1")
        if step < 0 or (pending and step == 0) or count < 1:
            raise ValueError(metadata)  # not in order
        if count > 1 and version == _SINGLES:
            raise ValueError(metadata)
        first = previous + step
        if first + count > offset + span or len(pending) + count > _MAX_PENDING:
            raise ValueError(metadata)  # beyond the span, or more than a worker ever holds
        pending.extend(range(first, first + count))
        previous = first + count - 1
    return Answered(offset, offset + span, frozenset(pending))
