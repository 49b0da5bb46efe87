"""Settings of the streams app (``python -m streams``): windows, thresholds, prices, webhook."""

from __future__ import annotations

import itertools
from typing import Self

from pydantic import Field, model_validator

from laneway.settings import CommonSettings, Price

__all__ = ["Price", "StreamsSettings"]


class StreamsSettings(CommonSettings):
    """The Faust app: usage rollups, quota factors and breaker levels."""

    streams_app_id: str = Field(
        "",
        description="Faust app id (consumer group, changelog topic names); "
        "default <prefix>-streams",
    )
    streams_data_dir: str = Field(".run/streams", description="Faust's local table data")
    streams_partitions: int = Field(
        0, ge=0, le=256, description="partitions of the changelog topics; 0: as laneway.usage has"
    )
    streams_replication_factor: int = Field(
        1, gt=0, description="replication factor of the changelog topics"
    )
    session_timeout_ms: int = Field(10_000, ge=6000, description="Kafka consumer session")
    streams_commit_interval_s: float = Field(
        1.0, gt=0, description="how often the streams app commits its input offsets"
    )

    quota_unit_tokens: int = Field(1000, gt=0, description="tokens in one quota budget unit")
    quota_factor_interval_s: float = Field(
        30.0, gt=0, description="how often quota factors are recomputed"
    )

    breaker_window_s: float = Field(60.0, gt=0, description="breaker: sliding error-rate window")
    breaker_bucket_s: float = Field(
        1.0, gt=0, description="breaker: resolution of the sliding window"
    )
    breaker_min_requests: int = Field(
        50, gt=0, description="breaker: fewest requests in the window for a rate to count"
    )
    breaker_enter: list[float] = Field(
        default_factory=lambda: [0.05, 0.10, 0.20],
        description="breaker: error rates above which levels 1, 2, 3 are entered (JSON list)",
    )
    breaker_exit: list[float] = Field(
        default_factory=lambda: [0.03, 0.07, 0.15],
        description="breaker: a level is left once the rate stays below this (JSON list)",
    )
    breaker_cooldown_s: float = Field(
        30.0, ge=0, description="breaker: how long the rate must stay low to step down a level"
    )
    breaker_eval_interval_s: float = Field(
        0.25, gt=0, description="breaker: how often levels are evaluated"
    )
    breaker_webhook_url: str = Field(
        "",
        pattern=r"(?i)^(https?://[^/\s]+\S*)?$",
        description="breaker: on-call webhook POSTed on entering level 2 (http:// or "
        "https://; '' : none)",
    )

    rollup_grace_s: float = Field(
        60.0, ge=0, description="rollups: an hour is closed this long after its end"
    )
    rollup_idle_s: float = Field(
        10.0, gt=0, description="rollups: close due hours of a partition idle this long"
    )
    usage_dedupe_s: float = Field(
        1800.0,
        gt=0,
        description="a usage event whose request id was folded this recently (at another "
        "offset: a worker's re-run after a crash) is not counted again",
    )
    rollup_flush_interval_s: float = Field(
        1.0, gt=0, description="rollups: how often closed hours are published"
    )
    rollup_provisional_s: float = Field(
        10.0,
        ge=0,
        description="rollups: the open hour of each team/class/model is published this often "
        "while it changes, with final=false (0: only closed hours)",
    )

    canary_window_s: float = Field(
        60.0, gt=0, description="canary: each step is judged on its traffic over this long"
    )
    canary_min_requests: int = Field(
        50, gt=0, description="canary: fewest canary requests in a step before it is judged"
    )
    canary_max_error_ratio: float = Field(
        1.5, ge=1, description="canary: its error rate may be this many times the stable route's"
    )
    canary_error_slack: float = Field(
        0.01, ge=0, le=1, description="canary: ...or this much above it (a stable rate near 0)"
    )
    canary_max_p99_ratio: float = Field(
        1.5, ge=1, description="canary: its P99 latency may be this many times the stable route's"
    )

    shadow_window_s: float = Field(
        300.0,
        gt=0,
        description="shadow routes: latency and errors of a shadow and its primary are "
        "compared over this sliding window",
    )

    @model_validator(mode="after")
    def _check_thresholds(self) -> Self:
        enter, leave = self.breaker_enter, self.breaker_exit
        if len(enter) != 3 or len(leave) != 3:
            raise ValueError(
                "LANEWAY_BREAKER_ENTER and LANEWAY_BREAKER_EXIT need three rates each "
                "(levels 1, 2, 3)"
            )
        rises = all(low < high for low, high in itertools.pairwise(enter))
        if not rises or any(not 0 < rate < 1 for rate in enter):
            raise ValueError(f"LANEWAY_BREAKER_ENTER={enter} must rise within (0, 1)")
        if any(out >= into for out, into in zip(leave, enter, strict=True)) or min(leave) < 0:
            raise ValueError(
                f"LANEWAY_BREAKER_EXIT={leave} must be below LANEWAY_BREAKER_ENTER={enter} "
                "level by level (the gap is the hysteresis)"
            )
        if self.breaker_bucket_s > self.breaker_window_s:
            raise ValueError(
                f"LANEWAY_BREAKER_BUCKET_S={self.breaker_bucket_s} is longer than "
                f"LANEWAY_BREAKER_WINDOW_S={self.breaker_window_s}"
            )
        return self

    @property
    def app_id(self) -> str:
        return self.streams_app_id or f"{self.topic_prefix}-streams"
