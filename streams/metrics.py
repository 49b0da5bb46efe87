"""Streams app metrics (served on LANEWAY_METRICS_PORT)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

__all__ = ["CANARY_WEIGHT", "EVENTS", "QUOTA_FACTOR", "RESTAMPED"]

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
CANARY_WEIGHT = Gauge(
    "laneway_canary_weight", "Share (%) of a model's sticky keys sent to its canary", ["model"]
)
