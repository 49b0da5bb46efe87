"""Metrics every service shares, and the rule that keeps their label sets bounded.

Team labels: the first ``MAX_TEAM_LABELS`` teams a process sees get a label of their own;
later ones fold into ``other``, so a flood of new API keys cannot explode the series count.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from laneway.errors import ConfigError

__all__ = [
    "BREAKER_LEVEL",
    "CONSUMER_LAG",
    "COST",
    "ERRORS",
    "MAX_TEAM_LABELS",
    "PROBE_LATENCY",
    "PROBE_SUCCESS",
    "QUEUE_WAIT",
    "TOKENS",
    "TTFT",
    "serve_metrics",
    "team_label",
]

MAX_TEAM_LABELS = 500
OTHER_TEAM = "other"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)

_teams: set[str] = set()
_teams_lock = threading.Lock()


def team_label(team: str) -> str:
    if team in _teams:
        return team
    with _teams_lock:
        if len(_teams) < MAX_TEAM_LABELS:
            _teams.add(team)
            return team
    return OTHER_TEAM


def serve_metrics(port: int) -> None:
    """Serve ``/metrics`` on ``port`` (services without an HTTP server of their own)."""
    if port:
        try:
            start_http_server(port)
        except OSError as exc:
            raise ConfigError(
                f"LANEWAY_METRICS_PORT={port}: cannot serve /metrics there: {exc.strerror or exc}"
            ) from None


TOKENS = Counter(
    "laneway_tokens_total",
    "Tokens by kind (prompt, cached, completion) per team, class and model",
    ["team", "cls", "model", "kind"],
)
COST = Counter(
    "laneway_cost_total",
    "Cost of served tokens from the price table (LANEWAY_PRICES), in its currency",
    ["team", "cls", "model"],
)
ERRORS = Counter("laneway_errors_total", "Errors by kind", ["kind"])
QUEUE_WAIT = Histogram(
    "laneway_queue_wait_seconds",
    "From acceptance to the start of execution",
    ["team", "cls", "model"],
    buckets=_LATENCY_BUCKETS,
)
TTFT = Histogram(
    "laneway_ttft_seconds",
    "From acceptance to the first token",
    ["team", "cls", "model"],
    buckets=_LATENCY_BUCKETS,
)
CONSUMER_LAG = Gauge(
    "laneway_consumer_lag", "Records not yet fetched on this worker's partitions", ["pool", "topic"]
)
BREAKER_LEVEL = Gauge("laneway_breaker_level", "Breaker level (0-3) of a model route", ["route"])
PROBE_SUCCESS = Gauge(
    "laneway_probe_success", "1 when the last synthetic request of a pool succeeded", ["pool"]
)
PROBE_LATENCY = Gauge(
    "laneway_probe_latency_seconds", "Latency of the last synthetic request of a pool", ["pool"]
)
