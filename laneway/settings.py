"""Typed settings, one class per service, all read from ``LANEWAY_*`` environment variables.

A ``LANEWAY_*`` variable that no settings class knows fails start-up: a misspelt setting must
never be silently ignored.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from laneway.constants import RedisKeys, RequestClass, Topics
from laneway.errors import ConfigError

__all__ = [
    "CommonSettings",
    "IngressSettings",
    "Price",
    "StackSettings",
    "WorkerSettings",
    "load_settings",
]

# Read outside the settings classes (before a venv or Python exists, or by the test setup).
_OTHER_KNOWN_VARIABLES = {
    "LANEWAY_API_KEY",  # the CLI's batch commands
    "LANEWAY_CACHE_DIR",
    "LANEWAY_TEST_KAFKA_PORT",
    "LANEWAY_TEST_REDIS_PORT",
}


class Price(BaseModel):
    """Price of one model route, per 1,000 tokens of each kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: float = Field(0.0, ge=0)
    cached: float = Field(0.0, ge=0)
    completion: float = Field(0.0, ge=0)


def _default_prices() -> dict[str, Price]:
    return {
        "laneway-code": Price(prompt=0.0005, cached=0.0001, completion=0.0015),
        "laneway-chat": Price(prompt=0.001, cached=0.0002, completion=0.003),
        "*": Price(prompt=0.001, cached=0.0002, completion=0.003),
    }


class CommonSettings(BaseSettings):
    """Where Kafka and Redis are and how laneway names things in them."""

    model_config = SettingsConfigDict(env_prefix="LANEWAY_", extra="forbid")

    kafka_bootstrap: str = Field("127.0.0.1:19092", description="Kafka bootstrap servers")
    redis_url: str = Field(
        "redis://127.0.0.1:16379/0",
        description="Redis URL; with Redis ACL users redis://<user>:<password>@host:port/0 "
        "(never logged)",
    )
    topic_prefix: str = Field("laneway", description="prefix of every Kafka topic")
    redis_prefix: str = Field("laneway", description="prefix of every Redis key")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    log_format: Literal["text", "json"] = Field(
        "text", description="log lines as text (fields as key=value) or one JSON object a line"
    )

    models: list[str] = Field(
        default_factory=lambda: ["laneway-code", "laneway-chat"],
        description="model names served (JSON list)",
    )
    max_prompt_tokens: int = Field(32_768, gt=0, description="largest accepted prompt")
    completion_max_tokens: int = Field(128, gt=0, description="max_tokens cap of completions")
    chat_max_tokens: int = Field(4096, gt=0, description="max_tokens cap of chat")

    metrics_port: int = Field(
        0, ge=0, le=65535, description="workers and streams: serve /metrics here (0: off)"
    )
    prices: dict[str, Price] = Field(
        default_factory=_default_prices,
        description="cost per 1k tokens by route: {route: {prompt, cached, completion}}; "
        "'*' prices the rest (JSON)",
    )

    quota_enabled: bool = Field(True, description="enforce team budgets")
    quota_unit_tokens: int = Field(1000, gt=0, description="tokens in one budget unit")
    quota_units_per_member: float = Field(
        50.0, gt=0, description="budget units per team member per hour"
    )
    quota_batch_ratio: float = Field(
        1.0, ge=0, description="batch pool size as a multiple of the interactive pool"
    )
    quota_offpeak: str = Field(
        "22:00-06:00",
        pattern=r"^([01]\d|2[0-3]):[0-5]\d-([01]\d|2[0-3]):[0-5]\d$|^$",
        description="UTC window when batch may borrow idle interactive budget ('' = never)",
    )
    quota_borrow_reserve: float = Field(
        0.3, ge=0, le=1, description="share of the interactive pool batch can never borrow"
    )
    quota_min_charge_tokens: int = Field(
        16,
        ge=0,
        description="tokens a request that used none costs its team: dropped before it ran "
        "(cancelled, superseded, expired), a flood of requests is still not free",
    )
    quota_max_excess: float = Field(
        1.0,
        ge=0,
        description="a request that used more tokens than it reserved (its prompt was longer "
        "than estimated) is charged at most this share of its reservation on top",
    )

    # Kafka authentication (docs/security.md): one principal per service, its ACLs say what
    # it may read and write.
    kafka_security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT",
        description="Kafka listener protocol: SASL_SSL in production, SASL_PLAINTEXT for the "
        "local secured mode (LANEWAY_SECURED), PLAINTEXT: no authentication",
    )
    kafka_sasl_mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"] = Field(
        "SCRAM-SHA-256",
        description="SASL mechanism of the Kafka principal (PLAIN: the compose admin only, "
        "whose login the brokers' own configuration holds)",
    )
    kafka_password: SecretStr = Field(
        SecretStr(""), description="password of LANEWAY_KAFKA_USERNAME (never logged)"
    )
    kafka_username: str = Field(
        "",
        validate_default=True,
        description="Kafka principal (SASL user) of this service",
    )
    kafka_ssl_cafile: str = Field(
        "", description="SASL_SSL: CA bundle that signed the brokers' certificates ('': system)"
    )

    @field_validator("kafka_username")
    @classmethod
    def _kafka_login_complete(cls, value: str, info: ValidationInfo) -> str:
        # On the user name, not the password: an error message shows the value it is about.
        protocol = info.data.get("kafka_security_protocol", "PLAINTEXT")
        password = info.data.get("kafka_password")
        if protocol != "PLAINTEXT" and not (value and password and password.get_secret_value()):
            raise ValueError(
                f"LANEWAY_KAFKA_SECURITY_PROTOCOL={protocol} needs LANEWAY_KAFKA_USERNAME and "
                "LANEWAY_KAFKA_PASSWORD (this service's principal)"
            )
        return value

    def price_of(self, route: str) -> Price:
        return self.prices.get(route) or self.prices.get("*") or Price()

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    @property
    def keys(self) -> RedisKeys:
        return RedisKeys(self.redis_prefix)


class IngressSettings(CommonSettings):
    """The OpenAI-compatible HTTP ingress."""

    host: str = Field("127.0.0.1", description="ingress listen address")
    port: int = Field(8000, ge=0, le=65535, description="ingress listen port")
    instance_id: str = Field(
        default_factory=lambda: f"ingress-{secrets.token_hex(4)}",
        description="names this replica's reply stream; unique per replica",
    )
    admin_key: SecretStr = Field(
        SecretStr(""), description="bearer key of the admin API (/admin/...); empty: disabled"
    )
    console_session_s: float = Field(
        8 * 3600.0,
        gt=0,
        le=7 * 86400,
        description="web console (/console, on with the admin key): a login lasts this long",
    )
    completion_deadline_ms: int = Field(2000, gt=0, description="default completion deadline")
    chat_deadline_ms: int = Field(30_000, gt=0, description="default chat deadline")
    reply_timeout_s: float = Field(300.0, gt=0, description="longest wait for a reply")
    max_body_bytes: int = Field(
        2 * 1024 * 1024,
        ge=1024,
        description="largest request body accepted; a longer one gets 413 before it is read "
        "to its end (a 32k-token chat is about 130 kB of JSON)",
    )
    cancels_per_s: int = Field(
        50,
        gt=0,
        description="DELETE /v1/requests/{id} calls one team may make per second, over all "
        "replicas (429 beyond): each tombstone reaches every worker",
    )
    cancel_hold_ms: int = Field(
        25,
        ge=0,
        le=1000,
        description="a gone client's tombstone (with a session and seq) waits this long before "
        "its Kafka record is written; none is if this ingress stores a newer seq of the session "
        "on the same topic meanwhile (Redis gets it at once either way; 0: no wait)",
    )
    breaker_routes: dict[str, dict[str, str]] = Field(
        default_factory=lambda: {
            "laneway-code": {"quantized": "laneway-code-fp8", "fallback": "laneway-code-small"},
            "laneway-chat": {"quantized": "laneway-chat-int8", "fallback": "laneway-chat-small"},
        },
        description="breaker: model → {quantized, fallback} routes of levels 1 and 2 (JSON)",
    )
    probe_interval_s: float = Field(
        300.0, ge=0, description="health probe of every pool this often (0: off)"
    )
    probe_timeout_s: float = Field(10.0, gt=0, description="a probe slower than this fails")
    affinity_prefix_chars: int = Field(
        256, gt=0, description="prompt prefix hashed into the affinity key without a session"
    )
    quota_lease_share: float = Field(
        0.01,
        ge=0,
        le=0.1,
        description="share of a team's hourly interactive budget this replica takes from "
        "Redis at once and admits from locally (0: one Redis reservation per request)",
    )
    quota_lease_idle_s: float = Field(
        10.0, gt=0, description="an unused quota lease goes back to its pool after this long"
    )


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
    batch_memory_high: float = Field(
        0.95,
        gt=0,
        le=1,
        description="batch aborts and re-queues its newest work above this KV-cache usage",
    )
    batch_yield_backlog: int = Field(
        0, ge=0, description="batch pauses while interactive lanes have more waiting than this"
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
        description="type-through: a running completion whose client left waits this long for "
        "its session's next keystroke, which may type through it, before it is aborted (0: no "
        "wait)",
    )
    reuse_max_entries: int = Field(
        2000, ge=0, description="type-through: sessions whose latest generation a worker keeps"
    )
    commit_interval_ms: int = Field(200, gt=0, description="how often offsets are committed")
    drain_grace_s: float = Field(10.0, ge=0, description="SIGTERM: time to finish in-flight")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="worker heartbeat to Redis")
    session_timeout_ms: int = Field(10_000, ge=6000, description="Kafka consumer session")

    upstream_url: str = Field("", description="OpenAI-compatible base URL for engine=openai")
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

    @field_validator("worker_id")
    @classmethod
    def _default_worker_id(cls, value: str) -> str:
        return value or f"{os.uname().nodename}-{os.getpid()}"


def _default_local_replicas() -> dict[RequestClass, tuple[int, int]]:
    return {"completion": (1, 3), "chat": (1, 1), "batch": (1, 1)}


class StackSettings(CommonSettings):
    """``laneway up``: the local single-node stack."""

    kafka_port: int = Field(
        19092, gt=0, le=65535, description="`laneway up`: Kafka port (controller: +1)"
    )
    redis_port: int = Field(16379, gt=0, le=65535, description="`laneway up`: Redis port")
    partitions: int = Field(6, gt=0, le=256, description="partitions of each request topic")
    data_dir: str = Field(
        ".run", description="where broker and Redis keep their data and `laneway up` its logs"
    )
    replication_factor: int = Field(
        1, ge=1, le=7, description="`laneway topics create`: replicas of each topic"
    )
    kafka_heap_mb: int = Field(768, ge=256, description="`laneway up`: broker JVM heap")
    port: int = Field(8000, ge=0, le=65535, description="ingress port")
    supervisor_port: int = Field(
        8001,
        ge=0,
        le=65535,
        description="`laneway up`: serve /metrics (restarts and state of every process) "
        "here (0: off)",
    )
    restart_backoff_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="`laneway up`: wait before restarting a process that exited; doubles "
        "with each further exit within LANEWAY_CRASH_WINDOW_S; jittered down by up to half",
    )
    restart_backoff_max_s: float = Field(
        30.0, gt=0, le=600, description="`laneway up`: longest wait before a restart"
    )
    crash_limit: int = Field(
        5,
        ge=1,
        le=1000,
        description="`laneway up`: a process that exits this often within "
        "LANEWAY_CRASH_WINDOW_S stops the stack",
    )
    crash_window_s: float = Field(
        60.0, gt=0, le=86_400, description="`laneway up`: window of LANEWAY_CRASH_LIMIT"
    )

    local_replicas: dict[RequestClass, tuple[int, int]] = Field(
        default_factory=_default_local_replicas,
        description="`laneway up`: fewest and most worker processes per pool, started and "
        "stopped by the pool's scaling signal (JSON {pool: [min, max]}; a pool left out: [1, 1])",
    )
    secured: bool = Field(
        False,
        description="`laneway up`: Kafka with SASL/SCRAM and ACLs and Redis with ACL users, one "
        "principal per service (passwords generated into <data dir>/secrets; docs/security.md)",
    )
    autoscale_interval_s: float = Field(
        1.0, gt=0, le=60, description="`laneway up`: how often the local autoscaler looks"
    )

    @field_validator("local_replicas")
    @classmethod
    def _replicas_in_range(
        cls, value: dict[RequestClass, tuple[int, int]], info: ValidationInfo
    ) -> dict[RequestClass, tuple[int, int]]:
        partitions = info.data.get("partitions") or 256
        for pool, (low, high) in value.items():
            if not 1 <= low <= high or low > partitions:
                raise ValueError(
                    f"{pool}: [{low}, {high}] needs 1 <= min <= max and min <= "
                    f"LANEWAY_PARTITIONS ({partitions})"
                )
        return value

    def replicas_of(self, pool: RequestClass) -> tuple[int, int]:
        """(min, max) worker processes of ``pool`` under ``laneway up``; the max is cut to
        the partition count (a member beyond it would idle)."""
        low, high = self.local_replicas.get(pool, (1, 1))
        return low, min(high, self.partitions)

    @field_validator("restart_backoff_max_s")
    @classmethod
    def _backoff_max_not_below_first(cls, value: float, info: ValidationInfo) -> float:
        first = info.data.get("restart_backoff_s")
        if first is not None and value < first:
            raise ValueError(
                f"must be at least LANEWAY_RESTART_BACKOFF_S ({first}), the first wait"
            )
        return value


S = TypeVar("S", bound=CommonSettings)


# Settings classes defined in other packages register by being subclasses of CommonSettings;
# these modules are imported so the check knows them even in a process that does not use them.
_SETTINGS_MODULES = ("streams.settings",)


def _all_settings_classes() -> list[type[CommonSettings]]:
    for module in _SETTINGS_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    found: list[type[CommonSettings]] = []
    pending: list[type[CommonSettings]] = [CommonSettings]
    while pending:
        cls = pending.pop(0)
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def known_variables() -> set[str]:
    names = set(_OTHER_KNOWN_VARIABLES)
    for cls in _all_settings_classes():
        names.update(f"LANEWAY_{field.upper()}" for field in cls.model_fields)
    return names


def check_environment(environ: dict[str, str] | None = None) -> None:
    """Refuse ``LANEWAY_*`` variables that no service reads (typos)."""
    env = os.environ if environ is None else environ
    unknown = sorted(
        k for k in env if k.upper().startswith("LANEWAY_") and k.upper() not in known_variables()
    )
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)}: no laneway service reads them "
            "(see the settings table in README.md for the names)"
        )


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Build ``cls`` from the environment plus ``overrides``; errors name the variable."""
    check_environment()
    try:
        return cls(**overrides)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            value = err.get("input")
            known = cls.model_fields.get(field)
            if known is not None and known.annotation is SecretStr:
                value = "(secret)"
            problems.append(f"LANEWAY_{field.upper()}={value!r}: {err['msg']}")
        raise ConfigError("bad setting: " + "; ".join(problems)) from None


def settings_table() -> str:
    """Markdown table of every setting (README's settings section is generated from it)."""
    rows = ["| variable | used by | default | meaning |", "|---|---|---|---|"]
    seen: dict[str, list[str]] = {}
    info: dict[str, tuple[str, str]] = {}
    for cls in _all_settings_classes():
        owner = "all" if cls is CommonSettings else cls.__name__.removesuffix("Settings").lower()
        for name, field in cls.model_fields.items():
            var = f"LANEWAY_{name.upper()}"
            if var in seen and "all" in seen[var]:
                continue
            seen.setdefault(var, []).append(owner)
            if field.default_factory is not None:
                generated = name == "instance_id"
                default = "(generated)" if generated else repr(field.default_factory())  # type: ignore[call-arg]
            elif isinstance(field.default, SecretStr):
                default = "(secret)"
            else:
                default = repr(field.default)
            info.setdefault(var, (default, field.description or ""))
    for var, owners in seen.items():
        default, meaning = info[var]
        rows.append(f"| `{var}` | {', '.join(owners)} | `{default}` | {meaning} |")
    return "\n".join(rows)
