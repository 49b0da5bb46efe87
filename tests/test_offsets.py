from __future__ import annotations

import random

from aiokafka import TopicPartition

from workers.answered import answered_by, commit_metadata, named_top
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


def test_a_commit_names_the_lines_above_it_still_unanswered() -> None:
    tracker = OffsetTracker()
    for offset in range(100, 110):
        tracker.begin(TP, offset)
    for offset in (100, 101, 103, 104, 105, 107, 108, 109):
        tracker.finish(TP, offset)
    state = tracker.snapshot(TP)
    assert state == (102, 110, [102, 106])
    metadata, covered = commit_metadata(*state)
    assert covered == 110
    answered = answered_by(102, metadata)
    assert [o for o in range(95, 115) if o in answered] == [103, 104, 105, 107, 108, 109]


def test_a_partitions_next_tenure_starts_where_the_last_commit_left_it() -> None:
    answered = answered_by(102, commit_metadata(102, 110, [102, 106])[0])
    tracker = OffsetTracker()
    tracker.inherit(TP, answered.high, answered.pending)
    assert tracker.snapshot(TP) == (102, 110, [102, 106])  # before anything is fetched again
    tracker.begin(TP, 102)
    tracker.finish(TP, 102)
    assert tracker.snapshot(TP) == (106, 110, [106])


def test_a_list_too_long_for_the_broker_is_cut_and_the_rest_waits() -> None:
    pending = list(range(0, 4000, 2))  # 2,000 unanswered lines among 4,000
    metadata, covered = commit_metadata(0, 4000, pending, limit=300)
    assert len(metadata) <= 300
    answered = answered_by(0, metadata)
    assert 0 < covered < 4000
    assert answered.high == covered
    # Nothing at or above the cut counts as answered; below it, exactly the odd offsets.
    assert not [o for o in range(covered, 4000) if o in answered]
    assert [o for o in range(covered) if o in answered] == list(range(1, covered, 2))


def test_metadata_laneway_did_not_write_says_nothing_above_the_offset() -> None:
    for foreign in (
        "",
        "hello",
        "lw1:x:1",
        "lw1:5:0,9",
        "lw1:5:3,1,0",
        "lw9:5:0",
        "lw1:5:0.3",  # runs are lw2's
        "lw2:5:0.9",  # a run beyond the span
        "lw2:5:0.0",  # a run of nothing
        "lw2:9999999999999:0.9999999999",  # more than any worker holds
    ):
        answered = answered_by(50, foreign)
        assert 50 not in answered
        assert 52 not in answered


def test_the_cut_never_moves_back_as_the_span_grows() -> None:
    """A later commit must name as answered every line an earlier one did: the cut depends on
    the unanswered lines alone, not on how many digits the span takes."""
    pending = list(range(1000, 5000, 2))
    covered = [commit_metadata(1000, high, pending)[1] for high in (1000 + 99_999, 1000 + 100_000)]
    assert covered[0] == covered[1]


def test_a_run_of_waiting_lines_takes_one_entry_however_long() -> None:
    """A team's job waiting for its budget is thousands of lines in a row: one run, so the
    commit's metadata names them all and every other team's line after them is answered."""
    low = 7_000
    waiting = list(range(low, low + 50_000))  # a whole job, parked
    others = [low + 50_000 + n for n in range(40)]  # answered behind it
    pending = [*waiting, low + 50_010, low + 50_020]  # two of the others still run
    pending.sort()
    metadata, covered = commit_metadata(low, others[-1] + 1, pending)
    assert covered == others[-1] + 1  # nothing cut
    assert len(metadata) < 40, metadata
    answered = answered_by(low, metadata)
    assert answered.pending == frozenset(pending)
    assert [o for o in others if o in answered] == [
        o for o in others if o not in (low + 50_010, low + 50_020)
    ]


def test_metadata_without_runs_is_written_as_before_runs() -> None:
    # A worker of an earlier version reads lw1 only: a commit with no run is written so.
    metadata, _ = commit_metadata(100, 110, [100, 102, 106])
    assert metadata == "lw1:10:0,2,4"
    metadata, _ = commit_metadata(100, 110, [100, 101, 102, 106])
    assert metadata == "lw2:10:0.3,4"
    assert answered_by(100, metadata).pending == frozenset({100, 101, 102, 106})


def test_what_a_commit_names_answered_tops_out_below_its_last_run() -> None:
    """A later commit must cover past the highest line an earlier one named answered; that
    line is found without walking a run of tens of thousands (checked against a walk)."""
    rng = random.Random(7)

    def walked(low: int, covered: int, pending: list[int]) -> int:
        unanswered = set(pending)
        return next((o for o in range(covered - 1, low - 1, -1) if o not in unanswered), low - 1)

    for _ in range(3000):
        low = rng.randint(0, 50)
        covered = low + rng.randint(0, 60)
        top = covered + rng.randint(0, 20)
        pending = set(rng.sample(range(low, top), rng.randint(0, top - low)))
        start = rng.randint(low, top)
        pending |= set(range(start, min(top, start + rng.randint(0, 40))))
        ordered = sorted(pending)
        assert named_top(low, covered, ordered) == walked(low, covered, ordered)
    # A whole job waiting at the end: the commit names the lines before it.
    assert named_top(100, 50_200, [*range(200, 50_200)]) == 199
    assert named_top(100, 50_200, [*range(100, 50_200)]) == 99  # none


def test_any_unanswered_lines_round_trip_through_the_metadata() -> None:
    """Whatever the unanswered lines (long runs, single lines, both), the metadata says of
    every line below its cut exactly what the worker knew, and nothing at or above it."""
    rng = random.Random(11)
    for _ in range(2000):
        low = rng.randint(0, 10**12)
        high = low + rng.randint(0, 300)
        pending: set[int] = set(rng.sample(range(low, high), rng.randint(0, high - low) // 3))
        for _ in range(rng.randint(0, 3)):
            start = rng.randint(low, high)
            pending |= set(range(start, min(high, start + rng.randint(1, 120))))
        ordered = sorted(pending)
        metadata, covered = commit_metadata(low, high, ordered, limit=rng.choice([40, 120, 3000]))
        answered = answered_by(low, metadata)
        assert answered.high == covered
        assert answered.pending == {o for o in ordered if o < covered}
        assert all((o in answered) == (o not in pending) for o in range(low, covered))
