"""The dispatch queue, the learned upstream capacity and a shared engine's shares, in memory."""

from __future__ import annotations

import time
from dataclasses import replace

import redis.asyncio as aioredis
from aiokafka import TopicPartition

from laneway.constants import HEARTBEAT_TTL_S, RedisKeys
from laneway.errors import Dropped, Expired, Superseded
from tests.stack import envelope
from workers.dispatch import Dispatcher, DispatchQueue, Work
from workers.fleet import FleetShare, Member, allocate
from workers.learned_slots import LearnedSlots
from workers.shield import CancelShield

TP = TopicPartition("t.req.completion.hi", 0)


def _work(offset: int = 0, **fields: object) -> Work:
    return Work(TP, offset, envelope(**fields))


def test_hi_band_first_then_earliest_deadline() -> None:
    now = time.time()
    queue = DispatchQueue()
    late_hi = _work(0, band="hi", deadline_ts=now + 9)
    lo = _work(1, band="lo", deadline_ts=now + 1)
    early_hi = _work(2, band="hi", deadline_ts=now + 2)
    no_deadline = _work(3, band="hi", deadline_ts=None)
    for work in (late_hi, lo, early_hi, no_deadline):
        queue.push(work)
    assert [queue.pop() for _ in range(4)] == [early_hi, late_hi, no_deadline, lo]
    assert queue.pop() is None


def test_removed_work_is_never_popped() -> None:
    queue = DispatchQueue()
    first, second = _work(0), _work(1)
    queue.push(first)
    queue.push(second)
    assert queue.remove(first.env.id) is first
    assert len(queue) == 1
    assert queue.pop() is second
    assert queue.pop() is None


def test_a_newer_keystroke_takes_its_older_ones_out_and_no_one_elses() -> None:
    queue = DispatchQueue()
    old = _work(0, session="doc", seq=1)
    other_team = _work(1, session="doc", seq=1, team="team-b")
    other_doc = _work(2, session="notes", seq=1)
    for work in (old, other_team, other_doc):
        queue.push(work)
    newer = envelope(session="doc", seq=2)
    assert queue.superseded(newer) == [old]
    assert {w.env.id for w in queue} == {other_team.env.id, other_doc.env.id}


def test_expired_work_leaves_by_its_deadline() -> None:
    now = time.time()
    queue = DispatchQueue()
    soon = _work(0, deadline_ts=now + 1)
    later = _work(1, deadline_ts=now + 5)
    queue.push(soon)
    queue.push(later)
    assert queue.next_deadline() == soon.env.deadline_ts
    assert queue.expired(now + 2) == [soon]
    assert queue.next_deadline() == later.env.deadline_ts
    assert [w.env.id for w in queue] == [later.env.id]


def test_work_queued_again_without_its_deadline_is_not_expired_by_its_first_wait() -> None:
    # A request shed by memory pressure after it started is queued again under its id, with
    # no start deadline (it met it); the deadline of its first wait no longer applies.
    now = time.time()
    queue = DispatchQueue()
    shed = _work(0, band="lo", deadline_ts=now + 1)
    queue.push(shed)
    assert queue.pop() is shed  # it starts, and is shed later
    waiting = _work(1, band="lo", deadline_ts=now + 30)  # came meanwhile, with a deadline
    queue.push(waiting)
    again = Work(shed.tp, shed.offset, shed.env.model_copy(update={"deadline_ts": None}))
    queue.push(again, front=True)
    assert queue.next_deadline() == waiting.env.deadline_ts
    assert queue.expired(now + 2) == []
    # First in its band again: with no deadline it sorted after every request of its band
    # that has one, and a busy band could keep it waiting (its offset pending) for good.
    assert queue.pop() is again
    assert queue.pop() is waiting


def test_dispatcher_starts_no_more_than_capacity_and_asks_the_shield_at_start() -> None:
    queue = DispatchQueue()
    started: list[Work] = []
    dropped: list[tuple[Work, Dropped]] = []
    stale = {"stale-one"}
    dispatcher = Dispatcher(
        queue,
        capacity=lambda: 2,
        verdict=lambda env, _now: Superseded("newer seq") if env.id in stale else None,
        start=started.append,
        drop=lambda work, reason: dropped.append((work, reason)),
    )
    works = [_work(i) for i in range(3)] + [_work(3, id="stale-one")]
    for work in works:
        queue.push(work)
    dispatcher.dispatch()
    assert started == works[:2]
    assert len(queue) == 2
    dispatcher.done()
    dispatcher.dispatch()
    assert started == works[:3]
    dispatcher.done()
    dispatcher.dispatch()  # the last one turned stale while it waited: dropped, never started
    assert started == works[:3]
    assert [(w.env.id, type(r)) for w, r in dropped] == [("stale-one", Superseded)]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1000


class _Upstream:
    """A server running ``slots`` requests at once, 10 ms to a first byte and 300 ms a
    request, driven by ``LearnedSlots`` with always more work waiting than it can take."""

    def __init__(self, slots: LearnedSlots, clock: _Clock, upstream_slots: int) -> None:
        self.learned, self.clock, self.slots = slots, clock, upstream_slots
        self.running: dict[str, float] = {}  # on the upstream: id → when it ends
        self.queued: list[str] = []  # sent, waiting upstream
        self.sent = 0
        self.waited = 0  # requests that waited upstream

    def serve(self, rounds: int) -> None:
        for _ in range(rounds):
            while self.learned.in_flight < self.learned.capacity():
                rid = f"r{self.sent}"
                self.sent += 1
                self.learned.sent(rid, 100)
                self.queued.append(rid)
            self.clock.advance(10)
            for rid, ends in list(self.running.items()):
                if ends <= self.clock.now:
                    del self.running[rid]
                    self.learned.done(rid)
            self.waited += max(0, len(self.queued) - (self.slots - len(self.running)))
            while self.queued and len(self.running) < self.slots:
                rid = self.queued.pop(0)
                self.running[rid] = self.clock.now + 0.3
                self.learned.first_byte(rid)


def test_learned_slots_find_the_upstreams_capacity_and_hold_to_it() -> None:
    clock = _Clock()
    slots = LearnedSlots(initial=2, probe_s=10.0, stall_floor_ms=20.0, clock=clock)
    upstream = _Upstream(slots, clock, upstream_slots=6)
    upstream.serve(300)  # 3 s
    assert slots.learned
    assert slots.limit == 6
    stalls, waited = slots.stalls, upstream.waited
    upstream.serve(3000)  # 30 s
    # A probe past the capacity every 10 s: each stalled and the limit went back, and each
    # cost one request at most one request's time (30 rounds) in the upstream's queue.
    assert slots.limit == 6
    assert slots.stalls <= stalls + 3
    assert upstream.waited - waited <= 3 * 30


def test_learned_slots_follow_a_server_that_grows() -> None:
    clock = _Clock()
    slots = LearnedSlots(initial=2, probe_s=1.0, stall_floor_ms=20.0, clock=clock)
    upstream = _Upstream(slots, clock, upstream_slots=4)
    upstream.serve(300)
    assert slots.limit == 4
    upstream.slots = 7
    upstream.serve(1000)  # a probe a second finds the room
    assert slots.limit == 7


def _warmed(clock: _Clock) -> LearnedSlots:
    """A limit of 4, having learned what an unqueued first byte takes (5 ms)."""
    slots = LearnedSlots(initial=4, stall_floor_ms=20.0, clock=clock)
    for i in range(10):
        slots.sent(f"w{i}", 100)
        clock.advance(5)
        slots.first_byte(f"w{i}")
        slots.done(f"w{i}")
    return slots


def test_no_more_is_sent_while_a_request_stalls_upstream() -> None:
    clock = _Clock()
    slots = _warmed(clock)
    slots.sent("a", 100)
    slots.sent("b", 100)
    clock.advance(5)
    slots.first_byte("a")
    clock.advance(200)  # "b" has waited far past any first byte seen
    assert slots.capacity() == 2  # what is out already: nothing more
    assert slots.limit == 1
    slots.first_byte("b")
    assert slots.capacity() == slots.limit


def test_a_request_the_upstream_never_answers_holds_the_rest_back_for_one_probe_interval() -> None:
    # No queue count from the server. One request of ours gets no first byte, ever: it is
    # taken for a stall and holds the rest back, but only until a probe goes out and the
    # server starts it at once, overtaking the stuck one.
    clock = _Clock()
    slots = _warmed(clock)
    slots.sent("stuck", 100)
    clock.advance(200)
    assert slots.capacity() == 1  # what is out already: nothing more
    clock.advance(slots.probe_s * 1000 / 2)
    assert slots.capacity() == 1
    clock.advance(slots.probe_s * 1000 / 2)
    assert slots.capacity() == 2  # held for probe_s: one more goes out
    slots.sent("probe", 100)
    assert slots.capacity() == 2  # and only one
    clock.advance(5)
    slots.first_byte("probe")
    assert slots.capacity() == 4  # the stuck one waits in no queue: the cut is undone
    slots.done("probe")
    clock.advance(60_000)
    assert slots.capacity() == 4  # and it holds nothing back while it stays stuck


def _full_with_four(clock: _Clock, limit: int) -> LearnedSlots:
    """A limit of ``limit``, 4 requests of ours streaming (the server's every slot)."""
    slots = _warmed(clock)
    slots.limit = limit
    for i in range(4):
        slots.sent(f"r{i}", 100)
    clock.advance(5)
    for i in range(4):
        slots.first_byte(f"r{i}")
    return slots


def test_a_request_that_waited_in_the_queue_itself_overtakes_nothing() -> None:
    # A, then B 25 ms later, queue on a full server; B reaches its queue first (a new
    # connection for A, or A's long prompt tokenized longer). B starting first shows no
    # stuck A: it waited a whole second itself.
    clock = _Clock()
    slots = _full_with_four(clock, limit=6)
    slots.sent("A", 100)
    clock.advance(25)
    slots.sent("B", 100)
    clock.advance(50)
    assert (slots.capacity(), slots.limit) == (6, 4)  # both stall: held, cut to 4
    clock.advance(1000)
    slots.done("r0")
    slots.first_byte("B")
    assert (slots.capacity(), slots.limit) == (5, 4)  # A still queued: held, still 4


def test_probes_into_a_long_queue_come_ever_further_apart() -> None:
    # Every slot on a minute-long chat, and A queued behind them: a real queue. The hold
    # lets a probe out after 10 s; it queues behind A, which shows the queue, and the next
    # comes 20 s after it, then 40 s.
    clock = _Clock()
    slots = _full_with_four(clock, limit=5)
    slots.sent("A", 100)
    sent = {"A": clock.now}
    for _ in range(600):  # a minute, the dispatcher asking every 100 ms
        clock.advance(100)
        while slots.in_flight < slots.capacity():
            sent[f"P{len(sent)}"] = clock.now
            slots.sent(f"P{len(sent) - 1}", 100)
    assert list(sent) == ["A", "P1", "P2"]
    assert round(sent["P2"] - sent["P1"]) == 20


def _due_a_probe(clock: _Clock) -> LearnedSlots:
    """One request stuck with no first byte, held back on for probe_s: a probe is due."""
    slots = _warmed(clock)
    slots.sent("stuck", 100)
    clock.advance(200)
    assert slots.capacity() == 1
    clock.advance(slots.probe_s * 1000)
    assert slots.capacity() == 2
    return slots


def test_a_probe_stuck_too_does_not_hold_the_pool_for_good() -> None:
    clock = _Clock()
    slots = _due_a_probe(clock)
    slots.sent("stuck too", 100)
    clock.advance(200)
    assert slots.capacity() == 2  # the probe stalls too: held
    clock.advance(2 * slots.probe_s * 1000 - 201)
    assert slots.capacity() == 2  # the next probe is due 20 s after the last
    clock.advance(1)
    assert slots.capacity() == 3
    slots.sent("probe", 100)
    clock.advance(5)
    slots.first_byte("probe")  # started at once: the two before it wait in no queue
    assert slots.capacity() == 4


def test_a_probe_waits_for_a_request_to_take_it() -> None:
    # Asked for room with nothing to send (another pool's turn on a shared engine): the
    # probe's room stays until a request takes it.
    clock = _Clock()
    slots = _due_a_probe(clock)
    clock.advance(1)
    assert slots.capacity() == 2  # not used up by being asked
    slots.sent("probe", 100)
    clock.advance(1)
    assert slots.capacity() == 2  # taken: no more until it starts


def test_a_long_prefill_that_a_later_request_overtakes_is_no_stall() -> None:
    clock = _Clock()
    slots = _warmed(clock)
    slots.sent("cold-prefix", 100)
    clock.advance(25)
    slots.sent("warm", 100)
    clock.advance(5)
    slots.first_byte("warm")  # started before the earlier one: that one is no queue
    clock.advance(500)
    assert slots.capacity() == 4
    slots.first_byte("cold-prefix")
    assert (slots.limit, slots.stalls) == (4, 0)


def test_upstream_metrics_showing_a_queue_cut_the_limit() -> None:
    slots = LearnedSlots(initial=8, clock=_Clock())
    for i in range(8):
        slots.sent(f"r{i}", 10)
    slots.upstream_load(waiting=3)
    assert slots.limit == 5


def test_a_request_stuck_upstream_holds_back_nothing_while_the_upstream_says_none_waits() -> None:
    # The server publishes its queue: empty. One request of ours gets no first byte (stuck on
    # its own, or a long prefill); the others must still go out, up to the limit.
    clock = _Clock()
    slots = _warmed(clock)
    slots.upstream_load(waiting=0, fresh_s=3.0)
    slots.sent("stuck", 100)
    clock.advance(500)  # far past any first byte seen
    assert slots.capacity() == 4  # nothing held back, and the limit stays
    slots.upstream_load(waiting=0, fresh_s=3.0)
    slots.first_byte("stuck")
    slots.done("stuck")
    assert (slots.limit, slots.stalls) == (4, 0)
    # Without a fresh count the same wait is read as a full server, as before.
    slots.sent("late", 100)
    clock.advance(4000)
    assert slots.capacity() == 1  # what is out already: nothing more
    assert slots.stalls == 1


def test_shares_go_to_completions_then_chats_then_batch_beyond_the_reserve() -> None:
    demand = {"completion": 3, "chat": 4, "batch": 20}
    assert allocate(8, 1, demand) == {"completion": 3, "chat": 4, "batch": 1}
    assert allocate(8, 1, {"completion": 0, "chat": 0, "batch": 20}) == {
        "completion": 0,
        "chat": 0,
        "batch": 7,
    }
    # A reserve above what interactive work asks now still keeps batch out of it.
    assert allocate(8, 5, {"completion": 1, "chat": 0, "batch": 20})["batch"] == 3
    # Interactive work beyond the engine: completions first, chat gets the rest, batch none.
    assert allocate(4, 1, {"completion": 3, "chat": 5, "batch": 9}) == {
        "completion": 3,
        "chat": 1,
        "batch": 0,
    }


def _member(worker: str, cls: str, running: int, queued: int = 0) -> Member:
    return Member(worker, cls, running, queued, capacity=8, ts=time.time())


def test_batch_gives_back_what_interactive_work_needs_and_no_more() -> None:
    # A client that never connects: the view below is set by hand.
    fleet = FleetShare(aioredis.Redis(), RedisKeys("t"), "gpu", "batch-1", "batch", reserve_min=1)
    fleet.connected = True
    fleet.members = {"c": _member("c", "completion", running=1, queued=2)}
    fleet._mine = _member("batch-1", "batch", running=7, queued=10)
    # 8 slots: completions ask 3, batch may keep 8 - 3 = 5 of its 7.
    assert fleet.excess() == 2
    assert fleet.room(5, 10) == 0
    fleet.members = {"c": _member("c", "completion", running=0)}
    assert fleet.room(5, 10) == 2  # all but the reserve (1)


def test_without_a_view_batch_starts_nothing_and_interactive_runs_alone() -> None:
    batch = FleetShare(aioredis.Redis(), RedisKeys("t"), "gpu", "b", "batch")
    batch._mine = _member("b", "batch", running=2)
    assert batch.room(2, 0) == 0
    assert batch.excess() == 0  # what runs finishes; nothing new starts
    completion = FleetShare(aioredis.Redis(), RedisKeys("t"), "gpu", "c", "completion")
    completion._mine = _member("c", "completion", running=2)
    assert completion.room(2, 0) == 6


def test_a_session_name_belongs_to_its_team() -> None:
    shield = CancelShield()
    mine = envelope(team="team-a", session="src/app.py", seq=5)
    shield.started(mine)
    theirs = envelope(team="team-b", session="src/app.py", seq=999_999_999)
    assert shield.observe(theirs) == []  # another team's counter aborts nothing of mine
    assert shield.verdict(envelope(team="team-a", session="src/app.py", seq=6)) is None
    newer = envelope(team="team-a", session="src/app.py", seq=7)
    assert shield.observe(newer) == [mine.id]
    assert isinstance(
        shield.verdict(envelope(team="team-a", session="src/app.py", seq=6)), Superseded
    )


def test_a_member_that_stopped_beating_drops_out_of_the_view() -> None:
    """A completion worker killed -9 while it ran 8 leaves its entry in Redis: its slots must
    not count against the shared engine for good."""
    fleet = FleetShare(aioredis.Redis(), RedisKeys("t"), "gpu", "c-live", "completion")
    fleet.connected = True
    now = time.time()
    fleet._mine = replace(_member("c-live", "completion", 0), ts=now)
    fleet.members = {
        "dead": replace(_member("dead", "completion", 8), ts=now - HEARTBEAT_TTL_S - 5)
    }
    assert fleet.room(0, 3) == 3


def test_one_burst_larger_than_the_engine_does_not_keep_batch_out() -> None:
    """Batch's reserve follows interactive's recent peak, but never the whole engine: one
    burst of more than it holds must not shut batch out for the peak window."""
    now = [1000.0]
    fleet = FleetShare(aioredis.Redis(), RedisKeys("t"), "gpu", "b", "batch", clock=lambda: now[0])
    fleet.connected = True
    fleet._published = (0, 10, 8)  # nothing to publish (no Redis here)
    fleet.members["c"] = Member("c", "completion", 8, 20, 8, now[0])  # 28 asked at once
    fleet.local(0, 10, 8)
    now[0] += 5  # the burst is over, well within the peak window
    fleet.members = {"c": replace(_member("c", "completion", 0), ts=now[0])}
    fleet.local(0, 10, 8)
    assert fleet.reserve == 7
    assert fleet.room(0, 10) >= 1


def test_work_whose_deadline_passes_while_the_engine_is_full_is_answered_then() -> None:
    """Its client gets the 504 at its deadline, not when a slot frees."""
    queue = DispatchQueue()
    dropped: list[tuple[Work, object]] = []
    dispatcher = Dispatcher(
        queue,
        capacity=lambda: 0,  # the engine is full
        verdict=lambda _env, _now: None,
        start=lambda _work: None,
        drop=lambda work, reason: dropped.append((work, reason)),
    )
    late = Work(TopicPartition("t", 0), 0, envelope(deadline_ts=time.time() - 0.5))
    queue.push(late)
    dispatcher.dispatch()
    assert [(w, type(r)) for w, r in dropped] == [(late, Expired)]
