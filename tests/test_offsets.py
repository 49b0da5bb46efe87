from __future__ import annotations

from aiokafka import TopicPartition

from workers.offsets import OffsetTracker

TP = TopicPartition("t", 0)


def test_commits_only_below_the_lowest_unfinished() -> None:
    tracker = OffsetTracker()
    for offset in (10, 11, 12):
        tracker.begin(TP, offset)
    tracker.finish(TP, 11)
    tracker.finish(TP, 12)
    assert tracker.committable() == {TP: 10}  # 10 still runs: a crash must re-run it
    tracker.mark_committed({TP: 10})
    assert tracker.committable() == {}
    tracker.finish(TP, 10)
    assert tracker.committable() == {TP: 13}


def test_forgotten_partitions_are_not_committed() -> None:
    tracker = OffsetTracker()
    tracker.begin(TP, 0)
    tracker.forget({TP})
    tracker.finish(TP, 0)
    assert tracker.committable() == {}


def test_a_run_from_before_a_rebalance_never_finishes_the_offset_fetched_again() -> None:
    tracker = OffsetTracker()
    tracker.begin(TP, 5)
    old = tracker.epoch(TP)
    tracker.forget({TP})  # taken away while offset 5 ran
    tracker.begin(TP, 5)  # back again: offset 5 fetched anew, and not done yet
    tracker.finish(TP, 5, old)  # the old run ends
    assert tracker.committable() == {TP: 5}
    tracker.finish(TP, 5, tracker.epoch(TP))
    assert tracker.committable() == {TP: 6}
