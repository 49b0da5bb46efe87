"""GPU workers: Kafka consumers per pool, their engines and the cancel shield."""

from workers.batch_lane import BatchLane
from workers.execution import RequestExecutor
from workers.factory import create_worker
from workers.offsets import OffsetTracker
from workers.pool import PoolWorker
from workers.profiles import EngineProfile
from workers.select import choose_engine
from workers.shield import CancelShield
from workers.sim import SimEngine, SimProfile
from workers.types import Engine, EngineDelta, EngineRequest, EngineStats
from workers.upstream import OpenAICompatibleEngine
from workers.vllm_engine import VllmEngine

__all__ = [
    "BatchLane",
    "CancelShield",
    "Engine",
    "EngineDelta",
    "EngineProfile",
    "EngineRequest",
    "EngineStats",
    "OffsetTracker",
    "OpenAICompatibleEngine",
    "PoolWorker",
    "RequestExecutor",
    "SimEngine",
    "SimProfile",
    "VllmEngine",
    "choose_engine",
    "create_worker",
]
