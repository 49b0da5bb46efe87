"""Shared core of laneway: settings, wire schema, names, client factories and the CLI."""

from laneway.constants import RedisKeys, Topics
from laneway.errors import LanewayError
from laneway.schema import CancelRecord, Reply, RequestEnvelope, UsageEvent
from laneway.settings import CommonSettings, IngressSettings, StackSettings, WorkerSettings

__all__ = [
    "CancelRecord",
    "CommonSettings",
    "IngressSettings",
    "LanewayError",
    "RedisKeys",
    "Reply",
    "RequestEnvelope",
    "StackSettings",
    "Topics",
    "UsageEvent",
    "WorkerSettings",
]

__version__ = "0.1.0"
