"""One logging setup for every service: time, level, logger, message."""

from __future__ import annotations

import gc
import logging

__all__ = ["setup_logging", "tune_gc"]


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # aiokafka logs every rebalance step at INFO; keep its warnings.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLevelName(level)))


def tune_gc() -> None:
    """Fewer, later collections for long-running services.

    Objects alive at start-up (modules, settings, clients) are frozen out of the collector,
    and the young generation is collected ten times less often: at hundreds of requests a
    second, default thresholds make collections a visible part of the latency tail.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(7000, 20, 20)
