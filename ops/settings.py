"""Settings of ``laneway up``, the local single-node stack."""

from __future__ import annotations

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from laneway.constants import RequestClass
from laneway.settings import CommonSettings

__all__ = ["StackSettings", "backoff_ceiling"]

# A service beats every second and the supervisor looks every 2 s: a shorter timeout would
# kill a process whose loop merely paused (a long GC, a starved machine).
_SHORTEST_HANG_TIMEOUT_S = 5.0


def backoff_ceiling(first_s: float, max_s: float, exits_in_window: int) -> float:
    """The wait before the restart after the n-th exit in the crash window, before jitter:
    ``first_s``, doubled per further exit, up to ``max_s``."""
    doublings = min(max(exits_in_window, 1) - 1, 32)
    return min(max_s, first_s * float(2**doublings))


def _default_local_replicas() -> dict[RequestClass, tuple[int, int]]:
    return {"completion": (1, 3), "chat": (1, 1), "batch": (1, 1)}


class StackSettings(CommonSettings):
    """``laneway up``: the local single-node stack."""

    kafka_port: int = Field(
        19092, gt=0, le=65534, description="`laneway up`: Kafka port (controller: +1)"
    )
    redis_port: int = Field(16379, gt=0, le=65535, description="`laneway up`: Redis port")
    redis_maxmemory: str = Field(
        "1gb",
        pattern=r"^[1-9][0-9]*(kb|mb|gb)$",
        description="`laneway up`: Redis memory bound; full, Redis refuses writes "
        "(noeviction) rather than forget a quota bucket or a key",
    )
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
        description="`laneway up`: serve /metrics (restarts and state of every process, "
        "and each one's own series) here (0: off)",
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
    hang_timeout_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="`laneway up`: a service (ingress, worker, streams) whose event loop gave "
        "no sign of life this long (LANEWAY_WATCHDOG_FILE) is killed and restarted, counted as "
        f"a crash (0: off; else at least {_SHORTEST_HANG_TIMEOUT_S:g})",
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

    @field_validator("data_dir")
    @classmethod
    def _data_dir_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                "must name a directory: empty, it would be the current directory (the "
                "source tree, under `make up`); unset it for .run"
            )
        return value

    @field_validator("hang_timeout_s")
    @classmethod
    def _hang_timeout_off_or_long_enough(cls, value: float) -> float:
        if 0 < value < _SHORTEST_HANG_TIMEOUT_S:
            raise ValueError(
                f"must be 0 (off) or at least {_SHORTEST_HANG_TIMEOUT_S:g}: a process beats "
                "every second and is looked at every 2 s, and a shorter timeout kills one "
                "whose loop merely paused"
            )
        return value

    @field_validator("restart_backoff_max_s")
    @classmethod
    def _backoff_max_not_below_first(cls, value: float, info: ValidationInfo) -> float:
        first = info.data.get("restart_backoff_s")
        if first is not None and value < first:
            raise ValueError(
                f"must be at least LANEWAY_RESTART_BACKOFF_S ({first}), the first wait"
            )
        return value

    @model_validator(mode="after")
    def _crash_limit_can_trip(self) -> StackSettings:
        # The restart waits come between the exits: when the waits before the last exit
        # alone outlast the window, the first exit has left it before the last one comes.
        waits = sum(
            backoff_ceiling(self.restart_backoff_s, self.restart_backoff_max_s, n)
            for n in range(1, self.crash_limit)
        )
        if waits > self.crash_window_s:
            raise ValueError(
                f"LANEWAY_CRASH_LIMIT={self.crash_limit} exits can never fall within "
                f"LANEWAY_CRASH_WINDOW_S={self.crash_window_s:g}: the restart waits between "
                f"them alone take {waits:g}s (LANEWAY_RESTART_BACKOFF_S="
                f"{self.restart_backoff_s:g}, doubling up to LANEWAY_RESTART_BACKOFF_MAX_S="
                f"{self.restart_backoff_max_s:g}), so a crash loop would never stop the stack; "
                "lower the limit or the backoff, or widen the window"
            )
        return self

    @model_validator(mode="after")
    def _ports_apart(self) -> StackSettings:
        # Two of the stack's listeners on one port: the second fails after the first started.
        ports = {
            "LANEWAY_KAFKA_PORT": self.kafka_port,
            "LANEWAY_KAFKA_PORT + 1 (the Kafka controller)": self.kafka_port + 1,
            "LANEWAY_REDIS_PORT": self.redis_port,
            "LANEWAY_PORT": self.port,
            "LANEWAY_SUPERVISOR_PORT": self.supervisor_port,
        }
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port and port in seen:
                raise ValueError(f"{seen[port]} and {name} are both {port}: each needs its own")
            seen[port] = name
        return self
