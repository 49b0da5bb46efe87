"""Per-pool vLLM engine profiles: the ``AsyncEngineArgs`` keywords each pool runs with.

The seed's table (DESIGN.md, Workers), one profile per pool:

- ``completion``: half precision (``LANEWAY_VLLM_DTYPE``), prefix caching on, ``max_tokens``
  capped at ``LANEWAY_COMPLETION_MAX_TOKENS`` (the ingress's cap, 128 by default). Code
  completions share long file prefixes, so the cache pays most here.
- ``chat``: quantized, long context: a pre-quantized checkpoint
  (``LANEWAY_VLLM_QUANTIZED_MODEL``, e.g. INT8 W8A8) or fp8 on the fly where the GPU has fp8;
  KV blocks offloaded to CPU memory (``LANEWAY_VLLM_KV_OFFLOAD_GIB``) on a GPU.
- ``batch``: the checkpoint's own precision, no quantization, prefix caching off (one-off
  documents; the cache would only evict the interactive pools' blocks on a shared GPU).
- ``quantized``: the breaker's level 1, the pool's profile with quantization forced on.
  Quantization is fixed when an engine starts, so this variant is a second engine (worker).

Every profile schedules by priority (the band: ``hi`` is 0, ``lo`` is 1, lower first).
Profiles are plain keyword dicts, built without importing vLLM; ``check_engine_args`` checks
their names against ``AsyncEngineArgs`` so a renamed vLLM option fails loudly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from laneway.errors import ConfigError
from workers.settings import WorkerSettings

__all__ = [
    "EngineProfile",
    "build_profile",
    "check_engine_args",
    "quantized_variant",
]

Quantization = Literal["none", "fp8", "checkpoint"]

_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What one engine runs: its ``AsyncEngineArgs`` keywords and request-side limits."""

    name: str
    engine_args: Mapping[str, Any]
    max_tokens_cap: int | None = None
    quantization: Quantization = "none"
    notes: tuple[str, ...] = field(default=())
    """Why a profile differs from the table (e.g. no quantization on this device); logged."""


def _common_args(settings: WorkerSettings, *, accelerator: bool) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": settings.vllm_model,
        "load_format": settings.vllm_load_format,
        "scheduling_policy": "priority",
        # laneway's own stat logger reads the scheduler stats; vLLM's default loggers (log
        # lines every 10 s, a Prometheus registry per engine) stay off.
        "disable_log_stats": True,
        "enforce_eager": settings.vllm_enforce_eager,
    }
    if settings.vllm_max_model_len:
        args["max_model_len"] = settings.vllm_max_model_len
    if settings.vllm_kv_cache_gib:
        args["kv_cache_memory_bytes"] = int(settings.vllm_kv_cache_gib * _GIB)
    if accelerator:
        args["gpu_memory_utilization"] = settings.vllm_gpu_memory_utilization
    return args


def _quantize(
    profile: EngineProfile, settings: WorkerSettings, *, fp8_supported: bool
) -> EngineProfile:
    """The profile with quantization on, or unchanged with a note when the device has none."""
    if profile.quantization != "none":
        return profile
    args = dict(profile.engine_args)
    if settings.vllm_quantized_model:
        # The checkpoint's own config names its scheme (compressed-tensors W8A8 and the like).
        args["model"] = settings.vllm_quantized_model
        args.pop("dtype", None)
        return replace(profile, engine_args=MappingProxyType(args), quantization="checkpoint")
    if fp8_supported:
        args["quantization"] = "fp8"
        return replace(profile, engine_args=MappingProxyType(args), quantization="fp8")
    note = (
        "running unquantized: this device has no fp8 and LANEWAY_VLLM_QUANTIZED_MODEL is unset "
        "(set it to a pre-quantized INT8 W8A8 checkpoint)"
    )
    return replace(profile, notes=(*profile.notes, note))


def _completion(settings: WorkerSettings, *, accelerator: bool) -> EngineProfile:
    args = _common_args(settings, accelerator=accelerator)
    args.update(dtype=settings.vllm_dtype, enable_prefix_caching=True)
    # The ingress's own cap: a fixed one here would cut text at 128 tokens ("length") that
    # an operator's higher LANEWAY_COMPLETION_MAX_TOKENS had let the client ask for.
    cap = settings.completion_max_tokens
    return EngineProfile("completion", MappingProxyType(args), max_tokens_cap=cap)


def _chat(settings: WorkerSettings, *, accelerator: bool, fp8_supported: bool) -> EngineProfile:
    args = _common_args(settings, accelerator=accelerator)
    # Long context: the model's whole window (unless LANEWAY_VLLM_MAX_MODEL_LEN narrows it),
    # long prompts prefilled in chunks between decode steps, multi-turn prefixes cached.
    args.update(dtype=settings.vllm_dtype, enable_prefix_caching=True, enable_chunked_prefill=True)
    notes: tuple[str, ...] = ()
    if settings.vllm_kv_offload_gib and accelerator:
        args.update(kv_offloading_size=settings.vllm_kv_offload_gib, kv_offloading_backend="native")
    elif settings.vllm_kv_offload_gib:
        notes = ("KV offload off: on a CPU the KV cache already lives in host memory",)
    profile = EngineProfile("chat", MappingProxyType(args), notes=notes)
    return _quantize(profile, settings, fp8_supported=fp8_supported)


def _batch(settings: WorkerSettings, *, accelerator: bool) -> EngineProfile:
    args = _common_args(settings, accelerator=accelerator)
    args.update(dtype="auto", enable_prefix_caching=False)
    return EngineProfile("batch", MappingProxyType(args))


def quantized_variant(
    profile: EngineProfile, settings: WorkerSettings, *, fp8_supported: bool
) -> EngineProfile:
    """The breaker's level 1: ``profile`` quantized; ``ConfigError`` if it cannot be."""
    quantized = _quantize(profile, settings, fp8_supported=fp8_supported)
    if quantized.quantization == "none":
        raise ConfigError(
            f"the quantized variant of the {profile.name} profile needs fp8 (this device has "
            "none) or a pre-quantized checkpoint: set LANEWAY_VLLM_QUANTIZED_MODEL"
        )
    return replace(quantized, name=f"{profile.name}-quantized")


def build_profile(
    settings: WorkerSettings, *, accelerator: bool, fp8_supported: bool
) -> EngineProfile:
    """The profile named by ``LANEWAY_VLLM_PROFILE`` (default: the worker's pool)."""
    if not settings.vllm_model:
        raise ConfigError(
            "LANEWAY_ENGINE=vllm needs LANEWAY_VLLM_MODEL (a model directory or hub id)"
        )
    pool_profile = {
        "completion": lambda: _completion(settings, accelerator=accelerator),
        "chat": lambda: _chat(settings, accelerator=accelerator, fp8_supported=fp8_supported),
        "batch": lambda: _batch(settings, accelerator=accelerator),
    }[settings.pool]()
    if settings.vllm_profile in ("pool", settings.pool):
        return pool_profile
    if settings.vllm_profile == "quantized":
        return quantized_variant(pool_profile, settings, fp8_supported=fp8_supported)
    raise ConfigError(
        f"LANEWAY_VLLM_PROFILE={settings.vllm_profile!r} on a {settings.pool} worker: a worker "
        f"runs its own pool's profile ('pool' or {settings.pool!r}) or 'quantized'"
    )


def check_engine_args(args: Mapping[str, Any], known: Iterable[str]) -> None:
    """Refuse keywords that ``AsyncEngineArgs`` does not have (renamed or removed options)."""
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ConfigError(
            f"vLLM's AsyncEngineArgs has no option(s) {', '.join(unknown)}: the installed vLLM "
            "renamed or removed them; update workers/profiles.py for it"
        )
