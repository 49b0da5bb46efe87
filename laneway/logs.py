"""One logging setup for every service: time, level, logger, message and its fields.

Call sites attach structured fields with ``extra={"request_id": ..., "team": ...}``; both
formats print them: the text format as ``key=value`` after the message, the JSON format
(``LANEWAY_LOG_FORMAT=json``, one object a line, for a log shipper) as keys of the object.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Literal

import orjson

__all__ = ["JsonFormatter", "TextFormatter", "described", "setup_logging", "tune_gc"]

LogFormat = Literal["text", "json"]

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def described(exc: BaseException) -> str:
    """An exception for a log line: its class and message. Not ``repr``: redis-py's names
    only a category and the class (``network:TimeoutError``), not what timed out where."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a call site attached with ``extra=``."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = fields_of(record)
        if not fields:
            return text
        pairs = " ".join(f"{k}={v}" for k, v in fields.items())
        head, sep, tail = text.partition("\n")  # keep a traceback below the fields
        return f"{head} {pairs}{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, message, the fields, and exc if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **fields_of(record),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def _retried_is_a_warning(record: logging.LogRecord) -> bool:
    """aiokafka logs a coordinator it cannot find yet as an ERROR, then retries: on every
    first start (the broker still creating its offsets topic) a new user's first sight was
    an error. A retriable one is a WARNING; one it gives up on stays an ERROR."""
    args = record.args if isinstance(record.args, tuple) else ()
    if record.levelno == logging.ERROR and args and getattr(args[0], "retriable", False):
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def setup_logging(level: str = "INFO", fmt: LogFormat = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler])
    # aiokafka logs every rebalance step at INFO; keep its warnings.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    coordinator = logging.getLogger("aiokafka.consumer.group_coordinator")
    if _retried_is_a_warning not in coordinator.filters:
        coordinator.addFilter(_retried_is_a_warning)


def tune_gc() -> None:
    """Fewer, later collections for long-running services.

    Objects alive at start-up (modules, settings, clients) are frozen out of the collector,
    and the young generation is collected ten times less often: at hundreds of requests a
    second, default thresholds make collections a visible part of the latency tail.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(7000, 20, 20)
