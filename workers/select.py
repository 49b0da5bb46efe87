"""Engine choice: explicit by LANEWAY_ENGINE, or automatic by what the machine has."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from laneway.errors import ConfigError
from laneway.settings import WorkerSettings
from workers.sim import SimEngine, SimProfile
from workers.types import Engine
from workers.upstream import OpenAICompatibleEngine

__all__ = ["choose_engine", "has_accelerator", "sim_profile"]


def has_accelerator() -> bool:
    """A CUDA/ROCm device node is present (checked without importing torch)."""
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/kfd")) or bool(
        os.environ.get("CUDA_VISIBLE_DEVICES", "").strip("-1 ")
        and Path("/proc/driver/nvidia").exists()
    )


def sim_profile(settings: WorkerSettings) -> SimProfile:
    return SimProfile(
        prefill_ms_per_token=settings.sim_prefill_ms_per_token,
        decode_ms_per_step=settings.sim_decode_ms_per_step,
        batch_slots=settings.sim_batch_slots,
        prefix_cache_blocks=settings.sim_prefix_cache_blocks,
        block_tokens=settings.sim_block_tokens,
        failure_rate=settings.sim_failure_rate,
        seed=settings.sim_seed,
    )


def _openai(settings: WorkerSettings) -> Engine:
    return OpenAICompatibleEngine(
        settings.upstream_url,
        api_key=settings.upstream_api_key.get_secret_value(),
        model=settings.upstream_model,
    )


def choose_engine(settings: WorkerSettings) -> tuple[Engine, str]:
    """The engine for this worker and the reason it was chosen (logged at start)."""
    if settings.engine == "sim":
        return SimEngine(sim_profile(settings)), "LANEWAY_ENGINE=sim"
    if settings.engine == "openai":
        if not settings.upstream_url:
            raise ConfigError(
                "LANEWAY_ENGINE=openai needs LANEWAY_UPSTREAM_URL (the server's /v1 URL)"
            )
        return _openai(settings), f"LANEWAY_ENGINE=openai, upstream {settings.upstream_url}"
    if settings.engine == "vllm":
        raise ConfigError(
            "LANEWAY_ENGINE=vllm: the vLLM engine is not part of this build yet; "
            "use LANEWAY_ENGINE=openai with a vLLM server (LANEWAY_UPSTREAM_URL) meanwhile"
        )
    vllm_present = importlib.util.find_spec("vllm") is not None
    if settings.upstream_url:
        return _openai(settings), f"LANEWAY_UPSTREAM_URL is set ({settings.upstream_url})"
    why = "no accelerator" if not has_accelerator() else "vLLM engine not in this build"
    if not vllm_present:
        why += ", vLLM not installed"
    return (
        SimEngine(sim_profile(settings)),
        f"{why} and LANEWAY_UPSTREAM_URL unset: running the SIMULATED engine (no real model)",
    )
