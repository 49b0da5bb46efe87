"""A pool's worker."""

from __future__ import annotations

from workers.pool import PoolWorker
from workers.settings import WorkerSettings
from workers.types import Engine

__all__ = ["create_worker"]


def create_worker(settings: WorkerSettings, engine: Engine) -> PoolWorker:
    """A worker of ``settings.pool``: its lane (``workers.lanes``) comes with the pool."""
    return PoolWorker(settings, engine)
