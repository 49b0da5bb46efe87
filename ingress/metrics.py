"""Ingress metrics, served on ``/metrics``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["CLIENT_GONE", "LATENCY", "OPEN_REQUESTS", "RESPONSES", "SHADOW", "TOMBSTONES"]

RESPONSES = Counter(
    "laneway_ingress_responses_total", "HTTP responses by class and status code", ["cls", "code"]
)
CLIENT_GONE = Counter(
    "laneway_ingress_client_gone_total",
    "Requests whose client went away before the end (logged as 499)",
    ["cls"],
)
LATENCY = Histogram(
    "laneway_ingress_latency_seconds",
    "End-to-end latency at the ingress, accept to last byte",
    ["team", "cls", "model"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60),
)
OPEN_REQUESTS = Gauge("laneway_ingress_open_requests", "Requests waiting on replies")
TOMBSTONES = Counter(
    "laneway_ingress_tombstones_total",
    "Cancel tombstones of gone clients: sent, or left out as a newer keystroke of the same "
    "session superseded the request",
    ["outcome"],
)
SHADOW = Counter(
    "laneway_ingress_shadow_total",
    "Copies of requests for a model's shadow route: mirrored (stored on Kafka), failed, or "
    "skipped (breaker above level 0, too many on their way)",
    ["model", "outcome"],
)
