"""A batch result always fits one Kafka record: one that would not is never written, since
Kafka refuses it at every try and its partition's commits would stop there for every team."""

from __future__ import annotations

import orjson

from laneway.constants import Topics
from laneway.errors import BadRequest
from laneway.openai_api import ChatRequest, validate_body
from laneway.requests import shape_request
from laneway.schema import BatchRequest, BatchResult
from laneway.settings import CommonSettings
from workers.batch import MAX_RESULT_BYTES, error_result, result_records


def _line(body: dict[str, object]) -> BatchRequest:
    return BatchRequest(job_id="job", line_id="l1", team="docs", body=body)


def test_an_unknown_model_of_a_megabyte_is_named_in_part() -> None:
    model = "'" * 420_000 + '"'
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    request = validate_body(ChatRequest, body)
    try:
        shape_request(CommonSettings(), request, "batch")
    except BadRequest as exc:
        result = error_result(_line(body), "r1", exc)
    else:
        raise AssertionError("an unknown model was served")
    value = result_records(Topics(), result)[0][2]
    assert len(value) < 10_000
    error = orjson.loads(value)["body"]["error"]
    assert error["code"] == "model_not_found"
    assert "more characters" in error["message"]


def test_an_unknown_field_with_a_long_name_is_named_in_part() -> None:
    body = {"model": "laneway-chat", "messages": [], "x" * 600_000: 1}
    try:
        validate_body(ChatRequest, body, prefix="body.")
    except BadRequest as exc:
        result = error_result(_line(body), "r1", exc)
    else:
        raise AssertionError("an unknown field was taken")
    value = result_records(Topics(), result)[0][2]
    assert len(value) < 10_000
    assert len(orjson.loads(value)["body"]["error"]["param"]) < 300


def test_a_result_over_a_record_is_answered_with_why_and_its_usage_kept() -> None:
    text = "y" * (MAX_RESULT_BYTES + 10)
    result = BatchResult(
        job_id="job",
        line_id="l1",
        request_id="r1",
        team="docs",
        status="ok",
        status_code=200,
        body={"choices": [{"message": {"content": text}}]},
    )
    ((topic, key, value),) = result_records(Topics(), result)
    written = BatchResult.model_validate_json(value)
    assert (topic, key) == (Topics().results_batch, b"job")
    assert (written.line_id, written.status, written.status_code) == ("l1", "error", 500)
    assert written.body is not None
    assert written.body["error"]["code"] == "result_too_large"
    assert len(value) < 10_000
