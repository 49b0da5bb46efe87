"""Log lines carry the fields call sites attach (request id, team), in text and JSON."""

from __future__ import annotations

import logging

import orjson
import pytest
from aiokafka.errors import GroupAuthorizationFailedError, GroupCoordinatorNotAvailableError
from redis.exceptions import TimeoutError as RedisTimeoutError

from laneway.logs import JsonFormatter, TextFormatter, described, setup_logging


def record(**extra: object) -> logging.LogRecord:
    logger = logging.getLogger("laneway.test")
    return logger.makeRecord(
        "laneway.test", logging.WARNING, __file__, 1, "reply lost for %s", ("r1",), None,
        extra=extra,
    )  # fmt: skip


def test_text_lines_print_the_fields_after_the_message() -> None:
    line = TextFormatter().format(record(request_id="r1", team="alpha"))
    assert line.endswith("WARNING laneway.test: reply lost for r1 request_id=r1 team=alpha")
    plain = TextFormatter().format(record())
    assert plain.endswith("reply lost for r1")


def test_json_lines_are_objects_with_the_fields_as_keys() -> None:
    entry = orjson.loads(JsonFormatter().format(record(request_id="r1", team="alpha")))
    assert entry["message"] == "reply lost for r1"
    assert (entry["level"], entry["logger"]) == ("WARNING", "laneway.test")
    assert (entry["request_id"], entry["team"]) == ("r1", "alpha")


def test_a_coordinator_aiokafka_retries_is_a_warning_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """aiokafka logs a group coordinator it cannot find yet as an ERROR and retries: every
    first start (the broker still making its offsets topic) began with an error."""
    aiokafka = logging.getLogger("aiokafka")
    level = aiokafka.level
    setup_logging("INFO")
    aiokafka.setLevel(level)  # the filter is what is tested; other tests keep their level
    coordinator = logging.getLogger("aiokafka.consumer.group_coordinator")
    with caplog.at_level(logging.WARNING, logger="aiokafka"):
        coordinator.error(
            "Group Coordinator Request failed: %s", GroupCoordinatorNotAvailableError()
        )
        coordinator.error("Group Coordinator Request failed: %s", GroupAuthorizationFailedError())
    assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]  # given up: an error


def test_an_exception_is_logged_with_what_went_wrong_where() -> None:
    # redis-py's repr says only "network:TimeoutError"; the log says what timed out.
    timeout = RedisTimeoutError("Timeout reading from 127.0.0.1:6379")
    assert described(timeout) == "TimeoutError: Timeout reading from 127.0.0.1:6379"
    assert described(TimeoutError()) == "TimeoutError"
