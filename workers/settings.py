"""Settings of a pool worker and its engine (``python -m workers``)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import (
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from laneway.constants import HEARTBEAT_TTL_S, INGRESS_ROLL_CALL_S, RequestClass
from laneway.settings import CommonSettings

__all__ = ["EngineName", "WorkerSettings"]


EngineName = Literal["auto", "sim", "openai", "vllm"]


class WorkerSettings(CommonSettings):
    """A worker of one pool and its engine."""

    pool: RequestClass = Field("completion", description="completion, chat or batch")
    worker_id: str = Field(
        default="",
        description="stable id (static group membership: a restart takes its partitions back "
        "at once); default <pool>-<host>-<pid>",
    )
    engine: EngineName = Field("auto", description="auto, sim, openai or vllm (auto: by machine)")
    max_inflight: int = Field(
        64,
        gt=0,
        description="requests a worker holds at once: waiting in its dispatch queue (where "
        "the shield can still drop them) or on the engine, which gets only what it can start",
    )
    memory_shed_at: float = Field(
        0.9,
        gt=0,
        le=1,
        description="memory pressure: at this engine KV-cache usage or above, the worker starts no "
        "batch or lo-band work and aborts what runs of it (newest first; batch before lo on "
        "a shared engine), to run it again later; hi-band work is never shed",
    )
    memory_resume_at: float = Field(
        0.8,
        gt=0,
        le=1,
        description="memory pressure ends once KV-cache usage has stayed below this for "
        "LANEWAY_MEMORY_COOLDOWN_S (below LANEWAY_MEMORY_SHED_AT: no flapping)",
    )
    memory_cooldown_s: float = Field(
        5.0, ge=0, description="memory pressure: how long usage must stay low before it ends"
    )
    memory_check_ms: int = Field(
        250, gt=0, le=10_000, description="memory pressure: how often engine usage is read"
    )
    batch_yield_backlog: int = Field(
        0, ge=0, description="batch pauses while interactive lanes have more waiting than this"
    )
    batch_parked_bodies: int = Field(
        2048,
        ge=0,
        description="batch lines waiting for their team's budget whose bodies a worker keeps; "
        "those beyond keep their place only and are read again from Kafka when admitted",
    )
    shield: bool = Field(
        True, description="drop stale work before it runs (off only to measure the baseline)"
    )
    cancel_fetch_wait_ms: int = Field(
        100,
        ge=0,
        le=1000,
        description="once caught up, the cancel topic is read in batches this far apart "
        "(running workers get tombstones from Redis at once; the topic is the record and the "
        "fallback; 0: a fetch per tombstone)",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=1024,
        description="streamed replies: tokens gathered per chunk after the first, which goes "
        "at once (as vLLM's --stream-interval; higher: less CPU per token, coarser stream)",
    )
    reuse_ttl_s: float = Field(
        30.0,
        ge=0,
        description="type-through: a finished completion stays reusable by its session's next "
        "keystrokes this long",
    )
    reuse_hold_ms: int = Field(
        30,
        ge=0,
        le=1000,
        description="type-through: a running streamed completion whose client left after it "
        "was sent text waits this long for its session's next keystroke, which may type "
        "through it, before it is aborted (0: no wait)",
    )
    reuse_max_entries: int = Field(
        2000, ge=0, description="type-through: sessions whose latest generation a worker keeps"
    )
    commit_interval_ms: int = Field(200, gt=0, description="how often offsets are committed")
    drain_grace_s: float = Field(10.0, ge=0, description="SIGTERM: time to finish in-flight")
    heartbeat_interval_s: float = Field(
        2.0,
        gt=0,
        le=HEARTBEAT_TTL_S / 2,
        description="worker heartbeat to Redis (at most half the "
        f"{HEARTBEAT_TTL_S:g} s a beat counts a worker live: longer, and a live worker is "
        "taken for dead between beats)",
    )
    session_timeout_ms: int = Field(10_000, ge=6000, description="Kafka consumer session")
    ingress_gone_s: float = Field(
        60.0,
        ge=0,
        description="an ingress process not heard of this long (its roll call in Redis, every "
        f"{INGRESS_ROLL_CALL_S:g} s) is taken for gone: its requests are stopped as if their "
        "clients left, not run on to their end for no one and billed. One cut off from Redis "
        "(the workers not) this long is taken for gone too: keep it above "
        "LANEWAY_HANG_TIMEOUT_S and what such an outage may last (0: never; else at least "
        f"{10 * INGRESS_ROLL_CALL_S:g} s)",
    )

    upstream_url: str = Field(
        "",
        pattern=r"(?i)^(https?://[^/\s]+\S*)?$",
        description="OpenAI-compatible base URL for engine=openai (http:// or https://)",
    )
    upstream_api_key: SecretStr = Field(SecretStr(""), description="bearer key of the upstream")
    upstream_model: str = Field("", description="model name upstream; default: the route")
    engine_id: str = Field(
        "",
        description="workers (of any pools, on any machines) with the same engine id share one "
        "engine's slots by priority: completion, chat, then batch ('': the engine is this "
        "worker's own)",
    )
    fleet_reserve_min: int = Field(
        1,
        ge=0,
        description="shared engine: fewest slots batch may never take; the reserve is the "
        "interactive classes' peak demand over LANEWAY_FLEET_PEAK_WINDOW_S when higher",
    )
    fleet_peak_window_s: float = Field(
        60.0, gt=0, description="shared engine: window of the interactive peak (the reserve)"
    )
    cache_isolation: bool = Field(
        True,
        description="an engine's prefix cache is shared within a team only: each request "
        "carries its team's salt (vLLM's `cache_salt`; engine=openai sends the field, so turn "
        "this off for a server that refuses fields it does not know)",
    )
    upstream_priority: bool = Field(
        False,
        description="engine=openai: send each request's priority (vLLM's `priority` field; the "
        "server needs --scheduling-policy priority)",
    )
    upstream_slots: int = Field(
        0,
        ge=0,
        description="engine=openai: requests the upstream runs at once; 0: learned (from its "
        "queue on /metrics where it publishes one, else from its first-byte times)",
    )
    upstream_metrics_url: str = Field(
        "auto",
        description="engine=openai: the upstream's Prometheus metrics (vLLM, SGLang), read "
        "for its queue length; 'auto': /metrics on the upstream's host; '': none",
    )
    upstream_read_timeout_s: float = Field(
        120.0, gt=0, description="engine=openai: longest silence of an upstream stream"
    )

    sim_prefill_ms_per_token: float = Field(0.05, ge=0, description="sim: prefill cost")
    sim_decode_ms_per_step: float = Field(15.0, ge=0, description="sim: one decode step")
    sim_batch_slots: int = Field(32, gt=0, description="sim: sequences decoded at once")
    sim_prefix_cache_blocks: int = Field(4096, ge=0, description="sim: prefix-cache LRU size")
    sim_kv_tokens: int = Field(
        0, ge=0, description="sim: KV memory for running sequences, in tokens (0: unlimited)"
    )
    sim_block_tokens: int = Field(16, gt=0, description="sim: tokens per KV block")
    sim_failure_rate: float = Field(0.0, ge=0, le=1, description="sim: injected error share")
    sim_route_failure_rates: dict[str, float] = Field(
        default_factory=dict,
        description="sim: injected error share of single routes, instead of the above (JSON "
        '{route: share}; a faulty canary: {"laneway-code-v2": 0.2})',
    )
    sim_seed: int = Field(0, description="sim: seed of injected failures")
    vllm_model: str = Field(
        "", description="engine=vllm: model directory or hub id (required by that engine)"
    )
    vllm_quantized_model: str = Field(
        "",
        description="engine=vllm: pre-quantized checkpoint (e.g. INT8 W8A8) for the chat and "
        "quantized profiles; empty: fp8 on the fly where the GPU has it",
    )
    vllm_profile: Literal["pool", "completion", "chat", "batch", "quantized"] = Field(
        "pool",
        description="engine=vllm: 'pool' runs the worker's pool profile; 'quantized' is the "
        "breaker's level-1 variant (a worker of its own)",
    )
    vllm_dtype: Literal["bfloat16", "float16"] = Field(
        "bfloat16",
        description="engine=vllm: half precision of the completion and chat profiles "
        "(float16 on GPUs older than Ampere)",
    )
    vllm_load_format: str = Field(
        "auto", description="engine=vllm: weight format; 'dummy' = random weights (tests)"
    )
    vllm_max_model_len: int = Field(
        0, ge=0, description="engine=vllm: context length in tokens; 0: the model's own"
    )
    vllm_kv_cache_gib: float = Field(
        0.0,
        ge=0,
        description="engine=vllm: KV cache size in GiB; 0: vLLM's default "
        "(GPU: by gpu_memory_utilization; CPU: VLLM_CPU_KVCACHE_SPACE)",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="engine=vllm: share of GPU memory the engine may take"
    )
    vllm_kv_offload_gib: float = Field(
        0.0,
        ge=0,
        description="engine=vllm, chat profile: CPU memory in GiB for KV blocks offloaded "
        "from the GPU; 0: off",
    )
    vllm_enforce_eager: bool = Field(
        False,
        description="engine=vllm: no torch.compile or CUDA graphs (faster start, slower steps)",
    )

    scale_min_replicas: int = Field(
        1, ge=1, le=256, description="scaling signal: fewest replicas the pool's signal asks for"
    )
    scale_max_replicas: int = Field(
        6,
        ge=1,
        le=256,
        description="scaling signal: most replicas it asks for (members beyond the pool's "
        "partition count would idle)",
    )
    scale_target_utilisation: float = Field(
        0.7,
        gt=0,
        le=1,
        description="scaling signal: share of the engines' capacity the pool's work (running, "
        "queued, lag) should fill; more asks for replicas",
    )
    scale_growth_horizon_s: float = Field(
        10.0,
        ge=0,
        description="scaling signal: lag growth is projected this far ahead (0: lag as it is)",
    )
    scale_kv_high: float = Field(
        0.9,
        gt=0,
        le=1,
        description="scaling signal: KV-cache usage above which a pool asks for replicas "
        "whatever its queue",
    )
    scale_down_window_s: float = Field(
        60.0,
        ge=0,
        description="scaling signal: the highest count asked for within this window is "
        "published (no flapping down; up is at once)",
    )

    @field_validator("scale_max_replicas")
    @classmethod
    def _max_not_below_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("scale_min_replicas")
        if low is not None and value < low:
            raise ValueError(f"must be at least LANEWAY_SCALE_MIN_REPLICAS ({low})")
        return value

    @field_validator("ingress_gone_s")
    @classmethod
    def _gone_after_roll_calls(cls, value: float) -> float:
        if 0 < value < 10 * INGRESS_ROLL_CALL_S:
            raise ValueError(
                f"must be 0 (never) or at least {10 * INGRESS_ROLL_CALL_S:g} s: a live replica "
                f"says it runs every {INGRESS_ROLL_CALL_S:g} s, and late roll calls (a busy "
                "replica, a slow Redis) must not stop its clients' requests"
            )
        return value

    @field_validator("memory_resume_at")
    @classmethod
    def _resume_below_shed(cls, value: float, info: ValidationInfo) -> float:
        shed_at = info.data.get("memory_shed_at")
        if shed_at is not None and value >= shed_at:
            raise ValueError(
                f"must be below LANEWAY_MEMORY_SHED_AT ({shed_at}), or pressure would end "
                "as soon as it began"
            )
        return value

    @field_validator("upstream_slots")
    @classmethod
    def _shared_upstream_slots(cls, value: int, info: ValidationInfo) -> int:
        engine_id = info.data.get("engine_id")
        if value == 0 and engine_id and info.data.get("engine") == "openai":
            # Learned from one worker's own first bytes, a shared engine's slots stay where
            # they start (a pool that runs fewer never learns more): batch ran 3 lines at a
            # time on a server that takes hundreds, or none, and nothing said why.
            raise ValueError(
                f"must be set for a shared engine (LANEWAY_ENGINE_ID={engine_id!r}): the "
                "requests the upstream runs at once, e.g. vLLM's --max-num-seqs"
            )
        return value

    @field_validator("worker_id")
    @classmethod
    def _default_worker_id(cls, value: str, info: ValidationInfo) -> str:
        return value or f"{info.data.get('pool', 'worker')}-{os.uname().nodename}-{os.getpid()}"

    @model_validator(mode="after")
    def _engine_has_what_it_needs(self) -> WorkerSettings:
        # Here, not where the engine starts: `laneway up` checks every service's settings
        # before it starts anything, instead of a crash loop after Kafka and Redis are up.
        if self.engine == "openai" and not self.upstream_url:
            raise ValueError(
                "LANEWAY_ENGINE=openai needs LANEWAY_UPSTREAM_URL (the server's /v1 URL)"
            )
        if self.engine == "vllm" and not self.vllm_model:
            raise ValueError(
                "LANEWAY_ENGINE=vllm needs LANEWAY_VLLM_MODEL (a model directory or hub id)"
            )
        return self
