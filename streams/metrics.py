"""Streams app metrics (served on LANEWAY_METRICS_PORT)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

__all__ = ["BREAKER_TEAM_LEVEL", "CANARY_WEIGHT", "EVENTS", "QUOTA_FACTOR", "RESTAMPED"]

EVENTS = Counter(
    "laneway_streams_events_total", "Usage records read by the streams app", ["result"]
)
RESTAMPED = Counter(
    "laneway_streams_restamped_total",
    "Usage records counted at the time the broker stored them, their own time being too far "
    "ahead of the app's clock or too far behind their stored time",
    ["reason"],
)
QUOTA_FACTOR = Gauge("laneway_quota_factor", "Dynamic quota factor of a team", ["team"])
# A series only while raised: teams at level 0 are the rule and would each be a series.
BREAKER_TEAM_LEVEL = Gauge(
    "laneway_breaker_team_level",
    "Breaker level (1-3) of a team on a model route: 3 refuses the team there with 503; "
    "no series at level 0",
    ["route", "team"],
)
CANARY_WEIGHT = Gauge(
    "laneway_canary_weight", "Share (%) of a model's sticky keys sent to its canary", ["model"]
)
