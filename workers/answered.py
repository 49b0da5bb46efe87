"""Out-of-order commits: which lines above a partition's committed offset are answered.

Kafka keeps one committed offset per partition, so a line that waits (for its team's budget,
or a long generation) would hold back every result behind it until it ends. The batch lane
writes each result as it comes instead, and its transaction's offset commit carries, in the
commit's metadata, the lines still unanswered between the committed offset and the highest
offset fetched. A new owner of the partition (after a rebalance or a crash) runs exactly
those again and skips the rest: nothing twice, nothing lost. Confluent's Parallel Consumer
keeps its incomplete offsets in the commit metadata the same way.

The metadata is ``lw1:<span>:<gaps>``: everything in ``[offset, offset + span)`` is answered
except the offsets listed, each given as its distance from the previous one (the first from
``offset``, which is always the first of them). The broker keeps at most
``offset.metadata.max.bytes`` (4096 by default) of it: a longer list is cut short, and the
lines above the cut are then committed by a later transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Answered", "answered_by", "commit_metadata"]

log = logging.getLogger(__name__)

_VERSION = "lw1"
# Below the broker's default offset.metadata.max.bytes (4096), with room to spare.
MAX_METADATA_CHARS = 3000
_SPAN_DIGITS = 19  # an offset is a signed 64-bit number


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


def commit_metadata(
    low: int, high: int, pending: Sequence[int], limit: int = MAX_METADATA_CHARS
) -> tuple[str, int]:
    """The metadata of a commit at ``low`` whose lines up to ``high`` (exclusive) are done
    except ``pending`` (sorted, all in ``[low, high)``), and the ``high`` it covers: the
    first pending offset left out when the list is too long, else ``high``."""
    if high <= low:
        return "", low
    gaps: list[str] = []
    # The span is sized at its widest, not as written: a span that gains a digit must not
    # move the cut back below lines an earlier commit named as answered.
    size = len(_VERSION) + _SPAN_DIGITS + 2
    previous = low
    for offset in pending:
        gap = str(offset - previous)
        if size + len(gap) + 1 > limit:
            high = offset  # it and everything above: for a later commit
            break
        gaps.append(gap)
        size += len(gap) + 1
        previous = offset
    if high <= low:
        return "", low
    return f"{_VERSION}:{high - low}:{','.join(gaps)}", high


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
    version, span_text, gaps = metadata.split(":", 2)
    span = int(span_text)
    if version != _VERSION or span < 0:
        raise ValueError(metadata)
    pending: list[int] = []
    previous = offset
    for gap in filter(None, gaps.split(",")):
        step = int(gap)
        if step < 0 or (pending and step == 0):
            raise ValueError(metadata)  # not in order
        previous += step
        pending.append(previous)
    if pending and pending[-1] >= offset + span:
        raise ValueError(metadata)  # beyond the span
    return Answered(offset, offset + span, frozenset(pending))
