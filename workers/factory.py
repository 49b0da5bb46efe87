"""The worker class of a pool."""

from __future__ import annotations

from workers.batch_pool import BatchPoolWorker
from workers.pool import PoolWorker
from workers.settings import WorkerSettings
from workers.types import Engine

__all__ = ["create_worker"]


def create_worker(settings: WorkerSettings, engine: Engine) -> PoolWorker:
    if settings.pool == "batch":
        return BatchPoolWorker(settings, engine)
    return PoolWorker(settings, engine)
