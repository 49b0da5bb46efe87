"""At-least-once offset bookkeeping: commit only below the lowest unfinished record."""

from __future__ import annotations

from aiokafka import TopicPartition

__all__ = ["OffsetTracker"]

# Offsets kept per partition that a run of an ended tenure finished (see ``finish``).
_MAX_FINISHED_LATE = 4096


class OffsetTracker:
    """Tracks in-flight offsets per partition.

    Requests finish out of order; the committable offset of a partition is its lowest
    unfinished offset, or one past the highest finished when none is in flight.
    """

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}
        # Bumped whenever a partition is taken away: work fetched before that must not
        # finish an offset of the partition's next tenure here (the same offsets come back
        # when it returns, and the new fetch of one is not done because an old run ended).
        self._epochs: dict[TopicPartition, int] = {}
        # Offsets a run of an ended tenure finished (it ran on while its partition was away
        # and answered): the partition's next tenure here need not run them again.
        self._finished_late: dict[TopicPartition, set[int]] = {}

    def epoch(self, tp: TopicPartition) -> int:
        """The partition's current tenure on this worker: pass it back to ``finish``."""
        return self._epochs.get(tp, 0)

    def current(self, tp: TopicPartition, epoch: int) -> bool:
        """Work fetched in tenure ``epoch`` still belongs here."""
        return self._epochs.get(tp, 0) == epoch

    def begin(self, tp: TopicPartition, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def finish(self, tp: TopicPartition, offset: int, epoch: int | None = None) -> None:
        """``offset`` is done with; when fetched in a tenure since ended, only noted (see
        ``finished_late``)."""
        if epoch is not None and not self.current(tp, epoch):
            late = self._finished_late.setdefault(tp, set())
            if len(late) < _MAX_FINISHED_LATE:
                late.add(offset)
            return
        pending = self._pending.get(tp)
        if pending is not None:
            pending.discard(offset)

    def finished_late(self, tp: TopicPartition, offset: int) -> bool:
        """Whether a run of an earlier tenure finished ``offset`` after its partition was
        taken away (once: the answer is used up)."""
        late = self._finished_late.get(tp)
        if late is None or offset not in late:
            return False
        late.discard(offset)
        return True

    def kept(self, partitions: set[TopicPartition]) -> None:
        """A rebalance gave this worker ``partitions``: what runs of the others finished
        late is no longer of use (their next owner runs what was not committed)."""
        for tp in set(self._finished_late) - partitions:
            del self._finished_late[tp]

    def in_flight(self, tp: TopicPartition | None = None) -> int:
        if tp is not None:
            return len(self._pending.get(tp, ()))
        return sum(len(p) for p in self._pending.values())

    def committable(self, only: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Offsets to commit now (those that moved since the last ``mark_committed``)."""
        out: dict[TopicPartition, int] = {}
        for tp, nxt in self._next.items():
            if only is not None and tp not in only:
                continue
            pending = self._pending.get(tp)
            offset = min(pending) if pending else nxt
            if self._committed.get(tp) != offset:
                out[tp] = offset
        return out

    def snapshot(self, tp: TopicPartition) -> tuple[int, int, list[int]] | None:
        """``(low, high, pending)``: the lowest unfinished offset (``high`` when none is),
        one past the highest fetched, and the unfinished ones, sorted; None when the
        partition has none of these yet."""
        high = self._next.get(tp)
        if high is None:
            return None
        pending = sorted(self._pending.get(tp, ()))
        return (pending[0] if pending else high), high, pending

    def partitions(self) -> list[TopicPartition]:
        return list(self._next)

    def inherit(self, tp: TopicPartition, high: int, pending: frozenset[int]) -> None:
        """Start a tenure where the last commit left the partition: ``pending`` still to
        run, everything else below ``high`` done with (``workers.answered``)."""
        self._next[tp] = max(self._next.get(tp, 0), high)
        self._pending.setdefault(tp, set()).update(pending)

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        self._committed.update(offsets)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Drop partitions this worker no longer owns (after a rebalance)."""
        for tp in partitions:
            self._pending.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)
            self._epochs[tp] = self._epochs.get(tp, 0) + 1
