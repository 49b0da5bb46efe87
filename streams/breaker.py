"""The tiered breaker: error counts over a sliding window and levels 0–3 with hysteresis.

A level is entered as soon as the windowed error rate is above its entry threshold; it is
left one level at a time, and only after the rate stayed below the (lower) exit threshold of
the current level for a whole cool-down. A window with fewer than the minimum request count
has no rate: it can never raise a level, and it counts as calm (no traffic is no evidence of
failure, and a route nobody is sent to must be able to recover and be probed again), except
while the app reads usage older than the window (a backlog): the window is then empty for
want of reading, and a raised level holds.

Whose errors count where: a team's own level counts all of its failures, engine errors and
requests the engine refused for what they asked (``rejected``: a prompt over the context)
alike, so a team that keeps sending bad requests is isolated, alone. A route's level counts
engine errors only, and only those seen by several teams (``route_counts``): one team can
neither trip the route for everyone with its own traffic nor hide a route fault. Only the
classes the ingress gates by these levels count (completion and chat; see the processor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from streams.settings import StreamsSettings

__all__ = [
    "MAX_LEVEL",
    "BreakerPolicy",
    "BreakerState",
    "add_outcome",
    "next_state",
    "route_counts",
    "window_counts",
]

MAX_LEVEL = 3
# Bucket of the sliding window → [requests, errors, rejected]; JSON-friendly (string keys).
# Buckets written before rejected requests were counted have two numbers.
Buckets = MutableMapping[str, list[int]]


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    enter: tuple[float, ...]
    exit: tuple[float, ...]
    cooldown_s: float
    min_requests: int
    window_s: float
    bucket_s: float

    @classmethod
    def from_settings(cls, settings: StreamsSettings) -> BreakerPolicy:
        return cls(
            enter=tuple(settings.breaker_enter),
            exit=tuple(settings.breaker_exit),
            cooldown_s=settings.breaker_cooldown_s,
            min_requests=settings.breaker_min_requests,
            window_s=settings.breaker_window_s,
            bucket_s=settings.breaker_bucket_s,
        )


@dataclass(frozen=True, slots=True)
class BreakerState:
    """Level of one subject (a route, or a team on a route) and how long it has been calm."""

    level: int = 0
    since: float = 0.0
    calm_since: float | None = None
    rate: float = 0.0
    requests: int = 0


def _bucket(ts: float, policy: BreakerPolicy) -> int:
    return int(ts // policy.bucket_s)


def _live(bucket: int, now: float, policy: BreakerPolicy) -> bool:
    return (bucket + 1) * policy.bucket_s > now - policy.window_s


def add_outcome(
    buckets: Buckets,
    ts: float,
    *,
    error: bool,
    now: float,
    policy: BreakerPolicy,
    rejected: bool = False,
) -> bool:
    """Count one ok, error or rejected outcome; drop buckets that left the window. False if
    ``ts`` is stale."""
    for key in [k for k in buckets if not _live(int(k), now, policy)]:
        del buckets[key]
    bucket = _bucket(ts, policy)
    if not _live(bucket, now, policy):
        return False
    counts = buckets.setdefault(str(bucket), [0, 0, 0])
    if len(counts) < 3:
        counts.append(0)
    counts[0] += 1
    counts[1] += int(error)
    counts[2] += int(rejected)
    return True


def window_counts(
    buckets: Mapping[str, list[int]], now: float, policy: BreakerPolicy
) -> tuple[int, int, int]:
    """(requests, errors, rejected) inside the window ending at ``now``."""
    requests = errors = rejected = 0
    for key, counts in buckets.items():
        if _live(int(key), now, policy):
            requests += counts[0]
            errors += counts[1]
            rejected += counts[2] if len(counts) > 2 else 0
    return requests, errors, rejected


def route_counts(per_team: Sequence[tuple[int, int]], min_requests: int) -> tuple[int, float]:
    """(requests, errors) a route's level is judged on, from each team's (requests, engine
    errors) on it, by the views of the route without one of its teams: the requests of the
    view with the lowest error rate among those of at least ``min_requests``, at the lowest
    rate any view shows (``errors`` is then that rate times those requests).

    So the route's rate is one that several teams see: one team's errors, however many,
    raise its own level and not the route's (the view without it has none), and a route only
    one team uses (no view without it can be judged) is judged by that team's level alone.
    An engine that fails everyone fails the rest too, however little the rest sends: a view
    too small to be judged alone can lower the route's rate, never raise it.
    """
    teams = [(n, e) for n, e in per_team if n > 0]  # all refused: nothing the engine took
    total_n = sum(n for n, _ in teams)
    total_e = sum(e for _, e in teams)
    views = [(total_n - n, total_e - e) for n, e in teams if total_n > n]
    judged = [(e / n, -n, n, e) for n, e in views if n >= min_requests]
    if not judged:
        return 0, 0
    rate, _, requests, errors = min(judged)
    lowest = min(e / n for n, e in views)
    return (requests, lowest * requests) if lowest < rate else (requests, errors)


def next_state(
    state: BreakerState,
    requests: int,
    errors: float,
    now: float,
    policy: BreakerPolicy,
    *,
    blind: bool = False,
) -> BreakerState:
    """The state after one evaluation; ``level`` changes at most once per call. ``blind``:
    the window may lack events not read yet (the app is reading usage older than the
    window), so too few requests for a rate are no sign of calm."""
    rate = errors / requests if requests else 0.0
    counted = requests >= policy.min_requests
    target = sum(1 for threshold in policy.enter if rate > threshold) if counted else 0
    if target > state.level:
        return BreakerState(level=target, since=now, rate=rate, requests=requests)
    if state.level == 0:
        return dataclasses.replace(state, calm_since=None, rate=rate, requests=requests)
    calm = rate < policy.exit[state.level - 1] if counted else not blind
    if not calm:
        return dataclasses.replace(state, calm_since=None, rate=rate, requests=requests)
    calm_since = now if state.calm_since is None else state.calm_since
    if now - calm_since >= policy.cooldown_s:
        # One level per cool-down; the next step needs a cool-down of its own.
        return BreakerState(
            level=state.level - 1, since=now, calm_since=now, rate=rate, requests=requests
        )
    return dataclasses.replace(state, calm_since=calm_since, rate=rate, requests=requests)
