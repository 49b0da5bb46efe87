"""What the streams app counts into the breaker, and for how long: interactive outcomes only,
at a time no later than its own clock, in keys that go once their window has passed.
Unit tests on the processor with in-memory tables (no broker, no Redis)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from streams.announce import BreakerSubject
from streams.breaker import BreakerState, route_counts
from streams.processor import UsageProcessor
from streams.settings import StreamsSettings
from tests.test_streams_logic import _Table, offline_processor
from tests.test_streams_process import usage_event

NOW = 1_800_000_000.0


class _Announcer:
    """Records the breaker transitions the processor announces."""

    def __init__(self) -> None:
        self.transitions: list[tuple[BreakerSubject, int, int]] = []

    async def breaker_changed(
        self, subject: BreakerSubject, old: BreakerState, new: BreakerState
    ) -> None:
        self.transitions.append((subject, old.level, new.level))

    async def store_level(self, subject: BreakerSubject, state: BreakerState) -> None:
        pass


class _RecordingTable(_Table):
    """A table that keeps the changelog records written from timers."""

    def __init__(self) -> None:
        super().__init__()
        self.changelog: list[tuple[int | None, Any, Any]] = []

    def send_changelog(
        self, partition: int | None, key: Any, value: Any, *args: Any, **kwargs: Any
    ) -> None:
        self.changelog.append((partition, key, value))


def _processor(
    clock: Callable[[], float], outcomes: _Table | None = None, **settings: Any
) -> tuple[UsageProcessor, _Announcer]:
    announcer = _Announcer()
    processor = offline_processor(
        StreamsSettings(**{"breaker_min_requests": 50, "breaker_cooldown_s": 10.0, **settings}),
        outcomes=_Table() if outcomes is None else outcomes,
        announcer=announcer,
        clock=clock,
    )
    return processor, announcer


async def test_batch_outcomes_never_move_the_interactive_breaker() -> None:
    """The ingress gates completions and chats by the route's and the team's level; batch
    lines are never gated by them. A failing batch engine, or a team's over-long batch lines,
    must not send every team's IDE traffic to the fallback (or a 503)."""
    processor, announcer = _processor(lambda: NOW)
    offset = iter(range(10_000))

    def fold(team: str, cls: str, status: str, count: int) -> None:
        for _ in range(count):
            event = usage_event(team=team, cls=cls, status=status, ts=NOW - 5)
            processor.handle(event.to_json(), 0, next(offset))

    for team in ("a", "b", "c"):
        fold(team, "completion", "ok", 100)
        fold(team, "chat", "ok", 60)
    for team in ("a", "b"):  # the nightly batch of two teams: the batch engine fails 40 %
        fold(team, "batch", "error", 120)
        fold(team, "batch", "ok", 180)
    fold("c", "batch", "rejected", 90)  # team c's lines over the context
    fold("c", "batch", "ok", 210)
    assert await processor.evaluate_breakers() == []
    assert announcer.transitions == []
    # The interactive classes still count: the chat engine failing everyone raises the route.
    for team in ("a", "b", "c"):
        fold(team, "chat", "error", 60)
    await processor.evaluate_breakers()
    assert (("laneway-code", None), 0, 3) in announcer.transitions


async def test_outcomes_stamped_ahead_count_no_longer_than_their_window() -> None:
    """An event stamped ahead of the app's clock is counted as of now, so it leaves the
    window a window after it came, not a window after the time it claims."""
    now = [NOW]
    processor, announcer = _processor(lambda: now[0], breaker_window_s=60.0)
    offset = iter(range(10_000))
    for team in ("a", "b"):
        for _ in range(100):  # a fault, from a worker whose clock runs 45 s fast
            event = usage_event(team=team, status="error", ts=now[0] + 45)
            processor.handle(event.to_json(), 0, next(offset))
    await processor.evaluate_breakers()
    assert (("laneway-code", None), 0, 3) in announcer.transitions
    now[0] += 65  # the fault is fixed: a window later it has left the window
    for team in ("a", "b"):
        for _ in range(100):
            event = usage_event(team=team, status="ok", ts=now[0])
            processor.handle(event.to_json(), 0, next(offset))
    await processor.evaluate_breakers()
    route = processor.states[("laneway-code", None)]
    assert (route.rate, route.requests) == (0.0, 100)  # the view without one of the teams


def test_a_route_fault_every_team_sees_raises_the_route_however_small_the_rest() -> None:
    # Both teams see 15 %; the rest without the big team is under the minimum count (50),
    # so it cannot speak for the route alone, but it does not hide the fault either.
    assert route_counts([(1000, 150), (20, 3)], min_requests=50) == (1000, 150)
    # A little traffic of another team that sees no errors still keeps one team's errors
    # from raising the route for everyone.
    requests, errors = route_counts([(100, 100), (10, 0)], min_requests=50)
    assert (requests, errors) == (100, 0)
    # The rest sees fewer errors than the big team: the route is judged at the rest's rate.
    requests, errors = route_counts([(1000, 150), (20, 2)], min_requests=50)
    assert requests == 1000
    assert errors / requests == 0.1
    # One team alone, or one team and teams with nothing to count: no rate of its own.
    assert route_counts([(500, 500)], min_requests=50) == (0, 0)
    assert route_counts([(500, 500), (0, 0)], min_requests=50) == (0, 0)


async def test_breaker_keys_leave_the_table_once_their_window_has_passed() -> None:
    """Any writer of usage can name a route: its key must not stay in the changelog, and be
    scanned every tick, for ever."""
    now = [NOW]
    outcomes = _RecordingTable()
    processor, _ = _processor(lambda: now[0], outcomes=outcomes, breaker_window_s=60.0)
    for offset in range(3):
        event = usage_event(route=f"made-up-{offset}", ts=now[0])
        processor.handle(event.to_json(), 2, offset)
    now[0] += 30
    processor.handle(usage_event(route="laneway-code", ts=now[0]).to_json(), 2, 3)
    await processor.evaluate_breakers()
    assert len(outcomes) == 4
    now[0] += 32  # the first three left the window; the fourth came 30 s later
    await processor.evaluate_breakers()
    assert [_route(key) for key in outcomes] == ["laneway-code"]
    assert sorted((partition, _route(key)) for partition, key, _ in outcomes.changelog) == [
        (2, f"made-up-{i}") for i in range(3)
    ]
    assert all(value is None for _, _, value in outcomes.changelog)


async def test_a_key_is_deleted_only_from_the_changelogs_this_instance_holds() -> None:
    """After a rebalance, a partition's new owner may have written a key since: a delete
    from the old owner, sent to that changelog after it, would lose the key on restart."""
    now = [NOW]
    outcomes = _RecordingTable()
    processor, _ = _processor(lambda: now[0], outcomes=outcomes, breaker_window_s=60.0)
    processor.owned = lambda: {1}
    event = usage_event(route="laneway-code", ts=now[0])
    processor.handle(event.to_json(), 1, 0)
    processor.handle(usage_event(route="laneway-code", ts=now[0]).to_json(), 2, 0)
    now[0] += 62
    await processor.evaluate_breakers()
    assert not outcomes
    assert [partition for partition, _, _ in outcomes.changelog] == [1]


def _route(key: str) -> str:
    route: str = orjson.loads(key)[0]
    return route


async def test_a_raised_level_holds_while_the_app_reads_usage_older_than_the_window() -> None:
    """After a restart with a backlog, the window is empty because its events have not been
    read yet, not because the route is calm: the level must not step down and then jump back
    once the app has caught up."""
    now = [NOW]
    processor, announcer = _processor(lambda: now[0], breaker_window_s=60.0)
    offset = iter(range(100_000))

    def fold(status: str, ts: float, stored_at: float, count: int = 100) -> None:
        for team in ("a", "b"):
            for _ in range(count):
                event = usage_event(team=team, status=status, ts=ts)
                processor.handle(event.to_json(), 0, next(offset), stored_at=stored_at)

    fold("error", now[0], now[0])
    await processor.evaluate_breakers()
    assert (("laneway-code", None), 0, 3) in announcer.transitions
    raised = len(announcer.transitions)
    down = now[0]
    now[0] += 300  # down for five minutes; then 40 s of reading the backlog
    for second in range(40):
        fold("error", down + second, down + second, count=5)
        await processor.evaluate_breakers()
        now[0] += 1
    assert announcer.transitions[raised:] == []
    # Caught up, on a calm route: one level down per cool-down.
    for _ in range(12):
        fold("ok", now[0], now[0], count=10)
        await processor.evaluate_breakers()
        now[0] += 1
    assert (("laneway-code", None), 3, 2) in announcer.transitions[raised:]


async def test_a_refusal_of_what_the_engine_has_not_counts_against_no_one() -> None:
    """An IDE plugin sends a suffix with every completion; the vllm engine has no
    fill-in-the-middle and refuses each (``unsupported``). Counted like a request refused
    for what it asks (``rejected``), its team went to level 3 within the window: isolated,
    a 503 for all its users, for the engine's shortfall. It raises no level."""
    processor, announcer = _processor(lambda: NOW)
    offset = iter(range(10_000))

    def fold(team: str, status: str, count: int) -> None:
        for _ in range(count):
            event = usage_event(team=team, status=status, ts=NOW - 5, prompt_tokens=0)
            processor.handle(event.to_json(), 0, next(offset))

    for team in ("ide", "other"):
        fold(team, "ok", 20)
    fold("ide", "unsupported", 200)
    assert await processor.evaluate_breakers() == []
    assert announcer.transitions == []
    # The same refusals as the request's own fault isolate the team: the count is live.
    fold("ide", "rejected", 200)
    await processor.evaluate_breakers()
    assert (("laneway-code", "ide"), 0, 3) in announcer.transitions
    assert not any(subject == ("laneway-code", None) for subject, _, _ in announcer.transitions)
