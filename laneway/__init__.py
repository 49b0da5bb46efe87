"""Shared core of laneway: common settings, wire schema, names, errors, client factories.

Every other package builds on it and it imports none of them (``lint-imports``).
"""

from laneway.constants import RedisKeys, Topics
from laneway.errors import LanewayError
from laneway.schema import CancelRecord, Reply, RequestEnvelope, UsageEvent
from laneway.settings import CommonSettings

__all__ = [
    "CancelRecord",
    "CommonSettings",
    "LanewayError",
    "RedisKeys",
    "Reply",
    "RequestEnvelope",
    "Topics",
    "UsageEvent",
]

__version__ = "0.1.0"
