"""One logging setup for every service: time, level, logger, message."""

from __future__ import annotations

import logging

__all__ = ["setup_logging"]


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # aiokafka logs every rebalance step at INFO; keep its warnings.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLevelName(level)))
